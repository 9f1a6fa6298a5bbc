"""Child process for the store damage tests: damages copies of a store and reads them.

Run as `python _store_damage.py STORE WORKDIR SEED FIRST LAST`. For each trial
`FIRST <= i < LAST` it copies STORE into WORKDIR, overwrites 1-3 random bytes of
`data.arrow` (drawn from `(SEED, i)`), opens the copy and reads every client, and
prints one line per trial, flushed before the next one starts::

    begin <i>
    end <i> ok|wrong|<exception type name>

`ok` means every client read back equal to the undamaged store, `wrong` that some
client read back different values without an error. A crash (a signal, an abort)
leaves a `begin` without its `end`; the parent test counts it and starts a new child
at the next trial. The address space is capped, so runaway allocations show up as
`MemoryError` instead of exhausting the machine.
"""

from __future__ import annotations

import resource
import shutil
import sys

import numpy as np

from fedlang.simulation import _tree, store

ADDRESS_SPACE_LIMIT = 8 << 30


def read_all(path: str) -> dict[str, list[np.ndarray]]:
    s = store.open_store(path)
    return {cid: _tree.flatten(s.read_arrays(cid)) for cid in s.client_ids}


def same(a: dict[str, list[np.ndarray]], b: dict[str, list[np.ndarray]]) -> bool:
    if list(a) != list(b):
        return False
    for cid in a:
        for x, y in zip(a[cid], b[cid], strict=True):
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if x.dtype == object:
                if x.tolist() != y.tolist():
                    return False
            elif x.tobytes() != y.tobytes():
                return False
    return True


def damage(data: bytearray, rng: np.random.Generator) -> None:
    for _ in range(int(rng.integers(1, 4))):
        position = int(rng.integers(len(data)))
        data[position] = (data[position] + int(rng.integers(1, 256))) % 256


def main() -> None:
    original, workdir, seed, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))
    expected = read_all(original)
    with open(f"{original}/{store.DATA_FILE}", "rb") as f:
        pristine = f.read()
    for i in range(first, last):
        copy = f"{workdir}/trial"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(original, copy)
        data = bytearray(pristine)
        damage(data, np.random.default_rng([seed, i]))
        with open(f"{copy}/{store.DATA_FILE}", "wb") as f:
            f.write(data)
        print(f"begin {i}", flush=True)
        try:
            outcome = "ok" if same(read_all(copy), expected) else "wrong"
        except Exception as e:  # every exception type is an outcome the parent counts
            outcome = type(e).__name__
        print(f"end {i} {outcome}", flush=True)


if __name__ == "__main__":
    main()
