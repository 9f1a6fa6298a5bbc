"""Client samplers with explicit, checkpointable random state.

A sampler picks each round's cohort. Its randomness is counter based: round `r`
draws from a generator seeded by `(seed, r)`, so the whole state is
`{'seed': ..., 'round_num': ...}`: `get_state()` returns that JSON-able dict and
`set_state()` restores it, and a resumed run picks exactly the cohorts an
uninterrupted one would (round 12's cohort does not depend on how rounds 0-11 ran).

Example:
  >>> sampler = UniformSampler(['a', 'b', 'c', 'd'], cohort_size=2, seed=0)
  >>> first = sampler.sample()
  >>> state = sampler.get_state()
  >>> second = sampler.sample()
  >>> sampler.set_state(state)
  >>> sampler.sample() == second
  True
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class _Sampler:
    """Shared state handling: a seed and the next round number."""

    def __init__(self, client_ids: Sequence[str], cohort_size: int, seed: int | None = None):
        self.client_ids = [str(c) for c in client_ids]
        if not self.client_ids:
            raise ValueError("Expected at least one client id, found none.")
        if not 1 <= cohort_size <= len(self.client_ids):
            raise ValueError(f"Expected 1 <= cohort_size <= {len(self.client_ids)} clients, found {cohort_size}.")
        self.cohort_size = int(cohort_size)
        self.seed = int(secrets.randbits(63) if seed is None else seed)
        self.round_num = 0

    def _rng(self, round_num: int, stream: int = 0) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(stream, round_num)))

    def get_state(self) -> dict[str, Any]:
        """The sampler's state as JSON-able data."""
        return {"kind": type(self).__name__, "seed": self.seed, "round_num": self.round_num}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores a state from `get_state`.

        Raises:
          ValueError: if the state is from another kind of sampler or malformed.
        """
        if state.get("kind") != type(self).__name__ or "seed" not in state or "round_num" not in state:
            raise ValueError(f"Expected a {type(self).__name__} state from get_state(), found {dict(state)!r}.")
        self.seed, self.round_num = int(state["seed"]), int(state["round_num"])

    def sample(self) -> list[str]:
        """The next round's cohort (client ids), advancing the round counter."""
        cohort = self.sample_round(self.round_num)
        self.round_num += 1
        return cohort

    def sample_round(self, round_num: int) -> list[str]:
        """The cohort of round `round_num`, without changing the state."""
        raise NotImplementedError


class UniformSampler(_Sampler):
    """Each round, `cohort_size` distinct clients chosen uniformly at random.

    Args:
      client_ids: the population.
      cohort_size: clients per round.
      seed: the seed; None draws one from the OS (it is part of the state).
    """

    def sample_round(self, round_num: int) -> list[str]:
        picks = self._rng(round_num).choice(len(self.client_ids), self.cohort_size, replace=False)
        return [self.client_ids[i] for i in picks]


class WeightedSampler(_Sampler):
    """Each round, distinct clients drawn with probability proportional to `weights`.

    Args:
      client_ids: the population.
      weights: one non-negative weight per client (e.g. its number of examples), or a
        mapping client id -> weight.
      cohort_size: clients per round, at most the number of positive weights.
      seed: the seed.

    Raises:
      ValueError: for negative weights or too few positive ones.
    """

    def __init__(self, client_ids: Sequence[str], weights: Sequence[float] | Mapping[str, float],
                 cohort_size: int, seed: int | None = None):
        super().__init__(client_ids, cohort_size, seed)
        if isinstance(weights, Mapping):
            weights = [weights[c] for c in self.client_ids]
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (len(self.client_ids),) or (w < 0).any() or not np.isfinite(w).all():
            raise ValueError(f"Expected {len(self.client_ids)} finite non-negative weights, found {w.shape} values.")
        if np.count_nonzero(w) < cohort_size:
            raise ValueError(f"Expected at least cohort_size={cohort_size} positive weights, found {np.count_nonzero(w)}.")
        self.probabilities = w / w.sum()

    def sample_round(self, round_num: int) -> list[str]:
        picks = self._rng(round_num).choice(len(self.client_ids), self.cohort_size, replace=False,
                                            p=self.probabilities)
        return [self.client_ids[i] for i in picks]


class BernoulliAvailability:
    """Each client is independently available with probability `p` each round."""

    def __init__(self, p: float):
        if not 0 < p <= 1:
            raise ValueError(f"Expected 0 < p <= 1, found {p}.")
        self.p = p

    def available(self, rng: np.random.Generator, num_clients: int, round_num: int) -> np.ndarray:
        """A boolean mask over clients."""
        return rng.random(num_clients) < self.p


class PeriodicAvailability:
    """Diurnal availability: client `k` is available for `fraction` of every `period`
    rounds, starting at its own phase (drawn once from the sampler's seed)."""

    def __init__(self, period: int, fraction: float):
        if period < 1 or not 0 < fraction <= 1:
            raise ValueError(f"Expected period >= 1 and 0 < fraction <= 1, found {period}, {fraction}.")
        self.period, self.fraction = period, fraction

    def available(self, rng: np.random.Generator, num_clients: int, round_num: int,
                  phases: np.ndarray | None = None) -> np.ndarray:
        """A boolean mask over clients (`phases` are per-client offsets in [0, 1))."""
        phases = rng.random(num_clients) if phases is None else phases
        return ((round_num / self.period + phases) % 1.0) < self.fraction


class AvailabilitySampler(_Sampler):
    """Uniform sampling among the clients available this round.

    If fewer than `cohort_size` clients are available, all available ones are
    returned (a smaller cohort, as in real deployments).

    Args:
      client_ids: the population.
      cohort_size: the largest cohort.
      availability: a `BernoulliAvailability` or `PeriodicAvailability`.
      seed: the seed (also fixes periodic phases).
    """

    def __init__(self, client_ids: Sequence[str], cohort_size: int,
                 availability: BernoulliAvailability | PeriodicAvailability, seed: int | None = None):
        super().__init__(client_ids, cohort_size, seed)
        self.availability = availability

    def available_clients(self, round_num: int) -> list[str]:
        """The clients available in round `round_num`."""
        n = len(self.client_ids)
        if isinstance(self.availability, PeriodicAvailability):
            phases = self._rng(0, stream=1).random(n)
            mask = self.availability.available(self._rng(round_num, 2), n, round_num, phases)
        else:
            mask = self.availability.available(self._rng(round_num, 2), n, round_num)
        return [c for c, m in zip(self.client_ids, mask) if m]

    def sample_round(self, round_num: int) -> list[str]:
        available = self.available_clients(round_num)
        k = min(self.cohort_size, len(available))
        picks = self._rng(round_num).choice(len(available), k, replace=False)
        return [available[i] for i in picks]
