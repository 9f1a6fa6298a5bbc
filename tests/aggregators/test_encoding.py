import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlang import aggregators
from fedlang.aggregators import hadamard

pytestmark = pytest.mark.usefixtures("runtime")
T = {"w": (np.float32, [30, 40]), "b": (np.float32, [5])}


def _vals(n=4):
    rng = np.random.default_rng(0)
    return [
        {
            "w": rng.normal(size=(30, 40)).astype(np.float32),
            "b": rng.normal(size=5).astype(np.float32),
        }
        for _ in range(n)
    ]


def test_quantized_sum_error_and_bits():
    p = aggregators.EncodedSumFactory.quantize(8, threshold=100, seed=0).create(T)
    vals = _vals()
    out = p.next(p.initialize(), vals)
    exact = sum(v["w"] for v in vals)
    step = max(float(v["w"].max() - v["w"].min()) / 255 for v in vals)
    assert np.abs(out.result["w"] - exact).max() <= 4 * step + 1e-5
    np.testing.assert_allclose(out.result["b"], sum(v["b"] for v in vals), rtol=1e-5, atol=1e-6)
    assert float(out.measurements["aggregated_bits"]) == 4 * (1200 * 8 + 64 + 5 * 32)
    assert float(out.measurements["uncompressed_bits"]) == 4 * 1205 * 32


def test_stochastic_rounding_is_unbiased():
    p = aggregators.EncodedSumFactory.quantize(2, threshold=0, seed=1).create((np.float32, [4000]))
    x = np.linspace(0, 1, 4000).astype(np.float32)
    out = p.next(p.initialize(), [x])
    assert abs(float(np.mean(out.result - x))) < 0.01


def test_top_k_keeps_the_largest_entries():
    p = aggregators.EncodedSumFactory.top_k(0.01, threshold=100).create(T)
    v = {"w": np.zeros((30, 40), np.float32), "b": np.ones(5, np.float32)}
    v["w"][3, 7], v["w"][10, 2] = 5.0, -4.0
    out = p.next(p.initialize(), [v])
    np.testing.assert_array_equal(out.result["w"], v["w"])
    assert float(out.measurements["aggregated_bits"]) == 12 * (11 + 32) + 5 * 32


def test_hadamard_rotation_round_trips():
    x = jnp.arange(37, dtype=jnp.float32)
    key = jax.random.key(0)
    y = hadamard.rotate(x, key)
    assert y.shape == (64,)
    np.testing.assert_allclose(hadamard.unrotate(y, key, 37), x, atol=1e-4)
    np.testing.assert_allclose(jnp.linalg.norm(y), jnp.linalg.norm(x), rtol=1e-5)


def test_bad_encoder():
    with pytest.raises(ValueError, match="bits"):
        aggregators.Encoder.quantize(0)
    with pytest.raises(TypeError, match="Encoder"):
        aggregators.EncodedSumFactory("8bit")


@pytest.mark.slow
def test_8_bit_quantization_saves_3_5x_at_equal_accuracy(request, load_script):
    if request.node.callspec.params.get("runtime") != "simulation":
        pytest.skip("one runtime (the default simulation) is enough for the end-to-end check")
    bench = load_script("bench/aggregators.py")
    results = {}
    for name, enc in (
        ("raw", aggregators.Encoder.identity()),
        ("q8", aggregators.Encoder.quantize(8)),
    ):
        agg = aggregators.MeanFactory(value_sum_factory=aggregators.EncodedSumFactory(enc, seed=0))
        acc, hist = bench.train(agg, rounds=10, broadcast_encoder=enc)
        results[name] = (
            acc,
            bench._bits(hist[-1], "aggregated_bits"),
            bench._bits(hist[-1], "broadcast_bits"),
        )
    assert results["raw"][1] / results["q8"][1] >= 3.5
    assert results["raw"][2] / results["q8"][2] >= 3.5
    assert results["q8"][0] >= results["raw"][0] - 0.01
