"""Hints for TFF's spellings: what fedlang calls a method TFF users reach for.

A TFF user's first try is TFF's name (`create_tf_dataset_for_client`,
`ModelWeights.assign_weights_to`); a bare `AttributeError` leaves them searching. A
class whose TFF namesake had such a method lists it here and raises `missing(...)` from
its `__getattr__`, which names fedlang's spelling (as an optimizer of another library
passed to an algorithm is answered with the forms fedlang accepts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def missing(obj: Any, name: str, spellings: Mapping[str, str]) -> AttributeError:
    """The `AttributeError` for `obj.name`: naming fedlang's spelling when `name` is
    TFF's (a key of `spellings`), else Python's usual message."""
    cls = type(obj).__name__
    if name in spellings:
        return AttributeError(
            f"{cls} has no attribute {name!r} (TFF's spelling); fedlang's is {spellings[name]}.",
            name=name, obj=obj,
        )
    return AttributeError(f"{cls!r} object has no attribute {name!r}", name=name, obj=obj)
