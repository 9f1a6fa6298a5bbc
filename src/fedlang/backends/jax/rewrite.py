"""Rewriting a traced JAX function primitive by primitive, and the CPU speed rules.

`evaluate(jaxpr, consts, args, rewrite_eqn)` re-binds a jaxpr's equations one by one
(on tracers, so it runs while an outer function is traced), giving `rewrite_eqn` the
chance to replace an equation by other JAX operations; calls (`jit`, `custom_jvp_call`,
...) are inlined so rewrites apply inside them. Programs built this way are
forward-only: they are compiled and run, never differentiated again (the gradient a
step takes is already in its jaxpr), so inlining custom-derivative calls loses nothing.
The browser export (`deploy/browser/rules.py`) rewrites what jax2onnx cannot convert
with it; `tuned(fn)` below rewrites what XLA:CPU runs slowly.

The CPU rules (`CPU_RULES`), each with exactly the primitive's semantics:

* `select_and_scatter_add`, the gradient of a max-pool (or min-pool) with windows that
  do not overlap (window = stride, no padding): XLA:CPU runs it as a scatter (2.1 ms
  against 1.1 ms by reshape for the FedAvg paper's CNN on batches of 20). As a reshape
  into windows, a comparison with each window's maximum and a first-occurrence mask
  (XLA's rule: the first maximum in row-major window order takes the cotangent) the
  CNN's step gradient takes 10.9 ms instead of 12.9 ms (`bench/cnn_cpu.py --parts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

# Call-like primitives whose body runs once with the same arguments: inlined.
INLINED = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
     "custom_vjp_call_jaxpr", "remat", "checkpoint"}
)
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")

# `rewrite_eqn(eqn, invals) -> outputs`, or None to bind the equation as it is.
EqnRewrite = Callable[[Any, list[Any]], "list[Any] | None"]


def body(eqn: Any) -> tuple[Any, Sequence[Any]]:
    """The jaxpr and constants of an inlined call."""
    for key in _BODY_PARAMS:
        found = eqn.params.get(key)
        if found is not None:
            if isinstance(found, jcore.ClosedJaxpr):
                return found.jaxpr, found.consts
            return found, ()
    raise TypeError(f"Expected a body in the call {eqn.primitive.name}, found none.")


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], rewrite_eqn: EqnRewrite) -> list[Any]:
    """Evaluates `jaxpr` on `args` (tracers or arrays), rewriting with `rewrite_eqn`."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs: list[Any] | None
        if eqn.primitive.name in INLINED:
            jaxpr_, consts_ = body(eqn)
            outs = evaluate(jaxpr_, consts_, invals, rewrite_eqn)
        else:
            outs = rewrite_eqn(eqn, invals)
        if outs is None:
            with eqn.ctx.manager:
                result = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outs = result if eqn.primitive.multiple_results else [result]
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def rewrite(fn: Callable[..., Sequence[Any]], rewrite_eqn: EqnRewrite) -> Callable[..., list[Any]]:
    """`fn` (flat arrays in, a list of arrays out) with `rewrite_eqn` applied when traced."""

    def rewritten(*args: Any) -> list[Any]:
        closed = jax.make_jaxpr(lambda *xs: list(fn(*xs)))(*args)
        return evaluate(closed.jaxpr, closed.consts, args, rewrite_eqn)

    return rewritten


def uses(jaxpr: Any, wanted: Callable[[Any], bool]) -> bool:
    """Whether an equation of `jaxpr` (or of a call it inlines) is `wanted`."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in INLINED:
            if uses(body(eqn)[0], wanted):
                return True
        elif wanted(eqn):
            return True
    return False


# ----------------------------------------------------------------------------
# The CPU rules


def _non_overlapping_pool_grad(eqn: Any) -> bool:
    p = eqn.params
    if eqn.primitive.name != "select_and_scatter_add" or p["select_prim"] not in (lax.ge_p, lax.le_p):
        return False
    source, operand = (v.aval for v in eqn.invars)
    shapes = (*source.shape, *operand.shape)
    return (
        all(isinstance(d, int) for d in shapes)
        and tuple(p["window_dimensions"]) == tuple(p["window_strides"])
        and all(lo == 0 and hi == 0 for lo, hi in p["padding"])
        and all(n * w <= m for n, w, m in zip(source.shape, p["window_dimensions"], operand.shape))
    )


def _pool_grad(eqn: Any, source: Any, operand: Any) -> list[Any]:
    """`select_and_scatter_add` for windows that tile the operand: each window's
    cotangent goes to its first maximum (minimum for `le`) in row-major window order;
    elements no window covers (a remainder VALID pooling drops) get zero."""
    window = tuple(eqn.params["window_dimensions"])
    pick_max = eqn.params["select_prim"] is lax.ge_p
    x = operand
    for d, (n, w) in enumerate(zip(source.shape, window)):
        if x.shape[d] != n * w:
            x = lax.slice_in_dim(x, 0, n * w, axis=d)
    nd = operand.ndim
    tiled = x.reshape([s for n, w in zip(source.shape, window) for s in (n, w)])
    # Window axes last, flattened in row-major window order: [*source.shape, prod(window)].
    order = [2 * d for d in range(nd)] + [2 * d + 1 for d in range(nd)]
    flat = tiled.transpose(order).reshape(*source.shape, -1)
    best = jnp.max(flat, axis=-1, keepdims=True) if pick_max else jnp.min(flat, axis=-1, keepdims=True)
    hit = flat == best
    first = jnp.logical_and(hit, jnp.cumsum(hit, axis=-1, dtype=jnp.int32) == 1)
    share = jnp.where(first, source[..., None], jnp.zeros((), source.dtype))
    placed = share.reshape(*source.shape, *window).transpose(np.argsort(order).tolist())
    placed = placed.reshape([n * w for n, w in zip(source.shape, window)])
    pads = [(0, m - s, 0) for m, s in zip(operand.shape, placed.shape)]
    if any(hi for _, hi, _ in pads):
        placed = lax.pad(placed, jnp.zeros((), placed.dtype), pads)
    return [placed]


CPU_RULES: dict[str, tuple[Callable[[Any], bool], Callable[..., list[Any]]]] = {
    "select_and_scatter_add": (_non_overlapping_pool_grad, _pool_grad),
}


def _cpu_eqn(eqn: Any, invals: list[Any]) -> list[Any] | None:
    rule = CPU_RULES.get(eqn.primitive.name)
    if rule is None or not rule[0](eqn):
        return None
    return rule[1](eqn, *invals)


def _cpu_wanted(eqn: Any) -> bool:
    rule = CPU_RULES.get(eqn.primitive.name)
    return rule is not None and rule[0](eqn)


def tuned(fn: Callable[..., Sequence[Any]]) -> Callable[..., list[Any]]:
    """`fn` as the runtimes compile it: on a CPU backend with `CPU_RULES` applied where
    they match (same results, faster programs); elsewhere, and where nothing matches,
    `fn`'s own trace, bound as it is."""

    def tuned_fn(*args: Any) -> list[Any]:
        closed = jax.make_jaxpr(lambda *xs: list(fn(*xs)))(*args)
        if jax.default_backend() == "cpu" and uses(closed.jaxpr, _cpu_wanted):
            return evaluate(closed.jaxpr, closed.consts, args, _cpu_eqn)
        return list(jcore.jaxpr_as_fun(closed)(*args))

    return tuned_fn
