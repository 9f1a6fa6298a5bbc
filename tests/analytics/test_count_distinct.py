import numpy as np
import pytest

import fedlang as fl
from fedlang import analytics


def test_small_counts_are_exact_and_duplicates_count_once(rt):
    assert round(analytics.count_distinct([[1, 2, 3], [3, 4, 4], []])) == 4
    assert round(analytics.count_distinct([["a", "b"], ["b", "é"], []], max_len=4)) == 3


def test_relative_error_at_scale():
    rng = np.random.default_rng(0)
    items = rng.permutation(200_000).astype(np.int32)
    with fl.runtime.simulation_context(strategy="scan", decision_cache=False):
        est = analytics.count_distinct(np.array_split(items, 20), precision=12)
    assert abs(est / 200_000 - 1) < 4 * 1.04 / np.sqrt(2**12)


def test_registers_merge_by_max(rt):
    comp = analytics.build_count_distinct(precision=4)
    both = comp([analytics.data.number_batches([1, 2], np.int32),
                 analytics.data.number_batches([2, 3], np.int32)])
    one = comp([analytics.data.number_batches([1, 2, 3], np.int32)])
    assert both["registers"].tolist() == one["registers"].tolist()


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision"):
        analytics.build_count_distinct(precision=30)
