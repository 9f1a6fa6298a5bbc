import numpy as np
import pytest

from fedlang import aggregators

pytestmark = pytest.mark.usefixtures("runtime")


def test_median_trimmed_mean_and_geometric_median_match_numpy():
    rng = np.random.default_rng(0)
    vals = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(7)]
    stacked = np.stack(vals)
    med = aggregators.MedianFactory().create((np.float32, [3, 2]))
    np.testing.assert_allclose(
        med.next(med.initialize(), vals).result, np.median(stacked, 0), rtol=1e-6
    )
    tm = aggregators.TrimmedMeanFactory(0.3).create((np.float32, [3, 2]))
    expected = np.sort(stacked, 0)[2:5].mean(0)
    np.testing.assert_allclose(tm.next(tm.initialize(), vals).result, expected, rtol=1e-5)
    gm = aggregators.GeometricMedianFactory().create((np.float32, [3, 2]))
    out = gm.next(gm.initialize(), vals)
    z = np.asarray(out.result)
    objective = np.linalg.norm((stacked - z).reshape(7, -1), axis=1).sum()
    for delta in (1e-2 * rng.normal(size=(3, 2)) for _ in range(5)):
        assert objective <= np.linalg.norm((stacked - z - delta).reshape(7, -1), axis=1).sum()
    assert int(out.measurements["num_clients"]) == 7


def test_bad_trim_fraction():
    with pytest.raises(ValueError, match="trim_fraction"):
        aggregators.TrimmedMeanFactory(0.5)


@pytest.mark.slow
def test_median_and_trimmed_mean_resist_attackers(request, load_script):
    if request.node.callspec.params.get("runtime") != "simulation":
        pytest.skip("one runtime (the default simulation) is enough for the end-to-end check")
    bench = load_script("bench/aggregators.py")
    clean, _ = bench.train(None, rounds=10)
    attacked, _ = bench.train(None, rounds=10, attackers=0.2)
    assert attacked < 0.5
    for factory in (aggregators.MedianFactory(), aggregators.TrimmedMeanFactory(0.2)):
        acc, _ = bench.train(factory, rounds=10, attackers=0.2)
        assert acc > clean - 0.07
