import numpy as np

from fedlang.simulation.datasets import cifar100
from fedlang.simulation.formats import sqlite


def test_load_data(tmp_path):
    path = tmp_path / "cifar100.sqlite"
    image = np.arange(3072) % 256
    example = {"coarse_label": np.array([4]), "image": image, "label": np.array([51])}
    sqlite.write_sqlite(path, "train", {"0": [example]})
    sqlite.write_sqlite(path, "test", {"0": [example]})
    train, _ = cifar100.load_data(path)
    assert str(train.element_spec) == "<coarse_label=int64,image=uint8[32,32,3],label=int64>"
    row = next(iter(train.create_dataset_for_client("0")))
    assert row["image"].dtype == np.uint8 and row["image"].reshape(-1).tolist() == image.tolist()
    assert int(row["label"]) == 51
