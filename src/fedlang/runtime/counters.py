"""What a run costs beyond its arithmetic: compilations, transfers and host waits.

The simulation runtime reports these per invocation (`SimulationContext.last_run`):
a round that compiles after the first round or two means some shape keeps changing
(a new client length, a new tail batch size), and transfers or host waits that grow
with the number of clients instead of the number of chunks mean a device idles.

Compilations are counted from JAX's own monitoring events (every XLA compilation in
the process, whichever thread started it); transfers and host waits are counted where
the runtime makes them explicitly.
"""

from __future__ import annotations

import dataclasses
import threading

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class Counts:
    """Counters of one invocation (or of the process, for `compilations`)."""

    compilations: int = 0
    host_to_device: int = 0  # explicit `jax.device_put` calls (each may move many arrays)
    device_to_host: int = 0  # explicit waits for device results (`jax.device_get`)

    def minus(self, other: Counts) -> Counts:
        return Counts(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


_lock = threading.Lock()
_totals = Counts()
_listening = False


def _on_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event == _COMPILE_EVENT:
        with _lock:
            _totals.compilations += 1


def start() -> None:
    """Starts counting compilations (idempotent; JAX is imported here, not before)."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_event)


def snapshot() -> Counts:
    """The process's totals so far."""
    with _lock:
        return dataclasses.replace(_totals)


def add(host_to_device: int = 0, device_to_host: int = 0) -> None:
    """Records explicit transfers made by the runtime."""
    with _lock:
        _totals.host_to_device += host_to_device
        _totals.device_to_host += device_to_host
