"""The CPU-side benchmark scripts of the simulation runtime run and report sane numbers."""

import pytest


@pytest.mark.timeout(300)
def test_strategy_agreement_reports_rounding_sized_one_round_differences(load_script, capsys):
    bench = load_script("bench/strategy_agreement.py")
    out = bench.main(["--cohort", "12", "--rounds", "2", "--test-size", "200",
                      "--variants", "vmap:12,scan,perturb:1e-7:1"])
    for row in out["rounds"]:
        assert row["vmap:12"]["one_round"] < 1e-4 and row["scan"]["one_round"] < 1e-4
        assert row["perturb:1e-7:1"]["one_round"] == 0  # its programs are loop's
    assert out["rounds"][0]["perturb:1e-7:1"]["drift"] > 0  # the perturbation is seen
    assert set(out["accuracy"]) == {"loop", "vmap:12", "scan", "perturb:1e-7:1"}
    assert all(0 <= a <= 1 for a in out["accuracy"].values())
    assert "accuracy after 2 rounds" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_cnn_step_timing_runs_tuned_and_side_by_side(load_script):
    bench = load_script("bench/cnn_cpu.py")
    for variant in ("fedlang-tuned", "fedlang-tuned-2-clients"):
        r = bench.time_jax(4, 1, variant)
        assert r["s_per_batch"] > 0 and len(r["runs_s"]) == 1


@pytest.mark.timeout(300)
def test_cnn_parts_and_chunk_sums_report_every_row(load_script, capsys):
    parts = load_script("bench/cnn_cpu.py").time_parts(repeats=1, calls=2)
    assert len(parts) == 9 and all(ms > 0 for ms in parts.values())
    sums = load_script("bench/chunk_sums.py").main(["--clients", "2"])
    assert len(sums) == 6 and all(ms > 0 for ms in sums.values())
    assert "device_put, 64-byte aligned host array" in capsys.readouterr().out
