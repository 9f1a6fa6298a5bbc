"""Local computations written in JAX: `jax_computation`.

A `JaxComputation` is typed by tracing (never by running) the user's function. When
it takes a client dataset (`sequence<T>`) the function consumes it through
`dataset.reduce(initial_state, step_fn)`; fedlang records that reduce as structure by
re-running the function with stand-in datasets, which yields the three flat programs
of the local-program contract (`fedlang.core.local`): `prologue`, `step` and
`epilogue`. Tracing returns an immutable `Traced` record; the computation never
changes after it is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.backends.jax import rewrite, strings
from fedlang.core import computation, ir, local, structure, tracing, types

_T = TypeVar("_T")


class _Captured(Exception):
    """Raised by a stand-in dataset to stop the user's function at its reduce."""

    def __init__(self, value: Any):
        super().__init__("captured")
        self.value = value


class _NoReduce(Exception):
    """The function never called dataset.reduce (it ignores its dataset)."""


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


def growing_buffers(comp: JaxComputation) -> JaxComputation:
    """Marks `comp` (without a dataset) as working on growing buffers (`float32[?, ...]`,
    one row per client, as `federated_aggregate` collects them for a median): when
    exported, each leaf's unknown leading dimension is its own size, which may be zero,
    rather than one size `a` >= 1 shared by all arguments (`program_avals`). Returns
    `comp`."""
    comp.buffers = True
    return comp


def _buffer_avals(leaf_types: Sequence[types.TensorType]) -> list[jax.ShapeDtypeStruct]:
    """Abstract values with each unknown dim its own symbol; leading ones `r - 1` (the
    symbols of `jax.export` are >= 1, a buffer may have no rows)."""
    names = [f"r{i}_{j}" for i, lt in enumerate(leaf_types) for j, d in enumerate(lt.shape)
             if d is None]
    symbols = dict(zip(names, jax.export.symbolic_shape(",".join(names)))) if names else {}
    return [
        jax.ShapeDtypeStruct(tuple(
            d if d is not None else symbols[f"r{i}_{j}"] - (1 if j == 0 else 0)
            for j, d in enumerate(lt.shape)), lt.dtype)
        for i, lt in enumerate(leaf_types)
    ]


def concrete_shape(t: types.TensorType) -> tuple[int, ...]:
    """The shape of a fully known tensor type (the state of a reduce must have one)."""
    if not t.is_fully_defined:
        raise TypeError(f"The state of dataset.reduce must have a fully known shape, found {t}.")
    return tuple(d for d in t.shape if d is not None)


def state_avals(state_type: types.Type) -> list[jax.ShapeDtypeStruct]:
    """Abstract values of the flat leaves of a reduce's state."""
    return [
        jax.ShapeDtypeStruct(concrete_shape(lt), lt.dtype)
        for lt in structure.leaf_types(state_type)
    ]


def program_avals(comp: local.LocalProgram) -> dict[str, list[jax.ShapeDtypeStruct]]:
    """Abstract flat arguments of each program of `comp`, with symbolic unknown dims.

    The leading unknown dimensions of the non-dataset arguments share the symbol `a`,
    those of a dataset element (and its mask) `b` (each its own, possibly zero, for
    `growing_buffers`).
    """
    arg_types = list(comp.arg_leaf_types)
    if comp.seq_index is None and getattr(comp, "buffers", False):
        return {"fn": _buffer_avals(arg_types)}
    if comp.seq_index is None:
        (args,) = abstract_args([(arg_types, "a")])
        return {"fn": args}
    element_types = structure.leaf_types(local.element_type(comp))
    element = local.element_type(comp)
    batch_types = [*element_types, local.mask_type(element)]
    args, batch = abstract_args([(arg_types, "a"), (batch_types, "b")])
    if not comp.uses_reduce:
        return {"epilogue": args}
    assert comp.state_type is not None
    state = state_avals(comp.state_type)
    return {"prologue": args, "step": args + state + batch, "epilogue": args + state}


def needs_x64(leaf: types.Type) -> bool:
    """Whether `leaf` is a 64-bit tensor type while JAX runs in 32 bits (sparse int64
    indices excepted: they are int64 as in TensorFlow)."""
    dt = getattr(leaf, "dtype", None)
    if dt is None or dt.itemsize != 8 or dt.kind not in "fiuc":
        return False
    if jax.config.jax_enable_x64:  # type: ignore[attr-defined]  # flags are dynamic attributes
        return False
    return not (dt.kind in "iu" and isinstance(leaf, types.SparseTensorType))


def _check_x64(t: types.Type, what: str) -> None:
    for leaf in types.tensor_leaves(t):
        if needs_x64(leaf):
            raise TypeError(
                f"{what} has a 64-bit type {leaf}, but JAX runs in 32 bits; use a 32-bit dtype or "
                "enable jax_enable_x64."
            )


class JaxLocal:
    """The local-program contract's execution, shared by JAX computations.

    Subclasses provide `part(name)`: a function of flat arrays returning a flat list of
    arrays, usable under `jax.jit` and `lax.scan` (and `jax.vmap` when `can_vmap`).
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
    masked: bool = False

    def part(self, name: str) -> Callable[..., list[Any]]:
        raise NotImplementedError

    def tuned_part(self, name: str) -> Callable[..., list[Any]]:
        """`part(name)` as the runtimes compile it: rewritten for speed on the platform
        where that changes nothing but speed (`backends/jax/rewrite.tuned`)."""
        return rewrite.tuned(self.part(name))

    @property
    def cache_key(self) -> Hashable:
        return (self.kind, self.name, id(self))

    @property
    def arg_leaf_types(self) -> tuple[types.TensorType, ...]:
        cached = self.__dict__.get("_arg_leaf_types")
        if cached is None:
            cached = tuple(
                lt
                for i, t in enumerate(self.param_types)
                if i != self.seq_index
                for lt in structure.leaf_types(t)
            )
            self.__dict__["_arg_leaf_types"] = cached
        return cached

    def program(self, key: Hashable, build: Callable[[], _T]) -> _T:
        cache = self.__dict__.setdefault("_programs", {})
        prog = cache.get(key)
        if prog is None:
            prog = cache[key] = build()
        return prog

    def run(self, name: str, leaves: list[Any]) -> list[Any]:
        return self.program(("jit", name), lambda: jax.jit(self.tuned_part(name)))(*leaves)

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
        return local.element_type(self)

    def invoke(self, arg: Any) -> Any:
        args = self.split_arg(arg)
        leaves = self.arg_leaves(args)
        result_t = self.type_signature.result
        if self.seq_index is None or not self.uses_reduce:
            out = self.run("fn" if self.seq_index is None else "epilogue", leaves)
        else:
            state = self.run("prologue", leaves)
            element_t = self.element_type
            for element in args[self.seq_index]:
                batch = structure.flatten(element, element_t)
                state = self.run("step", leaves + list(state) + local.with_mask(batch))
            out = self.run("epilogue", leaves + list(state))
        return structure.unflatten([np.asarray(x) for x in out], result_t)


@dataclasses.dataclass(frozen=True)
class Traced:
    """What tracing found out about a user's function (immutable)."""

    result_type: types.Type
    state_type: types.Type | None = None
    uses_reduce: bool = False
    masked: bool = False


class _Programs:
    """The flat programs of a user's function, for its parameter types and what tracing knows.

    While tracing, `result_type` and `state_type` may be unknown (None); each flat
    function then reports what it found in `found` (a scratch dict owned by the trace).
    """

    def __init__(
        self,
        fn: Callable,
        name: str,
        param_types: tuple[types.Type, ...],
        seq_index: int | None,
        arg_leaf_types: tuple[types.TensorType, ...],
        result_type: types.Type | None,
        state_type: types.Type | None,
        found: dict[str, Any] | None = None,
    ):
        self.fn, self.name = fn, name
        self.param_types, self.seq_index = param_types, seq_index
        self.n_args = len(arg_leaf_types)
        self.result_type, self.state_type = result_type, state_type
        self.found = found if found is not None else {}

    @property
    def element_type(self) -> types.Type:
        assert self.seq_index is not None
        return cast(types.SequenceType, self.param_types[self.seq_index]).element

    def user_args(self, leaves: Sequence[Any], dataset: DatasetStandIn | None) -> list[Any]:
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

    def to_leaves(
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

    def result_leaves(self, out: Any) -> list[Any]:
        if out is None:
            raise TypeError(
                f"The jax_computation {self.name} returned None; it must return tensors."
            )
        expected = self.result_type
        if expected is not None:
            # Match fields by name (jax.tree.map and jax.grad return dicts with sorted keys).
            try:
                out_leaves, _ = self.to_leaves(out, "the result", expected=expected)
                out_t = structure.type_of_leaves(out_leaves, expected)
            except TypeError:
                out_leaves, out_t = self.to_leaves(out, "the result")
            if not expected.is_assignable_from(out_t):
                raise TypeError(f"{self.name} returned {out_t}, but its type says {expected}.")
        else:
            out_leaves, out_t = self.to_leaves(out, "the result")
            self.found["result_type"] = out_t
        return out_leaves

    def fn_flat(self, *leaves: Any) -> list[Any]:
        return self.result_leaves(self.fn(*self.user_args(leaves, None)))

    def prologue_flat(self, *leaves: Any) -> list[Any]:
        ds = DatasetStandIn(self.element_type, "prologue")
        try:
            self.fn(*self.user_args(leaves, ds))
        except _Captured as c:
            initial_state, masked = c.value
            state_leaves, state_t = self.to_leaves(
                initial_state, "the initial state of dataset.reduce"
            )
            self.found.setdefault("state_type", state_t)
            self.found["masked"] = masked
            return state_leaves
        raise _NoReduce()

    def _state(self, state_leaves: Sequence[Any]) -> Any:
        assert self.state_type is not None
        return structure.to_container(
            structure.unflatten(state_leaves, self.state_type), self.state_type
        )

    def step_flat(self, *leaves: Any) -> list[Any]:
        state_t = self.state_type
        assert state_t is not None
        n_state = len(structure.leaf_types(state_t))
        args = leaves[: self.n_args]
        state_leaves = leaves[self.n_args : self.n_args + n_state]
        batch_leaves, mask = leaves[self.n_args + n_state : -1], leaves[-1]
        element_t = self.element_type
        batch = structure.to_container(structure.unflatten(batch_leaves, element_t), element_t)
        ds = DatasetStandIn(element_t, "step", state=self._state(state_leaves), batch=batch, mask=mask)
        try:
            self.fn(*self.user_args(args, ds))
        except _Captured as c:
            try:
                new_leaves, _ = self.to_leaves(c.value, "the state", expected=state_t)
                new_t = structure.type_of_leaves(new_leaves, state_t)
            except TypeError:
                new_t = types.to_type(_as_arrays(c.value))
            if not state_t.is_assignable_from(new_t):
                raise TypeError(
                    f"{self.name}: step_fn must return a state of the initial state's type {state_t}, "
                    f"found {new_t}."
                ) from None
            return [
                jnp.asarray(x, dtype=lt.dtype)
                for x, lt in zip(new_leaves, structure.leaf_types(state_t))
            ]
        raise TypeError(f"{self.name} did not call dataset.reduce consistently between traces.")

    def epilogue_flat(self, *leaves: Any) -> list[Any]:
        args, state_leaves = leaves[: self.n_args], leaves[self.n_args :]
        state = self._state(state_leaves) if self.state_type is not None else None
        ds = DatasetStandIn(self.element_type, "epilogue", state=state)
        return self.result_leaves(self.fn(*self.user_args(args, ds)))


def trace(
    fn: Callable,
    name: str,
    param_types: tuple[types.Type, ...],
    seq_index: int | None,
    arg_leaf_types: tuple[types.TensorType, ...],
    result_type: types.Type | None = None,
) -> Traced:
    """Types a user's function by abstract evaluation (`jax.eval_shape`); runs nothing."""
    found: dict[str, Any] = {}

    def programs(state_type: types.Type | None) -> _Programs:
        return _Programs(
            fn, name, param_types, seq_index, arg_leaf_types, result_type, state_type, found
        )

    if seq_index is None:
        (arg_avals,) = abstract_args([(arg_leaf_types, "a")])
        jax.eval_shape(programs(None).fn_flat, *arg_avals)
        return Traced(result_type or found["result_type"])
    element = cast(types.SequenceType, param_types[seq_index]).element
    arg_avals, batch_avals = abstract_args(
        [(arg_leaf_types, "a"), ([*structure.leaf_types(element), local.mask_type(element)], "b")]
    )
    try:
        jax.eval_shape(programs(None).prologue_flat, *arg_avals)
    except _NoReduce:
        jax.eval_shape(programs(None).epilogue_flat, *arg_avals)
        return Traced(result_type or found["result_type"])
    state_t = found["state_type"]
    traced_programs = programs(state_t)
    jax.eval_shape(traced_programs.step_flat, *arg_avals, *state_avals(state_t), *batch_avals)
    jax.eval_shape(traced_programs.epilogue_flat, *arg_avals, *state_avals(state_t))
    return Traced(result_type or found["result_type"], state_t, True, found["masked"])


def _trace_with_note(*args: Any) -> Traced:
    """`trace`, with a note on the two JAX errors users most often meet while typing."""
    try:
        return trace(*args)
    except jax.errors.TracerArrayConversionError as e:
        e.add_note(
            f"While typing the jax_computation {args[1]}: its code converts a traced value to a "
            "NumPy array (np.asarray, float(), .item(), or a library doing so). Inside a "
            "jax_computation use jax.numpy operations only."
        )
        raise
    except jax.errors.ConcretizationTypeError as e:
        e.add_note(
            f"While typing the jax_computation {args[1]}: Python control flow depends on a traced "
            "value. Use jax.lax.cond / jnp.where, or make the value static."
        )
        raise


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
        self.buffers = False  # exported for growing buffers (`growing_buffers`)
        self.parameter_names = computation.parameter_names_of(fn)
        param = computation.parameter_type_for(param_types, self.parameter_names, self.name)
        self.param_types = tuple(types.to_type(t) for t in param_types)
        for t in self.param_types:
            if isinstance(t, types.StructType) and any(
                isinstance(x, types.SequenceType) for x in t
            ):
                raise TypeError(
                    f"{self.name}: a dataset must be a parameter of its own, found it inside {t}."
                )
            if not isinstance(t, types.SequenceType):
                types.check_local(t, f"A parameter of the jax_computation {self.name}")
            strings.check_no_strings(t, f"A parameter of the jax_computation {self.name}")
            _check_x64(
                t if not isinstance(t, types.SequenceType) else t.element,
                f"{self.name}'s parameter",
            )
        seqs = [i for i, t in enumerate(self.param_types) if isinstance(t, types.SequenceType)]
        if len(seqs) > 1:
            raise TypeError(
                f"{self.name} takes {len(seqs)} datasets; a jax_computation takes at most one."
            )
        self.seq_index = seqs[0] if seqs else None
        traced = _trace_with_note(fn, self.name, self.param_types, self.seq_index, self.arg_leaf_types)
        if result_type is not None:
            declared = types.to_type(result_type)
            if not declared.is_assignable_from(traced.result_type):
                # The code may return the declared dicts with their keys in another order
                # (jax.tree.map sorts them): trace again, matching fields by name.
                try:
                    traced = _trace_with_note(
                        fn, self.name, self.param_types, self.seq_index, self.arg_leaf_types, declared
                    )
                except TypeError as e:
                    raise TypeError(
                        f"{self.name} declares the result type {declared}, but its JAX code "
                        f"returns {traced.result_type}."
                    ) from e
            traced = dataclasses.replace(traced, result_type=declared)
        self.traced = traced
        self.state_type = traced.state_type
        self.uses_reduce = traced.uses_reduce
        self.masked = traced.masked
        self.type_signature = types.FunctionType(param, traced.result_type)  # type: ignore[misc]
        self._programs_of_fn = _Programs(
            fn,
            self.name,
            self.param_types,
            self.seq_index,
            self.arg_leaf_types,
            traced.result_type,
            traced.state_type,
        )
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def part(self, name: str) -> Callable[..., list[Any]]:
        if name not in local.PARTS:
            raise ValueError(f"Expected a program name in {local.PARTS}, found {name!r}.")
        return getattr(self._programs_of_fn, f"{name}_flat")

    def to_ir(self) -> ir.Local:
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
