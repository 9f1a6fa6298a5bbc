"""Krum, multi-Krum and Bulyan: the papers' choices on hand-made inputs, and a plain-NumPy
transcription of the papers on random ones, on the runtime sample (tests/conftest.py)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang import aggregators
from fedlang.learning import algorithms, models

on_every_runtime = pytest.mark.usefixtures("runtime")


def run(factory, values, value_type=np.float32):
    p = factory.create(value_type)
    return p.next(p.initialize(), values)


# --- plain NumPy, as the papers state the rules ------------------------------------------


def np_scores(points, active, f):
    """Krum's scores among the active clients (Blanchard et al., 2017, section 4)."""
    k = max(len(active) - f - 2, 0)
    scores = {}
    for i in active:
        d = sorted(float(np.sum((points[i] - points[j]) ** 2)) for j in active if j != i)
        scores[i] = sum(d[:k])
    return scores


def np_multi_krum(points, f, m):
    scores = np_scores(points, list(range(len(points))), f)
    best = sorted(scores, key=lambda i: (scores[i], i))[:m]
    return np.mean([points[i] for i in best], axis=0), best[0]


def np_bulyan(points, f):
    """El Mhamdi et al., 2018, section 4: recursive Krum selection, then per coordinate the
    mean of the beta values closest to the median."""
    n = len(points)
    theta, beta = n - 2 * f, n - 4 * f
    left, chosen = list(range(n)), []
    for _ in range(theta):
        scores = np_scores(points, left, f)
        pick = min(left, key=lambda i: (scores[i], i))
        chosen.append(pick)
        left.remove(pick)
    stacked = np.stack([points[i] for i in chosen])
    med = np.median(stacked, axis=0)
    flat, med_flat = stacked.reshape(theta, -1), med.reshape(-1)
    out = np.empty_like(med_flat)
    for c in range(flat.shape[1]):
        order = sorted(range(theta), key=lambda r: (abs(flat[r, c] - med_flat[c]), r))
        out[c] = np.mean(flat[order[:beta], c])
    return out.reshape(med.shape)


# --- hand-made inputs --------------------------------------------------------------------


@on_every_runtime
def test_krum_picks_the_client_with_the_lowest_score_ties_to_the_lower_position():
    # n=5, f=1: scores sum the squared distances to the 2 nearest others:
    # 0 -> 1+9=10, 1 -> 1+4=5, 3 -> 4+1=5, 4 -> 1+9=10, 100 -> huge. Clients 1 and 3 tie.
    values = [0.0, 1.0, 3.0, 4.0, 100.0]
    out = run(aggregators.KrumFactory(1), values)
    assert float(out.result) == 1.0 and int(out.measurements["krum_selected"]) == 1
    # Multi-Krum: the m lowest scores, ties to the lower position, averaged.
    assert float(run(aggregators.KrumFactory(1, num_selected=3), values).result) == pytest.approx(
        (1.0 + 3.0 + 0.0) / 3)
    assert float(run(aggregators.KrumFactory(1, num_selected=None), values).result) == 2.0  # n-f


@on_every_runtime
def test_krum_measures_distances_over_the_whole_structure():
    # Squared distances over both leaves: client 0's two nearest are 1 and 3 (1 + 1 = 2);
    # clients 1 and 3 score 3; client 2 scores 9; client 4 is far in both leaves.
    a = [[0, 0], [1, 0], [0, 0], [0, 1], [10, 10]]
    b = [0, 0, 2, 0, -10]
    values = [{"a": np.float32(x), "b": np.float32(y)} for x, y in zip(a, b)]
    t = {"a": (np.float32, [2]), "b": np.float32}
    out = run(aggregators.KrumFactory(1), values, t)
    np.testing.assert_array_equal(out.result["a"], [0, 0])
    assert int(out.measurements["krum_selected"]) == 0
    two = run(aggregators.KrumFactory(1, num_selected=2), values, t).result
    np.testing.assert_allclose(two["a"], [0.5, 0.0])  # clients 0 and 1 (1 ties with 3)
    assert float(two["b"]) == 0.0


@on_every_runtime
def test_bulyan_selects_by_repeated_krum_then_averages_the_values_nearest_the_median():
    # n=7, f=1: theta = 5 selected (Krum picks 2, then 3, 1, 4, 0), beta = 3 kept per
    # coordinate: those nearest the median 2 are 2, 3 and 1.
    values = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 1000.0]
    assert float(run(aggregators.BulyanFactory(1), values).result) == 2.0
    # Two coordinates: the 5 clustered clients are selected; per coordinate the three
    # nearest the median are kept: x keeps clients 1, 2, 3 (median 2, mean 2), y keeps
    # 3, 2, 1 (median 12, mean (12 + 11 + 10) / 3 = 11): other clients per coordinate.
    points = [[0, 14.5], [1, 10], [2, 11], [3, 12], [4, 16], [100, 100], [-100, 50]]
    out = run(aggregators.BulyanFactory(1), [np.float32(p) for p in points], (np.float32, [2]))
    np.testing.assert_allclose(out.result, [2.0, 11.0], rtol=1e-6)


def test_random_inputs_equal_the_papers_rules_in_numpy():
    # The rules run at the server on the collected values: one runtime suffices here (the
    # hand-made cases above check every runtime collects the values in client order).
    rng = np.random.default_rng(0)
    for n, f in ((7, 1), (11, 2), (9, 0)):
        points = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(n)]
        points[0] = points[0] + 50.0  # one attacker far away
        t = (np.float32, [3, 2])
        for m in (1, 3):
            expected, best = np_multi_krum(points, f, m)
            out = run(aggregators.KrumFactory(f, num_selected=m), points, t)
            np.testing.assert_allclose(out.result, expected, rtol=1e-5, atol=1e-6)
            assert int(out.measurements["krum_selected"]) == best
        if n >= 4 * f + 3:
            np.testing.assert_allclose(
                run(aggregators.BulyanFactory(f), points, t).result, np_bulyan(points, f),
                rtol=1e-5, atol=1e-6)


# --- preconditions, composition ----------------------------------------------------------


@on_every_runtime
def test_too_few_clients_for_f_is_a_clear_error():
    with pytest.raises(ValueError, match=r"more than 2f \+ 2 = 4 clients per round, found 4"):
        run(aggregators.KrumFactory(1), [0.0, 1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="num_selected=6 values of 5 clients"):
        run(aggregators.KrumFactory(1, num_selected=6), [0.0, 1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match=r"at least 4f \+ 3 = 7 clients per round, found 6"):
        run(aggregators.BulyanFactory(1), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_byzantine"):
            aggregators.KrumFactory(bad)
        with pytest.raises(ValueError, match="num_byzantine"):
            aggregators.BulyanFactory(bad)
    with pytest.raises(ValueError, match="num_selected"):
        aggregators.KrumFactory(1, num_selected=0)


@on_every_runtime
def test_no_clients_gives_zeros():
    out = run(aggregators.KrumFactory(2), [])
    assert float(out.result) == 0.0 and int(out.measurements["num_clients"]) == 0
    assert float(run(aggregators.BulyanFactory(2), []).result) == 0.0


@on_every_runtime
def test_composes_with_clipping():
    clipped = aggregators.clipping_factory(1.0, aggregators.KrumFactory(1))
    out = run(clipped, [0.0, 1.0, 3.0, 4.0, 100.0])
    assert float(out.result) == 1.0  # client 1's value, within the clip


def test_bulyan_as_fed_avgs_model_aggregator_ignores_a_poisoned_client():
    def model_fn():
        return models.FunctionalModel(
            init_fn=lambda rng: {"w": jnp.zeros([2, 2])},
            apply_fn=lambda p, x: x @ p["w"],
            loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
                logits, y).mean(),
            input_spec={"x": (np.float32, [None, 2]), "y": (np.int32, [None])})

    process = algorithms.build_unweighted_fed_avg(
        model_fn, optax.sgd(0.1), model_aggregator=aggregators.BulyanFactory(1))
    rng = np.random.default_rng(1)
    data = [[{"x": rng.normal(size=(4, 2)).astype(np.float32),
              "y": rng.integers(0, 2, 4).astype(np.int32)}] for _ in range(7)]
    data[6][0]["x"] = data[6][0]["x"] * 1e4  # a poisoned client
    state, metrics = process.next(process.initialize(), data)
    assert int(metrics["aggregator"]["num_clients"]) == 7
    assert np.all(np.abs(process.get_model_weights(state).trainable["w"]) < 1.0)
