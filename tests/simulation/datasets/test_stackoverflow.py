import numpy as np

from fedlang.simulation.datasets import stackoverflow
from fedlang.simulation.formats import sqlite


def test_load_data_three_splits_and_defaults(tmp_path):
    path = tmp_path / "so.sqlite"
    full = {"tokens": b"how do i", "title": b"q", "tags": b"python|numpy", "score": np.array([3]),
            "creation_date": b"2010-01-01", "type": b"question"}
    sqlite.write_sqlite(path, "train", {"u1": [full]})
    sqlite.write_sqlite(path, "heldout", {"u2": [{"tokens": b"a", "title": b"b", "tags": b"c"}]})
    sqlite.write_sqlite(path, "test", {"u3": [full]})
    train, heldout, test = stackoverflow.load_data(path)
    row = next(iter(train.create_dataset_for_client("u1")))
    assert row["tags"] == b"python|numpy" and int(row["score"]) == 3
    sparse = next(iter(heldout.create_dataset_for_client("u2")))
    assert sparse["type"] == b"" and int(sparse["score"]) == 0
    assert test.client_ids == ["u3"]
