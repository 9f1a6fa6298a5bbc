"""The experiment driver: rounds, evaluation, writers, checkpoints and exact resume.

The process under test is FedAvg written with the core only (as in
examples/fedavg_from_scratch.py), so these tests do not depend on fedlang.learning.
"""

import collections
import doctest
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
import fedlang.simulation as sim
from fedlang.core import status

BATCH_SPEC = {"x": (np.float32, [16, 64]), "y": (np.int32, [16])}
MODEL_SPEC = {"kernel": (np.float32, [64, 10]), "bias": (np.float32, [10])}


def _loss(w, batch):
    logits = batch["x"] @ w["kernel"] + w["bias"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


class _FedAvg:
    """`initialize`/`next` like an IterativeProcess, with a namedtuple metrics value."""

    Metrics = collections.namedtuple("Metrics", ["loss", "num_examples"])

    def __init__(self, lr=0.3):
        model_t, batch_t = fl.to_type(MODEL_SPEC), fl.to_type(BATCH_SPEC)

        @fl.jax_computation()
        def init_model():
            return {"kernel": jnp.zeros([64, 10], jnp.float32), "bias": jnp.zeros([10], jnp.float32)}

        @fl.jax_computation(model_t, fl.SequenceType(batch_t))
        def client_update(w, dataset):
            def step(s, batch):
                loss, g = jax.value_and_grad(_loss)(s["w"], batch)
                return {"w": {k: v - lr * g[k] for k, v in s["w"].items()},
                        "n": s["n"] + jnp.float32(16), "loss": s["loss"] + loss * jnp.float32(16)}

            out = dataset.reduce({"w": w, "n": jnp.float32(0), "loss": jnp.float32(0)}, step)
            return {"w": out["w"], "n": out["n"], "loss": out["loss"] / jnp.maximum(out["n"], 1.0)}

        @fl.federated_computation()
        def initialize():
            return fl.federated_eval(init_model, fl.SERVER)

        @fl.federated_computation(fl.type_at_server(model_t), fl.type_at_clients(fl.SequenceType(batch_t)))
        def next_fn(w, data):
            out = fl.federated_map(client_update, (fl.federated_broadcast(w), data))
            new_w = fl.federated_mean(out.w, weight=out.n)
            return new_w, fl.federated_zip({"loss": fl.federated_mean(out.loss),
                                            "num_examples": fl.federated_sum(out.n)})

        self.process = fl.templates.IterativeProcess(initialize, next_fn)
        self.calls = 0
        self.fail_at = None

    def initialize(self):
        return self.process.initialize()

    def next(self, state, data):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise KeyboardInterrupt("simulated crash")
        state, m = self.process.next(state, data)
        return state, {"client_work": {"train": self.Metrics(m["loss"], m["num_examples"])}}


@pytest.fixture(scope="module")
def fedavg():
    with fl.runtime.simulation_context(strategy="loop"):
        yield _FedAvg()


@pytest.fixture(scope="module")
def data():
    return sim.datasets.digits_train_test(num_clients=8, partition="iid", seed=0)


def _preprocess(ds, seed):
    return ds.shuffle(200, seed=seed).batch(16, drop_remainder=True)


def _evaluation(test):
    xs = [test.create_dataset_for_client(c) for c in test.client_ids]
    arrays = [next(iter(ds.batch(10_000))) for ds in xs]
    x = np.concatenate([a["x"] for a in arrays])
    y = np.concatenate([a["y"] for a in arrays])

    def evaluate(state):
        logits = x @ np.asarray(state["kernel"]) + np.asarray(state["bias"])
        return {"accuracy": float(np.mean(logits.argmax(-1) == y)), "count": len(y)}

    return evaluate


def _run(fedavg, data, rounds, **kwargs):
    train, test = data
    kwargs.setdefault("progress", False)
    return sim.run_training(
        fedavg, train, sim.UniformSampler(train.client_ids, 3, seed=7), rounds,
        preprocess=_preprocess, evaluation=_evaluation(test), **kwargs,
    )


def _assert_equal_states(a, b):
    for key in ("kernel", "bias"):
        assert np.array_equal(np.asarray(a[key]), np.asarray(b[key]))


def test_runs_rounds_and_records_metrics(fedavg, data):
    result = _run(fedavg, data, 3, evaluate_every=2)
    assert result.round_num == 3 and result.resumed_from is None and result.checkpoint is None
    assert [h["round"] for h in result.history] == [1, 2, 3]
    first = result.history[0]["metrics"]
    assert set(first["train"]["client_work"]["train"]) == {"loss", "num_examples"}
    assert "eval" not in first  # evaluated after rounds 2 and 3 (the last)
    assert [("eval" in h["metrics"]) for h in result.history] == [False, True, True]
    assert result.history[-1]["metrics"]["eval"]["accuracy"] > 0.5


def test_resume_gives_exactly_the_uninterrupted_weights(fedavg, data, tmp_path):
    uninterrupted = _run(fedavg, data, 5)
    # arrange: a run that stops after round 2 (its checkpoint), then a fresh sampler
    first = _run(fedavg, data, 2, checkpoint_dir=tmp_path)
    # act
    resumed = _run(fedavg, data, 5, checkpoint_dir=tmp_path)
    # assert
    assert first.checkpoint is not None and resumed.resumed_from == 2
    assert [h["round"] for h in resumed.history] == [3, 4, 5]
    _assert_equal_states(resumed.state, uninterrupted.state)
    assert [p.name for p in sim.checkpoint.checkpoints(tmp_path)] == [
        "ckpt-00000004.fedlckpt", "ckpt-00000005.fedlckpt"]


def test_crash_mid_run_then_resume_is_exact_and_files_have_each_round_once(fedavg, data, tmp_path):
    uninterrupted = _run(fedavg, data, 5)
    out = tmp_path / "run"
    fedavg.calls, fedavg.fail_at = 0, 4  # round 4 crashes; rounds 1-3 completed
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(fedavg, data, 5, checkpoint_dir=out / "ckpt", checkpoint_every=2,
                 metrics=[sim.writers.JSONLinesWriter(out / "m.jsonl"), sim.writers.CSVWriter(out / "m.csv")])
    finally:
        fedavg.fail_at = None
    assert sim.checkpoint.load(sim.checkpoint.latest(out / "ckpt")).round_num == 2
    resumed = _run(fedavg, data, 5, checkpoint_dir=out / "ckpt",
                   metrics=[sim.writers.JSONLinesWriter(out / "m.jsonl"), sim.writers.CSVWriter(out / "m.csv")])
    assert resumed.resumed_from == 2
    _assert_equal_states(resumed.state, uninterrupted.state)
    rounds = [json.loads(line)["round"] for line in (out / "m.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3, 4, 5]
    csv_rounds = [line.split(",")[0] for line in (out / "m.csv").read_text().splitlines()[1:]]
    assert csv_rounds == ["1", "2", "3", "4", "5"]


def _ctrl_c_in_round(fedavg, monkeypatch, round_num, times=1):
    """Makes Ctrl-C (SIGINT to this process) arrive `times` times while round `round_num`
    runs, as a user's would."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own
    real_next, calls = fedavg.next, [0]

    def next_with_ctrl_c(state, data):
        calls[0] += 1
        if calls[0] == round_num:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        return real_next(state, data)

    monkeypatch.setattr(fedavg, "next", next_with_ctrl_c)


def test_ctrl_c_stops_after_the_round_checkpoints_it_and_resumes_exactly(
        fedavg, data, tmp_path, monkeypatch):
    uninterrupted = _run(fedavg, data, 5)
    _ctrl_c_in_round(fedavg, monkeypatch, 2)
    with pytest.raises(sim.TrainingInterrupted) as stopped:
        _run(fedavg, data, 5, checkpoint_dir=tmp_path, checkpoint_every=5)
    monkeypatch.undo()
    # round 2 finished and was checkpointed although checkpoint_every is 5
    assert stopped.value.result.round_num == 2 and stopped.value.rounds == 5
    assert stopped.value.checkpoint_round == 2 and stopped.value.result.checkpoint is not None
    assert [h["round"] for h in stopped.value.result.history] == [1, 2]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    resumed = _run(fedavg, data, 5, checkpoint_dir=tmp_path)
    assert resumed.resumed_from == 2
    _assert_equal_states(resumed.state, uninterrupted.state)


def test_ctrl_c_twice_stops_at_once_keeping_the_rounds_done(fedavg, data, tmp_path, monkeypatch):
    _ctrl_c_in_round(fedavg, monkeypatch, 2, times=2)
    with pytest.raises(sim.TrainingInterrupted) as stopped:
        _run(fedavg, data, 5, checkpoint_dir=tmp_path)
    assert isinstance(stopped.value.__cause__, KeyboardInterrupt)
    assert stopped.value.result.round_num == 1 and stopped.value.checkpoint_round == 1


def test_ctrl_c_during_set_up_stops_before_round_1(fedavg, data, tmp_path):
    with status.defer_interrupts() as interrupts:
        os.kill(os.getpid(), signal.SIGINT)  # while the caller loads data, say
        assert interrupts.requested()
        with pytest.raises(sim.TrainingInterrupted) as stopped:
            _run(fedavg, data, 5, checkpoint_dir=tmp_path)
    assert stopped.value.result.round_num == 0 and stopped.value.checkpoint_round is None
    assert sim.checkpoint.latest(tmp_path) is None


def test_interrupted_checkpoint_write_keeps_the_previous_one(fedavg, data, tmp_path, monkeypatch):
    _run(fedavg, data, 1, checkpoint_dir=tmp_path)

    def broken_fsync(fd):
        raise KeyboardInterrupt("killed while writing the checkpoint")

    monkeypatch.setattr(sim.checkpoint.os, "fsync", broken_fsync)
    with pytest.raises(KeyboardInterrupt):
        _run(fedavg, data, 2, checkpoint_dir=tmp_path)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000001.fedlckpt"]
    resumed = _run(fedavg, data, 2, checkpoint_dir=tmp_path)
    assert resumed.resumed_from == 1


def test_checkpoint_of_another_configuration_is_refused(fedavg, data, tmp_path):
    train = data[0]
    _run(fedavg, data, 1, checkpoint_dir=tmp_path, config={"client_lr": 0.3})
    with pytest.raises(sim.CheckpointMismatchError, match=r"client_lr: checkpoint 0.3, this run 0.1"):
        _run(fedavg, data, 2, checkpoint_dir=tmp_path, config={"client_lr": 0.1})
    other_sampler = sim.UniformSampler(train.client_ids, 3, seed=1)
    with pytest.raises(sim.CheckpointMismatchError, match=r"sampler.seed: checkpoint 7, this run 1"):
        sim.run_training(fedavg, train, other_sampler, 2, preprocess=_preprocess,
                         checkpoint_dir=tmp_path, config={"client_lr": 0.3}, progress=False)


def test_checkpoint_beyond_rounds_is_an_error(fedavg, data, tmp_path):
    _run(fedavg, data, 2, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="Expected rounds >= 2"):
        _run(fedavg, data, 1, checkpoint_dir=tmp_path)
    assert _run(fedavg, data, 2, checkpoint_dir=tmp_path).history == []
    with pytest.raises(FileExistsError, match="resume=False"):
        _run(fedavg, data, 2, checkpoint_dir=tmp_path, resume=False)


def test_function_train_data_and_learning_process_output(data):
    Output = collections.namedtuple("Output", ["state", "metrics"])

    class Counter:
        def initialize(self):
            return {"n": np.int64(0)}

        def next(self, state, client_data):
            return Output({"n": state["n"] + len(client_data)}, {"clients": len(client_data)})

    seen = []
    result = sim.run_training(
        Counter(), lambda r, ids: seen.append((r, ids)) or ids,
        sim.UniformSampler([str(i) for i in range(5)], 2, seed=0), 3, progress=False)
    assert int(result.state["n"]) == 6 and [r for r, _ in seen] == [1, 2, 3]


def test_bad_arguments(fedavg, data):
    train = data[0]
    sampler = sim.UniformSampler(train.client_ids, 2, seed=0)
    with pytest.raises(ValueError, match="Expected rounds to be an integer >= 0"):
        sim.run_training(fedavg, train, sampler, -1)
    with pytest.raises(TypeError, match="Expected a process with initialize"):
        sim.run_training(object(), train, sampler, 1)
    with pytest.raises(TypeError, match="Expected train_data to be a ClientData"):
        sim.run_training(fedavg, [1, 2], sampler, 1)

    class NoState:
        def sample(self):
            return train.client_ids[:2]

    with pytest.raises(TypeError, match=r"get_state\(\)/set_state\(\) to checkpoint"):
        sim.run_training(fedavg, train, NoState(), 1, checkpoint_dir="unused")


def test_derive_seed_depends_only_on_its_arguments():
    assert sim.derive_seed(0, 3, "a") == sim.derive_seed(0, 3, "a")
    assert len({sim.derive_seed(0, r, c) for r in range(3) for c in "abc"}) == 9


def test_docstring_example():
    from fedlang.simulation import driver

    result = doctest.testmod(driver)
    assert result.attempted > 0 and result.failed == 0
