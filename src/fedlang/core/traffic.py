"""Bits a federated computation moves per client, from the types of its intrinsics.

TFF measured traffic with a sizing executor; fedlang reads it off the computation:
every `federated_broadcast` in the IR sends its value's type to each client, and every
aggregation (sums, means, min/max, secure sums, `federated_aggregate`) takes its client
value's type from each client. Sizes are those of the types: a tensor of `n` elements
of a `k`-bit dtype is `n * k` bits (secure sums count their code dtype, `uint32`, not
the protocol's bit width; sparse values count as their dense shape, an upper bound).
Values of an unknown size (`?` dimensions, sequences, `federated_select`) count 0 and
are listed in `unsized`.

Learning processes report this per round under `metrics['traffic']` (the per-client
bits times the number of clients); `per_client_bits(process.next)` works for any
federated computation.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from fedlang.core import computation, intrinsics, ir, types

_UP = (intrinsics.Kind.AGGREGATE, intrinsics.Kind.SECURE_AGGREGATE)


class Traffic(NamedTuple):
    """Bits per client per call: server to client, client to server, and what was not sized."""

    broadcast_bits: int
    aggregated_bits: int
    unsized: tuple[str, ...] = ()


def type_bits(t: types.Type) -> int | None:
    """The bits of a value of local type `t`, or None when its size is not in its type."""
    total = 0
    for leaf in types.tensor_leaves(t) if not isinstance(t, types.SequenceType) else [t]:
        if isinstance(leaf, types.SparseTensorType):
            shape = leaf.dense_shape
        elif isinstance(leaf, types.TensorType):
            shape = leaf.shape
        else:
            return None
        dims = [d for d in shape if d is not None]
        if len(dims) != len(shape):
            return None
        total += math.prod(dims) * np.dtype(leaf.dtype).itemsize * 8
    return total


def _client_values(parameter: types.Type) -> list[types.Type]:
    """The member types each client sends into an aggregation: its CLIENTS-placed inputs."""
    parts = parameter.types if isinstance(parameter, types.StructType) else [parameter]
    return [
        t.member
        for t in parts
        if isinstance(t, types.FederatedType) and t.placement is types.CLIENTS
    ]


def per_client_bits(comp: computation.Computation | ir.Node) -> Traffic:
    """The bits one call of `comp` broadcasts to and aggregates from each client.

    Args:
      comp: a federated computation (e.g. `process.next`) or its IR.

    Returns:
      A `Traffic`.
    """
    node = comp if isinstance(comp, ir.Node) else comp.to_ir()
    down = up = 0
    unsized: list[str] = []
    for n in ir.walk(node):
        if not isinstance(n, ir.Intrinsic):
            continue
        kind = intrinsics.lookup(n.uri).kind
        if kind is intrinsics.Kind.SELECT:
            unsized.append(n.uri)  # what each client receives depends on its keys
            continue
        if kind is not intrinsics.Kind.BROADCAST and kind not in _UP:
            continue
        param = n.type_signature.parameter  # type: ignore[attr-defined]
        values = [param.member] if kind is intrinsics.Kind.BROADCAST else _client_values(param)
        for t in values:
            bits = type_bits(t)
            if bits is None:
                unsized.append(f"{n.uri}({t})")
            elif kind is intrinsics.Kind.BROADCAST:
                down += bits
            else:
                up += bits
    return Traffic(down, up, tuple(unsized))
