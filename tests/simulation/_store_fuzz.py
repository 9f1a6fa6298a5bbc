"""Child process for the store fuzz test: hypothesis mutates a store's files.

Run as `python _store_fuzz.py STORE WORKDIR MAX_EXAMPLES`. Each example copies STORE,
applies one mutation to `data.arrow` or `index.json` (overwrite, insert or delete a
few bytes, truncate, or, for the index, replace one JSON value by another of any
type), opens the copy and reads every client. Opening and reading
may only succeed with the original values, or raise `StoreError`; anything else
fails the property. Each mutation is printed (flushed) before it runs, so when this
process dies of a signal the parent shows the mutation that killed it. Exits 0 when
the property held for every example.
"""

from __future__ import annotations

import json
import pathlib
import resource
import shutil
import sys
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlang.simulation import store

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _store_damage  # a sibling script, not a package module

FILES = (store.DATA_FILE, store.INDEX_FILE)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def json_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path (keys and indices) of every value in a JSON document."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    return [prefix] + [p for k, v in children for p in json_paths(v, (*prefix, k))]


def replaced(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = dict(document) if isinstance(document, dict) else list(document)
    copy[path[0]] = replaced(document[path[0]], path[1:], value)
    return copy


@st.composite
def mutations(draw: st.DrawFn, pristine: dict[str, bytes]) -> tuple[str, str, Any, Any]:
    name = draw(st.sampled_from(FILES))
    kinds = ["overwrite", "insert", "delete", "truncate"] + (["json"] if name == store.INDEX_FILE else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "json":
        document = json.loads(pristine[name])
        return name, kind, draw(st.sampled_from(json_paths(document))), draw(JSON_VALUES)
    position = draw(st.integers(0, len(pristine[name]) - 1))
    return name, kind, position, draw(st.binary(min_size=1, max_size=3))


def mutate(data: bytes, kind: str, position: Any, payload: Any) -> bytes:
    if kind == "json":
        return json.dumps(replaced(json.loads(data), position, payload)).encode()
    if kind == "overwrite":
        return data[:position] + payload + data[position + len(payload):]
    if kind == "insert":
        return data[:position] + payload + data[position:]
    if kind == "delete":
        return data[:position] + data[position + len(payload):]
    return data[:position]


def main() -> None:
    original, workdir, max_examples = sys.argv[1], sys.argv[2], int(sys.argv[3])
    limit = _store_damage.ADDRESS_SPACE_LIMIT
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    expected = _store_damage.read_all(original)
    pristine = {name: pathlib.Path(original, name).read_bytes() for name in FILES}

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(mutations(pristine))
    def damaged_store_reads_back_or_raises_store_error(mutation: tuple[str, str, Any, Any]) -> None:
        name, kind, position, payload = mutation
        print(f"trying {mutation}", flush=True)
        copy = f"{workdir}/example"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(original, copy)
        with open(f"{copy}/{name}", "wb") as f:
            f.write(mutate(pristine[name], kind, position, payload))
        try:
            found = _store_damage.read_all(copy)
        except store.StoreError:
            return
        assert _store_damage.same(found, expected), f"{mutation} read back different values without an error"

    damaged_store_reads_back_or_raises_store_error()
    print("passed", flush=True)


if __name__ == "__main__":
    main()
