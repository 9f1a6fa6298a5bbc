"""The standard intrinsics: one `intrinsics.define` per federated operator.

Each definition gives the intrinsic's URI, kind, type rule and reference semantics
over internal values (CLIENTS values are Python lists with one entry per client), with
a one-line comment of its type signature in TFF notation. The user-facing functions
are in `operators`; runtimes look definitions up by URI (the constants below) in their
strategy tables. Importing this module also registers the sparse family
(`sparse_intrinsics`), so the table is complete.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from fedlang.core import intrinsics, sparse_intrinsics, structure, types
from fedlang.core.intrinsics import Kind

CLIENTS, SERVER = types.CLIENTS, types.SERVER
Runtime = intrinsics.Runtime


def _member(t: types.Type) -> types.Type:
    return cast(types.FederatedType, t).member


def _nan(t: types.Type) -> Any:
    return intrinsics.full(t, np.nan)


# ----------------------------------------------------------------------------
# Semantics helpers over internal values


def _map_leaves(fn: Callable, t: types.Type, *values: Any) -> Any:
    if isinstance(t, types.StructType):
        return tuple(_map_leaves(fn, et, *vs) for et, vs in zip(t.types, zip(*values)))
    return fn(t, *values)


def _reduce_clients(fn: Callable, t: types.Type, client_values: list[Any], empty: Callable) -> Any:
    if isinstance(t, types.StructType):
        return tuple(
            _reduce_clients(fn, et, [v[i] for v in client_values], empty)
            for i, et in enumerate(t.types)
        )
    if not client_values:
        return empty(t)
    return fn(t, [np.asarray(v) for v in client_values])


# ----------------------------------------------------------------------------
# The table


def _value_rule(placement: types.Placement) -> Callable:
    def rule(t: types.Type) -> types.Type:
        types.check_local(t, f"federated_value at {placement}")
        return types.FederatedType(t, placement, all_equal=True)

    return rule


def _value_impl(placement: types.Placement) -> Callable:
    def impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
        return [arg] * rt.num_clients if placement is CLIENTS else arg

    return impl


# Type signature: T -> T@SERVER
FEDERATED_VALUE_AT_SERVER = intrinsics.define(
    "federated_value_at_server",
    Kind.VALUE,
    "(T -> T@SERVER)",
    _value_rule(SERVER),
    _value_impl(SERVER),
)
# Type signature: T -> T@CLIENTS
FEDERATED_VALUE_AT_CLIENTS = intrinsics.define(
    "federated_value_at_clients",
    Kind.VALUE,
    "(T -> T@CLIENTS)",
    _value_rule(CLIENTS),
    _value_impl(CLIENTS),
)


def _eval_rule(placement: types.Placement) -> Callable:
    def rule(t: types.Type) -> types.Type:
        fn = intrinsics.expect_function(
            t, f"federated_eval at {placement}", "a computation with no parameter"
        )
        if fn.parameter is not None:
            raise TypeError(f"federated_eval expects a computation with no parameter, found {fn}.")
        types.check_local(fn.result, "federated_eval's result")
        return types.FederatedType(fn.result, placement)

    return rule


def _eval_impl(placement: types.Placement) -> Callable:
    def impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
        if placement is CLIENTS:
            return [rt.call(arg, None) for _ in range(rt.num_clients)]
        return rt.call(arg, None)

    return impl


# Type signature: ( -> T) -> T@SERVER
FEDERATED_EVAL_AT_SERVER = intrinsics.define(
    "federated_eval_at_server",
    Kind.VALUE,
    "(( -> T) -> T@SERVER)",
    _eval_rule(SERVER),
    _eval_impl(SERVER),
)
# Type signature: ( -> T) -> {T}@CLIENTS
FEDERATED_EVAL_AT_CLIENTS = intrinsics.define(
    "federated_eval_at_clients",
    Kind.VALUE,
    "(( -> T) -> {T}@CLIENTS)",
    _eval_rule(CLIENTS),
    _eval_impl(CLIENTS),
)


def _broadcast_rule(t: types.Type) -> types.Type:
    f = intrinsics.expect_federated(t, "federated_broadcast", SERVER)
    return types.FederatedType(f.member, CLIENTS, all_equal=True)


# Type signature: T@SERVER -> T@CLIENTS
FEDERATED_BROADCAST = intrinsics.define(
    "federated_broadcast",
    Kind.BROADCAST,
    "(T@SERVER -> T@CLIENTS)",
    _broadcast_rule,
    lambda arg, t, rt: [arg] * rt.num_clients,
)


def _map_rule(t: types.Type) -> types.Type:
    fn_t, value_t = intrinsics.struct_args(t, 2, "federated_map")
    fn = intrinsics.expect_function(
        fn_t, "federated_map", "a local computation as its first argument"
    )
    v = intrinsics.expect_federated(
        value_t,
        "federated_map",
        hint="To apply a local function to a local value, call it directly.",
    )
    intrinsics.check_parameter(fn, v.member, "federated_map")
    if types.contains_federated(fn.result):
        raise TypeError(
            f"federated_map expects a local function, found {fn}; its result is federated."
        )
    return types.FederatedType(fn.result, v.placement, all_equal=v.all_equal)


def _map_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    fn, value = arg
    if t.types[1].placement is CLIENTS:  # type: ignore[attr-defined]
        return [rt.call(fn, v) for v in value]
    return rt.call(fn, value)


# Type signature: <(T -> U), {T}@CLIENTS> -> {U}@CLIENTS  (and T@SERVER -> U@SERVER, all-equal -> all-equal)
FEDERATED_MAP = intrinsics.define(
    "federated_map", Kind.MAP, "(<(T -> U),{T}@CLIENTS> -> {U}@CLIENTS)", _map_rule, _map_impl
)


def _zip_member(
    t: types.Type, placement: types.Placement | None
) -> tuple[types.Type, types.Placement | None, bool]:
    if isinstance(t, types.FederatedType):
        if placement is not None and t.placement is not placement:
            raise TypeError(
                f"federated_zip expects values at one placement, found {t.placement} and {placement}."
            )
        return t.member, t.placement, t.all_equal
    if isinstance(t, types.StructType):
        members, all_equal = [], True
        for n, et in t.elements:
            m, placement, ae = _zip_member(et, placement)
            members.append((n, m))
            all_equal = all_equal and ae
        return types.StructType(members, container=t.container), placement, all_equal
    raise TypeError(f"federated_zip expects a struct of federated values, found {t}.")


def _zip_rule(t: types.Type) -> types.Type:
    if not isinstance(t, types.StructType):
        raise TypeError(f"federated_zip expects a struct of federated values, found {t}.")
    member, placement, all_equal = _zip_member(t, None)
    if placement is None:
        raise TypeError(f"federated_zip expects at least one federated value, found {t}.")
    return types.FederatedType(member, placement, all_equal=all_equal)


def _zip_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    placement = _zip_rule(t).placement  # type: ignore[attr-defined]

    def at(v: Any, vt: types.Type, i: int | None) -> Any:
        if isinstance(vt, types.FederatedType):
            return v if i is None else v[i]
        return tuple(at(x, et, i) for x, et in zip(v, vt.types))  # type: ignore[attr-defined]

    if placement is CLIENTS:
        return [at(arg, t, i) for i in range(rt.num_clients)]
    return at(arg, t, None)


# Type signature: <{A}@CLIENTS,{B}@CLIENTS> -> {<A,B>}@CLIENTS  (and at SERVER)
FEDERATED_ZIP = intrinsics.define(
    "federated_zip",
    Kind.MAP,
    "(<{A}@CLIENTS,{B}@CLIENTS> -> {<A,B>}@CLIENTS)",
    _zip_rule,
    _zip_impl,
)


def _sum_rule(t: types.Type) -> types.Type:
    v = intrinsics.expect_federated(
        t,
        "federated_sum",
        CLIENTS,
        "Did you mean to broadcast first, or is the value already aggregated?",
    )
    intrinsics.expect_numeric(v.member, "federated_sum", "iufc", "numeric values")
    return types.FederatedType(v.member, SERVER)


def _sum_leaf(lt: types.Type, vs: list[np.ndarray]) -> np.ndarray:
    return np.sum(np.stack(vs), axis=0, dtype=lt.dtype)  # type: ignore[attr-defined]


# Type signature: {T}@CLIENTS -> T@SERVER
FEDERATED_SUM = intrinsics.define(
    "federated_sum",
    Kind.AGGREGATE,
    "({T}@CLIENTS -> T@SERVER)",
    _sum_rule,
    lambda arg, t, rt: _reduce_clients(_sum_leaf, _member(t), arg, intrinsics.zeros),
    empty=intrinsics.zeros,
)


def _mean_rule(t: types.Type) -> types.Type:
    v = intrinsics.expect_federated(
        t,
        "federated_mean",
        CLIENTS,
        "Did you mean federated_broadcast, or is it already aggregated?",
    )
    intrinsics.expect_numeric(v.member, "federated_mean", "fc", "floating-point values")
    return types.FederatedType(v.member, SERVER)


def _mean_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    n = len(arg)
    return _reduce_clients(
        lambda lt, vs: (np.sum(np.stack(vs).astype(np.float64), axis=0) / n).astype(lt.dtype),
        cast(types.FederatedType, t).member,
        arg,
        _nan,
    )


# Type signature: {T}@CLIENTS -> T@SERVER  (T floating)
FEDERATED_MEAN = intrinsics.define(
    "federated_mean",
    Kind.AGGREGATE,
    "({T}@CLIENTS -> T@SERVER)",
    _mean_rule,
    _mean_impl,
    empty=_nan,
)


def _weighted_mean_rule(t: types.Type) -> types.Type:
    value_t, weight_t = intrinsics.struct_args(t, 2, "federated_mean")
    result = _mean_rule(value_t)
    w = intrinsics.expect_federated(weight_t, "federated_mean (weight)", CLIENTS)
    if (
        not isinstance(w.member, types.TensorType)
        or w.member.shape != ()
        or w.member.dtype.kind not in "iuf"
    ):
        raise TypeError(
            f"federated_mean expects a scalar numeric weight per client, found {weight_t}."
        )
    return result


def _weighted_mean_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    values, weights = arg
    w = np.asarray([np.asarray(x, np.float64) for x in weights])
    total = w.sum()

    def leaf(lt: types.Type, vs: list[np.ndarray]) -> np.ndarray:
        stacked = np.stack(vs).astype(np.float64)
        s = np.tensordot(w, stacked, axes=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (s / total).astype(lt.dtype)  # type: ignore[attr-defined]

    member = cast(types.FederatedType, cast(types.StructType, t).types[0]).member
    return _reduce_clients(leaf, member, values, _nan)


# Type signature: <{T}@CLIENTS,{W}@CLIENTS> -> T@SERVER  (sum(w*x)/sum(w); NaN when sum(w) == 0)
FEDERATED_WEIGHTED_MEAN = intrinsics.define(
    "federated_weighted_mean",
    Kind.AGGREGATE,
    "(<{T}@CLIENTS,{W}@CLIENTS> -> T@SERVER)",
    _weighted_mean_rule,
    _weighted_mean_impl,
    empty=_nan,
)


def _minmax(uri: str, reducer: Callable, identity: Callable) -> tuple[Callable, Callable]:
    def rule(t: types.Type) -> types.Type:
        v = intrinsics.expect_federated(t, uri, CLIENTS)
        intrinsics.expect_numeric(v.member, uri, "iuf", "real numbers")
        return types.FederatedType(v.member, SERVER)

    def impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
        return _reduce_clients(
            lambda lt, vs: reducer(np.stack(vs), axis=0).astype(lt.dtype),
            cast(types.FederatedType, t).member,
            arg,
            lambda lt: _map_leaves(
                lambda x: np.full([d or 0 for d in x.shape], identity(x.dtype), x.dtype), lt
            ),
        )

    return rule, impl


# Type signature: {T}@CLIENTS -> T@SERVER  (elementwise; the dtype's largest value for no clients)
FEDERATED_MIN = intrinsics.define(
    "federated_min",
    Kind.AGGREGATE,
    "({T}@CLIENTS -> T@SERVER)",
    *_minmax("federated_min", np.min, intrinsics.dtype_max),
    empty=lambda t: intrinsics.full(t, intrinsics.dtype_max),
)
# Type signature: {T}@CLIENTS -> T@SERVER  (elementwise; the dtype's smallest value for no clients)
FEDERATED_MAX = intrinsics.define(
    "federated_max",
    Kind.AGGREGATE,
    "({T}@CLIENTS -> T@SERVER)",
    *_minmax("federated_max", np.max, intrinsics.dtype_min),
    empty=lambda t: intrinsics.full(t, intrinsics.dtype_min),
)


def _aggregate_rule(t: types.Type) -> types.Type:
    uri = "federated_aggregate"
    value_t, zero_t, acc_t, merge_t, report_t = intrinsics.struct_args(t, 5, uri)
    v = intrinsics.expect_federated(value_t, uri, CLIENTS)
    types.check_local(zero_t, "federated_aggregate's zero")
    acc = intrinsics.expect_function(acc_t, uri, "an accumulate function (<U,T> -> U)")
    intrinsics.check_parameter(acc, types.StructType([zero_t, v.member]), uri + " (accumulate)")
    if not zero_t.is_assignable_from(acc.result):
        raise TypeError(
            f"{uri}: accumulate must return the zero's type {zero_t}, found {acc.result}."
        )
    merge = intrinsics.expect_function(merge_t, uri, "a merge function (<U,U> -> U)")
    intrinsics.check_parameter(merge, types.StructType([zero_t, zero_t]), uri + " (merge)")
    if not zero_t.is_assignable_from(merge.result):
        raise TypeError(f"{uri}: merge must return the zero's type {zero_t}, found {merge.result}.")
    report = intrinsics.expect_function(report_t, uri, "a report function (U -> R)")
    intrinsics.check_parameter(report, zero_t, uri + " (report)")
    return types.FederatedType(report.result, SERVER)


def _aggregate_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    values, zero, accumulate, merge, report = arg
    # Clients are accumulated in two partial aggregates that are then merged, so the
    # reference exercises `merge` exactly as chunked runtimes do.
    half = len(values) // 2
    partials = []
    for part in (values[:half], values[half:]):
        acc = zero
        for v in part:
            acc = rt.call(accumulate, (acc, v))
        partials.append(acc)
    return rt.call(report, rt.call(merge, tuple(partials)))


# Type signature: <{T}@CLIENTS,U,(<U,T> -> U),(<U,U> -> U),(U -> R)> -> R@SERVER
FEDERATED_AGGREGATE = intrinsics.define(
    "federated_aggregate",
    Kind.AGGREGATE,
    "(<{T}@CLIENTS,U,(<U,T> -> U),(<U,U> -> U),(U -> R)> -> R@SERVER)",
    _aggregate_rule,
    _aggregate_impl,
)


def _select_rule(t: types.Type) -> types.Type:
    uri = "federated_select"
    keys_t, max_t, server_t, fn_t = intrinsics.struct_args(t, 4, uri)
    keys = intrinsics.expect_federated(keys_t, uri + " (client_keys)", CLIENTS)
    if not (
        isinstance(keys.member, types.TensorType)
        and keys.member.dtype == np.int32
        and len(keys.member.shape) == 1
    ):
        raise TypeError(f"{uri} expects client keys of type {{int32[?]}}@CLIENTS, found {keys_t}.")
    mx = intrinsics.expect_federated(max_t, uri + " (max_key)", SERVER)
    if mx.member != types.TensorType(np.int32):
        raise TypeError(f"{uri} expects max_key of type int32@SERVER, found {max_t}.")
    server = intrinsics.expect_federated(server_t, uri + " (server_val)", SERVER)
    fn = intrinsics.expect_function(fn_t, uri, "a select function (<T,int32> -> U)")
    intrinsics.check_parameter(
        fn, types.StructType([server.member, types.TensorType(np.int32)]), uri + " (select_fn)"
    )
    return types.FederatedType(types.SequenceType(fn.result), CLIENTS)


def _select_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    keys, max_key, server_val, fn = arg
    out = []
    for i, client_keys in enumerate(keys):
        ks = checked_select_keys(i, client_keys, max_key)
        out.append([rt.call(fn, (server_val, np.int32(k))) for k in ks])
    return out


def checked_select_keys(client: int, keys: Any, max_key: Any) -> np.ndarray:
    """A client's federated_select keys as an array, checked to lie in `[0, max_key)`."""
    ks = np.asarray(keys)
    bad = ks[(ks < 0) | (ks >= max_key)]
    if bad.size:
        raise ValueError(
            f"federated_select: client {client} asked for key {int(bad[0])}, outside [0, {int(max_key)})."
        )
    return ks


# Type signature: <{int32[?]}@CLIENTS,int32@SERVER,T@SERVER,(<T,int32> -> U)> -> {sequence<U>}@CLIENTS
FEDERATED_SELECT = intrinsics.define(
    "federated_select",
    Kind.SELECT,
    "(<{int32[?]}@CLIENTS,int32@SERVER,T@SERVER,(<T,int32> -> U)> -> {sequence<U>}@CLIENTS)",
    _select_rule,
    _select_impl,
)


def _secure_rule(uri: str, param: str) -> Callable:
    def rule(t: types.Type) -> types.Type:
        value_t, bound_t = intrinsics.struct_args(t, 2, uri)
        v = intrinsics.expect_federated(value_t, uri, CLIENTS)
        intrinsics.expect_numeric(v.member, uri, "iu", "integers")
        types.check_local(bound_t, f"{uri}'s {param}")
        intrinsics.expect_numeric(bound_t, uri + f" ({param})", "iu", f"integer {param}s")
        leaves = types.tensor_leaves(v.member)
        if not (isinstance(bound_t, types.TensorType) and bound_t.shape == ()) and len(
            types.tensor_leaves(bound_t)
        ) != len(leaves):
            raise TypeError(
                f"{uri} expects one {param} or one per tensor of {v.member}, found {bound_t}."
            )
        return types.FederatedType(v.member, SERVER)

    return rule


def secure_bounds(bound: Any, bound_t: types.Type, member: types.Type) -> list[int]:
    n = len(types.tensor_leaves(member))
    flat = structure.flatten(bound, bound_t)
    ints = [int(np.asarray(b)) for b in flat]
    return ints * n if len(ints) == 1 else ints


def _modular_sum(
    values: list[Any], member: types.Type, moduli: list[int], wrap_inputs: list[int]
) -> Any:
    """Exact integer sum modulo `moduli[i]` per tensor, each input first wrapped modulo `wrap_inputs[i]`."""
    leaf_types = structure.leaf_types(member)
    flat_clients = [structure.flatten(v, member) for v in values]
    out = []
    for i, lt in enumerate(leaf_types):
        acc = np.zeros([d or 0 for d in lt.shape], dtype=object) if not flat_clients else None
        for client in flat_clients:
            x = np.mod(np.asarray(client[i]).astype(object), wrap_inputs[i])
            acc = x if acc is None else acc + x
        assert acc is not None  # zeros without clients, else the first client's value
        acc = np.mod(acc, moduli[i])
        out.append(np.asarray(acc.astype(np.int64)).astype(lt.dtype))
    return structure.unflatten(out, member)


def _secure_bitwidth_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    values, bitwidth = arg
    arg_t = cast(types.StructType, t)
    member = cast(types.FederatedType, arg_t.types[0]).member
    widths = secure_bounds(bitwidth, arg_t.types[1], member)
    n = max(len(values), 1)
    extra = math.ceil(math.log2(n)) if n > 1 else 0
    return _modular_sum(values, member, [2 ** (b + extra) for b in widths], [2**b for b in widths])


def _secure_modular_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    values, modulus = arg
    arg_t = cast(types.StructType, t)
    member = cast(types.FederatedType, arg_t.types[0]).member
    moduli = secure_bounds(modulus, arg_t.types[1], member)
    return _modular_sum(values, member, moduli, moduli)


# Type signature: <{T}@CLIENTS,B> -> T@SERVER  (T integer; inputs wrap modulo 2^B, the sum is
# exact in a group of 2^(B + ceil(log2 n)) as in the secure aggregation protocol)
FEDERATED_SECURE_SUM_BITWIDTH = intrinsics.define(
    "federated_secure_sum_bitwidth",
    Kind.SECURE_AGGREGATE,
    "(<{T}@CLIENTS,B> -> T@SERVER)",
    _secure_rule("federated_secure_sum_bitwidth", "bitwidth"),
    _secure_bitwidth_impl,
    empty=intrinsics.zeros,
)
# Type signature: <{T}@CLIENTS,M> -> T@SERVER  (sum of (x mod M), mod M, exactly)
FEDERATED_SECURE_MODULAR_SUM = intrinsics.define(
    "federated_secure_modular_sum",
    Kind.SECURE_AGGREGATE,
    "(<{T}@CLIENTS,M> -> T@SERVER)",
    _secure_rule("federated_secure_modular_sum", "modulus"),
    _secure_modular_impl,
    empty=intrinsics.zeros,
)


# ----------------------------------------------------------------------------
# Sequence intrinsics (local, or pointwise on a federated sequence)


def _pointwise(
    uri: str,
    t: types.Type,
    seq_t: types.Type,
    local_rule: Callable[[types.SequenceType], types.Type],
) -> types.Type:
    if isinstance(seq_t, types.FederatedType):
        if not isinstance(seq_t.member, types.SequenceType):
            raise TypeError(f"{uri} expects a sequence, found {seq_t}.")
        return types.FederatedType(
            local_rule(seq_t.member), seq_t.placement, all_equal=seq_t.all_equal
        )
    if not isinstance(seq_t, types.SequenceType):
        raise TypeError(f"{uri} expects a sequence (a dataset), found {seq_t}.")
    return local_rule(seq_t)


def _seq_map_rule(t: types.Type) -> types.Type:
    fn_t, seq_t = intrinsics.struct_args(t, 2, "sequence_map")
    fn = intrinsics.expect_function(fn_t, "sequence_map", "a local function as its first argument")

    def local(s: types.SequenceType) -> types.Type:
        intrinsics.check_parameter(fn, s.element, "sequence_map")
        return types.SequenceType(fn.result)

    return _pointwise("sequence_map", t, seq_t, local)


class MappedStream:
    """A lazily mapped sequence; each iteration is a fresh pass."""

    def __init__(self, source: Any, fn: Callable[[Any], Any]):
        self.source, self.fn = source, fn

    def __iter__(self) -> Any:
        return (self.fn(x) for x in self.source)


def _per_placement(seq_t: types.Type, value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(seq_t, types.FederatedType) and seq_t.placement is CLIENTS:
        return [fn(v) for v in value]
    return fn(value)


def _seq_map_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    fn, seq = arg
    return _per_placement(
        cast(types.StructType, t).types[1], seq, lambda s: MappedStream(s, lambda x: rt.call(fn, x))
    )


# Type signature: <(T -> U),sequence<T>> -> sequence<U>  (pointwise on {sequence<T>}@P)
SEQUENCE_MAP = intrinsics.define(
    "sequence_map",
    Kind.SEQUENCE,
    "(<(T -> U),sequence<T>> -> sequence<U>)",
    _seq_map_rule,
    _seq_map_impl,
)


def _seq_reduce_rule(t: types.Type) -> types.Type:
    seq_t, zero_t, op_t = intrinsics.struct_args(t, 3, "sequence_reduce")
    op = intrinsics.expect_function(op_t, "sequence_reduce", "an operator (<U,T> -> U)")
    zero_member = zero_t.member if isinstance(zero_t, types.FederatedType) else zero_t
    if isinstance(zero_t, types.FederatedType) and (
        not isinstance(seq_t, types.FederatedType) or zero_t.placement is not seq_t.placement
    ):
        raise TypeError(
            f"sequence_reduce: the zero {zero_t} must be local or at the sequence's placement ({seq_t})."
        )

    def local(s: types.SequenceType) -> types.Type:
        intrinsics.check_parameter(
            op, types.StructType([zero_member, s.element]), "sequence_reduce"
        )
        if not zero_member.is_assignable_from(op.result):
            raise TypeError(
                f"sequence_reduce: the operator must return the zero's type {zero_member}, found {op.result}."
            )
        return zero_member

    result = _pointwise("sequence_reduce", t, seq_t, local)
    if (
        isinstance(result, types.FederatedType)
        and isinstance(zero_t, types.FederatedType)
        and not zero_t.all_equal
    ):
        result = types.FederatedType(result.member, result.placement, all_equal=False)
    return result


def reduce_stream(seq: Any, zero: Any, step: Callable[[Any, Any], Any]) -> Any:
    """Folds a stream with `step(state, element)`: the host loop every runtime can fall back to."""
    state = zero
    for element in seq:
        state = step(state, element)
    return state


def _seq_reduce_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    seq, zero, op = arg
    arg_t = cast(types.StructType, t)
    seq_t, zero_t = arg_t.types[0], arg_t.types[1]
    if isinstance(seq_t, types.FederatedType) and seq_t.placement is CLIENTS:
        zeros = zero if isinstance(zero_t, types.FederatedType) else [zero] * len(seq)
        return [reduce_stream(s, z, lambda a, x: rt.call(op, (a, x))) for s, z in zip(seq, zeros)]
    return reduce_stream(seq, zero, lambda a, x: rt.call(op, (a, x)))


# Type signature: <sequence<T>,U,(<U,T> -> U)> -> U  (pointwise on {sequence<T>}@P)
SEQUENCE_REDUCE = intrinsics.define(
    "sequence_reduce",
    Kind.SEQUENCE,
    "(<sequence<T>,U,(<U,T> -> U)> -> U)",
    _seq_reduce_rule,
    _seq_reduce_impl,
)


def _seq_sum_rule(t: types.Type) -> types.Type:
    def local(s: types.SequenceType) -> types.Type:
        intrinsics.expect_numeric(s.element, "sequence_sum", "iufc", "numeric elements")
        return s.element

    return _pointwise("sequence_sum", t, t, local)


def _seq_sum_impl(arg: Any, t: types.Type, rt: Runtime) -> Any:
    element_t = t.member.element if isinstance(t, types.FederatedType) else t.element  # type: ignore[attr-defined]

    def add(a: Any, x: Any) -> Any:
        if a is None:
            return _map_leaves(lambda lt, q: np.asarray(q, lt.dtype), element_t, x)
        return _map_leaves(lambda lt, p, q: (p + np.asarray(q)).astype(lt.dtype), element_t, a, x)

    def total(seq: Any) -> Any:
        result = reduce_stream(seq, None, add)
        if result is None:  # an empty sequence sums to zeros (unknown dimensions have size 0)
            return intrinsics.zeros(element_t)
        return result

    return _per_placement(t, arg, total)


# Type signature: sequence<T> -> T  (pointwise on {sequence<T>}@P)
SEQUENCE_SUM = intrinsics.define(
    "sequence_sum", Kind.SEQUENCE, "(sequence<T> -> T)", _seq_sum_rule, _seq_sum_impl
)

SPARSE_SUM = sparse_intrinsics.FEDERATED_SPARSE_SUM
SPARSE_SUM_KEEP_SPARSE = sparse_intrinsics.FEDERATED_SPARSE_SUM_KEEP_SPARSE
SPARSE_MEAN = sparse_intrinsics.FEDERATED_SPARSE_MEAN
