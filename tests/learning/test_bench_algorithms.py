"""bench/algorithms.py: its attack is what it says, and its quick run reports every table."""

import jax
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms


def test_a_marked_client_sends_its_honest_update_negated_and_scaled(load_script):
    bench = load_script("bench/algorithms.py")
    process = algorithms.build_unweighted_fed_avg(bench.w1(attack_scale=10.0), optax.sgd(0.1))
    rng = np.random.default_rng(0)
    batch = {"x": rng.uniform(size=(8, 64)).astype(np.float32),
             "y": rng.integers(0, 10, 8).astype(np.int32)}
    marked = {"x": batch["x"], "y": batch["y"] + 10}

    def update(client_batch):
        state = process.initialize()
        before = process.get_model_weights(state).trainable
        with jax.numpy_dtype_promotion("standard"):
            state, _ = process.next(state, [[client_batch]])
        after = process.get_model_weights(state).trainable
        return {k: np.asarray(after[k]) - np.asarray(before[k]) for k in before}

    honest, attacker = update(batch), update(marked)
    assert np.abs(honest["kernel"]).max() > 1e-3  # an update to negate
    for k in honest:
        np.testing.assert_allclose(attacker[k], -10.0 * honest[k], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_run_reports_every_table(load_script, capsys):
    out = load_script("bench/algorithms.py").main(["--quick"])
    rounds = {r["algorithm"]: r for r in out["rounds"]}
    assert set(rounds) == {"FedAvg", "FedProx (mu 0.1)", "SCAFFOLD",
                           "Mime Lite (SGD momentum 0.9)"}
    for r in rounds.values():  # each stopped at the target, or ran every round below it
        stopped = r["final_accuracy"][0]
        assert (stopped >= r["target"]) == (r["rounds_per_seed"][0] is not None)
    personal = {r["method"].split(" (")[0].split(",")[0]: r for r in out["personal"]}
    assert set(personal) == {"FedAvg", "FedAvg + fine-tuning", "Ditto", "FedRecon"}
    baseline = out["personal"][0]
    assert baseline["method"] == "FedAvg, global model"
    assert personal["FedAvg + fine-tuning"]["accuracy"] > baseline["accuracy"]
    robust = {r["aggregator"].split(" (")[0]: r for r in out["robust"]}
    assert set(robust) == {"mean", "Krum", "Bulyan", "coordinate median"}
    assert robust["mean"]["attacked"] < robust["mean"]["clean"] - 0.2  # the attack bites
    assert all(0 <= r[k] <= 1 for r in out["robust"] for k in ("clean", "attacked"))
    printed = capsys.readouterr().out
    assert "### Rounds to a target accuracy" in printed
    assert "| FedAvg + fine-tuning (2 local epochs) |" in printed
    assert "| coordinate median |" in printed
