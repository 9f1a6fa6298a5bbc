"""Federated Stack Overflow from TFF's SQLite file (`stackoverflow.sqlite`), without TensorFlow.

Clients are users. Each element has TFF's fields: `tokens`, `title`, `tags`
(bytes; tags joined by '|'), and, when present, `creation_date`, `type` (bytes) and
`score` (int64); a missing optional field reads as b'' or 0.
"""

from __future__ import annotations

import os

import numpy as np

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation.formats import sqlite

FEATURES = {
    "creation_date": sqlite.Feature(bytes, default=b""),
    "score": sqlite.Feature(np.int64, default=np.int64(0)),
    "tags": sqlite.Feature(bytes),
    "title": sqlite.Feature(bytes),
    "tokens": sqlite.Feature(bytes),
    "type": sqlite.Feature(bytes, default=b""),
}


def load_data(path: str | os.PathLike) -> tuple[client_data_lib.ClientData, ...]:
    """Loads federated Stack Overflow: `(train, heldout, test)`, as TFF does.

    Raises:
      FileNotFoundError, ValueError: see `formats.sqlite.from_sqlite`.
    """
    return tuple(sqlite.from_sqlite(path, split, FEATURES) for split in ("train", "heldout", "test"))
