"""The `fedlang` command line: typer's CliRunner, and the real command for what a user sees."""

import concurrent.futures
import json
import os
import pathlib
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
    assert "pip install 'fedlang[tensorboard]'" in first.output  # how to view TensorBoard
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
    ("[training]\nrounds = 'ten'\n", "Expected training.rounds to be an integer"),
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


# -- through the real command: `python -m fedlang ...` with this checkout's sources ---------

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


def fedlang(*args, cwd=None):
    """Runs the real `fedlang` command; returns (exit status, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "fedlang", *map(str, args)], capture_output=True,
                         text=True, timeout=300, env=env, cwd=cwd)
    return out.returncode, out.stdout, out.stderr


def fedlang_all(*commands, cwd=None):
    """Several commands at once (each is a fresh process: most of its time is imports)."""
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda c: fedlang(*c, cwd=cwd), commands))


def _one_sentence_error(result, code, *fragments):
    status, _, err = result
    assert status == code, err[-2000:]
    assert "Traceback" not in err
    text = " ".join(err.split())
    assert text.startswith("Error: Expected"), text
    for f in fragments:
        assert f in text, (f, text)


CSV = "user,temp,humidity,label,blanky\n" + "".join(
    f"u{u},{1000 + 250 * ((u + i) % 4)},{50000 - 900 * i},{(u + i) % 4 // 2},"
    f"{'' if (u, i) == (1, 3) else (u + i) % 4 // 2}\n" for u in range(4) for i in range(12))


def _csv_config(tmp_path, name, **data):
    (tmp_path / "sensors.csv").write_text(CSV)
    data = {"dataset": '"csv"', "path": '"sensors.csv"', "client_column": '"user"',
            "x": '["temp", "humidity"]', "y": '"label"', "held_out_clients": 0, "epochs": 1,
            "batch_size": 4,
            **data}
    lines = ["[data]", *(f"{k} = {v}" for k, v in data.items() if v is not None),
             "[model]", 'kind = "softmax"', "num_classes = 2",
             "[training]", "rounds = 2", "cohort_size = 2", "evaluate_every = 10",
             "[output]", f'dir = "{name}"']
    (tmp_path / f"{name}.toml").write_text("\n".join(lines) + "\n")
    return f"{name}.toml"


def test_version_and_config_errors_say_one_sentence_with_tables_and_types(tmp_path):
    (tmp_path / "types.toml").write_text('[training]\nrounds = "5"\n')
    (tmp_path / "table.toml").write_text("[training]\nbogus = 1\n")
    version, types_, table = fedlang_all(["--version"], ["train", "types.toml"],
                                         ["train", "table.toml"], cwd=tmp_path)
    assert version[0] == 0 and version[1].strip() == "fedlang 0.1.0"
    _one_sentence_error(types_, 2, "Expected training.rounds to be an integer, found '5' (a string).")
    _one_sentence_error(table, 2, "in [training], found unknown key 'training.bogus'")


def test_data_errors_say_one_sentence_naming_config_keys(tmp_path):
    configs = [_csv_config(tmp_path, "no_client", client_column=None),
               _csv_config(tmp_path, "no_field", x='["temp", "wind"]'),
               _csv_config(tmp_path, "blanks", y='"blanky"')]
    no_client, no_field, blanks = fedlang_all(*(["train", c] for c in configs), cwd=tmp_path)
    _one_sentence_error(no_client, 2, "data.client_column", "'user', 'temp'", "in [data]")
    _one_sentence_error(no_field, 2, "found no field ['wind']", "'humidity'")
    # The CSV reader refuses a blank label cell, naming the column and the line.
    _one_sentence_error(blanks, 1, "column 'blanky'", "a blank at line", "sensors.csv")


def test_checkpoint_errors_name_the_cli_flags(tmp_path):
    from fedlang.simulation import checkpoint

    config = _csv_config(tmp_path, "run")
    checkpoint.save(tmp_path / "run" / "checkpoints", 3, {"w": np.zeros(2, np.float32)},
                    fingerprint="earlier", config={})
    fewer, fresh = fedlang_all(["train", config], ["train", config, "--rounds", 5, "--no-resume"],
                               cwd=tmp_path)
    _one_sentence_error(fewer, 2, "training.rounds (--rounds) >= 3", "Pass --rounds 3 or more",
                        "--output-dir DIR")
    _one_sentence_error(fresh, 2, "--no-resume", "Pass --resume", "--output-dir DIR")
    assert "resume=True" not in fresh[2] and "checkpoint_dir" not in fewer[2]


def test_data_convert_advice_names_the_overwrite_flag(tmp_path):
    (tmp_path / "d.csv").write_text("user,a,label\nu1,0.5,1\n")
    (tmp_path / "s").mkdir()
    result = fedlang("data", "convert", "d.csv", "s", "--client-column", "user", cwd=tmp_path)
    _one_sentence_error(result, 1, "Pass --overwrite")
    assert "overwrite=True" not in result[2]


def test_several_feature_columns_and_a_diverging_run_is_said(tmp_path, monkeypatch):
    # raw features in the thousands: the softmax's loss explodes in round 1
    status, _, err = fedlang("train", _csv_config(tmp_path, "raw"), "--no-progress", cwd=tmp_path)
    assert status == 0, err[-2000:]
    text = " ".join(err.split())
    assert "Warning: The training diverged: in round 1 the train loss is" in text
    assert "standardize = true in [data]" in text
    # standardized: the features the model sees have mean 0 and deviation 1
    config = _experiment.load_config(tmp_path / _csv_config(tmp_path, "std", standardize="true"))
    monkeypatch.chdir(tmp_path)
    train, _ = _experiment.load_data(config)
    xs = np.stack([e["x"] for c in train.client_ids for e in train.create_dataset_for_client(c)])
    np.testing.assert_allclose(xs.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(xs.std(0), 1, atol=1e-5)
