"""Runtimes that execute computations.

`reference_context()` is the interpreter every other runtime is checked against;
`simulation_context()` the fast, memory-bounded one (the default); `ray_context()`
the simulation runtime with each wave's clients on Ray actors (the `ray` extra). Each is a strategy
table over the intrinsic registry (see docs/architecture.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fedlang.core import context as _context
from fedlang.runtime.ray_runtime import RayContext as RayContext
from fedlang.runtime.ray_runtime import ray_context as ray_context
from fedlang.runtime.reference import ReferenceContext as ReferenceContext
from fedlang.runtime.simulation import Options as Options
from fedlang.runtime.simulation import SimulationContext as SimulationContext


@contextlib.contextmanager
def reference_context(num_clients: int | None = None) -> Iterator[ReferenceContext]:
    """Runs computations called in the body on the reference runtime."""
    with _context.with_context(ReferenceContext(num_clients)) as ctx:
        yield ctx  # type: ignore[misc]


@contextlib.contextmanager
def simulation_context(
    chunk_size: int | None = None,
    memory_budget: int = 512 << 20,
    strategy: str = "auto",
    num_clients: int | None = None,
    prefetch: bool = True,
    vmap_width: int | None = None,
    auto_budget_s: float = 1.0,
    decision_cache: bool | str = True,
    progress: bool | None = None,
    client_threads: int | None = None,
) -> Iterator[SimulationContext]:
    """Runs computations called in the body on the simulation runtime.

    Args:
      chunk_size: clients evaluated together; memory grows with it, not with the cohort.
      memory_budget: bytes of client data staged per chunk; larger clients stream.
      strategy: 'auto', 'loop', 'scan' or 'vmap' (how client datasets are reduced).
      num_clients: the cohort size when no CLIENTS-placed argument says.
      prefetch: stage the next chunk's data on a background thread.
      vmap_width: clients vectorized together by the 'vmap' strategy (None: as many
        as fit the chunk and the device's memory).
      auto_budget_s: seconds 'auto' may spend timing candidates per decision.
      decision_cache: where 'auto' remembers its decisions across runs (True: the
        default file, a path, or False).
      progress: say on stderr when 'auto' measures (None: when stderr is a terminal).
      client_threads: clients run at once on one CPU device (None: one per core when
        the step has a convolution, which XLA:CPU runs on one thread; else 1).

    Example:
      >>> import numpy as np, fedlang as fl
      >>> @fl.federated_computation(fl.type_at_clients(np.float32))
      ... def mean(x):
      ...   return fl.federated_mean(x)
      >>> with fl.runtime.simulation_context(chunk_size=2):
      ...   print(mean([1.0, 2.0, 3.0]))
      2.0
    """
    ctx = SimulationContext(
        Options(
            chunk_size,
            memory_budget,
            strategy,
            num_clients,
            prefetch,
            vmap_width,
            auto_budget_s,
            decision_cache,
            progress,
            client_threads,
        )
    )
    with ctx, _context.with_context(ctx):
        yield ctx


def set_default_context(ctx: _context.Context | None) -> None:
    """Makes `ctx` the runtime for computations called outside any `with` block."""
    _context.set_default_context(ctx)


def get_default_context() -> _context.Context | None:
    """The runtime computations run on outside any `with` block."""
    return _context.get_default_context()
