"""The SecAgg+ neighbour graph: a Harary graph on a seeded random ring of the clients.

Clients are sorted (by their id's UTF-8 bytes), then shuffled by a Fisher-Yates shuffle
drawing from an AES-256-CTR keystream keyed by HKDF-SHA256(round id, the sorted ids). Each
client is linked to the `degree / 2` clients on each side of it on the shuffled ring;
with `degree >= n - 1` the graph is complete (plain SecAgg). The graph depends only on the
round id (public, fixed when the round starts) and the set of clients that advertised
keys, so a restarted server derives the same one, and clients' positions on the ring are
random rather than chosen by anyone.

Example:
  >>> g = neighbours(["a", "b", "c", "d", "e"], degree=2, round_id=bytes(16))
  >>> sorted(len(v) for v in g.values())
  [2, 2, 2, 2, 2]
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedlang.deploy.secagg import masks

_INFO = b"fedlang-secagg/1/neighbour-graph"


def neighbours(
    client_ids: Sequence[str], degree: int, round_id: bytes
) -> dict[str, tuple[str, ...]]:
    """Each client's neighbours (sorted by id), for the given even `degree`.

    Raises:
      ValueError: an odd degree below n - 1, or repeated ids.
    """
    ids = sorted(client_ids, key=lambda c: c.encode())
    n = len(ids)
    if len(set(ids)) != n:
        raise ValueError("Expected distinct client ids, found repeated ones.")
    if degree >= n - 1:
        return {c: tuple(x for x in ids if x != c) for c in ids}
    if degree < 0 or degree % 2:
        raise ValueError(f"Expected an even degree >= 0 (or >= n - 1), found {degree}.")
    ring = _shuffle(ids, round_id)
    half = degree // 2
    out = {}
    for p, c in enumerate(ring):
        near = [ring[(p + d) % n] for d in range(1, half + 1)] + [
            ring[(p - d) % n] for d in range(1, half + 1)
        ]
        out[c] = tuple(sorted(near, key=lambda x: x.encode()))
    return out


def _shuffle(ids: list[str], round_id: bytes) -> list[str]:
    digest = hashlib.sha256()
    for c in ids:
        b = c.encode()
        digest.update(len(b).to_bytes(4, "little") + b)
    key = HKDF(hashes.SHA256(), 32, salt=round_id, info=_INFO).derive(digest.digest())
    n = len(ids)
    words = _words(key)
    ring = list(ids)
    for i in range(n - 1, 0, -1):
        j = _below(i + 1, words)
        ring[i], ring[j] = ring[j], ring[i]
    return ring


def _words(key: bytes) -> Iterator[int]:
    stream = masks.Keystream(key, 0)
    while True:
        yield from stream.words(1024).tolist()


def _below(bound: int, words: Iterator[int]) -> int:
    # Exactly uniform in [0, bound): reject words past the last whole multiple of bound.
    limit = (1 << 64) // bound * bound
    while True:
        w = next(words)
        if w < limit:
            return w % bound
