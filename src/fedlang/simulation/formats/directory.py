"""Reader for a directory of files per client: `root/<client_id>/<files>`.

Each file is one element, decoded lazily by a user function (default: a `.npy`
array via `numpy.load`). Client ids are the sorted sub-directory names; a client's
files are listed (sorted) when its dataset is iterated.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib


def _load_npy(path: pathlib.Path) -> np.ndarray:
    return np.load(path, allow_pickle=False)


def from_directory(root: str | os.PathLike, decode_fn: Callable[[pathlib.Path], Any] | None = None,
                   pattern: str | None = None, element_spec: Any = None) -> client_data_lib.ClientData:
    """Client data from `root/<client_id>/<file>`, one element per file.

    Args:
      root: the directory whose sub-directories are clients.
      decode_fn: `decode_fn(path) -> element`; default loads `.npy` files.
      pattern: the glob selecting a client's files (default `*.npy` with the default
        decoder, else `*`).
      element_spec: the spec of one element; inferred by decoding the first file of
        the first client when needed.

    Returns:
      A lazy `ClientData`.

    Raises:
      FileNotFoundError: if `root` is not a directory or has no sub-directory.
    """
    root = pathlib.Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"Expected a directory of client folders at {root}, found none.")
    client_ids = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not client_ids:
        raise FileNotFoundError(f"Expected one sub-directory per client in {root}, found none.")
    decode = decode_fn or _load_npy
    glob = pattern or ("*.npy" if decode_fn is None else "*")

    def files(cid: str) -> list[pathlib.Path]:
        return sorted(p for p in (root / cid).glob(glob) if p.is_file())

    def dataset_fn(cid: str) -> dataset_lib.Dataset:
        return dataset_lib.Dataset.from_generator_fn(lambda: (decode(f) for f in files(cid)), element_spec)

    return client_data_lib.ClientData(client_ids, dataset_fn, element_spec=element_spec)
