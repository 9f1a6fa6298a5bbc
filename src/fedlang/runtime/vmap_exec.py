"""The vectorized strategy: clients' reduces run together under one `jax.vmap`.

Clients of a chunk whose batches have the same shape are grouped (sorted by their
number of batches, so padding waste stays small), their batches stacked into
`[clients, batches, batch, ...]`, and one program runs `prologue`, a `lax.scan` of the
vmapped step, and `epilogue` for the whole group. The number of batches is rounded up
to a power of two so a run compiles a handful of programs; padded batches are skipped
exactly (`jnp.where` keeps the old state). For a masked reduce
(`dataset.reduce(..., masked=True)`) a client's smaller last batch is padded with
masked-out examples and joins the scan; otherwise such batches run afterwards, one
jitted step at a time.

Broadcast arguments (the model) are not copied per client: their vmap axis is None.
This pays off on accelerators and with many small clients; on CPUs the per-client
strategies usually win, which is why `auto` measures before choosing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedlang.core import jax_computation as jax_backend
from fedlang.core import structure
from fedlang.runtime import chunks


def _arg_leaves_with_axes(comp: Any, cv: Any) -> tuple[list[Any], list[int | None]]:
    """Flat non-dataset argument leaves of a chunk, with vmap axes (None: shared)."""
    if len(comp.param_types) == 1:
        parts = [cv]
    elif isinstance(cv, chunks.Rep):
        parts = [chunks.Rep(v) for v in cv.value]
    else:
        parts = list(cv)
    leaves: list[Any] = []
    axes: list[int | None] = []
    for i, (part, t) in enumerate(zip(parts, comp.param_types)):
        if i != comp.seq_index:
            lv, ax = chunks.leaves_with_axes(part, t)
            leaves += lv
            axes += ax
    return leaves, axes


def _client_batches(comp: Any, cv: Any, c: int) -> list[list[list[Any]]]:
    param_t = comp.type_signature.parameter
    element_t = comp.element_type
    out = []
    for i in range(c):
        stream = comp.split_arg(chunks.row(cv, param_t, i))[comp.seq_index]
        out.append(
            [
                [
                    *structure.flatten(b, element_t),
                    jax_backend.full_mask(structure.flatten(b, element_t)),
                ]
                for b in stream
            ]
        )
    return out


def _split_body(
    comp: Any, batches: list[list[Any]], pad_to: Any
) -> tuple[list[list[Any]], list[list[Any]]]:
    """The leading run of equal-shape batches (tails padded when masked), and the rest."""
    if not batches:
        return [], []
    shapes = [np.shape(x) for x in batches[0]]
    body: list[list[Any]] = []
    for k, b in enumerate(batches):
        if [np.shape(x) for x in b] != shapes and comp.masked:
            b = pad_to(b, batches[0])
        if [np.shape(x) for x in b] != shapes:
            return body, batches[k:]
        body.append(b)
    return body, []


def map_vmapped(comp: Any, cv: Any, c: int, width: int, pad_to: Any) -> Any:
    """Runs `comp` (which reduces a dataset) for `c` clients with vmapped groups."""
    result_t = comp.type_signature.result
    arg_leaves, arg_axes = _arg_leaves_with_axes(comp, cv)
    bodies, rests = [], []
    for batches in _client_batches(comp, cv, c):
        body, rest = _split_body(comp, batches, pad_to)
        bodies.append(body)
        rests.append(rest)
    # Group clients by batch shape, then by number of batches, `width` at a time.
    order = sorted(range(c), key=lambda i: (_signature(bodies[i]), len(bodies[i])))
    results: list[Any] = [None] * c
    start = 0
    while start < c:
        sig = _signature(bodies[order[start]])
        group = [order[start]]
        while (
            start + len(group) < c
            and len(group) < width
            and _signature(bodies[order[start + len(group)]]) == sig
        ):
            group.append(order[start + len(group)])
        start += len(group)
        states = _run_group(comp, arg_leaves, arg_axes, [bodies[i] for i in group], group)
        for k, i in enumerate(group):
            client_args = [x if a is None else x[i] for x, a in zip(arg_leaves, arg_axes)]
            state = states[k]
            for b in rests[i]:
                state = list(comp._run("step", client_args + state + b))
            out = comp._run("epilogue", client_args + state)
            results[i] = structure.unflatten([np.asarray(x) for x in out], result_t)
    return chunks.stack(results, result_t)


def _signature(body: list[list[Any]]) -> tuple:
    return tuple(np.shape(x) for x in body[0]) if body else ()


def _run_group(
    comp: Any,
    arg_leaves: list[Any],
    arg_axes: list[int | None],
    bodies: list[list[list[Any]]],
    group: list[int],
) -> list[list[Any]]:
    """Each group client's state leaves after the prologue and the scan of its batches."""
    w = len(group)
    longest = max(len(b) for b in bodies)
    # Groups are padded to a power-of-two number of clients (rows with no valid batch),
    # like the number of batches, so a run compiles a handful of programs.
    width = 1 << (w - 1).bit_length()
    if longest == 0:  # clients without data: just their initial states
        return [
            list(
                comp._run(
                    "prologue", [x if a is None else x[i] for x, a in zip(arg_leaves, arg_axes)]
                )
            )
            for i in group
        ]
    length = 1 << (longest - 1).bit_length()
    rows = group + [group[0]] * (width - w)
    group_args = [x if a is None else np.asarray(x)[rows] for x, a in zip(arg_leaves, arg_axes)]
    n_args = len(group_args)
    n_leaves = len(bodies[0][0])
    stacked = []
    for j in range(n_leaves):
        shape = np.shape(bodies[0][0][j])
        dtype = np.asarray(bodies[0][0][j]).dtype
        buf = np.zeros((width, length, *shape), dtype)
        for k, body in enumerate(bodies):
            if body:
                buf[k, : len(body)] = np.stack([b[j] for b in body])
        stacked.append(buf)
    valid = np.zeros((width, length), bool)
    for k, body in enumerate(bodies):
        valid[k, : len(body)] = True
    key = ("vmap-scan", tuple(arg_axes))
    prog = comp.program(key, lambda: jax.jit(_group_program(comp, arg_axes, n_args, n_leaves)))
    final = [np.asarray(x) for x in prog(*group_args, *stacked, valid)]
    return [[x[k] for x in final] for k in range(w)]


def _group_program(comp: Any, arg_axes: list[int | None], n_args: int, n_leaves: int) -> Any:
    prologue, step = comp.trace_fn("prologue"), comp.trace_fn("step")

    def one_client(*flat: Any) -> list[Any]:
        args, batches, valid = flat[:n_args], flat[n_args : n_args + n_leaves], flat[-1]
        state = list(prologue(*args))

        def body(carry: Any, xs: Any) -> tuple[Any, None]:
            b, v = xs
            new = step(*args, *carry, *b)
            return [jnp.where(v, n, o) for n, o in zip(new, carry)], None

        final, _ = lax.scan(body, state, (list(batches), valid))
        return final

    in_axes = (*arg_axes, *([0] * n_leaves), 0)
    return jax.vmap(one_client, in_axes=in_axes)
