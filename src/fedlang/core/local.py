"""The local-program contract: what runtimes may use of a local computation.

A local computation is placement-free code supplied by a backend (JAX today). The core
and every runtime use it only through `LocalComputation`; the backend's classes are
free to change behind it. A computation that consumes a client dataset (a
`sequence<T>` parameter) is split by its backend into three flat programs:

* `prologue(args) -> state` (everything before the dataset is reduced),
* `step(args, state, batch, mask) -> state` (one batch),
* `epilogue(args, state) -> result` (everything after the reduce),

and one without a dataset is the single program `fn(args) -> result`. Programs take
and return flat lists of arrays (the leaves of `structure.flatten`), so a runtime can
compose them freely: a host loop of `run("step", ...)` calls, a scan over stacked
batches, a vmap over clients (when `can_vmap`). The `mask` has one float32 entry per
example of the batch (1 real, 0 padding); a runtime may pad batches only when the
computation is `masked`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

import numpy as np

from fedlang.core import structure, types

PARTS = ("fn", "prologue", "step", "epilogue")

MASK_TYPE = types.TensorType(np.float32, [None])

_T = TypeVar("_T")


@runtime_checkable
class LocalComputation(Protocol):
    """A placement-free computation supplied by a backend: what the IR and the reference
    runtime need.

    Attributes:
      kind: the backend's name; serialization finds the backend's codec by it.
      name: the user's function name, for messages.
      type_signature: its `FunctionType`.
    """

    kind: str
    name: str
    type_signature: types.FunctionType

    def invoke(self, arg: Any) -> Any:
        """Runs on the internal form of the argument (None without a parameter)."""


@runtime_checkable
class LocalProgram(LocalComputation, Protocol):
    """What the fast runtimes use of a local computation (see the module docstring).

    A local computation that is not a `LocalProgram` still runs everywhere, one client
    at a time through `invoke`.

    Attributes:
      param_types: one type per Python parameter.
      seq_index: the index of the dataset parameter, or None.
      state_type: the reduce's state type (None without a reduce).
      uses_reduce: whether the dataset is reduced (False: only the epilogue runs).
      masked: whether the step takes and honours a padding mask.
      can_vmap: whether `part(...)` programs may be vectorized with `jax.vmap`.
      cache_key: identifies the computation's programs in this process (runtimes key
        their measurements and caches by it).
      arg_leaf_types: the tensor types of the flat non-dataset argument leaves.
    """

    param_types: tuple[types.Type, ...]
    seq_index: int | None
    state_type: types.Type | None
    uses_reduce: bool
    masked: bool
    can_vmap: bool

    @property
    def cache_key(self) -> Hashable: ...

    @property
    def arg_leaf_types(self) -> tuple[types.TensorType, ...]: ...

    def part(self, name: str) -> Callable[..., list[Any]]:
        """The flat program `name` (one of `PARTS`), traceable by the backend."""

    def tuned_part(self, name: str) -> Callable[..., list[Any]]:
        """`part(name)` as runtimes compile it: the backend may rewrite it for the
        platform it runs on (same results, faster); `part` stays what is exported."""

    def run(self, name: str, leaves: list[Any]) -> list[Any]:
        """Runs the compiled program `name` on flat leaves (compiled once, cached)."""

    def program(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """What a runtime derives from this computation (a compiled scan or vmap of its
        programs, a note of the lengths compiled), built once per key and cached."""

    def split_arg(self, arg: Any) -> list[Any]:
        """The internal argument split into one value per Python parameter."""

    def arg_leaves(self, args: list[Any]) -> list[Any]:
        """The flat leaves of the non-dataset arguments, in `arg_leaf_types` order."""


def dataset_index(comp: LocalProgram) -> int:
    """The index of a computation's dataset parameter among its Python parameters."""
    if comp.seq_index is None:
        raise TypeError(f"{comp.name} takes no dataset.")
    return comp.seq_index


def parameter_type(comp: LocalComputation) -> types.Type:
    """A computation's parameter type (a struct of its parameters when it has several)."""
    param = comp.type_signature.parameter
    if param is None:
        raise TypeError(f"{comp.name} takes no argument.")
    return param


def element_type(comp: LocalProgram) -> types.Type:
    """The element type of a computation's dataset parameter."""
    seq = comp.param_types[dataset_index(comp)]
    assert isinstance(seq, types.SequenceType)  # the backend checked it
    return seq.element


def mask_type(element_type: types.Type) -> types.TensorType:
    """The type of a batch's mask: `float32[n]`, `n` the batch size when the element's
    type fixes it (every non-scalar leaf leads with the same known size), else unknown."""
    leading = {lt.shape[0] for lt in structure.leaf_types(element_type) if lt.shape}
    if len(leading) == 1 and None not in leading:
        return types.TensorType(np.float32, [leading.pop()])
    return MASK_TYPE


def batch_size(batch_leaves: Sequence[Any]) -> int:
    """The number of examples in a batch: the leading dimension of its first non-scalar leaf."""
    for x in batch_leaves:
        shape = np.shape(x)
        if shape:
            return int(shape[0])
    return 1



def pad_batch(batch: list[Any], like: list[Any]) -> list[Any]:
    """`batch`'s leaves padded with zero examples to the shapes of `like`'s, when they
    differ only in the number of examples (a client's last, smaller batch joining a run
    of full ones; the mask marks the padding); otherwise `batch` unchanged."""
    n, target = batch_size(batch), batch_size(like)
    if n >= target or len(batch) != len(like):
        return batch
    for x, y in zip(batch, like):
        sx, sy = np.shape(x), np.shape(y)
        if len(sx) != len(sy) or (sx and (sx[0] != n or sx[1:] != sy[1:])) or (not sx and sy):
            return batch
    return [
        np.pad(np.asarray(x), [(0, target - n)] + [(0, 0)] * (np.ndim(x) - 1)) if np.ndim(x) else x
        for x in batch
    ]

_FULL_MASKS: dict[int, np.ndarray] = {}


def full_mask(batch_leaves: Sequence[Any]) -> np.ndarray:
    """The mask of an unpadded batch: every example is real (shared, read-only arrays)."""
    n = batch_size(batch_leaves)
    mask = _FULL_MASKS.get(n)
    if mask is None:
        mask = np.ones(n, np.float32)
        mask.setflags(write=False)
        _FULL_MASKS[n] = mask
    return mask


def with_mask(batch_leaves: list[Any]) -> list[Any]:
    """A batch's leaves followed by its full mask: the argument tail of the `step` program."""
    return [*batch_leaves, full_mask(batch_leaves)]


_KNOWN: dict[tuple[type, type], bool] = {}


def _conforms(value: Any, protocol: type) -> bool:
    key = (type(value), protocol)
    known = _KNOWN.get(key)
    if known is None:  # Protocol checks probe every member: do it once per class
        known = _KNOWN[key] = isinstance(value, protocol)
    return known


def is_local(value: Any) -> TypeGuard[LocalComputation]:
    """Whether `value` is a local computation (`LocalComputation`)."""
    return _conforms(value, LocalComputation)


def is_program(value: Any) -> TypeGuard[LocalProgram]:
    """Whether `value` offers the fast runtimes' contract (`LocalProgram`)."""
    return _conforms(value, LocalProgram)
