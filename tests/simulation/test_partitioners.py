import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlang.simulation import partitioners


def _assert_exact_cover(partition, n):
    allidx = np.concatenate([v for v in partition.values()]) if partition else np.empty(0)
    assert sorted(allidx.tolist()) == list(range(n))
    assert all(v.dtype == np.int64 for v in partition.values())


labels_strategy = st.lists(st.integers(0, 5), min_size=20, max_size=200).map(np.array)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 20), seed=st.integers(0, 2**31))
def test_iid_covers_every_example_once(n, k, seed):
    if n < k:
        with pytest.raises(ValueError, match="fewer clients"):
            partitioners.iid(n, k, seed)
        return
    part = partitioners.iid(n, k, seed)
    _assert_exact_cover(part, n)
    sizes = [len(v) for v in part.values()]
    assert max(sizes) - min(sizes) <= 1 and list(part) == [str(i) for i in range(k)]


@settings(max_examples=30, deadline=None)
@given(labels=labels_strategy, k=st.integers(1, 8), alpha=st.floats(0.05, 100), seed=st.integers(0, 1000))
def test_dirichlet_covers_every_example_once(labels, k, alpha, seed):
    part = partitioners.dirichlet(labels, k, alpha, min_size=0, seed=seed)
    _assert_exact_cover(part, len(labels))
    assert list(part) == [str(i) for i in range(k)]


def test_dirichlet_min_size_is_met():
    labels = np.repeat(np.arange(10), 30)
    part = partitioners.dirichlet(labels, 20, 0.3, min_size=5, seed=0)
    _assert_exact_cover(part, len(labels))
    assert min(len(v) for v in part.values()) >= 5


@settings(max_examples=30, deadline=None)
@given(labels=labels_strategy, k=st.integers(1, 5), s=st.integers(1, 3), seed=st.integers(0, 1000))
def test_shards_covers_every_example_once(labels, k, s, seed):
    part = partitioners.shards(labels, k, s, seed)
    _assert_exact_cover(part, len(labels))


@settings(max_examples=30, deadline=None)
@given(labels=labels_strategy, k=st.integers(1, 10), c=st.integers(1, 3), seed=st.integers(0, 1000))
def test_pathological_covers_every_example_once(labels, k, c, seed):
    num_classes = len(np.unique(labels))
    if c > num_classes or k * c < num_classes or len(labels) < k:
        with pytest.raises(ValueError):
            partitioners.pathological(labels, k, c, seed)
        return
    part = partitioners.pathological(labels, k, c, seed)
    _assert_exact_cover(part, len(labels))
    assert all(len(np.unique(labels[v])) <= c for v in part.values())


@settings(max_examples=30, deadline=None)
@given(keys=st.lists(st.sampled_from(["ann", "bob", "cy"]), min_size=1, max_size=50))
def test_natural_groups_by_key(keys):
    keys = np.array(keys)
    part = partitioners.natural(keys)
    _assert_exact_cover(part, len(keys))
    for k, idx in part.items():
        assert (keys[idx] == k).all()


def test_dirichlet_skew_depends_on_alpha():
    labels = np.repeat(np.arange(10), 100)

    def mean_classes(alpha):
        part = partitioners.dirichlet(labels, 10, alpha, seed=0)
        return np.mean([len(np.unique(labels[v])) for v in part.values()])

    assert mean_classes(0.05) < mean_classes(100.0)


def test_dirichlet_seeded_is_deterministic():
    labels = np.repeat(np.arange(3), 30)
    a, b = (partitioners.dirichlet(labels, 4, 0.5, seed=3) for _ in range(2))
    assert all((a[k] == b[k]).all() for k in a)


def test_bad_arguments():
    with pytest.raises(ValueError, match="alpha > 0"):
        partitioners.dirichlet([0, 1, 2], 2, 0.0)
    with pytest.raises(ValueError, match="min_size"):
        partitioners.dirichlet([0, 1, 2], 2, 1.0, min_size=2)
    with pytest.raises(ValueError, match="1-D"):
        partitioners.shards(np.zeros((2, 2)), 1)
    with pytest.raises(ValueError, match="num_clients >= 1"):
        partitioners.iid(5, 0)
    with pytest.raises(ValueError, match="Increase alpha"):
        partitioners.dirichlet(np.zeros(20), 10, 0.01, min_size=2, seed=0, max_tries=3)
