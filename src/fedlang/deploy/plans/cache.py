"""Verified plans, kept by the hash of their signed blob.

A signed plan is read, verified against the server's public key and parsed once, then
kept (the least recently used goes first): the server checks every upload against its
task's plan (`server.intake`) and folds with it when a secure round's stage closes, and
a client runs the same plan round after round (its compiled programs are kept with it).
Where the bytes come from is the caller's: the store's blobs on the server, downloads on
a client.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from fedlang.core import signing
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.deploy.plans import folding
from fedlang.deploy.plans import round as plan_lib

# What a signed plan becomes, by what the caller asks for.
_PARSE: dict[str, Callable[[bytes], Any]] = {
    "round": plan_lib.RoundPlan.from_bytes,
    "folder": lambda data: folding.Folder(plan_lib.RoundPlan.from_bytes(data)),
    "buffered": buffered_plan.BufferedPlan.from_bytes,
}


class VerifiedPlans:
    """Plans verified against one public key (see the module docstring).

    Args:
      read: a signed plan's bytes by its blob hash.
      public_key: the Ed25519 public key (raw 32 bytes, or a key object) plans are signed
        with.
      size: how many parsed plans to keep.
    """

    def __init__(self, read: Callable[[str], bytes], public_key: Any, size: int = 16):
        self.read = read
        self.public_key = public_key
        self.size = size
        self._kept: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def round(self, signed_hash: str) -> plan_lib.RoundPlan:
        """The round plan signed in blob `signed_hash`.

        Raises:
          SignatureError: it was not signed with `public_key`.
          SerializationError: it is not a round plan.
        """
        return self._get("round", signed_hash)

    def folder(self, signed_hash: str) -> folding.Folder:
        """The folder of the round plan signed in blob `signed_hash` (as `round`)."""
        return self._get("folder", signed_hash)

    def buffered(self, signed_hash: str) -> buffered_plan.BufferedPlan:
        """The buffered plan signed in blob `signed_hash` (as `round`)."""
        return self._get("buffered", signed_hash)

    def _get(self, what: str, signed_hash: str) -> Any:
        key = (what, signed_hash)
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        value = _PARSE[what](signing.verify(self.read(signed_hash), self.public_key))
        with self._lock:
            self._kept[key] = value
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return value
