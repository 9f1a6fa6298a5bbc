"""Federated CIFAR-100 from TFF's SQLite file (`cifar100.sqlite`), without TensorFlow.

Elements are `{'coarse_label': int64, 'image': uint8[32,32,3], 'label': int64}`
(TFF's fields, in its order); images are stored as Int64Lists of 3072 values.
"""

from __future__ import annotations

import os

import numpy as np

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation.formats import sqlite

FEATURES = {
    "coarse_label": sqlite.Feature(np.int64),
    "image": sqlite.Feature(np.uint8, (32, 32, 3)),
    "label": sqlite.Feature(np.int64),
}


def load_data(path: str | os.PathLike) -> tuple[client_data_lib.ClientData, client_data_lib.ClientData]:
    """Loads federated CIFAR-100: `(train, test)` from splits 'train' and 'test'.

    Raises:
      FileNotFoundError, ValueError: see `formats.sqlite.from_sqlite`.
    """
    return sqlite.from_sqlite(path, "train", FEATURES), sqlite.from_sqlite(path, "test", FEATURES)
