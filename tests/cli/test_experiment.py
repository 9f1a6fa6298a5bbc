"""The experiment config of `fedlang demo` and `fedlang train` (src/fedlang/cli/experiment.py):
its checks, said through the real command as one sentence naming the config keys and flags."""

import numpy as np

from fedlang.cli import experiment

from ._run import fedlang, fedlang_all, one_sentence_error

CSV = "user,temp,humidity,label,blanky\n" + "".join(
    f"u{u},{1000 + 250 * ((u + i) % 4)},{50000 - 900 * i},{(u + i) % 4 // 2},"
    f"{'' if (u, i) == (1, 3) else (u + i) % 4 // 2}\n" for u in range(4) for i in range(12))


def csv_config(tmp_path, name, **data):
    """Writes sensors.csv and NAME.toml (a softmax on its columns) in tmp_path."""
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


def test_fingerprint_ignores_rounds_and_output():
    a = experiment.load_config(training={"rounds": 3}, output={"dir": "a"})
    b = experiment.load_config(training={"rounds": 9}, output={"dir": "b"})
    assert experiment.fingerprint_config(a) == experiment.fingerprint_config(b)


def test_config_errors_say_one_sentence_with_tables_and_types(tmp_path):
    (tmp_path / "types.toml").write_text('[training]\nrounds = "5"\n')
    (tmp_path / "table.toml").write_text("[training]\nbogus = 1\n")
    types_, table = fedlang_all(["train", "types.toml"], ["train", "table.toml"], cwd=tmp_path)
    one_sentence_error(types_, 2, "Expected training.rounds to be an integer, found '5' (a string).")
    one_sentence_error(table, 2, "in [training], found unknown key 'training.bogus'")


def test_an_unknown_key_suggests_the_key_it_is_close_to(tmp_path):
    # issue 37, item 12h: a typo gets a "did you mean", through the real command
    (tmp_path / "typo.toml").write_text("[ouptut]\n")
    (tmp_path / "nested.toml").write_text("[training]\nround = 5\n")
    typo, nested = fedlang_all(["train", "typo.toml"], ["train", "nested.toml"], cwd=tmp_path)
    one_sentence_error(typo, 2, "found unknown key 'ouptut'. Did you mean 'output'?")
    one_sentence_error(nested, 2, "found unknown key 'training.round'. "
                                  "Did you mean 'training.rounds'?")
    try:
        experiment.load_config(training={"zzz": 1})
    except experiment.ConfigError as e:
        assert "Did you mean" not in str(e) and "Check its spelling" in str(e)
    else:
        raise AssertionError("an unknown key was accepted")


def test_errors_name_the_flag_that_gave_the_value(tmp_path):
    # issue 37, item 12g: --metrics-population is said as such, output.population when
    # the file set it
    (tmp_path / "pop.toml").write_text('[output]\npopulation = "pop"\n')
    (tmp_path / "empty.toml").write_text("")
    by_file, by_flag = fedlang_all(["train", "pop.toml"],
                                   ["train", "empty.toml", "--metrics-population", "pop"],
                                   cwd=tmp_path)
    one_sentence_error(by_file, 2, "Expected output.server and output.population together",
                       "found only output.population.")
    one_sentence_error(by_flag, 2, "Expected --metrics-server and --metrics-population together",
                       "found only --metrics-population.")
    assert experiment.named("output.population") == "output.population"
    assert experiment.flagged({"output": {"population": "p", "server": None}}) == {
        "output.population"}


def test_data_errors_say_one_sentence_naming_config_keys(tmp_path):
    configs = [csv_config(tmp_path, "no_client", client_column=None),
               csv_config(tmp_path, "no_field", x='["temp", "wind"]'),
               csv_config(tmp_path, "blanks", y='"blanky"'),
               csv_config(tmp_path, "npz", path='"data.npz"')]
    np.savez(tmp_path / "data.npz", x=np.zeros((3, 2), np.float32))
    no_client, no_field, blanks, npz = fedlang_all(*(["train", c] for c in configs), cwd=tmp_path)
    one_sentence_error(no_client, 2, "data.client_column", "'user', 'temp'", "in [data]")
    one_sentence_error(no_field, 2, "found no field ['wind']", "'humidity'")
    # The CSV reader refuses a blank label cell, naming the column and the line.
    one_sentence_error(blanks, 1, "column 'blanky'", "a blank at line", "sensors.csv")
    # A file of another format is named, never printed (its bytes are NULs and the like).
    one_sentence_error(npz, 1, "Expected a CSV file at data.npz, found a zip archive (an .npz?).")
    assert "\x00" not in npz[2]


def test_checkpoint_errors_name_the_cli_flags(tmp_path):
    from fedlang.simulation import checkpoint

    config = csv_config(tmp_path, "run")
    checkpoint.save(tmp_path / "run" / "checkpoints", 3, {"w": np.zeros(2, np.float32)},
                    fingerprint="earlier", config={})
    fewer, fresh = fedlang_all(["train", config], ["train", config, "--rounds", 5, "--no-resume"],
                               cwd=tmp_path)
    one_sentence_error(fewer, 2, "training.rounds (--rounds) >= 3", "Pass --rounds 3 or more",
                       "--output-dir DIR")
    one_sentence_error(fresh, 2, "--no-resume", "Pass --resume", "--output-dir DIR")
    assert "resume=True" not in fresh[2] and "checkpoint_dir" not in fewer[2]


def test_several_feature_columns_and_a_diverging_run_is_said(tmp_path, monkeypatch):
    # raw features in the thousands: the softmax's loss explodes in round 1
    status, _, err = fedlang("train", csv_config(tmp_path, "raw"), "--no-progress", cwd=tmp_path)
    assert status == 0, err[-2000:]
    text = " ".join(err.split())
    assert "Warning: The training diverged: in round 1 the train loss is" in text
    assert "standardize = true in [data]" in text
    # standardized: the features the model sees have mean 0 and deviation 1
    config = experiment.load_config(tmp_path / csv_config(tmp_path, "std", standardize="true"))
    monkeypatch.chdir(tmp_path)
    train, _ = experiment.load_data(config)
    xs = np.stack([e["x"] for c in train.client_ids for e in train.create_dataset_for_client(c)])
    np.testing.assert_allclose(xs.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(xs.std(0), 1, atol=1e-5)


def test_the_demo_resumes_a_run_stopped_short_and_starts_a_finished_one_afresh(tmp_path):
    def config(rounds):
        return experiment.load_config(
            data={"num_clients": 8, "held_out_clients": 0, "epochs": 1},
            model={"kind": "softmax"}, training={"rounds": rounds, "cohort_size": 3},
            output={"dir": str(tmp_path / "run")})

    ckpt = tmp_path / "run" / "checkpoints"
    experiment.run(config(2), progress=False, fresh=True)
    # 2 of 3 rounds done, as Ctrl-C leaves a run: `fedlang demo` again resumes it; a run
    # with all its rounds done, or of another config, it starts afresh
    assert experiment.unfinished(ckpt, config(3)) and not experiment.unfinished(ckpt, config(2))
    other = {**config(3), "algorithm": {**config(3)["algorithm"], "name": "fedprox"}}
    assert not experiment.unfinished(ckpt, other)
    resumed = experiment.run(config(3), progress=False, fresh=True)
    assert resumed.resumed_from == 2 and [h["round"] for h in resumed.history] == [3]
