"""Privacy accounting with Google's `dp-accounting` package (the accountant TFF uses).

`dp_epsilon(z, q, rounds, delta)` gives the epsilon of `rounds` rounds of the
Poisson-subsampled Gaussian mechanism with noise multiplier `z` and sampling
probability `q` (each client takes part in a round with probability `q`, e.g.
`clients_per_round / population`). `PrivacyAccountant` tracks it round by round, for
a driver that logs `(epsilon, delta)` after each round.

Accountants: 'rdp' (Rényi DP, the default: fast, slightly loose) and 'pld' (privacy
loss distributions: tighter, slower). For DP-FTRL tree aggregation (no sampling,
each client in at most one round per epoch), pass `mechanism='tree'`.
"""

from __future__ import annotations

from typing import Any

from fedlang.aggregators import tools

ACCOUNTANTS = ("rdp", "pld")


def _event(noise_multiplier: float, sampling_probability: float, rounds: int, mechanism: str):
    import dp_accounting

    if mechanism == "tree":
        return dp_accounting.SingleEpochTreeAggregationDpEvent(noise_multiplier, [rounds])
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling_probability < 1:
        gaussian = dp_accounting.PoissonSampledDpEvent(sampling_probability, gaussian)
    return dp_accounting.SelfComposedDpEvent(gaussian, rounds)


def _check(noise_multiplier: Any, sampling_probability: Any, rounds: Any, delta: Any,
           accountant: str, mechanism: str) -> tuple[float, float, int, float]:
    z = tools.check_number("noise_multiplier", noise_multiplier, 0.0, strict=True)
    q = tools.check_number("sampling_probability", sampling_probability, 0.0, strict=True)
    if q > 1:
        raise ValueError(f"Expected sampling_probability in (0, 1], found {q}.")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"Expected rounds to be a non-negative integer, found {rounds!r}.")
    d = tools.check_number("delta", delta, 0.0, strict=True)
    if d >= 1:
        raise ValueError(f"Expected delta in (0, 1), found {d}.")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"Expected accountant in {ACCOUNTANTS}, found {accountant!r}.")
    if mechanism not in ("gaussian", "tree"):
        raise ValueError(f"Expected mechanism 'gaussian' or 'tree', found {mechanism!r}.")
    if mechanism == "tree" and accountant != "rdp":
        raise ValueError("Tree aggregation is accounted with accountant='rdp' only.")
    return z, q, rounds, d


def dp_epsilon(
    noise_multiplier: float,
    sampling_probability: float,
    rounds: int,
    delta: float,
    accountant: str = "rdp",
    mechanism: str = "gaussian",
) -> float:
    """The epsilon of `rounds` rounds of the (Poisson-subsampled) Gaussian mechanism.

    Args:
      noise_multiplier: `z > 0`, noise standard deviation over the clip norm.
      sampling_probability: `q` in (0, 1], each client's chance to take part in a round.
      rounds: the number of rounds (0 gives 0).
      delta: the target delta in (0, 1).
      accountant: 'rdp' (default) or 'pld'.
      mechanism: 'gaussian' (DP-FedAvg) or 'tree' (DP-FTRL, one epoch, rdp only).

    Returns:
      epsilon (a float; `inf` when no finite epsilon exists).

    Raises:
      ValueError: on out-of-range arguments.
      ImportError: without `pip install dp-accounting`.

    Example:
      >>> from fedlang import aggregators
      >>> round(aggregators.dp_epsilon(1.1, 0.01, 100, 1e-5), 3)
      0.956
    """
    z, q, rounds, d = _check(
        noise_multiplier, sampling_probability, rounds, delta, accountant, mechanism
    )
    if rounds == 0:
        return 0.0
    import dp_accounting

    relation = (dp_accounting.NeighboringRelation.REPLACE_SPECIAL if mechanism == "tree"
                else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc = (
        dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
        if accountant == "rdp"
        else dp_accounting.pld.PLDAccountant()
    )
    acc.compose(_event(z, q, rounds, mechanism))
    return float(acc.get_epsilon(d))


class PrivacyAccountant:
    """Tracks `(epsilon, delta)` as rounds are run; call `step()` after each round.

    Args:
      noise_multiplier, sampling_probability, delta, accountant, mechanism: as for
        `dp_epsilon`.

    Example:
      >>> from fedlang import aggregators
      >>> acc = aggregators.PrivacyAccountant(1.1, 0.01, delta=1e-5)
      >>> for _ in range(100):
      ...     eps, delta = acc.step()
      >>> round(eps, 3), acc.rounds
      (0.956, 100)
    """

    def __init__(self, noise_multiplier: float, sampling_probability: float, delta: float,
                 accountant: str = "rdp", mechanism: str = "gaussian"):
        _check(noise_multiplier, sampling_probability, 0, delta, accountant, mechanism)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling_probability = float(sampling_probability)
        self.delta = float(delta)
        self.accountant, self.mechanism = accountant, mechanism
        self.rounds = 0

    @property
    def epsilon(self) -> float:
        """The epsilon spent by the rounds so far."""
        return dp_epsilon(self.noise_multiplier, self.sampling_probability, self.rounds,
                          self.delta, self.accountant, self.mechanism)

    def step(self, rounds: int = 1) -> tuple[float, float]:
        """Records `rounds` more rounds; returns `(epsilon, delta)` so far."""
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"Expected a non-negative integer number of rounds, found {rounds!r}.")
        self.rounds += rounds
        return self.epsilon, self.delta
