"""A virtual clock for simulating when clients finish: time distributions and events.

How long a client takes to train and report is drawn, not measured: simulations of
asynchronous and synchronous training (`fedlang.simulation.async_sim`) compare
algorithms in *virtual* time, whatever the machine running them.

* Distributions of seconds: `Constant`, `LogNormal` (the usual model of device
  compute times), `Pareto` (heavy tailed), `Stragglers` (a fraction of participations
  slowed down by a factor).
* `ClientTimes`: one participation lasts `compute * speed(client) + network`, where
  `speed` is a per-client factor drawn once (slow and fast devices) and `compute`,
  `network` are drawn anew for each participation.
* `AvailabilityWindows`: the existing availability models of `sampling`
  (`BernoulliAvailability`, `PeriodicAvailability`) over windows of virtual time.
* `EventQueue`: events ordered by (time, insertion order), popped a timestamp at a time.

All draws are counter based (`rng(seed, stream, counter)`), so a seed reproduces a
run bit for bit, whatever order the simulator happens to ask in.

Example:
  >>> times = ClientTimes(compute=LogNormal(median=10.0, sigma=0.5))
  >>> d = times.durations(seed=0, counter=0, clients=[3, 7], num_clients=10)
  >>> d.shape, bool((d > 0).all())
  ((2,), True)
  >>> bool((times.durations(0, 0, [3, 7], 10) == d).all())
  True
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from fedlang.simulation import sampling

# Streams of the counter-based generator: each kind of draw has its own.
STREAM_TIMES = 1
STREAM_SPEED = 2
STREAM_AVAILABILITY = 3
STREAM_PHASES = 4
STREAM_SELECT = 5


def rng(seed: int, stream: int, counter: int = 0) -> np.random.Generator:
    """The generator of draw number `counter` of `stream` for `seed`."""
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(stream, counter)))


class Distribution(Protocol):
    """Non-negative durations in virtual seconds."""

    def sample(self, gen: np.random.Generator, size: int) -> np.ndarray:
        """`size` draws as a float64 array."""
        ...


def _positive(name: str, value: float, allow_zero: bool = False) -> float:
    ok = value >= 0 if allow_zero else value > 0
    if not (isinstance(value, (int, float, np.number)) and math.isfinite(value) and ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"Expected {name} to be a finite number {bound}, found {value!r}.")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Constant:
    """Always `value` seconds (no variance)."""

    value: float

    def __post_init__(self) -> None:
        _positive("Constant.value", self.value, allow_zero=True)

    def sample(self, gen: np.random.Generator, size: int) -> np.ndarray:
        """`size` copies of the value."""
        del gen
        return np.full(size, float(self.value))


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """`median * exp(sigma * N(0, 1))`: right skewed, as device compute times are."""

    median: float
    sigma: float = 0.5

    def __post_init__(self) -> None:
        _positive("LogNormal.median", self.median)
        _positive("LogNormal.sigma", self.sigma, allow_zero=True)

    def sample(self, gen: np.random.Generator, size: int) -> np.ndarray:
        """`size` draws."""
        return self.median * np.exp(self.sigma * gen.standard_normal(size))


@dataclasses.dataclass(frozen=True)
class Pareto:
    """Heavy tailed: `scale * (1 + Lomax(alpha))`, at least `scale`; the mean is
    infinite for `alpha <= 1`, the variance for `alpha <= 2`."""

    scale: float
    alpha: float = 1.5

    def __post_init__(self) -> None:
        _positive("Pareto.scale", self.scale)
        _positive("Pareto.alpha", self.alpha)

    def sample(self, gen: np.random.Generator, size: int) -> np.ndarray:
        """`size` draws."""
        return self.scale * (1.0 + gen.pareto(self.alpha, size))


@dataclasses.dataclass(frozen=True)
class Stragglers:
    """`base`, except that a `fraction` of draws are multiplied by `slowdown`."""

    base: Distribution
    fraction: float = 0.1
    slowdown: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"Expected 0 <= Stragglers.fraction <= 1, found {self.fraction}.")
        _positive("Stragglers.slowdown", self.slowdown)

    def sample(self, gen: np.random.Generator, size: int) -> np.ndarray:
        """`size` draws."""
        base = self.base.sample(gen, size)
        slow = gen.random(size) < self.fraction
        return np.where(slow, base * self.slowdown, base)


def _check_distribution(name: str, d: Any) -> None:
    if not callable(getattr(type(d), "sample", None)):
        raise TypeError(
            f"Expected {name} to be a distribution (Constant, LogNormal, Pareto, Stragglers, "
            f"or any object with sample(rng, size)), found {type(d).__name__}."
        )


@dataclasses.dataclass(frozen=True)
class ClientTimes:
    """How long one participation of a client lasts, in virtual seconds.

    `duration = compute * speed[client] + network`.

    Attributes:
      compute: the local training time, drawn for each participation.
      network: the download and upload time, drawn for each participation.
      device_speed: a per-client multiplier of `compute`, drawn once per client from
        the seed (None: every device is alike).
    """

    compute: Distribution = LogNormal(1.0, 0.5)
    network: Distribution = Constant(0.0)
    device_speed: Distribution | None = None

    def __post_init__(self) -> None:
        _check_distribution("compute", self.compute)
        _check_distribution("network", self.network)
        if self.device_speed is not None:
            _check_distribution("device_speed", self.device_speed)

    def speeds(self, seed: int, num_clients: int) -> np.ndarray:
        """The per-client compute multipliers (ones without `device_speed`)."""
        if self.device_speed is None:
            return np.ones(num_clients)
        return np.asarray(self.device_speed.sample(rng(seed, STREAM_SPEED), num_clients), float)

    def durations(self, seed: int, counter: int, clients: Sequence[int] | np.ndarray,
                  num_clients: int, speeds: np.ndarray | None = None) -> np.ndarray:
        """The durations of participations of `clients` (population indices), draw
        number `counter` (one counter per group of participations drawn together).
        """
        gen = rng(seed, STREAM_TIMES, counter)
        k = len(clients)
        speeds = self.speeds(seed, num_clients) if speeds is None else speeds
        compute = np.asarray(self.compute.sample(gen, k), float)
        network = np.asarray(self.network.sample(gen, k), float)
        out = compute * speeds[np.asarray(clients, dtype=np.int64)] + network
        if not (np.isfinite(out).all() and (out >= 0).all()):
            raise ValueError("Expected client durations to be finite and >= 0; check the "
                             "distributions of ClientTimes.")
        return out


class AvailabilityWindows:
    """Which clients are available at a virtual time: an availability model of
    `fedlang.simulation.sampling` applied over consecutive windows of `window` seconds
    (window `w` plays the part of round `w`).

    Args:
      availability: `sampling.BernoulliAvailability(p)` (each window, each client
        independently) or `sampling.PeriodicAvailability(period, fraction)` (each
        client available `fraction` of every `period` windows, at its own phase).
      window: the window length in virtual seconds.
    """

    def __init__(self, availability: sampling.BernoulliAvailability | sampling.PeriodicAvailability,
                 window: float):
        if not isinstance(availability, (sampling.BernoulliAvailability,
                                         sampling.PeriodicAvailability)):
            raise TypeError(
                "Expected availability to be a sampling.BernoulliAvailability or "
                f"sampling.PeriodicAvailability, found {type(availability).__name__}."
            )
        self.availability = availability
        self.window = _positive("window", window)

    def window_of(self, t: float) -> int:
        """The index of the window holding time `t`."""
        return math.floor(t / self.window)

    def next_change(self, t: float) -> float:
        """The start of the window after the one holding `t`."""
        return (self.window_of(t) + 1) * self.window

    def mask(self, seed: int, num_clients: int, t: float) -> np.ndarray:
        """A boolean mask over the population: available at time `t`."""
        w = self.window_of(t)
        gen = rng(seed, STREAM_AVAILABILITY, w)
        if isinstance(self.availability, sampling.PeriodicAvailability):
            phases = rng(seed, STREAM_PHASES).random(num_clients)
            return self.availability.available(gen, num_clients, w, phases)
        return self.availability.available(gen, num_clients, w)


class EventQueue:
    """Events ordered by time, then by the order they were pushed (deterministic ties)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, time: float, event: Any) -> int:
        """Schedules `event` at `time`; returns its sequence number."""
        seq = self._seq
        heapq.heappush(self._heap, (float(time), seq, event))
        self._seq += 1
        return seq

    def nth_time(self, k: int) -> float:
        """The time of the `k`-th earliest pending event (1-based), inf if fewer are pending."""
        if k < 1:
            raise ValueError(f"Expected k >= 1, found {k}.")
        if k > len(self._heap):
            return math.inf
        return heapq.nsmallest(k, self._heap)[-1][0]

    def pop_simultaneous(self) -> tuple[float, list[Any]]:
        """The earliest time and every event at exactly that time, in push order.

        Raises:
          IndexError: when the queue is empty.
        """
        if not self._heap:
            raise IndexError("pop from an empty EventQueue")
        t, _, event = heapq.heappop(self._heap)
        events = [event]
        while self._heap and self._heap[0][0] == t:
            events.append(heapq.heappop(self._heap)[2])
        return t, events
