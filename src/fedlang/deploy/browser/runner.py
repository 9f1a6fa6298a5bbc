"""Running a browser task in Python with onnxruntime, step for step as `fedlang.js` does.

`run_task(description, broadcast, data)` reads the broadcast value, runs the task's
steps (programs, and loops over the client's batches) on numbered slots, and builds the
report bytes in the binary value format from the description's recipe. It is the
reference the page's JavaScript is checked against, and lets the description be tested
without a browser.

A task with client state (the description's `state`) runs with `run_task_with_state`:
it takes the client's stored state (bytes in the binary value format, or None for the
description's initial state) and returns the new state beside the report, as the page
does with the state it keeps in IndexedDB.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fedlang.deploy.browser import onnx_export

_PREFIX = struct.Struct("<4sHBI")


def read_value(data: bytes) -> list[np.ndarray]:
    """The tensors of a value in the binary value format, in the format's order."""
    magic, version, kind, head_len = _PREFIX.unpack_from(data)
    if magic != b"FEDL" or version != 1 or kind != 2:
        raise ValueError(f"Expected a fedlang value (FEDL, version 1, kind 2), found {magic!r}.")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if crc != zlib.crc32(data[:-4]):
        raise ValueError("Expected the value's CRC-32 to match, found another.")
    header = json.loads(data[_PREFIX.size : _PREFIX.size + head_len])
    pos, blobs = _PREFIX.size + head_len, []
    for _ in range(header["blobs"]):
        (n,) = struct.unpack_from("<Q", data, pos)
        blobs.append(data[pos + 8 : pos + 8 + n])
        pos += 8 + n
    out: list[np.ndarray] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict) and "blob" in v:
            arr = np.frombuffer(blobs[v["blob"]], np.dtype(v["dtype"]).newbyteorder("<"))
            out.append(arr.reshape(v["shape"]).astype(np.dtype(v["dtype"])))
        else:
            raise ValueError(f"Expected tensors and structs in the value, found {str(v)[:60]}.")

    walk(header["value"])
    return out


def write_value(header: dict[str, Any], leaves: list[np.ndarray]) -> bytes:
    """A value in the binary value format from a header template and its tensors."""
    header = json.loads(json.dumps(header))
    it = iter(leaves)

    def fill(v: Any) -> None:
        for x in v if isinstance(v, list) else ():
            if isinstance(x, dict) and "blob" in x:
                x["shape"] = list(next(it).shape)
            else:
                fill(x)

    fill(header["value"] if isinstance(header["value"], list) else [header["value"]])
    if not isinstance(header["value"], list):  # a tensor at the root
        header["value"]["shape"] = list(leaves[0].shape)
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    parts = [_PREFIX.pack(b"FEDL", 1, 2, len(head)), head]
    for leaf in leaves:
        raw = np.ascontiguousarray(leaf).astype(leaf.dtype.newbyteorder("<")).tobytes()
        parts += [struct.pack("<Q", len(raw)), raw]
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


def _leaf_dtypes(header: dict[str, Any]) -> list[str]:
    found: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict) and "blob" in v:
            found.append(v["dtype"])

    walk(header["value"])
    return found


def _batch_leaf(batch: Any, path: list[Any]) -> Any:
    for key in path:
        batch = batch[key]
    return batch


def run_task(description: dict[str, Any], broadcast: bytes,
             data: Mapping[str, Iterable[Any]]) -> bytes:
    """This client's report (bytes) for a browser task (see the module docstring)."""
    if "state" in description:
        raise ValueError("This task keeps client state: run it with run_task_with_state.")
    return run_task_with_state(description, broadcast, data, None)[0]


def run_task_with_state(description: dict[str, Any], broadcast: bytes,
                        data: Mapping[str, Iterable[Any]],
                        state: bytes | None) -> tuple[bytes, bytes | None]:
    """(report, new state) for a browser task; the new state is None when the task
    keeps no state or does not write it (see the module docstring)."""
    slots: dict[int, np.ndarray] = {}
    info = description["slots"]
    kept = description.get("state")
    if kept is not None:
        stored = read_value(state if state is not None else base64.b64decode(kept["initial"]))
        if len(stored) != len(kept["inputs"]) or any(
            x.dtype.name != info[s]["dtype"] or list(x.shape) != info[s]["shape"]
            for x, s in zip(stored, kept["inputs"])
        ):
            raise ValueError(f"Expected the stored client state {kept['name']!r} to match the "
                             "task's state type, found another; it was written for another task.")
        slots.update(zip(kept["inputs"], stored))
    for slot, value in zip(description["broadcast"], read_value(broadcast)):
        slots[slot] = value
    for slot, c in description["consts"].items():
        raw = base64.b64decode(c["data"])
        slots[int(slot)] = np.frombuffer(raw, np.dtype(c["dtype"]).newbyteorder("<")).reshape(
            c["shape"]).astype(c["dtype"])
    sessions = {
        name: onnx_export.session(base64.b64decode(model))
        for name, model in description["programs"].items()
    }

    def call(step: dict[str, Any], extra: dict[str, np.ndarray]) -> None:
        sess = sessions[step["program"]]
        wanted = {i.name for i in sess.get_inputs()}
        feeds = {n: slots[s] for n, s in step["inputs"].items() if n in wanted}
        feeds.update({n: a for n, a in extra.items() if n in wanted})
        names = list(step["outputs"])
        for name, value in zip(names, sess.run(names, feeds)):
            slots[step["outputs"][name]] = np.asarray(value, info[step["outputs"][name]]["dtype"])

    for step in description["run"]:
        if step["kind"] == "run":
            call(step, {})
            continue
        leaves = description["data"][step["dataset"]]["leaves"]
        for batch in data[step["dataset"]]:
            arrays = {name: np.asarray(_batch_leaf(batch, path), leaf["dtype"])
                      for (name, path), leaf in zip(step["batch"].items(), leaves)}
            n = next(iter(arrays.values())).shape[0] if arrays else 1
            arrays[step["mask"]] = np.ones(n, np.float32)
            call(step, arrays)
    report = description["report"]
    out = []
    for recipe, dtype in zip(report["leaves"], _leaf_dtypes(report["header"])):
        if "value" in recipe:
            out.append(np.asarray(recipe["value"], dtype))
        elif "times" in recipe:
            w = slots[recipe["times"]].astype(np.float32)
            out.append((slots[recipe["slot"]].astype(np.float32) * w).astype(dtype))
        else:
            out.append(slots[recipe["slot"]].astype(dtype))
    new_state = None
    if kept is not None and kept["outputs"]:
        new_state = write_value(kept["header"], [slots[s] for s in kept["outputs"]])
    return write_value(report["header"], out), new_state
