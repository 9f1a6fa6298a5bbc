"""`fedlang demo` and `fedlang train CONFIG.toml` (src/fedlang/cli/training.py)."""

import concurrent.futures
import json
import re
import signal
import time

import pytest

import fedlang.simulation as sim
from fedlang.cli import experiment

from ._run import SRC as SRC_ROOT
from ._run import fedlang, fedlang_in_terminal, invoke, start_fedlang


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
    first = invoke("train", config, "--no-progress")
    assert first.exit_code == 0, first.output
    assert "Accuracy by round" in first.output
    assert "pip install 'fedlang[tensorboard]'" in first.output  # how to view TensorBoard
    out = tmp_path / "run"
    assert {p.name for p in out.iterdir()} >= {"metrics.csv", "metrics.jsonl", "metrics.png",
                                               "tensorboard", "checkpoints"}
    resumed = invoke("train", config, "--rounds", 3, "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    assert "Resumed from the checkpoint of round 2" in resumed.output
    rounds = [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]
    other = _config(tmp_path, cohort_size=4)
    refused = invoke("train", other, "--rounds", 4, "--no-progress")
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
    result = invoke("train", path)
    assert result.exit_code == 2 and message in result.output


def test_train_missing_config(tmp_path):
    result = invoke("train", tmp_path / "nope.toml")
    assert result.exit_code == 1 and "Expected a TOML config" in result.output


@pytest.mark.slow
def test_demo_runs(tmp_path):
    result = invoke("demo", "--output-dir", tmp_path / "demo", "--rounds", 5, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "Accuracy by round" in result.output and (tmp_path / "demo" / "metrics.png").exists()


def test_train_help_is_the_config_reference_a_pip_user_has():
    # the messages about config keys point here, not to a file under docs/
    status, help_text, err = fedlang("train", "--help")
    assert status == 0, err
    text = " ".join(help_text.split())
    for table, keys in experiment.DEFAULTS.items():
        for key, default in keys.items():
            name = f"[{table}.{key}]" if isinstance(default, dict) else key
            assert name in text, name
        assert f"[{table}]" in text, table
    for choice in (*experiment.DATASETS, *experiment.ALGORITHMS, *experiment.OPTIMIZERS):
        assert choice in text, choice


def test_an_unknown_key_or_missing_config_points_to_the_installed_help(tmp_path):
    (tmp_path / "typo.toml").write_text("[training]\nround = 3\n")
    typo = fedlang("train", "typo.toml", cwd=tmp_path)
    missing = fedlang("train", "nope.toml", cwd=tmp_path)
    for status, _, err in (typo, missing):
        assert status in (1, 2) and "fedlang train --help" in err and "docs/" not in err, err


def test_the_demo_header_is_one_line_in_a_file_or_a_pipe(monkeypatch):
    # issue 37, item 12a: rich cut it at 80 columns ("...(Dirichlet\nalpha=0.5)...")
    import io

    from rich.console import Console

    from fedlang.cli import console, training

    piped, terminal = io.StringIO(), io.StringIO()
    config = experiment.load_config()
    monkeypatch.setattr(console, "out", Console(file=piped))  # not a terminal: 80 columns
    training.demo_header(config)
    monkeypatch.setattr(console, "out", Console(file=terminal, force_terminal=True, width=60,
                                                color_system=None))
    training.demo_header(config)
    assert piped.getvalue() == ("fedlang demo: FedAvg, MLP 64-32-10, digits over 40 clients "
                                "(Dirichlet alpha=0.5), 30 rounds of 10 clients.\n")
    lines = terminal.getvalue().splitlines()  # a terminal wraps it at its width, by words
    assert len(lines) > 1 and all(len(line) <= 60 for line in lines)
    assert " ".join(line.strip() for line in lines) == piped.getvalue().strip()


def test_demo_says_scikit_learn_is_missing_before_its_banner(tmp_path):
    # an install without scikit-learn (fedlang[deploy] only): the import fails
    (tmp_path / "uninstalled" / "sklearn").mkdir(parents=True)
    (tmp_path / "uninstalled" / "sklearn" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'sklearn'\", name='sklearn')\n")
    status, out, err = fedlang("demo", "--output-dir", tmp_path / "demo",
                               path_first=tmp_path / "uninstalled")
    assert status == 1 and out == "", (out, err)
    text = " ".join(err.split())
    assert text.startswith("Error: Expected scikit-learn"), text
    assert "pip install 'fedlang[examples]'" in text and "Traceback" not in text
    assert not (tmp_path / "demo").exists()


def test_autotuning_is_said_in_the_progress_bar_not_under_it(tmp_path):
    # A fresh decision cache: `auto` measures in round 1 and says so. Lines printed under
    # the live bar broke it; the bar shows them in its status column instead.
    status, screen = fedlang_in_terminal("train", _config(tmp_path), cwd=tmp_path,
                                         env={"FEDLANG_CACHE_DIR": str(tmp_path / "cache")})
    assert status == 0, "\n".join(screen[-30:])
    printed = [line for line in screen if line.startswith("fedlang: ")]
    in_bar = [line for line in screen if line.startswith("round ") and "measuring" in line]
    assert not printed and in_bar, "\n".join(screen)


def _wait_for(condition, process, what, timeout=240):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"fedlang ended before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.001)


def _ctrl_c(tmp_path, moment, times=1):
    """`fedlang train` (long enough not to end by itself) interrupted at `moment`."""
    run = tmp_path / "run"
    config = _config(tmp_path, rounds=5000, evaluate_every=3, checkpoint_every=1)
    process, finish = start_fedlang("train", config, "--no-progress", cwd=tmp_path)
    ckpt = run / "checkpoints"
    metrics = run / "metrics.jsonl"
    if moment == "set-up":  # the command has started; no round has ended
        _wait_for(run.exists, process, "output directory")
    elif moment == "mid-round":
        _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, process,
                  "second round")
    else:  # while a checkpoint is being written (its temporary file exists)
        _wait_for(lambda: ckpt.is_dir() and any(p.name.startswith(".ckpt")
                                                for p in ckpt.iterdir()), process,
                  "checkpoint being written")
    for _ in range(times):
        process.send_signal(signal.SIGINT)
        time.sleep(0.05)
    return finish()


MOMENTS = [("set-up", 1), ("mid-round", 1), ("checkpointing", 1), ("mid-round", 2)]


def test_ctrl_c_always_exits_130_saying_where_the_run_stands(tmp_path):
    # A KeyboardInterrupt raised inside JAX was swallowed (exit 0, training went on) or
    # crashed the interpreter at exit (SIGSEGV); now the first Ctrl-C stops at the end of
    # the round and checkpoints it, the second at once. Each moment is its own process,
    # all at once (most of each one's time is start-up).
    dirs = [tmp_path / f"{moment}-{times}" for moment, times in MOMENTS]
    with concurrent.futures.ThreadPoolExecutor(len(MOMENTS)) as pool:
        results = list(pool.map(lambda d, m: (d.mkdir(), _ctrl_c(d, *m))[1], dirs, MOMENTS))
    for d, (moment, times), (status, out, err) in zip(dirs, MOMENTS, results, strict=True):
        text = " ".join(err.split())
        assert status == 130, (moment, times, status, text[-2000:])
        assert "Traceback" not in err and "Exception ignored" not in err, (moment, err)
        said = re.search(r"Interrupted: (at round (\d+) of 5000|stopped at once \(the round "
                         r"in progress is lost\)); (.*)\.$", text)
        assert said, (moment, times, text)
        ckpt = d / "run" / "checkpoints"
        latest = sim.checkpoint.latest(ckpt)
        if latest is None:
            assert said.group(3) == "no checkpoint yet; run the same command to start again"
            continue
        assert said.group(3) == (f"last checkpoint in {ckpt}"
                                 f"{f' (round {said.group(2)})' if said.group(2) else ''}; "
                                 "run the same command to resume"), (moment, text)
        if said.group(2):  # stopped after a round: it is checkpointed, its metrics shown
            assert sim.checkpoint.load(latest).round_num == int(said.group(2))
            assert "Accuracy by round" in out, (moment, out)
    # the same command resumes where the first Ctrl-C stopped (fewer rounds: to end soon)
    d = dirs[1]
    done = sim.checkpoint.load(sim.checkpoint.latest(d / "run" / "checkpoints")).round_num
    again, out, err = fedlang("train", d / "exp.toml", "--rounds", done + 1, "--no-progress",
                              cwd=d)
    assert again == 0 and f"Resumed from the checkpoint of round {done}." in out, err


def test_the_readme_the_cli_page_and_the_help_give_the_demo_one_duration():
    # measured once with ./scripts/demo.sh (docs/cli.md says how); the three agree
    root = SRC_ROOT.parent
    texts = {"README.md": (root / "README.md").read_text(),
             "docs/cli.md": (root / "docs" / "cli.md").read_text(),
             "fedlang demo --help": " ".join(invoke("demo", "--help").output.split())}
    found = {name: set(re.findall(r"about (\d+ s|a minute|\d+ minutes?)", " ".join(t.split())))
             for name, t in texts.items()}
    assert all(found.values()) and len(set().union(*found.values())) == 1, found


def test_train_releases_each_rounds_metrics_to_a_server(tmp_path, monkeypatch):
    from fedlang import deploy
    from fedlang.deploy.driver import metrics as release

    monkeypatch.delenv("FEDLANG_ADMIN_TOKEN", raising=False)
    config = _config(tmp_path)
    with (deploy.Server(db=tmp_path / "server.db", port=0) as server,
          deploy.Admin(server.url, server.admin_token) as admin):
        admin.create_population("pop")
        flags = ["--metrics-server", server.url, "--metrics-population", "pop"]
        # refused before training: no token, a population the server lacks, half a pair
        no_token = invoke("train", config, *flags, "--no-progress")
        assert no_token.exit_code == 2 and "FEDLANG_ADMIN_TOKEN" in no_token.output
        unknown = invoke("train", config, "--metrics-server", server.url, "--metrics-population",
                         "nobody", "--admin-token", server.admin_token, "--no-progress")
        assert unknown.exit_code == 2 and "its populations are ['pop']" in unknown.output
        # the flag is named, not the config key it overrides (issue 37, item 12g)
        assert "Expected --metrics-population to be a population" in unknown.output
        half = invoke("train", config, "--metrics-server", server.url, "--no-progress")
        assert half.exit_code == 2 and "--metrics-server and --metrics-population" in half.output
        assert not (tmp_path / "run" / "checkpoints").exists()
        ran = invoke("train", config, *flags, "--admin-token", server.admin_token, "--no-progress")
        assert ran.exit_code == 0, ran.output
        released = admin.released_metrics("pop")
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in written] == [1, 2]
    expected = {(r["round"], kind, name): value for r in written
                for kind, values in release.release_form(r["metrics"]).items()
                for name, value in values.items()}
    assert {(m["round"], m["kind"], m["name"]): m["value"] for m in released} == expected
    assert any(kind == "train" for _, kind, _ in expected)  # (no held-out clients: no eval)
