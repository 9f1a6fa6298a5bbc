"""'auto' decides on a small probe within a budget, says so, and remembers across runs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.core import context
from fedlang.runtime import autotune, local_exec
from fedlang.runtime.simulation import Options, SimulationContext

SEQ = fl.SequenceType(fl.to_type({"x": (np.float32, [None, 3]), "y": (np.float32, [None])}))
W = fl.TensorType(np.float32, [3])


def make_round():
    # A fresh computation per test: decisions and programs are per computation.
    @fl.jax_computation(W, SEQ)
    def client_update(w, ds):
        def step(state, b, mask):
            w, n = state
            err = (b["x"] @ w - b["y"]) * mask
            return w - 0.1 * (b["x"].T @ err) / jnp.maximum(jnp.sum(mask), 1.0), n + jnp.sum(mask)

        w_new, n = ds.reduce((w, jnp.float32(0)), step, masked=True)
        return {"delta": w_new - w, "n": n}

    @fl.federated_computation(fl.type_at_server(W), fl.type_at_clients(SEQ))
    def fed_round(w, data):
        out = fl.federated_map(client_update, (fl.federated_broadcast(w), data))
        return fl.federated_mean(out.delta, weight=out.n), fl.federated_sum(out.n)

    return fed_round


def clients(num, batches=10, seed=0):
    rng = np.random.default_rng(seed)
    return [
        [
            {"x": rng.normal(size=(4, 3)).astype(np.float32), "y": rng.normal(size=4).astype(np.float32)}
            for _ in range(batches)
        ]
        for _ in range(num)
    ]


def run(ctx, fn, *args):
    with context.with_context(ctx):
        return fn(*args)


def test_decisions_are_written_and_read_back_by_the_next_run(tmp_path):
    path = str(tmp_path / "decisions.json")
    fed_round = make_round()
    w = np.ones(3, np.float32)
    first = SimulationContext(strategy="auto", decision_cache=path)
    want = run(first, fed_round, w, clients(6))
    measured = local_exec.describe_choices(first.runner)
    assert measured and {r["source"] for r in measured} == {"measured"}
    with open(path) as f:
        assert len(json.load(f)["decisions"]) == len(measured)

    second = SimulationContext(strategy="auto", decision_cache=path)  # a new run, same machine
    got = run(second, make_round(), w, clients(6))
    cached = local_exec.describe_choices(second.runner)
    assert cached and {r["source"] for r in cached} == {"cached"}
    # (With vectorized groups picked, the per-client decision is never needed again.)
    measured_picks = {r["decision"]: r["picked"] for r in measured}
    assert {r["decision"]: r["picked"] for r in cached}.items() <= measured_picks.items()
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_damaged_decision_file_is_ignored_and_rewritten(tmp_path):
    path = tmp_path / "decisions.json"
    path.write_text("{not json")
    ctx = SimulationContext(strategy="auto", decision_cache=str(path))
    run(ctx, make_round(), np.ones(3, np.float32), clients(6))
    assert json.loads(path.read_text())["decisions"]


def test_without_a_decision_file_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLANG_CACHE_DIR", str(tmp_path))
    ctx = SimulationContext(strategy="auto", decision_cache=False)
    run(ctx, make_round(), np.ones(3, np.float32), clients(6))
    assert list(tmp_path.iterdir()) == []
    assert SimulationContext().runner.tuner.path == str(tmp_path / autotune.CACHE_FILE)


def test_measuring_is_said_on_stderr(capsys):
    ctx = SimulationContext(strategy="auto", decision_cache=False, progress=True)
    run(ctx, make_round(), np.ones(3, np.float32), clients(6))
    err = capsys.readouterr().err
    assert "fedlang: measuring loop vs scan for client_update" in err
    assert "fedlang: picked" in err


def test_a_live_progress_display_shows_measuring_in_place_of_stderr(capsys):
    from fedlang.core import status

    shown = []
    ctx = SimulationContext(strategy="auto", decision_cache=False, progress=True)
    with status.showing(shown.append):
        run(ctx, make_round(), np.ones(3, np.float32), clients(6))
    assert any(m.startswith("measuring loop vs scan for client_update") for m in shown), shown
    assert "fedlang:" not in capsys.readouterr().err  # a line under a live bar breaks it


def test_measurement_stops_when_the_budget_is_spent():
    calls = {"a": 0, "b": 0}

    def candidate(name):
        def fn():
            calls[name] += 1
            return jnp.zeros(())

        return fn

    tuner = autotune.Tuner(budget_s=1e-9, cache=False, progress=False)
    seconds = tuner.measure("two candidates", {"a": candidate("a"), "b": candidate("b")}, units=4)
    assert calls == {"a": 2, "b": 2}  # one compiling run, then one timed round each
    assert set(seconds) == {"a", "b"} and all(v > 0 for v in seconds.values())


def test_one_slow_run_does_not_drop_a_candidate(monkeypatch):
    # A fake clock: each run advances it by the candidate's cost. Both compile slowly
    # (the untimed first run); "a" has one hiccup (its first timed run is 10x its usual
    # cost) and is still the fastest on its best run.
    now = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: now[0])
    costs = {"a": iter([20.0, 10.0] + [1.0] * 10), "b": iter([20.0] + [2.0] * 11)}

    def candidate(name):
        def fn():
            now[0] += next(costs[name])

        return fn

    tuner = autotune.Tuner(budget_s=1e9, cache=False, progress=False)
    seconds = tuner.measure("a hiccup", {"a": candidate("a"), "b": candidate("b")}, units=1)
    assert seconds == {"a": 1.0, "b": 2.0}


def test_scan_is_kept_unless_loop_clearly_wins():
    assert local_exec._loop_or_scan({"loop": 0.9, "scan": 1.0}) == "scan"
    assert local_exec._loop_or_scan({"loop": 0.7, "scan": 1.0}) == "loop"
    assert local_exec._loop_or_scan({"loop": 1.0, "scan": float("inf")}) == "loop"
    assert local_exec._width({"vmap": 0.9, "per-client": 1.0}) == "per-client"


def test_auto_options_are_validated():
    with pytest.raises(ValueError, match="auto_budget_s"):
        Options(auto_budget_s=0)
    with pytest.raises(ValueError, match="vmap_width"):
        Options(vmap_width=0)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a rule for XLA:CPU only")
def test_a_convolution_on_cpu_runs_per_client_loop_without_measuring(capsys):
    images = fl.SequenceType(fl.TensorType(np.float32, [None, 6, 6, 1]))
    kernel_t = fl.TensorType(np.float32, [3, 3, 1, 2])

    @fl.jax_computation(kernel_t, images)
    def conv_sum(kernel, ds):
        def step(total, x):
            y = jax.lax.conv_general_dilated(
                x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            return total + jnp.sum(y)

        return ds.reduce(jnp.float32(0), step)

    @fl.federated_computation(fl.type_at_server(kernel_t), fl.type_at_clients(images))
    def total(kernel, data):
        return fl.federated_sum(fl.federated_map(conv_sum, (fl.federated_broadcast(kernel), data)))

    kernel = np.ones((3, 3, 1, 2), np.float32)
    data = [[np.ones((2, 6, 6, 1), np.float32)] * 3 for _ in range(5)]
    ctx = SimulationContext(strategy="auto", decision_cache=False, progress=True)
    got = run(ctx, total, kernel, data)
    assert "measuring" not in capsys.readouterr().err
    rows = local_exec.describe_choices(ctx.runner)
    assert {(r["picked"], r["source"]) for r in rows} <= {("loop", "prior"), ("per-client", "prior")}
    assert rows and all(r["source"] == "prior" for r in rows)
    want = run(SimulationContext(strategy="loop"), total, kernel, data)
    np.testing.assert_allclose(got, want)
