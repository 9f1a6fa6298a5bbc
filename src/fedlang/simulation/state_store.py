"""The client-state store: each client's state on disk, keyed by client id.

A process that keeps client state (`process.client_state`, see
`fedlang.core.client_state`) reads and writes it through `store.cohort(client_ids)`,
a binding the runtimes read and write chunk by chunk: memory is O(chunk), whatever
the number of clients. A client never written reads the initial state. Layout::

    store.json    format, version, the state's leaves (dtype, shape) and record size
    type.bin      the state type S (`fedlang.core.serialization`)
    initial.bin   the initial state (a value of type S)
    HEAD          the committed version, as JSON, replaced atomically
    clients/ab/cdef.../000000000007.st   client states, one file per written version

A client's directory is named by a hash of its id (the id is also in each file and
checked on read). Each file holds one state: a header (magic, the client id, a CRC-32
of the payload) and the leaves' little-endian bytes.

**Versions and atomicity.** Each round that writes states is a *version*. A writing
cohort reserves the next version number in `HEAD` first, then writes each client's
new state as a new file of that version (never over a committed one); readers only
see files of committed versions. The round commits by replacing `HEAD` (write to a
temporary, fsync, `os.replace`): a process killed at any point before that leaves the
store as it was, its files belonging to a version that is never committed. Versions
that were reserved and not committed (a crash, an abort), and versions undone by
`rollback`, are recorded as *abandoned* ranges in `HEAD`; their files are ignored and
deleted when their client is next written.

**Checkpoints.** `version` is what a training checkpoint records; `rollback(v)` makes
version `v` current again when a run resumes from that checkpoint. Old versions are
kept from `retain_from(v)` on (by default only the newest), and pruned client by
client as clients are written.

One process writes a store at a time (the driver; Ray workers write the files of the
version their driver reserved). Client files are not fsynced unless `durable=True`:
a killed process never leaves a half-written store either way, but after a power
failure without `durable`, the newest version's files may be missing or torn (a
checksum error names them; roll back to an earlier checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import struct
import uuid
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fedlang.core import client_state as client_state_lib
from fedlang.core import serialization, structure, types
from fedlang.simulation import _atomic_dir

FORMAT = "fedlang.client_state"
FORMAT_VERSION = 1
META_FILE, TYPE_FILE, INITIAL_FILE, HEAD_FILE = "store.json", "type.bin", "initial.bin", "HEAD"
CLIENTS_DIR = "clients"
MAGIC = b"FLCS\x00\x01"
_U32 = struct.Struct("<I")
_NAME = re.compile(r"^(\d{12})\.st$")


class ClientStateError(ValueError):
    """A client-state store is missing, corrupt, or made for another state."""


# -- HEAD: the committed version ------------------------------------------------------------


def _read_head(root: pathlib.Path) -> dict[str, Any]:
    path = root / HEAD_FILE
    try:
        head = json.loads(path.read_text())
        version, nxt, floor = int(head["version"]), int(head["next"]), head["floor"]
        abandoned = [(int(a), int(b)) for a, b in head["abandoned"]]
    except FileNotFoundError:
        raise ClientStateError(f"Expected a client-state store at {root}, found no {HEAD_FILE}.") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ClientStateError(
            f"Expected a client-state store at {root}, found an unreadable {path} ({e}). "
            "Restore it from a backup, or start the run again with a fresh store."
        ) from e
    return {"version": version, "next": nxt, "abandoned": abandoned,
            "floor": None if floor is None else int(floor)}


def _write_head(root: pathlib.Path, head: dict[str, Any]) -> None:
    tmp = root / f".{HEAD_FILE}.tmp-{uuid.uuid4().hex}"
    data = {**head, "abandoned": [list(r) for r in _merged(head["abandoned"])]}
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / HEAD_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _atomic_dir.fsync_dir(root)


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[0] <= r[1]):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _abandoned(version: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(a <= version <= b for a, b in ranges)


# -- one client's files -----------------------------------------------------------------------


def _client_dir(root: pathlib.Path, client_id: str) -> pathlib.Path:
    digest = hashlib.blake2b(client_id.encode(), digest_size=16).hexdigest()
    return root / CLIENTS_DIR / digest[:2] / digest[2:]


def _versions(directory: pathlib.Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [int(m.group(1)) for n in names if (m := _NAME.match(n))]


def _file(directory: pathlib.Path, version: int) -> pathlib.Path:
    return directory / f"{version:012d}.st"


class _Layout:
    """The state's leaves: how one client's state maps to a record of bytes."""

    def __init__(self, state_type: types.Type):
        self.state_type = state_type
        self.leaf_types = structure.leaf_types(state_type)
        self.dtypes = [np.dtype(lt.dtype).newbyteorder("<") for lt in self.leaf_types]
        self.shapes = [tuple(int(d) for d in lt.shape) for lt in self.leaf_types]  # type: ignore[arg-type]
        self.sizes = [int(np.prod(s, dtype=np.int64)) * dt.itemsize
                      for s, dt in zip(self.shapes, self.dtypes)]
        self.record_bytes = sum(self.sizes)

    def to_bytes(self, leaves: list[np.ndarray], i: int) -> bytes:
        return b"".join(np.ascontiguousarray(x[i], dt).tobytes() for x, dt in zip(leaves, self.dtypes))

    def into(self, out: list[np.ndarray], i: int, payload: bytes) -> None:
        buf = np.frombuffer(payload, np.uint8)
        offset = 0
        for x, dt, shape, size in zip(out, self.dtypes, self.shapes, self.sizes):
            x[i] = buf[offset : offset + size].view(dt).reshape(shape)
            offset += size

    def empty(self, n: int) -> list[np.ndarray]:
        return [np.empty((n, *s), lt.dtype) for s, lt in zip(self.shapes, self.leaf_types)]


def _encode(client_id: str, payload: bytes) -> bytes:
    cid = client_id.encode()
    return b"".join([MAGIC, _U32.pack(len(cid)), cid, _U32.pack(zlib.crc32(payload)), payload])


def _decode(path: pathlib.Path, client_id: str, record_bytes: int) -> bytes:
    data = path.read_bytes()
    cid = client_id.encode()
    head = len(MAGIC) + 4 + len(cid) + 4
    fix = (f"The file is damaged (a power failure without durable=True?): resume the run "
           f"from an earlier checkpoint, or delete {path.parent} to restart client "
           f"{client_id!r} from the initial state.")
    if data[: len(MAGIC)] != MAGIC or len(data) != head + record_bytes:
        raise ClientStateError(
            f"Expected client {client_id!r}'s state ({head + record_bytes} bytes) in {path}, "
            f"found {len(data)} bytes that are not one. {fix}"
        )
    (n,) = _U32.unpack_from(data, len(MAGIC))
    if n != len(cid) or data[len(MAGIC) + 4 : len(MAGIC) + 4 + n] != cid:
        raise ClientStateError(
            f"Expected client {client_id!r}'s state in {path}, found another client's. {fix}"
        )
    (crc,) = _U32.unpack_from(data, head - 4)
    payload = data[head:]
    if zlib.crc32(payload) != crc:
        raise ClientStateError(
            f"Expected client {client_id!r}'s state in {path}, found one that fails its "
            f"checksum. {fix}"
        )
    return payload


# -- the binding a runtime reads and writes ------------------------------------------------------


class CohortStates:
    """The states of a cohort in a `ClientStateStore`: a `core.client_state.ClientStates`.

    Made by `ClientStateStore.cohort`. It reads the version that was committed when it
    was made; `begin` reserves the next version, `write` stages new states as files of
    that version (from any process that sees the store's directory: Ray workers write
    through `slice`s), and `commit` makes it the store's committed version.
    """

    def __init__(self, root: pathlib.Path, client_ids: tuple[str, ...], layout: _Layout,
                 initial: list[np.ndarray], head: dict[str, Any], durable: bool,
                 write_version: int | None = None, is_slice: bool = False):
        self.root = root
        self.client_ids = client_ids
        self._layout = layout
        self._initial = initial
        self._head = head  # the committed version read, with its abandoned ranges and floor
        self._durable = durable
        self._write_version = write_version
        self._is_slice = is_slice

    @property
    def state_type(self) -> types.Type:
        return self._layout.state_type

    @property
    def version(self) -> int:
        """The committed version this cohort reads."""
        return int(self._head["version"])

    def __len__(self) -> int:
        return len(self.client_ids)

    def __repr__(self) -> str:
        return f"CohortStates({len(self)} clients of {self.root}, version {self.version})"

    def slice(self, start: int, stop: int) -> CohortStates:
        return CohortStates(self.root, self.client_ids[start:stop], self._layout, self._initial,
                            self._head, self._durable, self._write_version, is_slice=True)

    def _latest(self, directory: pathlib.Path) -> int | None:
        h, abandoned = self._head["version"], self._head["abandoned"]
        valid = [v for v in _versions(directory) if v <= h and not _abandoned(v, abandoned)]
        return max(valid) if valid else None

    def read(self, start: int, stop: int) -> list[np.ndarray]:
        out = self._layout.empty(stop - start)
        for i, cid in enumerate(self.client_ids[start:stop]):
            directory = _client_dir(self.root, cid)
            version = self._latest(directory)
            if version is None:
                for x, init in zip(out, self._initial):
                    x[i] = init
            else:
                payload = _decode(_file(directory, version), cid, self._layout.record_bytes)
                self._layout.into(out, i, payload)
        return out

    def begin(self) -> None:
        if self._is_slice:
            raise ValueError("Begin a write on the whole cohort, not on a slice of it.")
        if self._write_version is not None:
            raise ValueError(
                f"This cohort's new states were already written (version {self._write_version}); "
                "make a new cohort with store.cohort(client_ids) for the next round."
            )
        head = _read_head(self.root)
        self._check_current(head)
        self._head = {**self._head, "floor": head["floor"]}  # what to keep, as of now
        self._write_version = head["next"]
        _write_head(self.root, {**head, "next": head["next"] + 1})

    def _check_current(self, head: dict[str, Any]) -> None:
        if head["version"] != self._head["version"] or head["abandoned"] != self._head["abandoned"]:
            raise ClientStateError(
                f"The client-state store at {self.root} changed since this cohort was made "
                f"(version {self._head['version']}, now {head['version']}): its states are "
                "stale. Make a new cohort with store.cohort(client_ids) for each round."
            )

    def write(self, start: int, stop: int, leaves: list[np.ndarray]) -> None:
        w = self._write_version
        if w is None:
            raise ValueError("Call begin() on the cohort before writing its new states.")
        for x, shape in zip(leaves, self._layout.shapes):
            if tuple(np.shape(x)) != (stop - start, *shape):
                raise ValueError(
                    f"Expected new states of {stop - start} clients with leaves of shape "
                    f"{shape}, found a leaf of shape {np.shape(x)}."
                )
        for i, cid in enumerate(self.client_ids[start:stop]):
            directory = _client_dir(self.root, cid)
            directory.mkdir(parents=True, exist_ok=True)
            final = _file(directory, w)
            tmp = directory / f".{final.name}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(_encode(cid, self._layout.to_bytes(leaves, i)))
                if self._durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            self._prune(directory, w)

    def _prune(self, directory: pathlib.Path, written: int) -> None:
        """Deletes the client's files no reader can need: abandoned versions, and
        committed ones superseded before the oldest version kept (the floor)."""
        h, abandoned, floor = self._head["version"], self._head["abandoned"], self._head["floor"]
        keep_from = h if floor is None else min(floor, h)
        versions = [v for v in _versions(directory) if v != written]
        valid_old = [v for v in versions if v <= keep_from and not _abandoned(v, abandoned)]
        newest_old = max(valid_old) if valid_old else None
        for v in versions:
            if _abandoned(v, abandoned) or (v <= keep_from and v != newest_old):
                _file(directory, v).unlink(missing_ok=True)

    def commit(self) -> None:
        if self._is_slice:
            raise ValueError("Commit the whole cohort, not a slice of it.")
        w = self._write_version
        if w is None:
            raise ValueError("Nothing to commit: call begin() and write() first.")
        head = _read_head(self.root)
        self._check_current(head)
        h = head["version"]
        # Versions reserved between this cohort's and its own (never committed) are abandoned.
        abandoned = [*head["abandoned"], (h + 1, w - 1)]
        _write_head(self.root, {**head, "version": w, "abandoned": _merged(abandoned)})
        self._write_version = None
        self._head = _read_head(self.root)

    def abort(self) -> None:
        # The reserved version is never committed: the next commit or rollback abandons
        # it, and its files are deleted as their clients are written again.
        self._write_version = None


# -- the store ------------------------------------------------------------------------------------


class ClientStateStore:
    """A directory of client states (see the module docstring).

    Args:
      directory: where the store lives; created when missing or empty (then
        `client_state` is required).
      client_state: the `ClientStateSpec` of the process using it
        (`process.client_state`): the state type and the initial state of clients
        seen for the first time. When given for an existing store, it must match the
        one the store was made with.
      durable: fsync every client file before a round commits (survives power
        failures; slower).

    Raises:
      ClientStateError: a corrupt store, or one made for another state type or
        initial state.
      FileNotFoundError: no store at `directory` and no `client_state` to make one.

    Example:
      >>> import tempfile, numpy as np, fedlang as fl
      >>> @fl.jax_computation()
      ... def zero():
      ...   return np.zeros(2, np.float32)
      >>> @fl.jax_computation((np.float32, [2]))
      ... def inc(s):
      ...   return s + 1
      >>> @fl.federated_computation(fl.type_at_clients((np.float32, [2])))
      ... def bump(states):
      ...   return (fl.federated_sum(states), fl.federated_map(inc, states))
      >>> bump = fl.with_client_state(bump, zero, parameter=0, result=1)
      >>> store = ClientStateStore(tempfile.mkdtemp(), bump.client_state)
      >>> total, cohort = bump(store.cohort(['a', 'b']))
      >>> total, store.get('a'), store.version
      (array([0., 0.], dtype=float32), array([1., 1.], dtype=float32), 1)
      >>> total, _ = bump(store.cohort(['a', 'c']))
      >>> total, store.get('a'), store.get('c')
      (array([1., 1.], dtype=float32), array([2., 2.], dtype=float32), array([1., 1.], dtype=float32))
    """

    def __init__(self, directory: str | os.PathLike, client_state: Any = None, *,
                 durable: bool = False):
        self.root = pathlib.Path(directory)
        self.durable = durable
        _atomic_dir.recover(self.root)
        spec = client_state
        if spec is not None and not isinstance(spec, client_state_lib.ClientStateSpec):
            raise TypeError(
                "Expected client_state to be a process's client-state spec "
                f"(process.client_state), found {types.describe(spec)}."
            )
        if not self.root.exists() or (self.root.is_dir() and not any(self.root.iterdir())):
            if spec is None:
                raise FileNotFoundError(
                    f"Expected a client-state store at {self.root}, found none. To make one, "
                    "pass the process's spec: ClientStateStore(directory, process.client_state)."
                )
            _create(self.root, spec)
        self._load()
        if spec is not None:
            self._check_spec(spec)

    def _load(self) -> None:
        root = self.root
        try:
            meta = json.loads((root / META_FILE).read_text())
            if meta.get("format") != FORMAT:
                raise ClientStateError(f"Expected a {FORMAT} store at {root}, found {meta.get('format')!r}.")
            if int(meta.get("format_version", -1)) > FORMAT_VERSION:
                raise ClientStateError(
                    f"The client-state store at {root} has format version {meta['format_version']}, "
                    f"newer than this fedlang reads ({FORMAT_VERSION}). Upgrade fedlang."
                )
            state_type = serialization.deserialize_type((root / TYPE_FILE).read_bytes())
            initial = serialization.deserialize_value((root / INITIAL_FILE).read_bytes(),
                                                      expected_type=state_type)
        except ClientStateError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ClientStateError(
                f"Expected a client-state store at {root}, found one that cannot be read ({e}). "
                "Restore it, or start the run again with a fresh store directory."
            ) from e
        self._layout = _Layout(state_type)
        self._initial = structure.flatten(structure.to_internal(initial, state_type), state_type)
        self.initial = initial
        _read_head(root)

    def _check_spec(self, spec: client_state_lib.ClientStateSpec) -> None:
        if spec.state_type != self.state_type:
            raise ClientStateError(
                f"Expected the client-state store at {self.root} to hold states of type "
                f"{spec.state_type}, found {self.state_type}. Use a store made for this process."
            )
        initial = _initial_leaves(spec)
        if any(not np.array_equal(a, b) for a, b in zip(initial, self._initial)):
            raise ClientStateError(
                f"The client-state store at {self.root} was made with another initial state "
                "than this process declares (another seed or model?). Use a store made for "
                "this process, or a fresh directory."
            )

    @property
    def state_type(self) -> types.Type:
        """`S`, the type of one client's state."""
        return self._layout.state_type

    @property
    def version(self) -> int:
        """The committed version (0 before any round wrote states)."""
        return int(_read_head(self.root)["version"])

    def cohort(self, client_ids: Iterable[str]) -> CohortStates:
        """The binding of these clients' states, for a runtime to read and write.

        Raises:
          TypeError: a client id that is not a string; ValueError: a repeated id.
        """
        ids = tuple(client_ids)
        seen: set[str] = set()
        for cid in ids:
            if not isinstance(cid, str):
                raise TypeError(f"Expected client ids as strings, found {types.describe(cid)}.")
            if cid in seen:
                raise ValueError(
                    f"Expected each client once in a cohort, found {cid!r} twice: its new state "
                    "would be written twice in one round. Sample without replacement."
                )
            seen.add(cid)
        return CohortStates(self.root, ids, self._layout, self._initial, _read_head(self.root),
                            self.durable)

    def get(self, client_id: str) -> Any:
        """One client's committed state (the initial state if it was never written)."""
        cohort = self.cohort([client_id])
        return client_state_lib.unstack_states(cohort.read(0, 1), self.state_type, 1)[0]

    def has_state(self, client_id: str) -> bool:
        """Whether the client has a committed state (False: it reads the initial one)."""
        return self.cohort([client_id])._latest(_client_dir(self.root, client_id)) is not None

    def rollback(self, version: int) -> None:
        """Makes `version` the committed version again (resuming a run from a
        checkpoint): the versions after it are abandoned.

        Raises:
          ClientStateError: a version after the committed one, or older than what was
            kept (`retain_from`).
        """
        head = _read_head(self.root)
        h, floor = head["version"], head["floor"]
        if version > h:
            raise ClientStateError(
                f"Expected a version up to {h} (the store's newest) to roll back to, found "
                f"{version}: the checkpoint is newer than the client-state store at {self.root}. "
                "Use the store that was saved with this run."
            )
        if version < h and (floor is None or version < floor):
            kept = h if floor is None else floor
            raise ClientStateError(
                f"Cannot roll the client-state store at {self.root} back to version {version}: "
                f"versions before {kept} were not kept. Call store.retain_from(v) with the "
                "oldest version a checkpoint may return to (run_training does)."
            )
        if version == h:
            return
        abandoned = _merged([*head["abandoned"], (version + 1, h)])
        _write_head(self.root, {**head, "version": version, "abandoned": abandoned})

    def retain_from(self, version: int | None) -> None:
        """Keeps every version from `version` on, so `rollback` can return to it (None:
        keep only the newest)."""
        head = _read_head(self.root)
        if version is not None and version > head["version"]:
            raise ValueError(f"Expected a version up to {head['version']}, found {version}.")
        _write_head(self.root, {**head, "floor": version})

    def __repr__(self) -> str:
        return f"ClientStateStore({str(self.root)!r}, state {self.state_type}, version {self.version})"



def _initial_leaves(spec: client_state_lib.ClientStateSpec) -> list[np.ndarray]:
    value = structure.to_internal(spec.initial_state(), spec.state_type)
    return [np.asarray(x) for x in structure.flatten(value, spec.state_type)]


def _create(root: pathlib.Path, spec: client_state_lib.ClientStateSpec) -> None:
    state_type = spec.state_type
    _Layout(state_type)  # checks the leaves have fixed shapes
    initial = structure.unflatten(_initial_leaves(spec), state_type)
    root.parent.mkdir(parents=True, exist_ok=True)
    with _atomic_dir.staging(root) as tmp:
        (tmp / TYPE_FILE).write_bytes(serialization.serialize_type(state_type))
        (tmp / INITIAL_FILE).write_bytes(
            serialization.serialize_value(structure.to_python(initial, state_type), state_type))
        layout = _Layout(state_type)
        (tmp / META_FILE).write_text(json.dumps({
            "format": FORMAT, "format_version": FORMAT_VERSION, "state_type": str(state_type),
            "record_bytes": layout.record_bytes,
            "leaves": [{"dtype": dt.name, "shape": list(s)} for dt, s in zip(layout.dtypes, layout.shapes)],
        }))
        (tmp / CLIENTS_DIR).mkdir()
        _write_head(tmp, {"version": 0, "next": 1, "abandoned": [], "floor": None})
        _atomic_dir.commit(tmp, root)
