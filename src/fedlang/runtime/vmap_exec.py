"""The vectorized strategy: clients' reduces run together under one `jax.vmap`.

Clients of a chunk whose batches have the same shape are grouped (sorted by their
number of batches, so padding waste stays small), their batches stacked into
`[clients, batches, batch, ...]`, and one program runs `prologue`, a `lax.scan` of the
vmapped step and `epilogue` for the whole group. The number of batches and of clients
of a group are rounded up to powers of two so a run compiles a handful of programs;
padded batches are skipped exactly (`jnp.where` keeps the old state). For a masked
reduce (`dataset.reduce(..., masked=True)`) smaller batches are padded with
masked-out examples and join the scan; otherwise such batches run afterwards, one
jitted step at a time (the slow path).

Data movement is per group and per chunk, never per client: the chunk's shared
arguments (the model) go to the device once, each group's batches, per-client
arguments and validity mask in one `jax.device_put` (while the previous group
computes: dispatch is asynchronous), and all the groups' results come back in one
`jax.device_get` at the end of the chunk. A group's staged bytes are bounded by
`group_bytes` (a fraction of the device's memory on accelerators).

This pays off on accelerators and with many small clients; on CPUs the per-client
strategies usually win, which is why `auto` measures before choosing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedlang.core import local, structure
from fedlang.runtime import chunks, counters

#: Bounds a client's batch shapes: `LocalRunner.pad_batches` for one computation.
Pad = Callable[[Iterable[chunks.Batch]], Iterator[chunks.Batch]]


def _arg_leaves_with_axes(
    comp: local.LocalProgram, cv: chunks.ChunkValue
) -> tuple[chunks.Leaves, list[int | None]]:
    """Flat non-dataset argument leaves of a chunk, with vmap axes (None: shared)."""
    if len(comp.param_types) == 1:
        parts = [cv]
    elif isinstance(cv, chunks.Rep):
        parts = [chunks.Rep(v) for v in cv.value]
    else:
        parts = list(cv)
    leaves: chunks.Leaves = []
    axes: list[int | None] = []
    for i, (part, t) in enumerate(zip(parts, comp.param_types)):
        if i != comp.seq_index:
            lv, ax = chunks.leaves_with_axes(part, t)
            leaves += lv
            axes += ax
    return leaves, axes


def _client_batches(
    comp: local.LocalProgram,
    cv: chunks.ChunkValue,
    c: int,
    pad: Pad,
    streams: list[chunks.Stream] | None,
) -> list[list[chunks.Batch]]:
    param_t, seq_index = local.parameter_type(comp), local.dataset_index(comp)
    flat = structure.flattener(local.element_type(comp))
    out = []
    for i in range(c):
        stream = (
            comp.split_arg(chunks.row(cv, param_t, i))[seq_index] if streams is None else streams[i]
        )
        out.append(list(pad(local.with_mask(flat(b)) for b in stream)))
    return out


def _split_body(
    comp: local.LocalProgram,
    batches: list[chunks.Batch],
    pad_to: Callable[[chunks.Batch, chunks.Batch], chunks.Batch],
) -> tuple[list[chunks.Batch], list[chunks.Batch]]:
    """The leading run of equal-shape batches (tails padded when masked), and the rest."""
    if not batches:
        return [], []
    shapes = [np.shape(x) for x in batches[0]]
    body: list[chunks.Batch] = []
    for k, b in enumerate(batches):
        if [np.shape(x) for x in b] != shapes and comp.masked:
            b = pad_to(b, batches[0])
        if [np.shape(x) for x in b] != shapes:
            return body, batches[k:]
        body.append(b)
    return body, []


MIN_LENGTH = 8  # the fewest batches a group is padded to


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def padded_length(batches: int) -> int:
    """The padded number of batches of a group whose longest client has `batches`."""
    return max(MIN_LENGTH, pow2(batches))


def padded_steps(lengths: list[int], width: int) -> int:
    """The steps vectorized groups of at most `width` clients compute (padding
    included) for clients with these numbers of batches."""
    ordered = sorted(lengths)
    rows = pow2(min(width, len(ordered)))
    return sum(
        rows * padded_length(max(ordered[k : k + width])) for k in range(0, len(ordered), width)
    )


def map_vmapped(
    comp: local.LocalProgram,
    cv: chunks.ChunkValue,
    c: int,
    width: int,
    group_bytes: int,
    pad: Pad,
    streams: list[chunks.Stream] | None = None,
    rows: int | None = None,
) -> chunks.ChunkValue:
    """Runs `comp` (which reduces a dataset) for `c` clients with vmapped groups of at
    most `width` clients and `group_bytes` of staged batches; `pad` bounds the batch
    shapes (see `LocalRunner.pad_batches`), `streams` replaces the clients' datasets,
    `rows` sets the groups' padded number of rows (to measure a group of another chunk)."""
    result_t = comp.type_signature.result
    arg_leaves, arg_axes = _arg_leaves_with_axes(comp, cv)
    shared = [x for x, a in zip(arg_leaves, arg_axes) if a is None]
    shared = list(jax.device_put(shared))  # the model: once per chunk
    counters.add(host_to_device=1)
    bodies, rests = [], []
    for batches in _client_batches(comp, cv, c, pad, streams):
        body, rest = _split_body(comp, batches, local.pad_batch)
        bodies.append(body)
        rests.append(rest)
    # Group clients by batch shape, then by number of batches. Every group has `rows`
    # rows (a power of two, padded with empty rows) and a power-of-two number of batches
    # of at least MIN_LENGTH: a run compiles one program per length bucket.
    order = sorted(range(c), key=lambda i: (_signature(bodies[i]), len(bodies[i])))
    step_bytes = max((sum(np.asarray(x).nbytes for x in b[0]) for b in bodies if b), default=0)
    longest = max((len(b) for b in bodies), default=0)
    fit = max(1, group_bytes // max(1, padded_length(longest) * step_bytes))
    cap = min(width, c, fit)
    if rows is None:
        rows = pow2(cap)
        if rows > fit:
            rows //= 2
            cap = rows
    pending: list[tuple[list[int], chunks.Leaves, bool]] = []
    start = 0
    while start < c:
        sig = _signature(bodies[order[start]])
        group = [order[start]]
        while (
            start + len(group) < c
            and len(group) < cap
            and _signature(bodies[order[start + len(group)]]) == sig
        ):
            group.append(order[start + len(group)])
        start += len(group)
        fused = not any(rests[i] for i in group)
        out = _run_group(
            comp, arg_leaves, arg_axes, shared, [bodies[i] for i in group], group, fused, rows
        )
        pending.append((group, out, fused))
    fetched = jax.device_get([out for _, out, _ in pending])  # one wait for the chunk
    counters.add(device_to_host=1)
    results: list[Any] = [None] * c
    for (group, _, fused), final in zip(pending, fetched):
        for k, i in enumerate(group):
            leaves = [x[k] for x in final]
            if not fused:  # the slow path: an unmasked reduce with batches of other shapes
                client_args = [x if a is None else x[i] for x, a in zip(arg_leaves, arg_axes)]
                for b in rests[i]:
                    leaves = list(comp.run("step", client_args + leaves + b))
                leaves = [np.asarray(x) for x in comp.run("epilogue", client_args + leaves)]
            results[i] = structure.unflatten(leaves, result_t)
    return chunks.stack(results, result_t)


def _signature(body: list[chunks.Batch]) -> tuple:
    return tuple(np.shape(x) for x in body[0]) if body else ()


def _run_group(
    comp: local.LocalProgram,
    arg_leaves: chunks.Leaves,
    arg_axes: list[int | None],
    shared: chunks.Leaves,
    bodies: list[list[chunks.Batch]],
    group: list[int],
    fused: bool,
    rows_total: int,
) -> chunks.Leaves:
    """Device arrays `[rows, ...]`: the group's results (`fused`) or states after the
    prologue and the scan of its batches; row k is client `group[k]`."""
    w = len(group)
    longest = max(len(b) for b in bodies)
    if longest == 0:  # clients without data: their initial states (or results)
        outs = []
        for i in group:
            args = [x if a is None else x[i] for x, a in zip(arg_leaves, arg_axes)]
            state = list(comp.run("prologue", args))
            outs.append(list(comp.run("epilogue", args + state)) if fused else state)
        return [jnp.stack([o[j] for o in outs]) for j in range(len(outs[0]))]
    # Rows and batches are padded (rows with no valid batch), so a run compiles a
    # handful of programs.
    width, length = rows_total, padded_length(longest)
    rows = np.asarray(group + [group[0]] * (width - w))
    per_client = [np.asarray(x)[rows] for x, a in zip(arg_leaves, arg_axes) if a is not None]
    stacked = []
    for j, leaf in enumerate(bodies[0][0]):
        leaf = np.asarray(leaf)
        buf = chunks.aligned_zeros((width, length, *leaf.shape), leaf.dtype)
        for k, body in enumerate(bodies):
            for t, b in enumerate(body):
                buf[k, t] = b[j]
        stacked.append(buf)
    valid = np.zeros((width, length), bool)
    for k, body in enumerate(bodies):
        valid[k, : len(body)] = True
    staged = jax.device_put([*per_client, *stacked, valid])  # one transfer per group
    counters.add(host_to_device=1)
    per_client_dev, batches_dev, valid_dev = (
        staged[: len(per_client)],
        staged[len(per_client) : -1],
        staged[-1],
    )
    shared_it, client_it = iter(shared), iter(per_client_dev)
    group_args = [next(shared_it) if a is None else next(client_it) for a in arg_axes]
    key = ("vmap-scan", tuple(arg_axes), fused)
    prog = comp.program(
        key, lambda: jax.jit(_group_program(comp, arg_axes, len(group_args), len(stacked), fused))
    )
    return list(prog(*group_args, *batches_dev, valid_dev))


def _group_program(
    comp: local.LocalProgram, arg_axes: list[int | None], n_args: int, n_leaves: int, fused: bool
) -> Callable[..., chunks.Leaves]:
    prologue, step, epilogue = (comp.tuned_part(p) for p in ("prologue", "step", "epilogue"))

    def one_client(*flat: chunks.Leaf) -> chunks.Leaves:
        args, batches, valid = flat[:n_args], flat[n_args : n_args + n_leaves], flat[-1]
        state = list(prologue(*args))

        def body(
            carry: chunks.Leaves, xs: tuple[chunks.Batch, jax.Array]
        ) -> tuple[chunks.Leaves, None]:
            b, v = xs
            new = step(*args, *carry, *b)
            return [jnp.where(v, n, o) for n, o in zip(new, carry)], None

        final, _ = lax.scan(body, state, (list(batches), valid))
        return list(epilogue(*args, *final)) if fused else final

    in_axes = (*arg_axes, *([0] * n_leaves), 0)
    return jax.vmap(one_client, in_axes=in_axes)
