"""Metrics as the writers and plots take them: JSON-able Python, flattened keys, scalars.

A round's metrics are a nested mapping (e.g. `{'train': {...}, 'eval': {...},
'round_time_s': 0.4}`) of numbers, arrays, namedtuples and dataclasses; `to_python`
makes them JSON-able, `flatten_metrics` turns the nesting into `'a/b/c'` keys (CSV
columns, TensorBoard tags, plot panels) and `scalars` keeps the numbers.

Example:
  >>> flatten_metrics({'train': {'loss': 0.5, 'acc': [1, 2]}, 'time': 1.5})
  {'train/loss': 0.5, 'train/acc': [1, 2], 'time': 1.5}
  >>> scalars(flatten_metrics({'train': {'loss': 0.5, 'acc': [1, 2]}}))
  {'train/loss': 0.5}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np


def to_python(value: Any) -> Any:
    """Metrics as JSON-able Python: mappings, namedtuples and dataclasses become dicts,
    sequences lists, numpy/JAX scalars numbers and arrays (nested) lists."""
    if isinstance(value, Mapping):
        return {str(k): to_python(v) for k, v in value.items()}
    if hasattr(value, "_asdict"):
        return {str(k): to_python(v) for k, v in value._asdict().items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_python(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [to_python(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    array = np.asarray(value)
    if array.dtype.kind == "b":
        return array.tolist()
    if array.dtype.kind in "iu":
        return array.tolist()
    if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
        return array.astype(np.float64).tolist()
    return str(value)


def flatten_metrics(metrics: Mapping[str, Any], sep: str = "/") -> dict[str, Any]:
    """Nested mappings flattened to `'a/b/c'` keys (other values are leaves)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, f"{prefix}{sep}{k}" if prefix else str(k))
        else:
            out[prefix] = node

    walk(to_python(metrics), "")
    return out


def scalars(flat: Mapping[str, Any]) -> dict[str, float | int]:
    """The numeric scalar entries of flattened metrics."""
    return {k: v for k, v in flat.items() if isinstance(v, int | float)}
