"""Federated EMNIST from TFF's SQLite file (`emnist_all.sqlite`), read without TensorFlow.

Elements are `{'pixels': float32[28,28], 'label': int32}`; clients are writers.
Download and decompress the file once (fedlang never downloads at run time), then::

    train, test = emnist.load_data('emnist_all.sqlite', only_digits=True)
"""

from __future__ import annotations

import os

import numpy as np

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation.formats import sqlite

FEATURES = {
    "pixels": sqlite.Feature(np.float32, (28, 28)),
    "label": sqlite.Feature(np.int32),
}


def load_data(path: str | os.PathLike, only_digits: bool = True
              ) -> tuple[client_data_lib.ClientData, client_data_lib.ClientData]:
    """Loads federated EMNIST (lazily: only client metadata is read here).

    Args:
      path: the decompressed `emnist_all.sqlite` file.
      only_digits: the 10-class digits subset (splits `digits_only_train` /
        `digits_only_test`) instead of all 62 classes (`all_train` / `all_test`).

    Returns:
      `(train, test)` `ClientData`, as TFF's `emnist.load_data`.

    Raises:
      FileNotFoundError, ValueError: see `formats.sqlite.from_sqlite`.
    """
    prefix = "digits_only" if only_digits else "all"
    return (sqlite.from_sqlite(path, f"{prefix}_train", FEATURES),
            sqlite.from_sqlite(path, f"{prefix}_test", FEATURES))
