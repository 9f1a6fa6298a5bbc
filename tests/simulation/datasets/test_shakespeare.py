from fedlang.simulation.datasets import shakespeare
from fedlang.simulation.formats import sqlite


def test_load_data(tmp_path):
    path = tmp_path / "shakespeare.sqlite"
    sqlite.write_sqlite(path, "train", {"KING": [{"snippets": b"To be"}, {"snippets": b"or not"}]})
    sqlite.write_sqlite(path, "test", {"KING": [{"snippets": b"to be"}]})
    train, test = shakespeare.load_data(path)
    assert [e["snippets"] for e in train.create_dataset_for_client("KING")] == [b"To be", b"or not"]
    assert test.num_examples("KING") == 1



def test_snippets_have_a_str_element_spec(tmp_path):
    from fedlang.core import structure, types

    path = tmp_path / "shakespeare.sqlite"
    sqlite.write_sqlite(path, "train", {"KING": [{"snippets": b"To be"}, {"snippets": "é".encode()}]})
    sqlite.write_sqlite(path, "test", {"KING": [{"snippets": b"to be"}]})
    train, _ = shakespeare.load_data(path)
    assert str(train.element_spec) == "<snippets=str>"
    # What a runtime reads from the dataset: UTF-8 bytes become str values.
    stream = structure.to_internal(
        train.create_dataset_for_client("KING"), types.SequenceType(train.element_spec)
    )
    assert [e[0].item() for e in stream] == ["To be", "é"]
