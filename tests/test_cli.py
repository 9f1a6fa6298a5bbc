"""The `fedlang` command line (typer's CliRunner; one subprocess for `python -m fedlang`)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import fedlang.simulation as sim
from fedlang import _experiment, cli

runner = CliRunner()


def _invoke(*args):
    return runner.invoke(cli.app, [str(a) for a in args])


@pytest.fixture
def store_path(tmp_path):
    cd = sim.datasets.digits(num_clients=6, partition="iid", seed=0)
    return sim.store.write(tmp_path / "digits_store", cd)


def test_python_dash_m_fedlang_help():
    out = subprocess.run([sys.executable, "-m", "fedlang", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout and "train" in out.stdout


def test_data_inspect_store(store_path):
    result = _invoke("data", "inspect", store_path)
    assert result.exit_code == 0, result.output
    assert "6" in result.output and "1,797" in result.output
    assert "<x=float32[64],y=int32>" in result.output
    assert "Clients by number of examples" in result.output


def test_data_convert_csv_then_inspect(tmp_path):
    csv_path = tmp_path / "d.csv"
    csv_path.write_text("user,a,label\nu1,0.5,1\nu1,1.5,0\nu2,2.5,1\n")
    missing = _invoke("data", "convert", csv_path, tmp_path / "s")
    assert missing.exit_code == 1 and "['user', 'a', 'label']" in missing.output
    result = _invoke("data", "convert", csv_path, tmp_path / "s", "--client-column", "user")
    assert result.exit_code == 0, result.output
    assert "Wrote 2 clients, 3 examples" in result.output
    assert sim.ClientData.from_store(tmp_path / "s").num_examples("u1") == 2
    again = _invoke("data", "convert", csv_path, tmp_path / "s", "--client-column", "user")
    assert again.exit_code == 1 and "overwrite" in again.output


def test_data_inspect_sqlite_lists_splits_then_decodes(tmp_path):
    from fedlang.simulation.formats import sqlite

    path = tmp_path / "t.sqlite"
    sqlite.write_sqlite(path, "train", {"a": [{"pixels": np.ones(4, np.float32), "label": np.int64([3])}]})
    listed = _invoke("data", "inspect", path)
    assert listed.exit_code == 0 and "['train']" in listed.output
    detail = _invoke("data", "inspect", path, "--split", "train")
    assert detail.exit_code == 0, detail.output
    assert "label=int32" in detail.output and "pixels=float32[4]" in detail.output


@pytest.mark.parametrize("content, message", [
    (None, "found nothing there"),
    (b"not a store", "Expected a store directory"),
])
def test_data_inspect_bad_paths(tmp_path, content, message):
    path = tmp_path / "thing.bin"
    if content is not None:
        path.write_bytes(content)
    result = _invoke("data", "inspect", path)
    assert result.exit_code == 1 and message in result.output


def test_data_inspect_corrupt_store(store_path):
    (store_path / "index.json").write_text("{")
    result = _invoke("data", "inspect", store_path)
    assert result.exit_code == 1 and "corrupt" in result.output


def _config(tmp_path, **training):
    training = {"rounds": 2, "cohort_size": 3, "evaluate_every": 1, "checkpoint_every": 1, **training}
    lines = [
        "[data]", 'dataset = "digits"', "num_clients = 8", "held_out_clients = 0", "epochs = 1",
        "[model]", 'kind = "softmax"',
        "[algorithm.client_optimizer]", 'name = "sgd"', "learning_rate = 0.2",
        "[training]", *(f"{k} = {v}" for k, v in training.items()),
        "[output]", f'dir = "{tmp_path / "run"}"',
    ]
    path = tmp_path / "exp.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_train_writes_outputs_resumes_and_refuses_another_config(tmp_path):
    config = _config(tmp_path)
    first = _invoke("train", config, "--no-progress")
    assert first.exit_code == 0, first.output
    assert "Accuracy by round" in first.output
    out = tmp_path / "run"
    assert {p.name for p in out.iterdir()} >= {"metrics.csv", "metrics.jsonl", "metrics.png",
                                               "tensorboard", "checkpoints"}
    resumed = _invoke("train", config, "--rounds", 3, "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    assert "Resumed from the checkpoint of round 2" in resumed.output
    rounds = [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]
    other = _config(tmp_path, cohort_size=4)
    refused = _invoke("train", other, "--rounds", 4, "--no-progress")
    assert refused.exit_code == 1
    assert "cohort_size: checkpoint 3, this run 4" in refused.output


@pytest.mark.parametrize("text, message", [
    ("[data]\nbogus = 1\n", "unknown key 'data.bogus'"),
    ("[training]\nrounds = 'ten'\n", "Expected training.rounds to be a int"),
    ("[algorithm]\nname = 'fedmagic'\n", "algorithm.name in"),
    ("[data\n", "syntax error"),
    ("[data]\ndataset = 'store'\n", "data.path for dataset 'store'"),
])
def test_train_bad_configs_exit_2_with_the_reason(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = _invoke("train", path)
    assert result.exit_code == 2 and message in result.output


def test_train_missing_config(tmp_path):
    result = _invoke("train", tmp_path / "nope.toml")
    assert result.exit_code == 1 and "Expected a TOML config" in result.output


def test_fingerprint_ignores_rounds_and_output():
    a = _experiment.load_config(training={"rounds": 3}, output={"dir": "a"})
    b = _experiment.load_config(training={"rounds": 9}, output={"dir": "b"})
    assert _experiment.fingerprint_config(a) == _experiment.fingerprint_config(b)


@pytest.mark.slow
def test_demo_runs(tmp_path):
    result = _invoke("demo", "--output-dir", tmp_path / "demo", "--rounds", 5, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "Accuracy by round" in result.output and (tmp_path / "demo" / "metrics.png").exists()
