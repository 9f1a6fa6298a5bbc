import sqlite3

import numpy as np
import pytest

from fedlang.simulation.formats import sqlite


def _write(path):
    sqlite.write_sqlite(path, "train", {
        "w2": [{"v": np.array([1.0, 2.0], np.float32), "t": b"hi"}],
        "w1": [{"v": np.array([3.0, 4.0], np.float32), "t": b"a"}, {"v": np.array([5.0, 6.0], np.float32), "t": b"b"}],
    })
    sqlite.write_sqlite(path, "test", {"w1": [{"v": np.zeros(2, np.float32), "t": b"z"}]}, packed=False)


FEATURES = {"v": sqlite.Feature(np.float32, (2,)), "t": sqlite.Feature(bytes)}


def test_reads_clients_lazily(tmp_path):
    path = tmp_path / "d.sqlite"
    _write(path)
    cd = sqlite.from_sqlite(path, "train", FEATURES)
    assert cd.client_ids == ["w1", "w2"] and cd.num_examples("w1") == 2
    ds = cd.create_dataset_for_client("w1")
    path.unlink()  # nothing was read yet: iterating now fails
    with pytest.raises(sqlite3.OperationalError):
        list(ds)


def test_decodes_examples_in_order(tmp_path):
    path = tmp_path / "d.sqlite"
    _write(path)
    cd = sqlite.from_sqlite(path, "train", FEATURES)
    rows = list(cd.create_dataset_for_client("w1"))
    assert [r["t"] for r in rows] == [b"a", b"b"] and rows[1]["v"].tolist() == [5.0, 6.0]
    assert str(cd.preprocess(lambda d: d.map(lambda e: {"v": e["v"]})).element_spec) == "<v=float32[2]>"
    unpacked = sqlite.from_sqlite(path, "test", FEATURES)
    assert next(iter(unpacked.create_dataset_for_client("w1")))["t"] == b"z"
    raw = sqlite.from_sqlite(path, "train")
    assert isinstance(next(iter(raw.create_dataset_for_client("w2"))), bytes)
    assert sqlite.split_names(path) == ["test", "train"]


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="SQLite"):
        sqlite.from_sqlite(tmp_path / "none.sqlite", "train")
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE foo (x INTEGER)")
    with pytest.raises(ValueError, match=r"missing \['examples', 'client_metadata'\]"):
        sqlite.from_sqlite(other, "train")
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all, just some bytes" * 10)
    with pytest.raises(ValueError, match="SQLite database"):
        sqlite.from_sqlite(junk, "train")


def test_unknown_split_and_bad_features(tmp_path):
    path = tmp_path / "d.sqlite"
    _write(path)
    with pytest.raises(ValueError, match=r"splits are \['test', 'train'\]"):
        sqlite.from_sqlite(path, "validation")
    wrong = sqlite.from_sqlite(path, "train", {"v": sqlite.Feature(np.float32, (3,))})
    with pytest.raises(ValueError, match="Expected 3 values"):
        list(wrong.create_dataset_for_client("w1"))
    missing = sqlite.from_sqlite(path, "train", {"q": sqlite.Feature(np.int64)})
    with pytest.raises(ValueError, match="feature 'q'"):
        list(missing.create_dataset_for_client("w1"))
