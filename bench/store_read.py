"""Micro-benchmark: what the store's checksums and Arrow validation cost.

Writes an EMNIST-shaped store (`--gigabytes`, default 1; the generator of
`data_store.py`), then reads every client back `--passes` times from the page cache
(`Store.read_arrays` plus a sum over the pixels, which touches every page), first as
written (version 2: Arrow validation and CRC-32 checksums), then with the index
rewritten as version 1 (validation, no checksums). Prints write throughput and read
throughput for both. Run it with another fedlang on PYTHONPATH to compare versions.

Usage:
  python bench/store_read.py                     # 1 GB, about a minute on 2 cores
  python bench/store_read.py --gigabytes 0.1     # smoke
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile
import time
import warnings

import numpy as np
from data_store import _source, client_sizes


def read_all(path: pathlib.Path, passes: int) -> float:
    """Seconds per pass over every client (best of `passes`)."""
    from fedlang.simulation import store

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the version 1 store warns that it is unverified
        s = store.open_store(path)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        total = 0.0
        for cid in s.client_ids:
            total += float(np.add.reduce(s.read_arrays(cid)["x"], axis=None))
        best = min(best, time.perf_counter() - t)
    return best


def as_version_1(path: pathlib.Path) -> None:
    index = json.loads((path / "index.json").read_text())
    index["version"] = 1
    index.pop("checksum", None)
    index["clients"] = {cid: entry[:2] for cid, entry in index["clients"].items()}
    (path / "index.json").write_text(json.dumps(index))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--clients", type=int, default=140)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from fedlang.simulation import store

    out = pathlib.Path(tempfile.mkdtemp(prefix="fedlang-store-read-"))
    path = out / "store"
    print(f"Writing the store to {path} (deleted at the end)", flush=True)
    try:
        t = time.perf_counter()
        store.write(path, _source(client_sizes(args.clients, args.gigabytes * 1e9, args.seed), args.seed))
        write_s = time.perf_counter() - t
        size = (path / "data.arrow").stat().st_size
        index = json.loads((path / "index.json").read_text())
        written = index["version"]
        rows = [("store", f"{size / 1e9:.2f} GB, {len(index['clients'])} clients, version {written}"),
                ("write (incl. generating the data)", f"{write_s:.1f} s, {size / 1e6 / write_s:.0f} MB/s")]
        if written >= 2:
            s = read_all(path, args.passes)
            rows.append(("read, version 2 (validated, checksums)", f"{s:.2f} s, {size / 1e6 / s:.0f} MB/s"))
        as_version_1(path)
        s = read_all(path, args.passes)
        rows.append(("read, version 1 (no checksums)", f"{s:.2f} s, {size / 1e6 / s:.0f} MB/s"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    width = max(len(k) for k, _ in rows)
    print(f"| {'measure'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k.ljust(width)} | {v} |")


if __name__ == "__main__":
    main()
