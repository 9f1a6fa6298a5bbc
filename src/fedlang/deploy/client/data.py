"""A device's data readers: the datasets a client trains on, read from its files.

`NpzDataset` reads an `.npz` file of numeric arrays with as many rows each (what
`fedlang client --data NAME=PATH` and `Client(data={"train": "x.npz"})` take): checked
from the arrays' headers when made, read and batched when iterated.
"""

from __future__ import annotations

import os
import pathlib
import zipfile
from collections.abc import Iterator

import numpy as np

# Array kinds a plan computes on (numpy's dtype.kind): bool, integers, floats, complex.
_NUMERIC = "biufc"
_KINDS = {"U": "text", "S": "bytes", "O": "Python objects, pickled", "V": "raw records",
          "M": "dates", "m": "time spans"}


class NpzDataset:
    """The rows of an `.npz` file's arrays, in batches (the file is read when iterated).

    Each element is a dict of the file's arrays (in their order in the file), row by row.

    Raises:
      FileNotFoundError: if there is no file at `path`.
      ValueError: if it is not an `.npz` file of numeric arrays (bool, integer, float or
        complex; text, bytes and objects are refused, naming the array and its dtype)
        with as many rows each (checked from the arrays' headers; the data are read when
        iterated).
    """

    def __init__(self, path: str | os.PathLike[str], batch_size: int = 20):
        if batch_size < 1:
            raise ValueError(f"Expected a batch size of at least 1, found {batch_size}.")
        self.path = pathlib.Path(path)
        self.batch_size = batch_size
        self._check()

    def _check(self) -> None:
        path, fix = self.path, "save each client's arrays with numpy.savez(path, x=..., y=...)"
        if not path.exists():
            raise FileNotFoundError(
                f"Expected client data at {path}, found no such file (in {pathlib.Path.cwd()});"
                " check the path."
            )
        if not path.is_file():  # a pipe or a device: reading it now would consume it
            return
        shapes, dtypes = {}, {}
        try:
            with zipfile.ZipFile(path) as z:
                for member in z.namelist():
                    with z.open(member) as f:
                        version = np.lib.format.read_magic(f)
                        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                else np.lib.format.read_array_header_2_0)
                        shape, _, dtype = read(f)
                    name = member.removesuffix(".npy")
                    shapes[name], dtypes[name] = shape, dtype
        except (zipfile.BadZipFile, ValueError, OSError) as e:
            raise ValueError(
                f"Expected {path} to be an .npz file of numeric arrays, found another file "
                f"({e}); {fix}."
            ) from e
        for name, dtype in dtypes.items():
            # Plans compute on numbers: text or objects would fail later, inside a task.
            if dtype.kind not in _NUMERIC:
                what = _KINDS["O"] if dtype.hasobject else _KINDS.get(dtype.kind, "not numbers")
                raise ValueError(
                    f"Expected {path} to hold numeric arrays, found array {name!r} of dtype "
                    f"{dtype} ({what}); convert it to numbers (e.g. class ids) or leave it out; "
                    f"{fix}."
                )
        rows = {k: s[0] if s else None for k, s in shapes.items()}
        if not rows:
            raise ValueError(f"Expected {path} to hold arrays, found none; {fix}.")
        if None in rows.values() or len(set(rows.values())) != 1:
            raise ValueError(
                f"Expected {path} to hold arrays with as many rows each, found "
                f"{ {k: 'a scalar' if n is None else f'{n} rows' for k, n in rows.items()} }; {fix}."
            )

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        with np.load(self.path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) != 1:
            raise ValueError(
                f"Expected the arrays of {self.path} to have as many rows each, found "
                f"{ {k: len(a) for k, a in arrays.items()} }."
            )
        (n,) = lengths
        for start in range(0, n, self.batch_size):
            yield {k: a[start : start + self.batch_size] for k, a in arrays.items()}
