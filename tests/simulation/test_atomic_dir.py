"""Store writers killed (SIGKILL) at every moment of a write: opening the store repairs it."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fedlang.simulation import _atomic_dir, store

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


class Writer:
    """`_store_writer.py` in a child process, stopped at `moment` until killed."""

    def __init__(self, path, value, moment):
        env = dict(os.environ, PYTHONPATH=str(SRC))
        self.process = subprocess.Popen([sys.executable, str(HERE / "_store_writer.py"), str(path), str(value), moment],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.process.stdout.readline()
        if line.strip() != f"reached {moment}":
            self.kill()
            pytest.fail(f"writer did not reach {moment}: {line!r} {self.process.stderr.read()[-2000:]}")

    def kill(self):
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process.stdout.close()
        self.process.stderr.close()


def _value(path):
    return [int(e["v"]) for e in store.read_client(path, "c")]


def _hidden(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))


def _age(directory):
    """Makes `directory` look last modified a minute ago (beyond the grace period)."""
    past = time.time() - 60
    os.utime(directory, (past, past))


@pytest.fixture
def old_store(tmp_path):
    return store.write(tmp_path / "st", [("c", [{"v": np.int32(1)}])])


def test_kill_between_the_renames_is_rolled_forward(tmp_path, old_store):
    # Before: nothing at the path; the data only in a hidden .st.old-* directory.
    Writer(old_store, 2, "between-renames").kill()
    assert not old_store.exists()
    assert _value(old_store) == [2]  # opening finished the replacement
    assert _hidden(tmp_path) == []


def test_kill_before_the_renames_keeps_the_old_store_and_cleans_the_temporary(tmp_path, old_store):
    Writer(old_store, 2, "before-renames").kill()
    [tmp] = [p for p in tmp_path.iterdir() if p.name.startswith(".st.tmp-")]
    assert _value(old_store) == [1]
    assert tmp.exists()  # too recent: a writer may have just created it
    _age(tmp)
    assert _value(old_store) == [1]
    assert _hidden(tmp_path) == []


def test_kill_before_deleting_the_old_store(tmp_path, old_store):
    Writer(old_store, 2, "before-cleanup").kill()
    assert len(_hidden(tmp_path)) == 1
    assert _value(old_store) == [2]
    assert _hidden(tmp_path) == []


def test_temporary_of_a_live_writer_is_kept_until_it_dies(tmp_path, old_store):
    writer = Writer(old_store, 2, "while-writing")
    try:
        [tmp] = [p for p in tmp_path.iterdir() if p.name.startswith(".st.tmp-")]
        _age(tmp)
        assert _value(old_store) == [1]
        assert tmp.exists()  # locked by the live writer
    finally:
        writer.kill()
    store.write(tmp_path / "other", {"c": [{"v": np.int32(3)}]})  # another store: leaves st's alone
    assert tmp.exists()
    store.write(old_store, {"c": [{"v": np.int32(4)}]}, overwrite=True)  # writing cleans, like opening
    assert _value(old_store) == [4]
    assert _hidden(tmp_path) == []


def test_recover_without_anything_to_do(tmp_path):
    _atomic_dir.recover(tmp_path / "missing" / "st")
    _atomic_dir.recover(tmp_path / "st")
    assert list(tmp_path.iterdir()) == []
