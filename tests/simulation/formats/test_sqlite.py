import contextlib
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
    with pytest.raises(FileNotFoundError, match=r"d\.sqlite"):
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


def _tables(path, examples_columns, metadata_columns):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"CREATE TABLE examples ({examples_columns})")
        conn.execute(f"CREATE TABLE client_metadata ({metadata_columns})")
        conn.commit()


def test_tables_with_other_columns(tmp_path):
    # Before: sqlite3.OperationalError: no such column: num_examples.
    path = tmp_path / "d.sqlite"
    _tables(path, "split_name TEXT, client_id TEXT, serialized_example_proto BLOB", "client_id TEXT, split_name TEXT, n INT")
    with pytest.raises(ValueError, match=r"columns \['client_id', 'split_name', 'num_examples'\] in table "
                                         r"client_metadata of .*d\.sqlite.*missing \['num_examples'\]"):
        sqlite.from_sqlite(path, "train")


def test_metadata_counts_that_are_null_or_wrong(tmp_path):
    path = tmp_path / "d.sqlite"
    _write(path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE tmp AS SELECT * FROM client_metadata")
        conn.execute("DROP TABLE client_metadata")
        conn.execute("CREATE TABLE client_metadata (client_id TEXT, split_name TEXT, num_examples INTEGER)")
        conn.execute("INSERT INTO client_metadata SELECT * FROM tmp")
        conn.execute("UPDATE client_metadata SET num_examples = 3 WHERE client_id = 'w1' AND split_name = 'train'")
        conn.execute("UPDATE client_metadata SET num_examples = 0 WHERE client_id = 'w2'")
        conn.execute("UPDATE client_metadata SET num_examples = NULL WHERE split_name = 'test'")
        conn.commit()
    # Before: TypeError: int() argument must be ... not 'NoneType'.
    with pytest.raises(ValueError, match=r"non-negative integer num_examples for client 'w1' of split 'test'.*None"):
        sqlite.from_sqlite(path, "test")
    # Before: the counts were never checked.
    cd = sqlite.from_sqlite(path, "train", FEATURES)
    with pytest.raises(ValueError, match=r"3 examples of client 'w1'.*client_metadata.*found 2 in .*d\.sqlite"):
        list(cd.create_dataset_for_client("w1"))
    with pytest.raises(ValueError, match=r"0 examples of client 'w2'.*found more"):
        list(cd.create_dataset_for_client("w2"))


def test_values_that_do_not_fit_the_feature_dtype(tmp_path):
    # Before: an int64 3000000000 read into an int32 feature wrapped to -1294967296.
    path = tmp_path / "d.sqlite"
    sqlite.write_sqlite(path, "train", {"a": [{"label": np.array([3_000_000_000]), "t": b"caf\xe9"}]})
    ints = sqlite.from_sqlite(path, "train", {"label": sqlite.Feature(np.int32)})
    with pytest.raises(ValueError, match=r"feature 'label'.*int32.*3000000000.*client 'a' in .*d\.sqlite"):
        list(ints.create_dataset_for_client("a"))
    assert int(next(iter(sqlite.from_sqlite(path, "train", {"label": sqlite.Feature(np.int64)})
                         .create_dataset_for_client("a")))["label"]) == 3_000_000_000
    text = sqlite.from_sqlite(path, "train", {"t": sqlite.Feature(str)})
    with pytest.raises(ValueError, match=r"UTF-8 text in feature 't'.*client 'a'.*Feature\(bytes\)"):
        list(text.create_dataset_for_client("a"))


def test_null_example_blob(tmp_path):
    path = tmp_path / "d.sqlite"
    _tables(path, "split_name TEXT, client_id TEXT, serialized_example_proto BLOB",
            "client_id TEXT, split_name TEXT, num_examples INTEGER")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("INSERT INTO examples VALUES ('train', 'a', NULL)")
        conn.execute("INSERT INTO client_metadata VALUES ('a', 'train', 1)")
        conn.commit()
    cd = sqlite.from_sqlite(path, "train", FEATURES)
    with pytest.raises(ValueError, match=r"serialized tf.train.Example .*found NULL \(client 'a'"):
        list(cd.create_dataset_for_client("a"))


def test_views_are_not_read_as_tables(tmp_path):
    # A view runs a query of the file's author (it could loop): only real tables are read.
    path = tmp_path / "d.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE client_metadata (client_id TEXT, split_name TEXT, num_examples INTEGER)")
        conn.execute("CREATE VIEW examples AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                     "SELECT 'train' AS split_name, 'a' AS client_id, x'00' AS serialized_example_proto FROM n")
        conn.commit()
    with pytest.raises(ValueError, match=r"missing \['examples'\]"):
        sqlite.from_sqlite(path, "train")
