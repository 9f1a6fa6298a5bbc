"""Numeric casts that never change a value silently.

Readers narrow what they read (int64 -> int32, float64 -> float32, or a dtype the
user asked for), and numpy's `astype` would wrap 3000000000 to -1294967296, turn
1e300 into inf and 2.5 into 2 without a word. `checked` casts like `astype` but
refuses any value the cast would change beyond rounding, naming the first one:

- to an integer type: values outside its range, and from floats also NaN, inf and
  non-integral values;
- to a narrower float: finite values that would overflow to inf;
- to bool: values other than 0 and 1.

Rounding to the nearest representable value (float64 -> float32, int64 -> float32)
is accepted: it is what narrowing floats means.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class CastError(ValueError):
    """A value that does not fit the target dtype.

    Attributes:
      row: the index along the first axis of the first offending value (0 for a scalar).
      value: that value.
      dtype: the target dtype.
      reason: why it does not fit, e.g. "is outside the range of int32 [...]".
    """

    def __init__(self, row: int, value: Any, dtype: np.dtype, reason: str):
        self.row, self.value, self.dtype, self.reason = row, value, dtype, reason
        super().__init__(f"{value!r} at row {row}, which {reason}")


def _bad_values(array: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray | None, str]:
    src = array.dtype
    if dtype.kind == "b":
        if src.kind == "b":
            return None, ""
        return (array != 0) & (array != 1), "is not 0 or 1 (a bool)"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if src.kind in "biu":
            if np.can_cast(src, dtype, "safe"):
                return None, ""
            return (array < info.min) | (array > info.max), f"is outside the range of {dtype} [{info.min}, {info.max}]"
        if src.kind == "f":
            # Compare against powers of two, which floats hold exactly (info.max does not).
            lo, hi = float(info.min), float(info.max) + 1.0
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(array) | (array != np.trunc(array)) | (array < lo) | (array >= hi)
            return bad, f"is not an integer within the range of {dtype}"
    if dtype.kind == "f" and src.kind == "f" and dtype.itemsize < src.itemsize:
        with np.errstate(over="ignore"):
            narrowed = array.astype(dtype)
        return np.isinf(narrowed) & np.isfinite(array), f"overflows {dtype} (its largest value is {np.finfo(dtype).max})"
    return None, ""


def checked(array: np.ndarray, dtype: Any) -> np.ndarray:
    """`array.astype(dtype)`, refusing values the cast would change beyond rounding.

    Args:
      array: a numeric (or bool) array.
      dtype: the target dtype.

    Returns:
      `array` itself when it already has `dtype`, else a converted copy.

    Raises:
      CastError: (a `ValueError`) naming the first value that does not fit.
    """
    dtype = np.dtype(dtype)
    if array.dtype == dtype:
        return array
    bad, reason = _bad_values(array, dtype)
    if bad is not None and bad.any():
        first = int(np.flatnonzero(bad.reshape(-1))[0])  # in C order: the first row's first
        row = first // (bad.size // len(array)) if array.ndim else 0
        raise CastError(row, array.reshape(-1)[first].item(), dtype, reason)
    with np.errstate(over="ignore", invalid="ignore"):
        return array.astype(dtype)
