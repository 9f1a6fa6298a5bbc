"""fedlang's own ONNX conversion rules: JAX-level rewrites of what jax2onnx gets wrong.

jax2onnx (the version pinned in the `browser` extra, 0.17.1) converts most JAX primitives
to ONNX, but five patterns that a training step meets are refused or converted into
models onnxruntime rejects (measured on logistic regression and the FedAvg-paper CNN,
docs/deploy.md "Browser clients"):

1. `dot_general` contracting the left operand's axis 0 (the weight gradient `gᵀx`):
   jax2onnx's Gemm shortcut builds a model onnxruntime refuses.
2. `conv_general_dilated` in the layouts of a kernel gradient ("Unsupported conv
   layouts").
3. `scatter-add`, the gradient of `take_along_axis` (integer-label cross-entropy)
   ("scatter pattern not supported").
4. `select_and_scatter_add`, the gradient of a max-pool (no converter).
5. `reduce_window_max`, a forward max-pool: a 4-D MaxPool onnxruntime refuses.

Each rule here rewrites its primitive into other JAX primitives that convert cleanly
(transposes, elementwise ops, reductions, strided slices, padding), with exactly the
primitive's semantics, so each is tested against JAX itself, not against a converter.
`rewrite(fn)` applies them while tracing, through `backends/jax/rewrite.py`: it
re-traces `fn`'s jaxpr and binds every equation as is, except those a rule rewrites;
calls (`jit`, `custom_jvp_call`, ...) are inlined so rules apply inside them. `check(jaxpr, supported)` walks a jaxpr and
names the first primitive neither a rule nor the converter handles.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from fedlang.backends.jax import rewrite as jax_rewrite

# Calls are inlined so the rules apply inside them (`backends/jax/rewrite.py`).
INLINED = jax_rewrite.INLINED


class UnsupportedPrimitive(TypeError):
    """A primitive (or a use of one) that cannot be exported for browsers."""

    def __init__(self, primitive: str, message: str):
        super().__init__(message)
        self.primitive = primitive


@dataclasses.dataclass(frozen=True)
class Rule:
    """A rewrite of one primitive.

    Attributes:
      primitive: the primitive's name in jaxprs.
      refuse: `refuse(eqn) -> reason | None`: why this use cannot be rewritten.
      needed: `needed(eqn) -> bool`: whether this use must be rewritten (others are left
        to the converter).
      apply: `apply(eqn, *invals) -> list of outputs`, with JAX operations.
      gap: what goes wrong without the rule (for messages and docs).
    """

    primitive: str
    refuse: Callable[[Any], str | None]
    needed: Callable[[Any], bool]
    apply: Callable[..., list[Any]]
    gap: str


RULES: dict[str, Rule] = {}


def _rule(primitive: str, gap: str, refuse: Callable[[Any], str | None] | None = None,
          needed: Callable[[Any], bool] | None = None) -> Callable[[Callable], Callable]:
    def register(apply: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        RULES[primitive] = Rule(
            primitive, refuse or (lambda eqn: None), needed or (lambda eqn: True), apply, gap
        )
        return apply

    return register


# ----------------------------------------------------------------------------
# 1. dot_general contracting the left operand's leading axes


def _dot_needs_rewrite(eqn: Any) -> bool:
    (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    rank = len(eqn.invars[0].aval.shape)
    trailing = tuple(range(rank - len(lhs_contract), rank))
    return not lhs_batch and tuple(lhs_contract) != trailing


@_rule("dot_general", "a contraction over the left operand's axis 0 becomes a Gemm that "
       "onnxruntime refuses", needed=_dot_needs_rewrite)
def _dot_general(eqn: Any, lhs: Any, rhs: Any) -> list[Any]:
    (lhs_contract, rhs_contract), _ = eqn.params["dimension_numbers"]
    rank = lhs.ndim
    free = [d for d in range(rank) if d not in lhs_contract]
    # The free axes keep their order (they lead the result), the contracted ones go last.
    lhs_t = lax.transpose(lhs, (*free, *lhs_contract))
    contract = tuple(range(len(free), rank))
    out = lax.dot_general(
        lhs_t, rhs, ((contract, tuple(rhs_contract)), ((), ())),
        precision=eqn.params.get("precision"),
        preferred_element_type=eqn.params.get("preferred_element_type"),
    )
    return [out]


# ----------------------------------------------------------------------------
# 2. convolutions in any layout: transpose -> Conv (NCHW, OIHW) -> transpose


def _conv_layouts(eqn: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    dn = eqn.params["dimension_numbers"]
    return tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)


def _conv_needed(eqn: Any) -> bool:
    lhs, rhs, out = _conv_layouts(eqn)
    canonical = tuple(range(len(lhs)))
    return not (lhs == rhs == out == canonical)


def _conv_refuse(eqn: Any) -> str | None:
    if eqn.params.get("batch_group_count", 1) != 1:
        return (f"a convolution with batch_group_count={eqn.params['batch_group_count']} (the "
                "kernel gradient of a grouped convolution) has no ONNX Conv equivalent")
    return None


@_rule("conv_general_dilated", "the kernel gradient's layouts are refused by jax2onnx "
       "('Unsupported conv layouts')", refuse=_conv_refuse, needed=_conv_needed)
def _conv(eqn: Any, lhs: Any, rhs: Any) -> list[Any]:
    lhs_spec, rhs_spec, out_spec = _conv_layouts(eqn)
    canonical = tuple(range(len(lhs_spec)))
    p = eqn.params
    out = lax.conv_general_dilated(
        lax.transpose(lhs, lhs_spec), lax.transpose(rhs, rhs_spec),
        window_strides=p["window_strides"], padding=p["padding"],
        lhs_dilation=p["lhs_dilation"], rhs_dilation=p["rhs_dilation"],
        dimension_numbers=lax.ConvDimensionNumbers(canonical, canonical, canonical),
        feature_group_count=p["feature_group_count"], precision=p.get("precision"),
        preferred_element_type=p.get("preferred_element_type"),
    )
    return [lax.transpose(out, tuple(int(i) for i in np.argsort(out_spec)))]


# ----------------------------------------------------------------------------
# 3. scatter-add along one axis (the gradient of take_along_axis and of indexing)


def _scatter_refuse(eqn: Any) -> str | None:
    dn = eqn.params["dimension_numbers"]
    operand, indices, _ = (v.aval for v in eqn.invars)
    if len(dn.scatter_dims_to_operand_dims) != 1 or tuple(dn.inserted_window_dims) != tuple(
        dn.scatter_dims_to_operand_dims
    ):
        return ("a scatter-add that indexes more than one axis (or keeps the indexed axis as a "
                "window) is not supported; index one axis at a time (take_along_axis, x[:, i])")
    if not indices.shape or indices.shape[-1] != 1:
        return "a scatter-add whose index vector is not the last axis of its indices"
    if not all(isinstance(d, int) for d in (operand.shape[a] for a in dn.inserted_window_dims)):
        return "a scatter-add along an axis of unknown size"
    return None


@_rule("scatter-add", "the gradient of take_along_axis is a scatter-add jax2onnx refuses "
       "('scatter pattern not supported')", refuse=_scatter_refuse)
def _scatter_add(eqn: Any, operand: Any, indices: Any, updates: Any) -> list[Any]:
    """`operand` plus each update at its index, as a one-hot product summed over the
    scatter positions (an index outside the axis adds nothing, as FILL_OR_DROP does)."""
    dn = eqn.params["dimension_numbers"]
    axis = dn.scatter_dims_to_operand_dims[0]
    size = operand.shape[axis]
    index = indices[..., 0]  # [scatter dims...]
    if eqn.params.get("mode") == lax.GatherScatterMode.CLIP:
        index = jnp.clip(index, 0, size - 1)
    scatter_rank = index.ndim
    # updates: scatter dims (those not in update_window_dims) in the order of the indices'
    # dims, window dims in the order of the operand's remaining dims.
    window = tuple(dn.update_window_dims)
    scatter_axes = [d for d in range(updates.ndim) if d not in window]
    upd = lax.transpose(updates, (*scatter_axes, *window))  # [S..., W...]
    onehot = (index[..., None] == lax.broadcasted_iota(index.dtype, (*index.shape, size),
                                                         scatter_rank)).astype(updates.dtype)
    # operand dims: the indexed axis, batching dims (paired with scatter dims) and window
    # dims (each filled from 0; a window shorter than its dim is padded with zeros).
    batching = dict(zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims))
    window_dims = [d for d in range(operand.ndim) if d != axis and d not in batching]
    # product over [S..., W..., C] then sum the scatter dims that are not batching dims
    w_rank = len(window_dims)
    prod = upd[(..., None)] * lax.expand_dims(onehot, tuple(range(scatter_rank, scatter_rank + w_rank)))
    summed = [s for s in range(scatter_rank) if s not in batching.values()]
    contrib = jnp.sum(prod, axis=tuple(summed)) if summed else prod
    kept = [s for s in range(scatter_rank) if s in batching.values()]
    # contrib dims: kept scatter dims (batching), window dims, then C
    position = {}
    for i, s in enumerate(kept):
        position[next(o for o, si in batching.items() if si == s)] = i
    for j, d in enumerate(window_dims):
        position[d] = len(kept) + j
    position[axis] = len(kept) + w_rank
    contrib = lax.transpose(contrib, tuple(position[d] for d in range(operand.ndim)))
    pads = [(0, o - c, 0) for o, c in zip(operand.shape, contrib.shape)]
    if any(hi for _, hi, _ in pads):
        contrib = lax.pad(contrib, jnp.zeros((), contrib.dtype), pads)
    return [operand + contrib.astype(operand.dtype)]


# ----------------------------------------------------------------------------
# 4, 5. max-pooling and its gradient, as strided slices (no MaxPool, no scatter)


def _window_offsets(window: Sequence[int]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(w) for w in window))


def _lowest(dtype: Any) -> Any:
    return -np.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _trivial(w: int, s: int) -> bool:
    return w == 1 and s == 1


def _candidates(x: Any, window: Sequence[int], strides: Sequence[int],
                out_shape: Sequence[Any]) -> list[Any]:
    """For each offset in the window (row-major order), the strided slice of `x` holding
    that window element of every output position (axes with a window and stride of 1,
    such as the batch axis, are left whole)."""
    out = []
    for offset in _window_offsets(window):
        c = x
        for d, (o, w, s, n) in enumerate(zip(offset, window, strides, out_shape)):
            if not _trivial(w, s):
                c = lax.slice_in_dim(c, o, o + s * (n - 1) + 1, s, axis=d)
        out.append(c)
    return out


def _padded(x: Any, padding: Sequence[tuple[int, int]], value: Any) -> Any:
    for axis, (low, high) in enumerate(padding):
        x = _edge_pad(x, axis, low, high, value)
    return x


def _dilate(x: Any, axis: int, stride: int) -> Any:
    """`stride - 1` zeros between neighbours along `axis` (lax.pad's interior padding,
    which ONNX's Pad lacks), as a stack with zeros and a reshape."""
    if stride == 1:
        return x
    n = x.shape[axis]
    zeros = jnp.zeros_like(x)
    stacked = jnp.stack([x, *[zeros] * (stride - 1)], axis=axis + 1)
    merged = stacked.reshape((*x.shape[:axis], n * stride, *x.shape[axis + 1 :]))
    return lax.slice_in_dim(merged, 0, n * stride - (stride - 1), axis=axis)


def _edge_pad(x: Any, axis: int, low: int, high: int, value: Any = 0) -> Any:
    """`x` with `low` and `high` entries of `value` around `axis` (a concatenation: the
    converter's Pad needs every dimension known, and the batch's is not)."""
    if not (low or high):
        return x
    n = x.shape[axis]
    filled = jnp.full_like(x, value)
    copies = -(-max(low, high) // n)  # enough copies of a slab of n for the widest side
    slab = filled if copies == 1 else jnp.concatenate([filled] * copies, axis=axis)
    parts = [lax.slice_in_dim(slab, 0, low, axis=axis)] if low else []
    parts.append(x)
    if high:
        parts.append(lax.slice_in_dim(slab, 0, high, axis=axis))
    return jnp.concatenate(parts, axis=axis)


def _window_refuse(eqn: Any) -> str | None:
    p = eqn.params
    for key in ("base_dilation", "window_dilation"):
        if any(d != 1 for d in p.get(key, ())):
            return f"a pooling window with {key} other than 1"
    if any(not isinstance(d, int) for d in eqn.outvars[0].aval.shape[1:]):
        return "a pooling window over an axis of unknown size (other than the batch axis)"
    return None


def _pool_out_shape(eqn: Any, x: Any) -> list[Any]:
    return [x.shape[0], *eqn.outvars[0].aval.shape[1:]]


@_rule("reduce_window_max", "a max-pool becomes a 4-D MaxPool that onnxruntime refuses "
       "('Unsupported pooling size')", refuse=_window_refuse)
def _reduce_window_max(eqn: Any, x: Any) -> list[Any]:
    p = eqn.params
    xp = _padded(x, p["padding"], _lowest(x.dtype))
    cands = _candidates(xp, p["window_dimensions"], p["window_strides"], _pool_out_shape(eqn, x))
    out = cands[0]
    for c in cands[1:]:
        out = lax.max(out, c)
    return [out]


def _select_refuse(eqn: Any) -> str | None:
    if eqn.params["select_prim"] is not lax.ge_p:
        return f"select_and_scatter_add selecting with {eqn.params['select_prim']} (only max-pool's ge)"
    if any(not isinstance(d, int) for d in eqn.invars[1].aval.shape[1:]):
        return "a pooling window over an axis of unknown size (other than the batch axis)"
    return None


@_rule("select_and_scatter_add", "the max-pool gradient has no converter in jax2onnx",
       refuse=_select_refuse)
def _select_and_scatter_add(eqn: Any, source: Any, operand: Any) -> list[Any]:
    """Each output's cotangent goes to the first maximum of its window (XLA's rule for
    `ge`), found among the window's strided slices; each slice's share is put back in
    place with an interior-padded `pad` and the shares are summed."""
    p = eqn.params
    window, strides, padding = p["window_dimensions"], p["window_strides"], p["padding"]
    xp = _padded(operand, padding, _lowest(operand.dtype))
    out_shape = [source.shape[0], *source.shape[1:]]
    cands = _candidates(xp, window, strides, out_shape)
    best = cands[0]
    for c in cands[1:]:
        best = lax.max(best, c)
    taken = jnp.zeros(source.shape, jnp.bool_)
    total = None
    zero = jnp.zeros((), source.dtype)
    for offset, c in zip(_window_offsets(window), cands):
        take = jnp.logical_and(c == best, jnp.logical_not(taken))
        taken = jnp.logical_or(taken, take)
        share = jnp.where(take, source, zero)
        placed = share
        for d, (o, w, s) in enumerate(zip(offset, window, strides)):
            if not _trivial(w, s):
                n = share.shape[d]
                placed = _edge_pad(_dilate(placed, d, s), d, o, xp.shape[d] - (o + s * (n - 1) + 1))
        total = placed if total is None else total + placed
    assert total is not None
    for axis, (low, high) in enumerate(padding):
        if low or high:
            total = lax.slice_in_dim(total, low, low + operand.shape[axis], axis=axis)
    return [total]


# ----------------------------------------------------------------------------
# Applying and checking the rules


def _body(eqn: Any) -> tuple[Any, Sequence[Any]]:
    try:
        return jax_rewrite.body(eqn)
    except TypeError as e:
        raise UnsupportedPrimitive(eqn.primitive.name, str(e)) from None


def _browser_eqn(eqn: Any, invals: list[Any]) -> list[Any] | None:
    name = eqn.primitive.name
    rule = RULES.get(name)
    if rule is None or not rule.needed(eqn):
        return None
    reason = rule.refuse(eqn)
    if reason is not None:
        raise UnsupportedPrimitive(name, f"Cannot export {name} for browsers: {reason}.")
    return rule.apply(eqn, *invals)


def evaluate(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluates `jaxpr` on `args` (tracers or arrays), rewriting with `RULES`."""
    return jax_rewrite.evaluate(jaxpr, consts, args, _browser_eqn)


def rewrite(fn: Callable[..., Sequence[Any]]) -> Callable[..., list[Any]]:
    """`fn` (flat arrays in, a list of arrays out) with the rules applied when traced."""
    return jax_rewrite.rewrite(fn, _browser_eqn)


def rules_used(jaxpr: Any) -> set[str]:
    """The primitives of `jaxpr` (and the calls it inlines) that a rule rewrites."""
    used: set[str] = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in INLINED:
            used |= rules_used(_body(eqn)[0])
        elif name in RULES and RULES[name].needed(eqn):
            used.add(name)
    return used


def check(jaxpr: Any, supported: Collection[str], where: str = "") -> None:
    """Refuses the first primitive of `jaxpr` that cannot be exported.

    A primitive passes when a rule rewrites it (and accepts this use of it) or when the
    converter has a rule for it (`supported`) and no rule needs to rewrite it. Bodies of
    control flow (`cond`, `while`, `scan`) are converted by jax2onnx as they are, so a
    primitive inside them that needs a rule is refused.

    Raises:
      UnsupportedPrimitive: naming the primitive and why.
    """
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        rule = RULES.get(name)
        if name in INLINED:
            check(_body(eqn)[0], supported, where)
            continue
        if rule is not None and rule.needed(eqn):
            if where:
                raise UnsupportedPrimitive(
                    name,
                    f"Cannot export {name} inside {where} for browsers: fedlang rewrites it "
                    f"({rule.gap}) only outside control flow. Move it out of the loop or "
                    "branch.",
                )
            reason = rule.refuse(eqn)
            if reason is not None:
                raise UnsupportedPrimitive(name, f"Cannot export {name} for browsers: {reason}.")
            continue
        if name not in supported:
            raise UnsupportedPrimitive(
                name,
                f"Cannot export the JAX primitive {name!r} for browsers: neither jax2onnx nor "
                "fedlang has an ONNX conversion rule for it. Express that step with other "
                "operations, or train these clients with the Python client.",
            )
        for sub in _sub_jaxprs(eqn):
            check(sub, supported, where or f"lax.{name}")


def _sub_jaxprs(eqn: Any) -> Iterator[Any]:
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jcore.Jaxpr):
                yield item
