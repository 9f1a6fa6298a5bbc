"""Runs examples/fedavg_from_scratch.py on small settings and checks that it learns."""

import subprocess
import sys

import numpy as np
import pytest

import fedlang as fl

MODEL = "<kernel=float32[64,10],bias=float32[10]>"
BATCHES = "{sequence<<x=float32[?,64],y=int32[?]>>}@CLIENTS"


@pytest.fixture(scope="module")
def example(load_script):
    return load_script("examples/fedavg_from_scratch.py")


def test_process_type_signatures(example):
    process = example.build_fedavg()

    assert str(process.initialize.type_signature) == f"( -> {MODEL}@SERVER)"
    assert str(process.next.type_signature) == (
        f"(<server_weights={MODEL}@SERVER,client_data={BATCHES}> -> "
        f"<{MODEL}@SERVER,<client_loss=float32,num_examples=float32>@SERVER>)"
    )


def test_data_is_non_iid_and_deterministic(example):
    clients, test = example.load_data(num_clients=20, seed=0)
    again, _ = example.load_data(num_clients=20, seed=0)

    assert len(clients) == 20
    assert sum(len(c["y"]) for c in clients) + len(test["y"]) == 1797
    for c, d in zip(clients, again):
        np.testing.assert_array_equal(c["y"], d["y"])
        assert c["x"].dtype == np.float32 and c["y"].dtype == np.int32
        assert c["x"].min() >= 0.0 and c["x"].max() <= 1.0
        # Mostly two labels: the top two make up most of every client's examples.
        counts = np.sort(np.bincount(c["y"], minlength=10))[::-1]
        assert counts[:2].sum() >= 0.7 * counts.sum()


def test_one_round_reports_metrics(example):
    clients, _ = example.load_data(num_clients=4, seed=1)
    process = example.build_fedavg()
    rng = np.random.default_rng(0)
    data = [example.make_batches(c, batch_size=16, epochs=1, rng=rng) for c in clients]

    state = process.initialize()
    new_state, metrics = process.next(state, data)

    assert set(new_state) == {"kernel", "bias"}
    assert new_state["kernel"].shape == (64, 10)
    assert not np.allclose(new_state["kernel"], state["kernel"])
    expected_examples = sum(len(batches) * 16 for batches in data)
    assert float(metrics["num_examples"]) == expected_examples
    assert 0.0 < float(metrics["client_loss"]) < np.log(10.0) + 1e-3


def test_training_improves_accuracy(example, capsys):
    history = example.main(rounds=6, verbose=True)

    assert len(history) == 7
    assert history[0] < 0.2  # an all-zero model predicts one class
    assert history[-1] > 0.75
    assert history[-1] - history[0] > 0.5
    out = capsys.readouterr().out
    assert "round  6" in out and "test accuracy" in out


_RUN_SERIALIZED = """
import sys
import numpy as np
import fedlang as fl

initialize = fl.Computation.from_bytes(open(sys.argv[1], "rb").read())
next_fn = fl.Computation.from_bytes(open(sys.argv[2], "rb").read())
rng = np.random.default_rng(0)
batch = {"x": rng.random((16, 64), dtype=np.float32), "y": (np.arange(16) % 10).astype(np.int32)}
with fl.runtime.reference_context():
    state, metrics = next_fn(initialize(), [[batch] * 3, [batch]])
print(float(metrics["client_loss"]), float(metrics["num_examples"]), float(state["bias"][0]))
"""


def test_serialized_process_runs_without_the_example(example, tmp_path):
    # arrange: the process's computations as bytes, and the same round run in-process
    process = example.build_fedavg()
    init_file, next_file = tmp_path / "initialize.fedlang", tmp_path / "next.fedlang"
    init_file.write_bytes(process.initialize.to_bytes())
    next_file.write_bytes(process.next.to_bytes())
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.random((16, 64), dtype=np.float32),
        "y": (np.arange(16) % 10).astype(np.int32),
    }
    with fl.runtime.reference_context():
        state, metrics = process.next(process.initialize(), [[batch] * 3, [batch]])

    # act: a fresh interpreter that never imports the example
    out = subprocess.run(
        [sys.executable, "-c", _RUN_SERIALIZED, str(init_file), str(next_file)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )

    # assert
    loss, num_examples, bias0 = (float(v) for v in out.stdout.split())
    assert num_examples == float(metrics["num_examples"]) == 64.0
    assert loss == pytest.approx(float(metrics["client_loss"]), rel=1e-5)
    assert bias0 == pytest.approx(float(state["bias"][0]), rel=1e-4, abs=1e-6)
