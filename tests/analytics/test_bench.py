"""bench/analytics.py runs (quick sizes) and its numbers are what the analytics promise."""

import math

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_histogram_part(load_script, capsys):
    bench = load_script("bench/analytics.py")
    out = bench.main(["--quick", "--only", "hist"])
    exact = next(r for r in out["hist"] if math.isinf(r["epsilon"]))
    assert exact["hist_mae"] == 0 and exact["quantile_max"] <= 1 / 2**8
    noisy = {r["epsilon"]: r["hist_mae"] for r in out["hist"]}
    assert noisy[1.0] > noisy[10.0] > 0  # more privacy, more noise
    assert "| epsilon | histogram: mean abs error per bin" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_mode_end_to_end(load_script):
    bench = load_script("bench/analytics.py")
    out = bench.main(["--quick", "--only", "heavy", "--only", "hll", "--only", "cohort"])
    assert all(abs(r["rel_error"]) < 0.03 for r in out["hll"])
    at_inf = [r for r in out["heavy"] if math.isinf(r["epsilon"])]
    assert all(r["hits"] == 20 for r in at_inf)
    assert {r["method"] for r in out["cohort"]} == {"TrieHH round", "IBLT sketch round"}
