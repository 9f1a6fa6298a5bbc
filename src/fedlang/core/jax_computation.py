"""Local computations written in JAX: `jax_computation`.

A `JaxComputation` is typed by tracing (never by running) the user's function. When
it takes a client dataset (`sequence<T>`) the function consumes it through
`dataset.reduce(initial_state, step_fn)`; fedlang records that reduce as structure by
re-running the function with stand-in datasets, which yields three programs:

* `prologue(args) -> initial_state` (everything before the reduce),
* `step(args, state, batch) -> state` (one application of `step_fn`),
* `epilogue(args, state) -> result` (everything after the reduce),

each a pure function of flat tensor leaves that can be jitted, vmapped or exported.
Runtimes then choose how to run the reduce: a host loop of jitted steps over a stream
(any size, the reference runtime's way) or a scan over stacked batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.core import computation, ir, structure, tracing, types


class _Captured(Exception):
    """Raised by a stand-in dataset to stop the user's function at its reduce."""

    def __init__(self, value: Any):
        super().__init__("captured")
        self.value = value


class DatasetStandIn:
    """What a `jax_computation` sees for a `sequence<T>` parameter while being traced.

    Use `reduce(initial_state, step_fn)` exactly once; `map(fn)` applies `fn` to each
    element before `step_fn`. `element_type` is the fedlang type of one element.
    """

    def __init__(
        self,
        element_type: types.Type,
        mode: str,
        state: Any = None,
        batch: Any = None,
        mask: Any = None,
    ):
        self.element_type = element_type
        self._mode = mode
        self._state = state
        self._batch = batch
        self._mask = mask
        self._maps: tuple[Callable, ...] = ()
        self._calls = [0]  # shared with mapped copies: one reduce per dataset

    def map(self, fn: Callable[[Any], Any]) -> DatasetStandIn:
        """Applies `fn` (JAX code) to each element before it reaches the reduce."""
        out = DatasetStandIn(self.element_type, self._mode, self._state, self._batch, self._mask)
        out._maps = (*self._maps, fn)
        out._calls = self._calls
        return out

    def reduce(self, initial_state: Any, step_fn: Callable[..., Any], masked: bool = False) -> Any:
        """Folds the dataset: `state = step_fn(state, element)` for each element.

        With `masked=True` the step is called as `step_fn(state, batch, mask)`, where
        `mask` is a float32 vector with one entry per example of the batch: 1 for a real
        example, 0 for padding. Runtimes may then pad batches to a common size (so a run
        compiles fewer programs and clients can be vectorized); the step must weight
        every per-example quantity (loss, counts, metrics) by the mask.
        """
        self._calls[0] += 1
        if self._calls[0] > 1:
            raise TypeError(
                "dataset.reduce may be called once per dataset in a jax_computation; to run several "
                "epochs, repeat the dataset before passing it to the computation."
            )
        if self._mode == "prologue":
            raise _Captured((initial_state, bool(masked)))
        if self._mode == "step":
            batch = self._batch
            for fn in self._maps:
                batch = fn(batch)
            raise _Captured(
                step_fn(self._state, batch, self._mask) if masked else step_fn(self._state, batch)
            )
        return self._state  # epilogue: the reduce's result is the final state

    def __iter__(self) -> Any:
        raise TypeError(
            "A dataset inside a jax_computation cannot be iterated in Python; consume it with "
            "dataset.reduce(initial_state, step_fn) so each runtime can choose how to run it."
        )


def _abstract_leaves(
    leaf_types: Sequence[types.TensorType], lead: str, scope_names: list[str]
) -> list[tuple[list[int | str], np.dtype]]:
    """(dims, dtype) per leaf, unknown dims as symbol names; unknown leading dims share `lead`."""
    out = []
    for lt in leaf_types:
        dims: list[int | str] = []
        for i, d in enumerate(lt.shape):
            if d is None:
                name = lead if i == 0 else f"{lead}{len(scope_names)}"
                if name not in scope_names:
                    scope_names.append(name)
                dims.append(name)
            else:
                dims.append(d)
        out.append((dims, lt.dtype))
    return out


def abstract_args(
    groups: Sequence[tuple[Sequence[types.TensorType], str]],
) -> list[list[jax.ShapeDtypeStruct]]:
    """Abstract values for several groups of leaves, with symbolic dims in one scope."""
    names: list[str] = []
    raw = [_abstract_leaves(lts, lead, names) for lts, lead in groups]
    symbols = dict(zip(names, jax.export.symbolic_shape(",".join(names)))) if names else {}
    return [
        [
            jax.ShapeDtypeStruct(tuple(symbols[d] if isinstance(d, str) else d for d in dims), dt)
            for dims, dt in g
        ]
        for g in raw
    ]


def _check_x64(t: types.Type, what: str) -> None:
    for leaf in types.tensor_leaves(t):
        dt = getattr(leaf, "dtype", None)
        if (
            dt is not None
            and dt.itemsize == 8
            and dt.kind in "fiuc"
            and not jax.config.jax_enable_x64  # type: ignore[attr-defined]  # flags are dynamic attributes
        ):
            if dt.kind in "iu" and isinstance(leaf, types.SparseTensorType):
                continue
            raise TypeError(
                f"{what} has a 64-bit type {leaf}, but JAX runs in 32 bits; use a 32-bit dtype or "
                "enable jax_enable_x64."
            )


class JaxLocal:
    """Shared execution of a local JAX computation given its flat programs.

    Subclasses provide `trace_fn(part)` for part in ('fn', 'prologue', 'step',
    'epilogue'): a function of flat arrays returning a flat list of arrays, usable
    under `jax.jit` and `lax.scan` (and `jax.vmap` when `can_vmap`). Runtimes build
    their own programs from these and cache them with `program(key, build)`.
    """

    can_vmap = True

    kind = "jax"
    name: str
    type_signature: types.FunctionType
    parameter_names: tuple[str, ...]
    param_types: tuple[types.Type, ...]
    seq_index: int | None
    state_type: types.Type | None
    uses_reduce: bool
    masked: bool = False  # whether the reduce's step takes a padding mask (and tolerates padding)

    def trace_fn(self, part: str) -> Callable[..., list[Any]]:
        raise NotImplementedError

    def program(self, key: Any, build: Callable[[], Callable]) -> Callable:
        """A program derived from this computation, built once per key and cached."""
        cache = self.__dict__.setdefault("_programs", {})
        if key not in cache:
            cache[key] = build()
        return cache[key]

    def _run(self, part: str, leaves: list[Any]) -> list[Any]:
        return self.program(("jit", part), lambda: jax.jit(self.trace_fn(part)))(*leaves)

    def split_arg(self, arg: Any) -> list[Any]:
        n = len(self.param_types)
        return [] if n == 0 else ([arg] if n == 1 else list(arg))

    def arg_leaves(self, args: list[Any]) -> list[Any]:
        return [
            leaf
            for i, (a, t) in enumerate(zip(args, self.param_types))
            if i != self.seq_index
            for leaf in structure.flatten(a, t)
        ]

    @property
    def element_type(self) -> types.Type:
        assert self.seq_index is not None
        return self.param_types[self.seq_index].element  # type: ignore[attr-defined]

    def invoke(self, arg: Any) -> Any:
        """Runs on internal values; a dataset is streamed through a host loop of jitted steps."""
        args = self.split_arg(arg)
        leaves = self.arg_leaves(args)
        result_t = self.type_signature.result
        if self.seq_index is None or not self.uses_reduce:
            out = self._run("fn" if self.seq_index is None else "epilogue", leaves)
        else:
            state = self._run("prologue", leaves)
            element_t = self.element_type
            for element in args[self.seq_index]:
                batch = structure.flatten(element, element_t)
                state = self._run("step", leaves + state + batch + [full_mask(batch)])
            out = self._run("epilogue", leaves + state)
        return structure.unflatten([np.asarray(x) for x in out], result_t)


class JaxComputation(JaxLocal, computation.Computation):
    """A typed, placement-free computation written in JAX (see `jax_computation`)."""

    def __init__(
        self,
        fn: Callable,
        param_types: Sequence[Any],
        result_type: Any = None,
        name: str | None = None,
    ):
        self.fn = fn
        self.name = name or cast(str, getattr(fn, "__name__", "jax_computation"))
        self.parameter_names = computation.parameter_names_of(fn)
        param = computation.parameter_type_for(param_types, self.parameter_names, self.name)
        self.param_types = tuple(types.to_type(t) for t in param_types)
        seqs = [i for i, t in enumerate(self.param_types) if isinstance(t, types.SequenceType)]
        for t in self.param_types:
            if not isinstance(t, types.SequenceType):
                types.check_local(t, f"A parameter of the jax_computation {self.name}")
            if isinstance(t, types.StructType) and any(
                isinstance(x, types.SequenceType) for x in t
            ):
                raise TypeError(
                    f"{self.name}: a dataset must be a parameter of its own, found it inside {t}."
                )
            _check_x64(
                t if not isinstance(t, types.SequenceType) else t.element,
                f"{self.name}'s parameter",
            )
        if len(seqs) > 1:
            raise TypeError(
                f"{self.name} takes {len(seqs)} datasets; a jax_computation takes at most one."
            )
        self.seq_index = seqs[0] if seqs else None
        self.state_type = None
        self.uses_reduce = False
        self._arg_leaf_types = [
            lt
            for i, t in enumerate(self.param_types)
            if i != self.seq_index
            for lt in structure.leaf_types(t)
        ]
        self._result_t: types.Type | None = None
        self._trace_types()
        assert self._result_t is not None
        if result_type is not None:
            declared = types.to_type(result_type)
            if not declared.is_assignable_from(self._result_t):
                # The code may return the declared dicts with their keys in another order
                # (jax.tree.map sorts them): trace again, matching fields by name.
                traced, self._result_t = self._result_t, declared
                try:
                    self._trace_types()
                except TypeError:
                    raise TypeError(
                        f"{self.name} declares the result type {declared}, but its JAX code returns {traced}."
                    ) from None
            self._result_t = declared
        self.type_signature = types.FunctionType(param, self._result_t)  # type: ignore[misc]
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    # -- building the user's arguments -------------------------------------------------

    def _user_args(self, leaves: Sequence[Any], dataset: DatasetStandIn | None) -> list[Any]:
        it = iter(leaves)
        args = []
        for i, t in enumerate(self.param_types):
            if i == self.seq_index:
                args.append(dataset)
            else:
                n = len(structure.leaf_types(t))
                value = structure.unflatten([next(it) for _ in range(n)], t)
                args.append(structure.to_container(value, t))
        return args

    def _to_leaves(
        self, value: Any, what: str, expected: types.Type | None = None
    ) -> tuple[list[Any], types.Type]:
        value = _as_arrays(value)
        try:
            t = types.to_type(value) if expected is None else expected
            internal = structure.from_container(value, t)
        except TypeError as e:
            raise TypeError(
                f"{self.name}: {what} is not a tensor or a container of tensors: {e}"
            ) from None
        leaves = structure.flatten(internal, t)
        return [jnp.asarray(x) if isinstance(x, int | float | bool) else x for x in leaves], t

    # -- the flat programs ------------------------------------------------------------

    def _fn_flat(self, *leaves: Any) -> list[Any]:
        out = self.fn(*self._user_args(leaves, None))
        return self._result_leaves(out)

    def _result_leaves(self, out: Any) -> list[Any]:
        if out is None:
            raise TypeError(
                f"The jax_computation {self.name} returned None; it must return tensors."
            )
        if self._result_t is not None:
            # Match fields by name (jax.tree.map and jax.grad return dicts with sorted keys).
            try:
                out_leaves, _ = self._to_leaves(out, "the result", expected=self._result_t)
                out_t = structure.type_of_leaves(out_leaves, self._result_t)
            except TypeError:
                out_leaves, out_t = self._to_leaves(out, "the result")
        else:
            out_leaves, out_t = self._to_leaves(out, "the result")
        if self._result_t is None:
            self._result_t = out_t
        elif not self._result_t.is_assignable_from(out_t):
            raise TypeError(f"{self.name} returned {out_t}, but its type says {self._result_t}.")
        return out_leaves

    def _prologue_flat(self, *leaves: Any) -> list[Any]:
        ds = DatasetStandIn(self.element_type, "prologue")
        try:
            self.fn(*self._user_args(leaves, ds))
        except _Captured as c:
            initial_state, self.masked = c.value
            state_leaves, state_t = self._to_leaves(
                initial_state, "the initial state of dataset.reduce"
            )
            if self.state_type is None:
                self.state_type = state_t
            return state_leaves
        raise _NoReduce()

    def _step_flat(self, *leaves: Any) -> list[Any]:
        assert self.state_type is not None
        n_args = len(self._arg_leaf_types)
        n_state = len(structure.leaf_types(self.state_type))
        args, state_leaves, batch_leaves, mask = (
            leaves[:n_args],
            leaves[n_args : n_args + n_state],
            leaves[n_args + n_state : -1],
            leaves[-1],
        )
        state = structure.to_container(
            structure.unflatten(state_leaves, self.state_type), self.state_type
        )
        element_t = self.element_type
        batch = structure.to_container(structure.unflatten(batch_leaves, element_t), element_t)
        ds = DatasetStandIn(element_t, "step", state=state, batch=batch, mask=mask)
        try:
            self.fn(*self._user_args(args, ds))
        except _Captured as c:
            try:
                new_leaves, _ = self._to_leaves(c.value, "the state", expected=self.state_type)
                new_t = structure.type_of_leaves(new_leaves, self.state_type)
            except TypeError:
                new_t = types.to_type(_as_arrays(c.value))
            if not self.state_type.is_assignable_from(new_t):
                raise TypeError(
                    f"{self.name}: step_fn must return a state of the initial state's type {self.state_type}, "
                    f"found {new_t}."
                ) from None
            return [
                jnp.asarray(x, dtype=lt.dtype)
                for x, lt in zip(new_leaves, structure.leaf_types(self.state_type))
            ]
        raise TypeError(f"{self.name} did not call dataset.reduce consistently between traces.")

    def _epilogue_flat(self, *leaves: Any) -> list[Any]:
        n_args = len(self._arg_leaf_types)
        args, state_leaves = leaves[:n_args], leaves[n_args:]
        state = None
        if self.uses_reduce:
            assert self.state_type is not None
            state = structure.to_container(
                structure.unflatten(state_leaves, self.state_type), self.state_type
            )
        ds = DatasetStandIn(self.element_type, "epilogue", state=state)
        return self._result_leaves(self.fn(*self._user_args(args, ds)))

    # -- typing by tracing ---------------------------------------------------------------

    def _trace_types(self) -> None:
        try:
            self._trace_types_inner()
        except (TypeError, ValueError) as e:
            if not getattr(e, "__notes__", None):
                raise
            # Re-raise without the note JAX attaches while tracing: it points at JAX's frames.
            raise type(e)(str(e)) from None

    def _trace_types_inner(self) -> None:
        if self.seq_index is None:
            (arg_avals,) = abstract_args([(self._arg_leaf_types, "a")])
            jax.eval_shape(self._fn_flat, *arg_avals)
            return
        element_leaf_types = structure.leaf_types(self.element_type)
        arg_avals, batch_avals = abstract_args(
            [(self._arg_leaf_types, "a"), ([*element_leaf_types, MASK_TYPE], "b")]
        )
        try:
            jax.eval_shape(self._prologue_flat, *arg_avals)
            self.uses_reduce = True
        except _NoReduce:
            self.uses_reduce = False
        if self.uses_reduce:
            assert self.state_type is not None
            state_avals = [
                jax.ShapeDtypeStruct(_concrete_shape(lt), lt.dtype)
                for lt in structure.leaf_types(self.state_type)
            ]
            jax.eval_shape(self._step_flat, *arg_avals, *state_avals, *batch_avals)
            jax.eval_shape(self._epilogue_flat, *arg_avals, *state_avals)
        else:
            jax.eval_shape(self._epilogue_flat, *arg_avals)

    def trace_fn(self, part: str) -> Callable[..., list[Any]]:
        return getattr(self, f"_{part}_flat")

    # -- Computation ----------------------------------------------------------------------

    def to_ir(self) -> ir.Node:
        return ir.Local(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return computation.Computation.__call__(self, *args, **kwargs)


def _as_arrays(value: Any) -> Any:
    """Python numbers and symbolic dimensions in a result become JAX arrays (containers kept)."""
    if isinstance(value, jax.Array | np.ndarray | np.generic) or hasattr(
        value, "fedlang_sparse_type"
    ):
        return value
    if isinstance(value, dict):
        return {k: _as_arrays(v) for k, v in value.items()}
    if types.is_namedtuple(value):
        return type(value)(*[_as_arrays(v) for v in value])
    if isinstance(value, list | tuple):
        return type(value)(_as_arrays(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _as_arrays(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    if isinstance(value, int | float | bool) or type(value).__name__ == "_DimExpr":
        return jnp.asarray(value)
    return value


class _NoReduce(Exception):
    """The function never called dataset.reduce (it ignores its dataset)."""


MASK_TYPE = types.TensorType(np.float32, [None])


def batch_size(batch_leaves: Sequence[Any]) -> int:
    """The number of examples in a batch: the leading dimension of its first non-scalar leaf."""
    for x in batch_leaves:
        shape = np.shape(x)
        if shape:
            return int(shape[0])
    return 1


def full_mask(batch_leaves: Sequence[Any]) -> np.ndarray:
    """The mask of an unpadded batch: every example is real (shared, read-only arrays)."""
    n = batch_size(batch_leaves)
    if n not in _FULL_MASKS:
        mask = np.ones(n, np.float32)
        mask.setflags(write=False)
        _FULL_MASKS[n] = mask
    return _FULL_MASKS[n]


_FULL_MASKS: dict[int, np.ndarray] = {}


def _concrete_shape(t: types.TensorType) -> tuple[int, ...]:
    if not t.is_fully_defined:
        raise TypeError(f"The state of dataset.reduce must have a fully known shape, found {t}.")
    return tuple(d for d in t.shape if d is not None)


def jax_computation(*param_types: Any, result_type: Any = None) -> Any:
    """Decorator: a typed, placement-free local computation written in JAX.

    Args:
      *param_types: one type spec per parameter (anything `fedlang.to_type` accepts;
        `fedlang.SequenceType(T)` for a client dataset). With none, the computation is
        polymorphic and typed at each new argument type.
      result_type: optional declared result type; it must accept what the JAX code returns.

    Returns:
      A `JaxComputation`. Its result type comes from tracing with `jax.eval_shape`; it can
      be called directly (on NumPy values) or used inside a federated computation with
      `federated_map` / `federated_eval`.

    A dataset parameter is consumed with `dataset.reduce(initial_state, step_fn)`
    (`step_fn(state, batch) -> state`, JAX code) and optionally `dataset.map(fn)`.

    Example:
      >>> import numpy as np, fedlang as fl
      >>> @fl.jax_computation(np.float32)
      ... def add_half(x):
      ...   return x + 0.5
      >>> str(add_half.type_signature)
      '(float32 -> float32)'
      >>> float(add_half(1.0))
      1.5
    """
    return tracing.decorator(param_types, lambda fn, ts: JaxComputation(fn, ts, result_type))
