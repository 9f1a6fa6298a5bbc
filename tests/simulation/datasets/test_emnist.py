import numpy as np
import pytest

from fedlang.simulation.datasets import emnist
from fedlang.simulation.formats import sqlite


def _example(label):
    return {"pixels": np.full(784, label / 10, np.float32), "label": np.array([label])}


def test_load_data_digits_and_all(tmp_path):
    path = tmp_path / "emnist_all.sqlite"
    sqlite.write_sqlite(path, "digits_only_train", {"f0": [_example(1), _example(2)], "f1": [_example(3)]})
    sqlite.write_sqlite(path, "digits_only_test", {"f0": [_example(4)]})
    sqlite.write_sqlite(path, "all_train", {"f9": [_example(5)]})
    sqlite.write_sqlite(path, "all_test", {"f9": [_example(6)]})
    train, test = emnist.load_data(path)
    assert train.client_ids == ["f0", "f1"] and test.client_ids == ["f0"]
    assert str(train.element_spec) == "<pixels=float32[28,28],label=int32>"
    batch = next(iter(train.create_dataset_for_client("f0").batch(2)))
    assert batch["label"].tolist() == [1, 2] and batch["pixels"].shape == (2, 28, 28)
    all_train, _ = emnist.load_data(path, only_digits=False)
    assert all_train.client_ids == ["f9"]


def test_missing_split_is_clear(tmp_path):
    path = tmp_path / "e.sqlite"
    sqlite.write_sqlite(path, "train", {"f0": [_example(1)]})
    with pytest.raises(ValueError, match="digits_only_train"):
        emnist.load_data(path)
