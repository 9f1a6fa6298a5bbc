from fedlang.simulation.datasets import shakespeare
from fedlang.simulation.formats import sqlite


def test_load_data(tmp_path):
    path = tmp_path / "shakespeare.sqlite"
    sqlite.write_sqlite(path, "train", {"KING": [{"snippets": b"To be"}, {"snippets": b"or not"}]})
    sqlite.write_sqlite(path, "test", {"KING": [{"snippets": b"to be"}]})
    train, test = shakespeare.load_data(path)
    assert [e["snippets"] for e in train.create_dataset_for_client("KING")] == [b"To be", b"or not"]
    assert test.num_examples("KING") == 1
