"""Federated Shakespeare from TFF's SQLite file (`shakespeare.sqlite`), without TensorFlow.

Clients are speaking roles; each element is `{'snippets': bytes}`, a line of text
(strings have no fedlang type: map them to character ids before training).
"""

from __future__ import annotations

import os

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation.formats import sqlite

FEATURES = {"snippets": sqlite.Feature(bytes)}


def load_data(path: str | os.PathLike) -> tuple[client_data_lib.ClientData, client_data_lib.ClientData]:
    """Loads federated Shakespeare: `(train, test)` from splits 'train' and 'test'.

    Raises:
      FileNotFoundError, ValueError: see `formats.sqlite.from_sqlite`.
    """
    return sqlite.from_sqlite(path, "train", FEATURES), sqlite.from_sqlite(path, "test", FEATURES)
