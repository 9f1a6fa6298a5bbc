"""Algebraic properties shared by every aggregator: chunking never changes the result."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlang import aggregators
from fedlang.core import context
from fedlang.runtime import ReferenceContext, SimulationContext

VALUE_T = {"w": (np.float32, [3, 2]), "b": (np.float32, [2])}

FACTORIES = {
    "median": lambda: aggregators.MedianFactory(),
    "trimmed_mean": lambda: aggregators.TrimmedMeanFactory(0.2),
    "geometric_median": lambda: aggregators.GeometricMedianFactory(),
    "clipping": lambda: aggregators.clipping_factory(
        aggregators.QuantileEstimator(1.0), aggregators.UnweightedMeanFactory()),
    "zeroing": lambda: aggregators.zeroing_factory(2.0, aggregators.SumFactory()),
    "dp": lambda: aggregators.DifferentiallyPrivateFactory.gaussian_adaptive(0.5, 8, seed=3),
    "dp_tree": lambda: aggregators.DifferentiallyPrivateFactory.tree_aggregation(0.5, 8, 1.0, seed=3),
    "secure": lambda: aggregators.SecureSumFactory(2.0, bits=12, seed=1),
    "encoded": lambda: aggregators.EncodedSumFactory.quantize(4, threshold=2, seed=1),
    "top_k": lambda: aggregators.EncodedSumFactory.top_k(0.5, threshold=2),
}
_PROCESSES: dict = {}


def _process(name):
    if name not in _PROCESSES:
        _PROCESSES[name] = FACTORIES[name]().create(VALUE_T)
    return _PROCESSES[name]


def _run(ctx, process, values, rounds=2):
    previous = context.get_default_context()
    context.set_default_context(ctx)
    try:
        state, outs = process.initialize(), []
        for _ in range(rounds):
            out = process.next(state, values)
            state = out.state
            outs.append(out.result)
        return outs
    finally:
        context.set_default_context(previous)


def _values(seed, n):
    rng = np.random.default_rng(seed)
    return [{"w": rng.normal(size=(3, 2)).astype(np.float32) * (1 + i),
             "b": rng.normal(size=2).astype(np.float32)} for i in range(n)]


@pytest.mark.parametrize("name", sorted(FACTORIES))
@settings(max_examples=2, deadline=None)
@given(n=st.integers(1, 5), chunk=st.integers(1, 4), seed=st.integers(0, 100))
def test_any_chunking_gives_the_reference_result(name, n, chunk, seed):
    # arrange
    process, values = _process(name), _values(seed, n)
    # act
    expected = _run(ReferenceContext(), process, values)
    actual = _run(SimulationContext(chunk_size=chunk, prefetch=False), process, values)
    # assert
    for e, a in zip(expected, actual):
        for k in ("w", "b"):
            np.testing.assert_allclose(a[k], e[k], rtol=1e-4, atol=1e-4)
