import numpy as np
import pytest

import fedlang as fl
from fedlang import analytics


def _clients(seed=1, n=10):
    rng = np.random.default_rng(seed)
    out = [rng.normal(0, 1.5, size=rng.integers(0, 60)).astype(np.float32) for _ in range(n)]
    out[3] = np.array([], np.float32)
    out[4] = np.array([-3.0, 3.0, np.nan], np.float32)  # edges are in, NaN is out
    return out


def test_histogram_matches_numpy(rt):
    clients = _clients()
    every = np.concatenate(clients)
    edges = np.linspace(-3, 3, 13)
    h = analytics.histogram(clients, edges)
    finite = every[np.isfinite(every)]
    assert h.counts.tolist() == np.histogram(finite, edges)[0].tolist()
    assert h.out_of_range == len(every) - np.histogram(finite, edges)[0].sum()


def test_category_histograms(rt):
    h = analytics.category_histogram([[0, 1, 1, 5], [2, -1], []], 3)
    assert h.counts.tolist() == [1, 2, 1] and h.out_of_range == 2
    s = analytics.string_histogram(
        [["cat", "dog", "cat", "chat très long"], ["emu"], []], ["cat", "dog", "chat très"],
        max_len=10,
    )
    # 'chat très long' is cut to 10 bytes ('chat très' is 10 bytes): counted, and matched.
    assert s.counts.tolist() == [2, 1, 1] and s.out_of_range == 1 and s.truncated == 1


def test_quantiles_are_exact_to_a_leaf(rt):
    clients = _clients(2)
    every = np.concatenate(clients)
    every = every[np.isfinite(every)]
    qs = [0.05, 0.25, 0.5, 0.75, 0.95]
    q = analytics.quantiles(clients, qs, lower=-5, upper=5, depth=8)
    width = 10 / 2**8
    assert np.all(np.abs(q.values - np.quantile(every, qs)) <= 2 * width)
    assert q.tree[0] == len(every)


def test_tree_levels_add_up():
    batches = analytics.data.number_batches([0.5, 1.5, 3.5, 3.9])
    tree = np.asarray(analytics.build_tree_histogram(0, 4, 2)([batches]))
    assert tree.tolist() == [4, 2, 2, 1, 1, 0, 2]


def test_dp_histogram_noise_scale_and_privacy():
    privacy = analytics.Privacy(noise_multiplier=1.0, clip=2.0, seed=11)
    comp = analytics.build_histogram(np.linspace(0, 1, 401), privacy=privacy)
    with fl.runtime.reference_context():
        noisy = np.asarray(comp([[], analytics.data.number_batches([0.5])]))
    noise = np.delete(noisy[:-1], 200)  # the bins with no record
    assert abs(noise.std() / privacy.stddev - 1) < 0.12
    h = analytics.histogram([[0.2]], [0, 1], privacy=privacy)
    assert h.privacy.epsilon == privacy.spent(1).epsilon


def test_dp_quantiles_stay_near_with_many_records():
    rng = np.random.default_rng(0)
    clients = [rng.uniform(0, 1, 20) for _ in range(50)]
    privacy = analytics.Privacy(noise_multiplier=1.0, clip=30.0, seed=1)
    with fl.runtime.reference_context():
        q = analytics.quantiles(clients, [0.5], 0, 1, depth=6, privacy=privacy)
    assert abs(q.values[0] - 0.5) < 0.1 and q.privacy is not None


def test_bad_bins_and_categories():
    with pytest.raises(ValueError, match="increasing"):
        analytics.build_histogram([0, 0, 1])
    with pytest.raises(ValueError, match="distinct"):
        analytics.build_string_histogram(["a", "a"], 4)
    with pytest.raises(ValueError, match="depth"):
        analytics.build_tree_histogram(0, 1, 0)
    with pytest.raises(ValueError, match="quantiles in"):
        analytics.tree_quantiles([1, 1, 0], [1.5], 0, 1)
