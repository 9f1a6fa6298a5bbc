"""Krum, multi-Krum and Bulyan: Byzantine-robust aggregation by distances between values.

Up to `f` of the `n` clients (`num_byzantine`) may send anything. Each client's value
(the whole structure, all tensors together) is a point; `d(i, j)` is the squared
Euclidean distance between the values of clients `i` and `j`.

* **Krum** (Blanchard, El Mhamdi, Guerraoui and Stainer, "Machine Learning with
  Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017): client `i`'s score
  is the sum of `d(i, j)` over its `n - f - 2` nearest other clients; the result is the
  value of the client with the lowest score. Requires `n > 2f + 2`.
* **Multi-Krum** (same paper): the mean of the `m` values with the lowest scores
  (`num_selected=m`; `None` is the paper's suggestion `m = n - f`).
* **Bulyan** (El Mhamdi, Guerraoui and Rouault, "The Hidden Vulnerability of
  Distributed Learning in Byzantium", ICML 2018): selects `theta = n - 2f` values by
  applying Krum again and again, each time to the clients not yet selected (with
  `n' - f - 2` neighbours among the `n'` left); then, per coordinate, averages the
  `beta = theta - 2f` selected values closest to the selected values' median.
  Requires `n >= 4f + 3`.

Ties (equal scores, equal distances to the median) go to the lower client position
(for Bulyan's coordinate step: to the value selected first). Like the median and the
trimmed mean, these need every value, so they collect the cohort at the server
(`robust.collect_process`: memory O(cohort x model)); the cohort's size is known only
when a round runs, so a cohort too small for `f` raises a `ValueError` then, naming
the sizes. All are unweighted. Type signature:

    create(V) -> AggregationProcess
      initialize: ( -> <>@SERVER)
      next: (<<>@SERVER, {V}@CLIENTS> -> <<>@SERVER, V@SERVER, <num_clients=int32,...>@SERVER>)

Krum's measurements also hold `krum_selected` (int32): the position in the cohort of
the client with the lowest score. With no clients the result is zeros.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.aggregators import factory, robust
from fedlang.core import processes


def _check_count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"Expected {name} to be an integer >= {low}, found {value!r}.")
    return int(value)


def pairwise_distances(xs: list[Any]) -> Any:
    """JAX: `d[i, j]`, the squared distance between clients `i` and `j` over all leaves.

    Args:
      xs: stacked leaves, each `float32[n, ...]`.

    Returns:
      `float32[n, n]`, symmetric with a zero diagonal (computed a row at a time: memory
      O(n x model), not O(n^2 x model)).
    """
    n = xs[0].shape[0]
    flat = [x.reshape(n, -1) for x in xs]

    def row(i: Any) -> Any:
        return sum(jnp.sum(jnp.square(v - v[i][None]), axis=1) for v in flat)

    return jax.lax.map(row, jnp.arange(n))


def krum_scores(d: Any, active: Any, num_neighbours: Any) -> Any:
    """JAX: each active client's sum of `d` to its `num_neighbours` nearest other active
    clients; `inf` for inactive ones.

    Args:
      d: `float32[n, n]` squared distances.
      active: `bool[n]`, the clients taking part.
      num_neighbours: an int (may be traced), at most the active clients minus one.
    """
    n = d.shape[0]
    others = jnp.where(jnp.eye(n, dtype=bool) | ~active[None, :], jnp.inf, d)
    nearest = jnp.sort(others, axis=1)
    take = jnp.arange(n)[None, :] < num_neighbours
    scores = jnp.sum(jnp.where(take, nearest, 0.0), axis=1)
    return jnp.where(active, scores, jnp.inf)


def krum(xs: list[Any], num_byzantine: int, num_selected: int | None) -> tuple[list[Any], Any]:
    """JAX: (multi-)Krum over stacked leaves `xs` (`[n, ...]`, n known); module docstring.

    Raises:
      ValueError: when `n <= 2f + 2`, or more values are to be averaged than there are.
    """
    n, f = xs[0].shape[0], num_byzantine
    if n <= 2 * f + 2:
        raise ValueError(
            f"Krum with num_byzantine={f} needs more than 2f + 2 = {2 * f + 2} clients per "
            f"round, found {n}. Sample more clients per round or lower num_byzantine."
        )
    m = n - f if num_selected is None else num_selected
    if m > n:
        raise ValueError(
            f"Multi-Krum cannot average num_selected={m} values of {n} clients; sample at "
            f"least {m} clients per round or lower num_selected."
        )
    scores = krum_scores(pairwise_distances(xs), jnp.ones([n], bool), n - f - 2)
    order = jnp.argsort(scores, stable=True)  # equal scores: the lower position first
    chosen = order[:m]
    return [jnp.mean(x[chosen], axis=0) for x in xs], {"krum_selected": order[0].astype(jnp.int32)}


def bulyan(xs: list[Any], num_byzantine: int) -> tuple[list[Any], Any]:
    """JAX: Bulyan over stacked leaves `xs` (`[n, ...]`, n known); module docstring.

    Raises:
      ValueError: when `n < 4f + 3`.
    """
    n, f = xs[0].shape[0], num_byzantine
    if n < 4 * f + 3:
        raise ValueError(
            f"Bulyan with num_byzantine={f} needs at least 4f + 3 = {4 * f + 3} clients per "
            f"round, found {n}. Sample more clients per round or lower num_byzantine."
        )
    theta, beta = n - 2 * f, n - 4 * f
    d = pairwise_distances(xs)

    def select(t: Any, carry: Any) -> Any:
        active, order = carry
        neighbours = jnp.maximum(n - t - f - 2, 0)  # Krum among the n - t clients left
        pick = jnp.argmin(krum_scores(d, active, neighbours))
        return active.at[pick].set(False), order.at[t].set(pick.astype(jnp.int32))

    _, order = jax.lax.fori_loop(
        0, theta, select, (jnp.ones([n], bool), jnp.zeros([theta], jnp.int32)))
    out = []
    for x in xs:
        chosen = x[order]  # [theta, ...], in the order Krum selected them
        gap = jnp.abs(chosen - jnp.median(chosen, axis=0)[None])
        closest = jnp.argsort(gap, axis=0, stable=True)[:beta]
        out.append(jnp.mean(jnp.take_along_axis(chosen, closest, axis=0), axis=0))
    return out, {}


class KrumFactory(factory.UnweightedAggregationFactory):
    """Krum, or multi-Krum with `num_selected > 1` (module docstring).

    Args:
      num_byzantine: f, the most clients per round assumed Byzantine (>= 0).
      num_selected: m, the values with the lowest scores to average; 1 (default) is
        Krum; None is `n - f`.

    Raises:
      ValueError: for negative or non-integer counts (and, when a round runs, for a
        cohort with `n <= 2f + 2` or fewer than `m` clients).

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> p = aggregators.KrumFactory(num_byzantine=1).create(np.float32)
      >>> out = p.next(p.initialize(), [0.0, 1.0, 3.0, 4.0, 100.0])
      >>> print(out.result, out.measurements['krum_selected'])
      1.0 1
    """

    def __init__(self, num_byzantine: int, num_selected: int | None = 1):
        self.num_byzantine = _check_count("num_byzantine", num_byzantine, 0)
        self.num_selected = None if num_selected is None else _check_count(
            "num_selected", num_selected, 1)

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the (multi-)Krum process for floating `value_type`."""
        value_t = factory.check_value_type(value_type, "f")
        f, m = self.num_byzantine, self.num_selected
        return robust.collect_process(
            value_t, lambda xs: krum(xs, f, m), {"krum_selected": np.int32})


class BulyanFactory(factory.UnweightedAggregationFactory):
    """Bulyan over Krum (module docstring).

    Args:
      num_byzantine: f, the most clients per round assumed Byzantine (>= 0).

    Raises:
      ValueError: for a negative or non-integer count (and, when a round runs, for a
        cohort with `n < 4f + 3`).

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> p = aggregators.BulyanFactory(num_byzantine=1).create(np.float32)
      >>> print(p.next(p.initialize(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 1000.0]).result)
      2.0
    """

    def __init__(self, num_byzantine: int):
        self.num_byzantine = _check_count("num_byzantine", num_byzantine, 0)

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the Bulyan process for floating `value_type`."""
        value_t = factory.check_value_type(value_type, "f")
        f = self.num_byzantine
        return robust.collect_process(value_t, lambda xs: bulyan(xs, f), {})
