"""Child process for the kill tests: writes a store and stops at a chosen moment.

Run as `python _store_writer.py PATH VALUE MOMENT`. It overwrites the store at PATH
with one client 'c' whose single element is `{'v': VALUE}`, and when it reaches
MOMENT it prints `reached MOMENT` and sleeps until the parent kills it (SIGKILL):

- `while-writing`: the source is producing rows (the temporary is half written);
- `before-renames`: the temporary is complete, the old store still in place;
- `between-renames`: the old store was moved aside, the new one not yet in place;
- `before-cleanup`: the new store is in place, the old one not yet deleted.

The renames and deletions are the real ones of `store.write`; the pauses only make
the kill land exactly at the moment under test.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import time

import numpy as np

from fedlang.simulation import store


def pause(moment: str, wanted: str) -> None:
    if moment == wanted:
        print(f"reached {moment}", flush=True)
        time.sleep(600)


def main() -> None:
    path, value, moment = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rename, rmtree = pathlib.Path.rename, shutil.rmtree

    def paused_rename(self: pathlib.Path, target: str | pathlib.Path) -> pathlib.Path:
        if pathlib.Path(target).name.startswith(f".{path.name}.old-"):
            pause(moment, "before-renames")
            done = rename(self, target)
            pause(moment, "between-renames")
            return done
        return rename(self, target)

    def paused_rmtree(target: str | pathlib.Path, *args: object, **kwargs: object) -> None:
        if pathlib.Path(target).name.startswith(f".{path.name}.old-"):
            pause(moment, "before-cleanup")
        rmtree(target, *args, **kwargs)  # type: ignore[arg-type]

    pathlib.Path.rename = paused_rename  # type: ignore[method-assign]
    shutil.rmtree = paused_rmtree  # type: ignore[assignment]

    def rows():
        yield {"v": np.int32(value)}
        pause(moment, "while-writing")

    store.write(path, [("c", rows())], overwrite=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
