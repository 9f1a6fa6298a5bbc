"""Checkpoints of a whole training run, written atomically.

A checkpoint is one file, `ckpt-<round>.fedlckpt`, holding the process state (any
pytree of arrays: nested dicts, tuples, namedtuples, registered dataclasses), the
driver's state (round number, sampler state) and a *fingerprint* of the run's
configuration and state structure. Its layout::

    magic       8 bytes   b"FLCKPT\\x00\\x01"
    header_len  u32       then `header_len` bytes of UTF-8 JSON: round_num,
                          fingerprint, config, structure (path, dtype, shape per
                          leaf), driver state
    header_crc  u32       CRC-32 of the header bytes
    value                 the leaves, as one `fedlang.serialize_value` frame
                          (versioned, checksummed; never pickle)

Writing goes to a hidden temporary file in the same directory, which is fsync'ed and
renamed over the final name with `os.replace`, so a run interrupted mid-write leaves
the previous checkpoint intact and never a partial file under a checkpoint name.
Older checkpoints are deleted only after the new one is complete.

A run whose clients keep state (`fedlang.simulation.ClientStateStore`) records the
store's committed version in the driver state (`client_state_version`): the client
states are checkpointed with the run by the store keeping that version, and resuming
rolls the store back to it (`run_training` does both; `read_header` reads the
versions of older checkpoints without their states).

Leaves are matched to the live state by *path* (`'model/kernel'`), so a namedtuple
state restores into a dict state with the same fields and vice versa; dtypes and
shapes must agree exactly. A checkpoint from another configuration is refused with
`CheckpointMismatchError`, naming what differs.

Example:
  >>> import tempfile, numpy as np
  >>> d = tempfile.mkdtemp()
  >>> state = {'w': np.ones(3, np.float32), 'step': np.int32(2)}
  >>> fp = fingerprint({'lr': 0.1}, state)
  >>> path = save(d, 2, state, fingerprint=fp, config={'lr': 0.1})
  >>> ckpt = load(latest(d))
  >>> ckpt.round_num, ckpt.restore(state, fp)['w'].tolist()
  (2, [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import struct
import uuid
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from fedlang.core import serialization
from fedlang.simulation import _atomic_dir

MAGIC = b"FLCKPT\x00\x01"
SUFFIX = ".fedlckpt"
_NAME = re.compile(r"^ckpt-(\d+)\.fedlckpt$")
_U32 = struct.Struct("<I")


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or not a fedlang checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """A valid checkpoint of a different run configuration or state structure."""


# -- state <-> leaves -------------------------------------------------------------


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flatten(state: Any) -> tuple[list[tuple[str, Any]], Any]:
    pairs, treedef = jax.tree_util.tree_flatten_with_path(state)
    return [("/".join(_key_name(k) for k in path), leaf) for path, leaf in pairs], treedef


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _describe(path: str, leaf: Any) -> dict[str, Any]:
    if _is_key(leaf):
        data = jax.random.key_data(leaf)
        return {"path": path, "dtype": f"key<{jax.random.key_impl(leaf)}>", "shape": list(data.shape)}
    array = np.asarray(leaf)
    return {"path": path, "dtype": array.dtype.name, "shape": list(array.shape)}


def state_structure(state: Any) -> list[dict[str, Any]]:
    """The state's leaves as `{'path', 'dtype', 'shape'}` dicts, sorted by path."""
    pairs, _ = _flatten(state)
    return sorted((_describe(p, leaf) for p, leaf in pairs), key=lambda d: d["path"])


def fingerprint(config: Mapping[str, Any] | None, state: Any) -> str:
    """A hash of the run configuration (JSON-able) and the state's structure.

    Raises:
      TypeError: if `config` is not JSON-serializable.
    """
    try:
        text = json.dumps({"config": config or {}, "state": state_structure(state)}, sort_keys=True)
    except TypeError as e:
        raise TypeError(
            f"Expected a JSON-serializable run config (str, numbers, lists, dicts), found {e}. "
            "Convert the offending values, e.g. with str()."
        ) from e
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# -- writing ----------------------------------------------------------------------


def checkpoint_path(directory: str | os.PathLike, round_num: int) -> pathlib.Path:
    """Where `save` puts the checkpoint of `round_num`."""
    return pathlib.Path(directory) / f"ckpt-{round_num:08d}{SUFFIX}"


def _encode(round_num: int, state: Any, fp: str, config: Mapping[str, Any] | None,
            driver_state: Mapping[str, Any] | None) -> tuple[bytes, bytes]:
    pairs, _ = _flatten(state)
    leaves = [np.asarray(jax.random.key_data(v)) if _is_key(v) else np.asarray(v) for _, v in pairs]
    header = {
        "format": "fedlang.checkpoint",
        "round_num": int(round_num),
        "fingerprint": fp,
        "config": config or {},
        "structure": [_describe(p, v) for p, v in pairs],
        "driver_state": driver_state or {},
    }
    head = json.dumps(header).encode()
    prefix = MAGIC + _U32.pack(len(head)) + head + _U32.pack(zlib.crc32(head))
    return prefix, serialization.serialize_value(leaves)


def save(directory: str | os.PathLike, round_num: int, state: Any, *, fingerprint: str,
         config: Mapping[str, Any] | None = None, driver_state: Mapping[str, Any] | None = None,
         keep: int = 2) -> pathlib.Path:
    """Writes the checkpoint of `round_num` atomically, then prunes older ones.

    Args:
      directory: the checkpoint directory (created if needed).
      round_num: the number of completed rounds.
      state: the process state (a pytree of arrays).
      fingerprint: from `fingerprint(config, initial_state)`.
      config: the JSON-able run configuration, stored to explain mismatches.
      driver_state: JSON-able extra state (e.g. the sampler's `get_state()`).
      keep: how many of the newest checkpoints to keep (at least 1).

    Returns:
      The checkpoint's path.
    """
    if keep < 1:
        raise ValueError(f"Expected keep >= 1 checkpoints, found {keep}.")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, round_num)
    prefix, value = _encode(round_num, state, fingerprint, config, driver_state)
    tmp = directory / f".{final.name}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(prefix)
            f.write(value)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _atomic_dir.fsync_dir(directory)
    for old in checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    for stale in directory.glob(f".ckpt-*{SUFFIX}.tmp-*"):  # left by a killed writer
        stale.unlink(missing_ok=True)
    return final


# -- reading ----------------------------------------------------------------------


def checkpoints(directory: str | os.PathLike) -> list[pathlib.Path]:
    """The checkpoint files in `directory`, oldest round first (temp files ignored)."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest(directory: str | os.PathLike) -> pathlib.Path | None:
    """The newest checkpoint in `directory`, or None."""
    found = checkpoints(directory)
    return found[-1] if found else None


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint; `restore` rebuilds the state in a live state's structure.

    Attributes:
      path: the file it came from.
      round_num: the number of completed rounds.
      fingerprint: the run's fingerprint (see `fingerprint`).
      config: the run configuration it was saved with.
      structure: `{'path', 'dtype', 'shape'}` per leaf, in saved order.
      driver_state: extra JSON state (sampler state, ...).
      leaves: the saved arrays, in `structure` order.
    """

    path: pathlib.Path
    round_num: int
    fingerprint: str
    config: dict[str, Any]
    structure: list[dict[str, Any]]
    driver_state: dict[str, Any]
    leaves: list[np.ndarray]

    def check(self, expected_fingerprint: str, config: Mapping[str, Any] | None = None,
              template: Any = None) -> None:
        """Raises `CheckpointMismatchError` unless the fingerprints agree, naming what differs."""
        if self.fingerprint == expected_fingerprint:
            return
        details = []
        if config is not None:
            details += _config_diff(self.config, json.loads(json.dumps(dict(config))))
        if template is not None:
            details += _structure_diff(sorted(self.structure, key=lambda d: d["path"]),
                                       state_structure(template))
        what = "; ".join(details[:6]) or "the configuration differs"
        raise CheckpointMismatchError(
            f"Expected a checkpoint of this run's configuration (fingerprint {expected_fingerprint}), "
            f"found {self.path} from a different one (fingerprint {self.fingerprint}): {what}. "
            "Resume with the original configuration, or use a new checkpoint directory."
        )

    def restore(self, template: Any, expected_fingerprint: str | None = None,
                config: Mapping[str, Any] | None = None) -> Any:
        """The saved state, in the pytree structure of `template` (e.g. `initialize()`).

        Raises:
          CheckpointMismatchError: if the fingerprint or the leaves' paths, dtypes or
            shapes differ from the template's.
        """
        if expected_fingerprint is not None:
            self.check(expected_fingerprint, config, template)
        saved = {d["path"]: (d, leaf) for d, leaf in zip(self.structure, self.leaves)}
        pairs, treedef = _flatten(template)
        diff = _structure_diff(sorted(self.structure, key=lambda d: d["path"]), state_structure(template))
        if diff:
            raise CheckpointMismatchError(
                f"Expected a checkpoint with the live state's structure, found {self.path} with "
                f"another: {'; '.join(diff[:6])}. Use a checkpoint of this model and algorithm."
            )
        leaves = []
        for path, live in pairs:
            desc, array = saved[path]
            if _is_key(live):
                impl = desc["dtype"][4:-1]
                # the stub says jax.Array; JAX accepts any array-like key data
                leaves.append(jax.random.wrap_key_data(array, impl=impl))  # type: ignore[arg-type]
            elif isinstance(live, jax.Array):
                leaves.append(jax.numpy.asarray(array))
            elif isinstance(live, bool | int | float | complex):
                leaves.append(type(live)(array.item()))
            else:
                leaves.append(np.array(array))
        return jax.tree_util.tree_unflatten(treedef, leaves)


def _config_diff(saved: Mapping[str, Any], live: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(live), key=str):
        name = f"{prefix}{key}"
        a, b = saved.get(key, "<missing>"), live.get(key, "<missing>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += _config_diff(a, b, f"{name}.")
        elif a != b:
            out.append(f"{name}: checkpoint {a!r}, this run {b!r}")
    return out


def _structure_diff(saved: list[dict[str, Any]], live: list[dict[str, Any]]) -> list[str]:
    a = {d["path"]: d for d in saved}
    b = {d["path"]: d for d in live}
    out = [f"state leaf {p!r} only in the checkpoint" for p in a if p not in b]
    out += [f"state leaf {p!r} missing from the checkpoint" for p in b if p not in a]
    for p in a.keys() & b.keys():
        if (a[p]["dtype"], a[p]["shape"]) != (b[p]["dtype"], b[p]["shape"]):
            out.append(f"state leaf {p!r}: checkpoint {a[p]['dtype']}{a[p]['shape']}, "
                       f"this run {b[p]['dtype']}{b[p]['shape']}")
    return sorted(out)


def _corrupt(path: pathlib.Path, what: str) -> CheckpointError:
    fix = f"Delete {path} to resume from the previous checkpoint, or start a new run."
    return CheckpointError(f"Expected a fedlang checkpoint at {path}, found {what}. {fix}")


def _header(path: pathlib.Path, data: bytes) -> tuple[dict[str, Any], int]:
    """The checked header of a checkpoint's bytes (`data` may stop after it), and where
    its value starts."""
    if data[: len(MAGIC)] != MAGIC:
        raise _corrupt(path, f"a file starting with {data[:8]!r}")
    pos = len(MAGIC)
    if len(data) < pos + 4:
        raise _corrupt(path, "a truncated file")
    (n,) = _U32.unpack_from(data, pos)
    head = data[pos + 4 : pos + 4 + n]
    if len(head) != n or len(data) < pos + 8 + n:
        raise _corrupt(path, "a truncated file")
    (crc,) = _U32.unpack_from(data, pos + 4 + n)
    if zlib.crc32(head) != crc:
        raise _corrupt(path, "a header that fails its checksum")
    try:
        header = json.loads(head)
    except ValueError as e:
        raise _corrupt(path, f"unreadable contents ({e})") from e
    if not isinstance(header, dict):
        raise _corrupt(path, "a header that is not a JSON object")
    return header, pos + 8 + n


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's header (round_num, fingerprint, config, structure, driver_state)
    without reading its state: what a driver needs to know about older checkpoints.

    Raises:
      FileNotFoundError: if the file does not exist.
      CheckpointError: if its header is truncated or corrupt.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Expected a checkpoint file at {path}, found none.")
    with open(path, "rb") as f:
        prefix = f.read(len(MAGIC) + 4)
        n = _U32.unpack_from(prefix, len(MAGIC))[0] if len(prefix) == len(MAGIC) + 4 else 0
        data = prefix + f.read(n + 4)
    return _header(path, data)[0]


def load(path: str | os.PathLike) -> Checkpoint:
    """Reads and verifies a checkpoint file (checksums, format, structure).

    Raises:
      FileNotFoundError: if the file does not exist.
      CheckpointError: (a `ValueError`) if it is truncated, corrupt or not a checkpoint.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Expected a checkpoint file at {path}, found none.")
    data = path.read_bytes()

    def corrupt(what: str) -> CheckpointError:
        return _corrupt(path, what)

    header, start = _header(path, data)
    try:
        leaves = serialization.deserialize_value(data[start:])
        structure = header["structure"]
        ckpt = Checkpoint(path, int(header["round_num"]), str(header["fingerprint"]),
                          dict(header["config"]), list(structure), dict(header["driver_state"]),
                          [np.asarray(v) for v in leaves])
    except (serialization.SerializationError, KeyError, TypeError, ValueError) as e:
        raise corrupt(f"unreadable contents ({e})") from e
    if len(ckpt.leaves) != len(structure) or any(
        list(v.shape) != d["shape"] for v, d in zip(ckpt.leaves, structure)
    ):
        raise corrupt("leaves that do not match its header")
    return ckpt
