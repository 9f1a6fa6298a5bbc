"""The federated operators users call inside a `federated_computation`.

Each validates its arguments, applies TFF's conveniences (a struct of CLIENTS values
is zipped implicitly; constants become literals) and records a call to the intrinsic
defined in `intrinsic_defs` (registered in `intrinsics.TABLE`), whose type rule gives
the result type.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedlang.core import intrinsic_defs as defs
from fedlang.core import tracing, types

CLIENTS, SERVER = types.CLIENTS, types.SERVER


def _federated(value: Any) -> tracing.Value:
    """A federated Value; a struct of federated values is zipped first (as in TFF)."""
    v = tracing.to_value(value)
    t = v.type_signature
    if isinstance(t, types.StructType) and types.contains_federated(t):
        return federated_zip(v)
    return v


def _placement(placement: Any, uri: str) -> types.Placement:
    if not isinstance(placement, types.Placement):
        raise TypeError(
            f"{uri} expects fedlang.CLIENTS or fedlang.SERVER as placement, found {placement!r}."
        )
    return placement


def federated_value(value: Any, placement: types.Placement) -> tracing.Value:
    """Places a local value (or constant) at `placement`, the same at every place.

    Type signature: `(T -> T@P)` (all-equal at CLIENTS).
    """
    p = _placement(placement, "federated_value")
    uri = (defs.FEDERATED_VALUE_AT_SERVER if p is SERVER else defs.FEDERATED_VALUE_AT_CLIENTS).uri
    return tracing.call_intrinsic(uri, value)


def federated_eval(fn: Any, placement: types.Placement) -> tracing.Value:
    """Evaluates a parameterless local computation at `placement` (at each client).

    Type signature: `(( -> T) -> T@SERVER)` or `(( -> T) -> {T}@CLIENTS)`.
    """
    p = _placement(placement, "federated_eval")
    uri = (defs.FEDERATED_EVAL_AT_SERVER if p is SERVER else defs.FEDERATED_EVAL_AT_CLIENTS).uri
    return tracing.call_intrinsic(uri, fn)


def federated_broadcast(value: Any) -> tracing.Value:
    """Sends a server value to every client.

    Type signature: `(T@SERVER -> T@CLIENTS)`.
    """
    return tracing.call_intrinsic(defs.FEDERATED_BROADCAST.uri, value)


def federated_map(fn: Any, value: Any) -> tracing.Value:
    """Applies a local computation pointwise at the value's placement.

    Type signature: `(<(T -> U),{T}@CLIENTS> -> {U}@CLIENTS)`; also
    `(<(T -> U),T@SERVER> -> U@SERVER)` and all-equal to all-equal. A struct of
    federated values, e.g. `(a, b)`, is zipped first. A polymorphic computation is
    concretized at the member type.
    """
    v = _federated(value)
    vt = v.type_signature
    if not isinstance(vt, types.FederatedType):
        raise TypeError(
            f"federated_map expects a federated value, found {vt}. To apply a local function to a "
            "local value, call it directly."
        )
    fn_node = (
        tracing.ir_of(fn, vt.member) if not isinstance(fn, tracing.Value) else tracing.to_node(fn)
    )
    return tracing.call_intrinsic(defs.FEDERATED_MAP.uri, (tracing.NodeRef(fn_node), v))


def federated_apply(fn: Any, value: Any) -> tracing.Value:
    """`federated_map` at the server: `(<(T -> U),T@SERVER> -> U@SERVER)`."""
    v = _federated(value)
    if not (
        isinstance(v.type_signature, types.FederatedType) and v.type_signature.placement is SERVER
    ):
        raise TypeError(
            f"federated_apply expects a value placed at SERVER, found {v.type_signature}."
        )
    return federated_map(fn, v)


def federated_zip(value: Any) -> tracing.Value:
    """Turns a struct of federated values into a federated struct.

    Type signature: `(<{A}@CLIENTS,{B}@CLIENTS> -> {<A,B>}@CLIENTS)` (and at SERVER).
    """
    return tracing.call_intrinsic(defs.FEDERATED_ZIP.uri, value)


def federated_sum(value: Any) -> tracing.Value:
    """Sums client values at the server.

    Type signature: `({T}@CLIENTS -> T@SERVER)`.
    """
    return tracing.call_intrinsic(defs.FEDERATED_SUM.uri, _federated(value))


def federated_mean(value: Any, weight: Any = None) -> tracing.Value:
    """The (weighted) mean of client values at the server.

    Type signature: `({T}@CLIENTS -> T@SERVER)`, or with weights
    `(<{T}@CLIENTS,{W}@CLIENTS> -> T@SERVER)` computing `sum(w*x) / sum(w)` (NaN when
    the weights sum to zero).
    """
    v = _federated(value)
    if weight is None:
        return tracing.call_intrinsic(defs.FEDERATED_MEAN.uri, v)
    return tracing.call_intrinsic(defs.FEDERATED_WEIGHTED_MEAN.uri, (v, tracing.to_value(weight)))


def federated_min(value: Any) -> tracing.Value:
    """Elementwise minimum over clients: `({T}@CLIENTS -> T@SERVER)`."""
    return tracing.call_intrinsic(defs.FEDERATED_MIN.uri, _federated(value))


def federated_max(value: Any) -> tracing.Value:
    """Elementwise maximum over clients: `({T}@CLIENTS -> T@SERVER)`."""
    return tracing.call_intrinsic(defs.FEDERATED_MAX.uri, _federated(value))


def federated_aggregate(
    value: Any, zero: Any, accumulate: Any, merge: Any, report: Any
) -> tracing.Value:
    """Aggregates client values with a custom monoid.

    Type signature: `(<{T}@CLIENTS,U,(<U,T> -> U),(<U,U> -> U),(U -> R)> -> R@SERVER)`.
    Clients are folded into partial aggregates with `accumulate`, partials combined
    with `merge`, and the result finished with `report`. Polymorphic computations are
    concretized at the types implied by `zero` and the client values.
    """
    v = _federated(value)
    vt = v.type_signature
    if not isinstance(vt, types.FederatedType):
        raise TypeError(f"federated_aggregate expects a value placed at CLIENTS, found {vt}.")
    z = tracing.to_value(zero)
    zt = z.type_signature
    acc = tracing.ir_of(accumulate, types.StructType([zt, vt.member]))
    mrg = tracing.ir_of(merge, types.StructType([zt, zt]))
    rep = tracing.ir_of(report, zt)
    return tracing.call_intrinsic(
        defs.FEDERATED_AGGREGATE.uri,
        (v, z, tracing.NodeRef(acc), tracing.NodeRef(mrg), tracing.NodeRef(rep)),
    )


def federated_select(
    client_keys: Any, max_key: Any, server_val: Any, select_fn: Any
) -> tracing.Value:
    """Sends each client the items of a server value selected by its keys.

    Type signature: `(<{int32[?]}@CLIENTS,int32@SERVER,T@SERVER,(<T,int32> -> U)> ->
    {sequence<U>}@CLIENTS)`: client i receives `[select_fn(server_val, k) for k in keys_i]`.
    Keys must lie in `[0, max_key)`.
    """
    keys, mx, sv = (
        tracing.to_value(client_keys),
        tracing.to_value(max_key),
        tracing.to_value(server_val),
    )
    st = sv.type_signature
    member = st.member if isinstance(st, types.FederatedType) else st
    fn = tracing.ir_of(select_fn, types.StructType([member, types.TensorType(np.int32)]))
    return tracing.call_intrinsic(defs.FEDERATED_SELECT.uri, (keys, mx, sv, tracing.NodeRef(fn)))


def _int_constant(x: Any, uri: str, what: str) -> Any:
    if isinstance(x, tracing.Value):
        raise TypeError(
            f"{uri} expects the {what} as a Python integer (or a structure of them), found {x.type_signature}."
        )
    if types.is_container(x):
        return (
            type(x)(*[_int_constant(v, uri, what) for v in x])
            if isinstance(x, tuple)
            else [_int_constant(v, uri, what) for v in x]
        )
    if not isinstance(x, int | np.integer) or isinstance(x, bool) or int(x) <= 0:
        raise TypeError(f"{uri} expects a positive integer {what}, found {x!r}.")
    return np.int64(x)


def federated_secure_sum_bitwidth(value: Any, bitwidth: Any) -> tracing.Value:
    """Sums integer client values as the secure aggregation protocol would.

    Type signature: `(<{T}@CLIENTS,B> -> T@SERVER)`. Each input is encoded in `bitwidth`
    bits (values outside `[0, 2^bitwidth)` wrap around, as in the real protocol) and
    the sum is exact in a group of size `2^(bitwidth + ceil(log2(num_clients)))`.
    """
    b = _int_constant(bitwidth, "federated_secure_sum_bitwidth", "bitwidth")
    return tracing.call_intrinsic(defs.FEDERATED_SECURE_SUM_BITWIDTH.uri, (_federated(value), b))


def federated_secure_modular_sum(value: Any, modulus: Any) -> tracing.Value:
    """Sums integer client values modulo `modulus`, exactly (`sum(x mod m) mod m`).

    Type signature: `(<{T}@CLIENTS,M> -> T@SERVER)`.
    """
    m = _int_constant(modulus, "federated_secure_modular_sum", "modulus")
    return tracing.call_intrinsic(defs.FEDERATED_SECURE_MODULAR_SUM.uri, (_federated(value), m))


def _seq_member(value: tracing.Value) -> types.Type:
    t = value.type_signature
    member = t.member if isinstance(t, types.FederatedType) else t
    if not isinstance(member, types.SequenceType):
        raise TypeError(f"Expected a sequence (a dataset), found {t}.")
    return member.element


def sequence_map(fn: Any, value: Any) -> tracing.Value:
    """Maps each element of a sequence: `(<(T -> U),sequence<T>> -> sequence<U>)`.

    On `{sequence<T>}@CLIENTS` it applies at each client.
    """
    v = tracing.to_value(value)
    return tracing.call_intrinsic(
        defs.SEQUENCE_MAP.uri, (tracing.NodeRef(tracing.ir_of(fn, _seq_member(v))), v)
    )


def sequence_reduce(value: Any, zero: Any, op: Any) -> tracing.Value:
    """Folds a sequence: `(<sequence<T>,U,(<U,T> -> U)> -> U)`, pointwise when federated.

    Executed as a host loop of the (jitted) operator over the stream, so sequences of
    any length work.
    """
    v, z = tracing.to_value(value), tracing.to_value(zero)
    zt = z.type_signature
    zero_member = zt.member if isinstance(zt, types.FederatedType) else zt
    fn = tracing.ir_of(op, types.StructType([zero_member, _seq_member(v)]))
    return tracing.call_intrinsic(defs.SEQUENCE_REDUCE.uri, (v, z, tracing.NodeRef(fn)))


def sequence_sum(value: Any) -> tracing.Value:
    """Sums the elements of a sequence: `(sequence<T> -> T)`, pointwise when federated."""
    return tracing.call_intrinsic(defs.SEQUENCE_SUM.uri, tracing.to_value(value))


def federated_sparse_sum(value: Any, keep_sparse: bool = False) -> tracing.Value:
    """Sums sparse client values with explicit semantics (never component-wise).

    Type signature: `({sparse<T[s]>}@CLIENTS -> T[s]@SERVER)`: every client's entries are
    scattered into a dense result (duplicate indices add up). With `keep_sparse=True`:
    `({sparse<T[s]>}@CLIENTS -> sparse<T[s]>@SERVER)`, the union of the clients'
    indices with summed values (coalesced: unique, sorted indices).
    """
    uri = (defs.SPARSE_SUM_KEEP_SPARSE if keep_sparse else defs.SPARSE_SUM).uri
    return tracing.call_intrinsic(uri, _federated(value))


def federated_sparse_mean(value: Any) -> tracing.Value:
    """The mean of sparse client values over the clients that contributed to each index.

    Type signature: `({sparse<T[s]>}@CLIENTS -> sparse<T[s]>@SERVER)`. At each index of
    the union of the clients' indices, the sum of the values divided by the number of
    clients that sent that index (a client sending an index twice counts once).
    """
    return tracing.call_intrinsic(
        defs.SPARSE_MEAN.uri, _federated(value)
    )
