"""Building a directory aside and moving it into place, surviving kills at any point.

A writer builds the new directory in a hidden temporary next to its target,
`.NAME.tmp-ID`, and moves it into place when it is complete. Replacing an existing
directory takes two renames (POSIX has no atomic exchange of two directories)::

    NAME -> .NAME.old-ID        # the previous directory moves aside
    .NAME.tmp-ID -> NAME        # the new one takes its place
    delete .NAME.old-ID

A writer killed between the two renames leaves nothing at `NAME`; one killed while
building leaves its temporary behind. `recover(target)` (run before a directory is
opened and before one is written) repairs both:

- `NAME` missing, `.NAME.old-ID` and `.NAME.tmp-ID` present: the temporary was
  complete before the first rename, so the replacement is finished (rolled forward).
- `NAME` present and `.NAME.old-ID` left: the previous directory is deleted.
- a `.NAME.tmp-ID` no live writer is using: deleted.

Which temporaries are in use is known exactly: a writer holds an exclusive `flock` on
its temporary directory for its whole life, and the kernel drops the lock when the
process ends, however it ends (SIGKILL included). A pid file would be fooled by
reused pids and by writers on another machine sharing the directory; an age limit
alone would delete a slow writer's temporary or keep a dead one for hours. The one
moment without the lock, between `mkdir` and `flock`, is covered by also requiring a
temporary to be `GRACE_S` seconds old before it is deleted. Where `fcntl` does not
exist (Windows), temporaries are deleted only after `UNLOCKED_STALE_S`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import time
import uuid
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

GRACE_S = 5.0
UNLOCKED_STALE_S = 24 * 3600.0
# How long `recover` waits for a live writer that is between its two renames.
WINDOW_WAIT_S = 10.0


def _siblings(target: pathlib.Path, kind: str) -> dict[str, pathlib.Path]:
    """ID -> path of the `.NAME.<kind>-ID` directories next to `target`."""
    prefix = f".{target.name}.{kind}-"
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return {}
    return {e.name[len(prefix):]: pathlib.Path(e.path) for e in entries
            if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)}


def _try_lock(path: pathlib.Path) -> int | None:
    """An fd holding an exclusive lock on directory `path`, or None if a live process holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    if fcntl is None:
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _age_s(path: pathlib.Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def fsync_dir(path: pathlib.Path) -> None:
    """Makes a rename or a new file in directory `path` durable (where the file system can)."""
    with contextlib.suppress(OSError):  # not every file system can sync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def staging(target: pathlib.Path) -> Iterator[pathlib.Path]:
    """A fresh locked temporary directory next to `target`; deleted if the block raises.

    Call `commit(tmp, target)` inside the block to move it into place.
    """
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    fd = _try_lock(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)


def commit(tmp: pathlib.Path, target: pathlib.Path) -> None:
    """Moves the complete directory `tmp` (from `staging`) to `target`, replacing it."""
    if target.exists():
        old = target.parent / f".{target.name}.old-{tmp.name.rsplit('-', 1)[1]}"
        target.rename(old)
        try:
            tmp.rename(target)
        except OSError:
            if not target.exists():  # put the previous directory back, then report
                old.rename(target)
            raise
        fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)
        fsync_dir(target.parent)


def recover(target: pathlib.Path) -> None:
    """Finishes a replacement of `target` cut short and deletes stale temporaries.

    Best effort: a directory that cannot be changed (read-only) is left as it is.
    """
    deadline = time.monotonic() + WINDOW_WAIT_S
    while not target.exists():
        olds, tmps = _siblings(target, "old"), _siblings(target, "tmp")
        pending = [i for i in olds if i in tmps]
        if not pending:
            break
        fd = _try_lock(tmps[pending[0]])
        if fd is None:  # a live writer between its renames: it is about to finish
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
            continue
        try:
            tmps[pending[0]].rename(target)
        except OSError:
            break  # read-only, or another process got there first: leave it
        finally:
            os.close(fd)
        fsync_dir(target.parent)
    if target.exists():
        for old in _siblings(target, "old").values():
            shutil.rmtree(old, ignore_errors=True)
    for tmp in _siblings(target, "tmp").values():
        if fcntl is None and _age_s(tmp) < UNLOCKED_STALE_S:
            continue
        fd = _try_lock(tmp)
        if fd is None:
            continue
        try:
            if _age_s(tmp) >= GRACE_S:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            os.close(fd)
