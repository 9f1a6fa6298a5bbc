"""Minimal nested-structure helpers for dataset elements.

Elements are nested dicts, lists, tuples and namedtuples of arrays. `jax.tree_util`
would do, but it sorts dict keys (which would reorder fields and so change element
types) and importing JAX only to walk a dict costs a second, so the data layer keeps
its own twenty lines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def is_node(x: Any) -> bool:
    """Whether `x` is a container (as opposed to a leaf)."""
    return isinstance(x, Mapping | list | tuple)


def flatten(struct: Any) -> list[Any]:
    """The leaves of `struct`, depth first, dict fields in insertion order."""
    if isinstance(struct, Mapping):
        return [leaf for v in struct.values() for leaf in flatten(v)]
    if isinstance(struct, list | tuple):
        return [leaf for v in struct for leaf in flatten(v)]
    return [struct]


def unflatten(template: Any, leaves: list[Any]) -> Any:
    """Rebuilds `template`'s structure with `leaves` (in `flatten` order)."""
    return _rebuild(template, iter(leaves))


def _rebuild(template: Any, it: Any) -> Any:
    if isinstance(template, Mapping):
        # a concrete mapping class (dict, OrderedDict, ...), built from (key, value) pairs
        return type(template)((k, _rebuild(v, it)) for k, v in template.items())  # type: ignore[call-arg]
    if _is_namedtuple(template):
        return type(template)(*(_rebuild(v, it) for v in template))
    if isinstance(template, list | tuple):
        return type(template)(_rebuild(v, it) for v in template)
    return next(it)


def map_structure(fn: Callable[..., Any], struct: Any) -> Any:
    """Applies `fn` to every leaf of `struct`, keeping the structure."""
    return unflatten(struct, [fn(leaf) for leaf in flatten(struct)])


def paths(struct: Any, prefix: str = "") -> list[str]:
    """A '/'-joined path for every leaf (dict keys, or positions in sequences)."""
    if isinstance(struct, Mapping):
        items = list(struct.items())
    elif isinstance(struct, list | tuple):
        items = [(str(i), v) for i, v in enumerate(struct)]
    else:
        return [prefix]
    out: list[str] = []
    for k, v in items:
        out.extend(paths(v, f"{prefix}/{k}" if prefix else str(k)))
    return out
