"""The experiment config of `fedlang demo` and `fedlang train`: data, model, algorithm,
evaluation and driver, from a TOML file.

A config has the tables `[data]`, `[model]`, `[algorithm]` (with
`[algorithm.client_optimizer]`, `[algorithm.server_optimizer]`), `[training]` and
`[output]`; every key has a default (`DEFAULTS`, which is `fedlang demo`'s run), and
an unknown key is an error. `fedlang train --help` lists them (the training
module's help text), and a test keeps that list equal to `DEFAULTS`.

Its errors are `ConfigError`s worded for a config file and the `fedlang train` flags,
raised before any training starts where that is possible.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import itertools
import json
import math
import pathlib
import shutil
import tomllib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedlang import simulation as sim
from fedlang.core import types
from fedlang.simulation import checkpoint, inspection, metrics
from fedlang.simulation.formats import tabular

DEFAULTS: dict[str, dict[str, Any]] = {
    "data": {
        "dataset": "digits", "path": "", "format": "auto", "split": "", "client_column": "",
        "num_clients": 40, "partition": "dirichlet", "alpha": 0.5, "seed": 0,
        "x": "x", "y": "y", "standardize": False, "held_out_clients": 8,
        "batch_size": 16, "epochs": 2, "shuffle_buffer": 200,
    },
    "model": {"kind": "mlp", "hidden": [32], "num_classes": 10, "seed": 0},
    "algorithm": {
        "name": "fedavg", "proximal_strength": 0.01,
        "client_optimizer": {"name": "sgd", "learning_rate": 0.1},
        "server_optimizer": {"name": "sgd", "learning_rate": 1.0},
    },
    "training": {"rounds": 30, "cohort_size": 10, "seed": 0, "evaluate_every": 5,
                 "checkpoint_every": 5},
    # server, population: also release each round's metrics to a task store server's
    # population (its dashboard plots them); the admin token comes from FEDLANG_ADMIN_TOKEN
    # or --admin-token, never from the file
    "output": {"dir": "fedlang-demo", "resume": True, "server": "", "population": ""},
}
DATASETS = ("digits", "synthetic", "store", "sqlite", "csv", "leaf", "directory")
ALGORITHMS = ("fedavg", "fedavg_unweighted", "fedprox", "fedsgd")
OPTIMIZERS = ("sgd", "adam", "adagrad", "yogi", "adamw", "rmsprop")
# Keys that do not change the trained weights, so a resumed run may change them.
_NOT_FINGERPRINTED = {"training": ("rounds", "evaluate_every", "checkpoint_every"), "output": None}
# The `fedlang train` flag that overrides a config key, for advice in messages.
FLAGS = {"training.rounds": "--rounds", "output.dir": "--output-dir",
         "output.resume": "--resume/--no-resume", "output.server": "--metrics-server",
         "output.population": "--metrics-population"}
# The package a dataset is read with, where fedlang itself does not depend on it:
# dataset -> (module to import, distribution, the fedlang extra that installs it).
NEEDS = {"digits": ("sklearn.datasets", "scikit-learn", "examples")}
# A train loss this many times a uniform guess's means the run diverged.
DIVERGED = 10.0


def flagged(overrides: Mapping[str, Mapping[str, Any]]) -> frozenset[str]:
    """The config keys (`table.key`) that `overrides` (from `fedlang train`'s flags) set."""
    return frozenset(f"{table}.{key}" for table, values in overrides.items()
                     for key, value in values.items() if value is not None)


def named(key: str, flags: frozenset[str] = frozenset()) -> str:
    """`key` as the user gave it: its flag when a flag set it (in `flags`), else the key.

    Example:
      >>> named("output.population", frozenset({"output.population"}))
      '--metrics-population'
    """
    return FLAGS[key] if key in flags and key in FLAGS else key


class ConfigError(ValueError):
    """An invalid experiment config or data (unknown key, wrong type, bad value), said
    for the config file and the `fedlang train` flags."""


def _kind(value: Any) -> str:
    """What a TOML value is, in words."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "a table" if isinstance(value, Mapping) else type(value).__name__


def _fits(default: Any, value: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, int | float)
    return isinstance(value, type(default))


def _merge(defaults: Mapping[str, Any], given: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = copy.deepcopy(dict(defaults))
    for key, value in given.items():
        name = f"{where}.{key}" if where else key
        if key not in defaults:
            close = difflib.get_close_matches(str(key), [str(k) for k in defaults], n=1)
            meant = f"{where}.{close[0]}" if where and close else "".join(close)
            hint = f"Did you mean {meant!r}?" if close else "Check its spelling"
            raise ConfigError(f"Expected keys among {sorted(defaults)} in [{where or 'top level'}], "
                              f"found unknown key {name!r}. {hint} (`fedlang train --help` lists "
                              "every table and key).")
        default = defaults[key]
        if isinstance(default, Mapping):
            if not isinstance(value, Mapping):
                raise ConfigError(f"Expected a table for {name!r}, found {value!r}.")
            out[key] = {**value} if key.endswith("_optimizer") else _merge(default, value, name)
        elif name == "data.x" and isinstance(value, list) and value and all(
                isinstance(v, str) for v in value):
            out[key] = value  # several feature columns, stacked into one vector
        elif not _fits(default, value):
            extra = " or a list of field names" if name == "data.x" else ""
            raise ConfigError(f"Expected {name} to be {_kind(default)}{extra}, found {value!r} "
                              f"({_kind(value)}).")
        else:
            out[key] = value
    return out


def load_config(path: str | pathlib.Path | None = None, **overrides: Any) -> dict[str, Any]:
    """The config of a TOML file (None: the defaults), with defaults filled in.

    Args:
      path: the `.toml` file.
      **overrides: `table={key: value}` applied on top (e.g. from CLI flags).

    Raises:
      FileNotFoundError: if the file does not exist.
      ConfigError: (a `ValueError`) for invalid TOML, unknown keys or wrong types.
      ImportError: when the dataset needs a package that is not installed.
    """
    given: dict[str, Any] = {}
    if path is not None:
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"Expected a TOML config at {path}, found none. Check the path; every key is "
                "optional, so an empty file runs the demo's config (`fedlang train --help` "
                "lists every table and key).")
        try:
            given = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"Expected a valid TOML file at {path}, found a syntax error: {e}.") from e
    config = _merge(DEFAULTS, given, "")
    for table, values in overrides.items():
        config[table] = _merge(config[table], {k: v for k, v in values.items() if v is not None}, table)
    _check(config, flagged(overrides))
    check_installed(config)
    return config


def _check(c: dict[str, Any], flags: frozenset[str] = frozenset()) -> None:
    d, t = c["data"], c["training"]
    for ok, msg in (
        (d["dataset"] in DATASETS, f"data.dataset in {list(DATASETS)}, found {d['dataset']!r}"),
        (c["algorithm"]["name"] in ALGORITHMS,
         f"algorithm.name in {list(ALGORITHMS)}, found {c['algorithm']['name']!r}"),
        (c["model"]["kind"] in ("mlp", "softmax"), f"model.kind 'mlp' or 'softmax', found {c['model']['kind']!r}"),
        (d["dataset"] in ("digits", "synthetic") or d["path"], f"data.path for dataset {d['dataset']!r}, found none"),
        (t["rounds"] >= 0 and t["cohort_size"] >= 1 and d["batch_size"] >= 1 and d["epochs"] >= 1,
         "training.rounds >= 0 and cohort_size, data.batch_size, data.epochs >= 1"),
    ):
        if not ok:
            raise ConfigError(f"Expected {msg}.")
    o = c["output"]
    if bool(o["server"]) != bool(o["population"]):
        given = "output.server" if o["server"] else "output.population"
        # said the way the user gave the one found: both flags, or both keys
        both = flags | {"output.server", "output.population"} if given in flags else frozenset()
        raise ConfigError(
            f"Expected {named('output.server', both)} and {named('output.population', both)} "
            f"together (--metrics-server URL --metrics-population NAME, or server and population "
            f"in [output]), found only {named(given, both)}.")
    for key in ("client_optimizer", "server_optimizer"):
        opt = c["algorithm"][key]
        if opt.get("name") not in OPTIMIZERS:
            raise ConfigError(f"Expected algorithm.{key}.name in {list(OPTIMIZERS)}, found {opt.get('name')!r}.")


def check_installed(config: Mapping[str, Any]) -> None:
    """Refuses, before anything is printed or run, a dataset whose reader is not installed.

    Raises:
      ImportError: naming the package and the pip command that installs it.
    """
    module, package, extra = NEEDS.get(config["data"]["dataset"], (None, "", ""))
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(
                f"Expected {package}, which reads the {config['data']['dataset']!r} dataset (the "
                f"demo's), found it not installed ({e}). Install it: pip install "
                f"'fedlang[{extra}]' (or pip install {package}).") from e
    if config["output"].get("server"):
        try:
            importlib.import_module("httpx")
        except ImportError as e:
            raise ImportError(
                "Expected httpx, which releasing metrics to a server (output.server, "
                f"--metrics-server) needs, found it not installed ({e}). Install the deploy "
                "extra: pip install 'fedlang[deploy]'.") from e


def fingerprint_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of `config` that determines the trained weights."""
    out = copy.deepcopy(dict(config))
    for table, keys in _NOT_FINGERPRINTED.items():
        if keys is None:
            out.pop(table, None)
        else:
            for k in keys:
                out[table].pop(k, None)
    return out


# -- building the pieces ----------------------------------------------------------


def _source(d: Mapping[str, Any]) -> sim.ClientData:
    if d["dataset"] == "digits":
        return sim.datasets.digits(d["num_clients"], d["partition"], d["alpha"], d["seed"])
    if d["dataset"] == "synthetic":
        return sim.datasets.synthetic(d["alpha"], d["alpha"], d["num_clients"], seed=d["seed"])
    path = pathlib.Path(d["path"])
    if not path.exists():
        raise FileNotFoundError(
            f"Expected the data.path of dataset {d['dataset']!r} to exist, found nothing at {path}.")
    fmt = "auto" if d["dataset"] == "store" else d["dataset"]
    fmt = d["format"] if d["format"] != "auto" else fmt
    kind = inspection.detect_format(path) if fmt == "auto" else fmt
    if kind == "csv" and not d["client_column"]:
        raise ConfigError(
            f"Expected data.client_column to name the client-id column of {path}, found none; "
            f"its columns are {tabular.column_names(path)}. Set client_column in [data].")
    if kind == "sqlite" and not d["split"]:
        from fedlang.simulation.formats import sqlite

        raise ConfigError(
            f"Expected data.split for the SQLite file {path}, found none; its splits are "
            f"{sqlite.split_names(path)}. Set split in [data].")
    columns = None
    if kind == "csv":
        # Read only the fields the run uses (a blank cell elsewhere does not matter), after
        # checking that they exist.
        header = tabular.column_names(path)
        columns = [*([d["x"]] if isinstance(d["x"], str) else list(d["x"])), d["y"]]
        missing = [c for c in columns if c not in header]
        if missing:
            raise ConfigError(
                f"Expected data.x and data.y to name fields of the data, found no field {missing}; "
                f"its fields are {sorted(c for c in header if c != d['client_column'])}. Set x "
                "and y in [data].")
    return inspection.open_source(path, fmt, split=d["split"] or None,
                                  client_column=d["client_column"] or None, columns=columns)


def _features(cd: sim.ClientData, d: Mapping[str, Any]) -> sim.ClientData:
    """Client data with elements `{'x': features, 'y': integer label}`, checked first."""
    fields = cd.structure
    if not isinstance(fields, Mapping):
        raise ConfigError(
            f"Expected elements with named fields (set data.x and data.y), found {fields}.")
    xs = [d["x"]] if isinstance(d["x"], str) else list(d["x"])
    missing = [f for f in [*xs, d["y"]] if f not in fields]
    if missing:
        raise ConfigError(
            f"Expected data.x and data.y to name fields of the data, found no field {missing}; "
            f"its fields are {sorted(fields)}. Set x and y in [data].")
    y_t = fields[d["y"]]
    if not (isinstance(y_t, types.TensorType) and y_t.shape == () and y_t.dtype.kind in "iu"):
        raise ConfigError(
            f"Expected the label field data.y = {d['y']!r} to hold one integer per example, found "
            f"{y_t}. A blank or non-integer cell turns a CSV column into floats (blanks become "
            "NaN): fill or drop those rows.")
    for f in xs:
        t = fields[f]
        if not (isinstance(t, types.TensorType) and t.dtype.kind in "iuf"
                and (len(xs) == 1 or t.shape == ())):
            raise ConfigError(
                f"Expected the feature field {f!r} to hold {'numbers' if len(xs) == 1 else 'one number'}"
                f" per example, found {t}.")
    if xs == ["x"] and d["y"] == "y":
        return cd
    y = d["y"]
    if len(xs) == 1:
        (x,) = xs
        spec = {"x": fields[x], "y": y_t}
        return cd.preprocess(lambda ds: ds.map(lambda e: {"x": e[x], "y": e[y]}, spec))
    spec = {"x": types.TensorType(np.float32, [len(xs)]), "y": y_t}
    return cd.preprocess(lambda ds: ds.map(
        lambda e: {"x": np.asarray([e[c] for c in xs], np.float32), "y": e[y]}, spec))


def standardizer(train: sim.ClientData) -> tuple[np.ndarray, np.ndarray]:
    """The features' mean and standard deviation over the training clients (one pass).

    Raises:
      ConfigError: when a feature is not finite (a blank cell) somewhere.
    """
    total = total_sq = None
    count = 0
    for cid in train.client_ids:
        for e in train.create_dataset_for_client(cid):
            x = np.asarray(e["x"], np.float64)
            total = x if total is None else total + x
            total_sq = x * x if total_sq is None else total_sq + x * x
            count += 1
    if total is None or total_sq is None:
        raise ConfigError("Expected training examples to standardize, found none.")
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean * mean, 0.0))
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std))):
        raise ConfigError(
            "Expected finite features to standardize, found NaN or infinite values (a blank "
            "CSV cell becomes NaN): fill or drop those rows.")
    return mean.astype(np.float32), np.where(std > 0, std, 1.0).astype(np.float32)


def load_data(config: Mapping[str, Any]) -> tuple[sim.ClientData, sim.ClientData | None]:
    """`(train, held_out)` client data with elements `{'x', 'y'}`, standardized if asked.

    Raises:
      ConfigError: for a field that does not exist, non-integer labels, a CSV without
        `client_column`, an SQLite file without `split`.
      FileNotFoundError: when `data.path` does not exist.
    """
    d = config["data"]
    cd = _features(_source(d), d)
    if d["held_out_clients"] <= 0:
        train, test = cd, None
    else:
        if not 1 <= d["held_out_clients"] < len(cd.client_ids):
            raise ConfigError(
                f"Expected data.held_out_clients in [0, {len(cd.client_ids) - 1}] (there are "
                f"{len(cd.client_ids)} clients), found {d['held_out_clients']}.")
        train, test = sim.ClientData.train_test_client_split(cd, d["held_out_clients"], seed=d["seed"])
    if d["standardize"]:
        mean, std = standardizer(train)
        spec = train.structure

        def scale(ds: sim.Dataset) -> sim.Dataset:
            return ds.map(lambda e: {"x": ((e["x"] - mean) / std).astype(np.float32), "y": e["y"]},
                          {"x": types.TensorType(np.float32, spec["x"].shape), "y": spec["y"]})

        train = train.preprocess(scale)
        test = None if test is None else test.preprocess(scale)
    return train, test


def build_model_fn(config: Mapping[str, Any], element_spec: Any) -> Callable[[], Any]:
    """A `model_fn` for fedlang.learning: an MLP or softmax regression on flattened `x`."""
    import jax
    import jax.numpy as jnp
    import optax

    from fedlang.learning import models

    m = config["model"]
    x_t = element_spec["x"] if not hasattr(element_spec, "x") else element_spec.x
    in_dim = int(np.prod(x_t.shape))
    sizes = [in_dim, *(m["hidden"] if m["kind"] == "mlp" else []), m["num_classes"]]

    def init(rng: Any) -> dict[str, Any]:
        params = {}
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            rng, key = jax.random.split(rng)
            params[f"w{i}"] = jax.random.normal(key, (a, b), jnp.float32) * jnp.float32(np.sqrt(1.0 / a))
            params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
        return params

    def apply(params: Any, x: Any) -> Any:
        h = jnp.reshape(x, (x.shape[0], -1)).astype(jnp.float32)
        for i in range(len(sizes) - 1):
            h = h @ params[f"w{i}"] + params[f"b{i}"]
            if i < len(sizes) - 2:
                h = jax.nn.relu(h)
        return h

    def loss(logits: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(logits, y.astype(jnp.int32)).mean()

    spec = {"x": (x_t.dtype, [None, *x_t.shape]), "y": (np.int32, [None])}
    return lambda: models.FunctionalModel(init, apply, loss, spec, metrics=[models.Accuracy()])


def _optimizer(spec: Mapping[str, Any]) -> Any:
    import optax

    params = {k: v for k, v in spec.items() if k != "name"}
    try:
        return getattr(optax, spec["name"])(**params)
    except TypeError as e:
        raise ConfigError(f"Expected arguments of optax.{spec['name']}, found {params} ({e}).") from e


def build_processes(config: Mapping[str, Any], model_fn: Callable[[], Any]) -> tuple[Any, Any]:
    """`(training process, evaluation process)` from fedlang.learning."""
    from fedlang.learning import algorithms

    a = config["algorithm"]
    client, server = _optimizer(a["client_optimizer"]), _optimizer(a["server_optimizer"])
    seed = config["model"]["seed"]
    if a["name"] == "fedavg":
        process = algorithms.build_weighted_fed_avg(model_fn, client, server, seed=seed)
    elif a["name"] == "fedavg_unweighted":
        process = algorithms.build_unweighted_fed_avg(model_fn, client, server, seed=seed)
    elif a["name"] == "fedprox":
        process = algorithms.build_fed_prox(model_fn, a["proximal_strength"], client, server, seed=seed)
    else:
        process = algorithms.build_fed_sgd(model_fn, server, seed=seed)
    return process, algorithms.build_fed_eval(model_fn)


def _eval_fn(process: Any, eval_process: Any, test: sim.ClientData, batch_size: int) -> Callable[[Any], Any]:
    datasets = [test.create_dataset_for_client(c).batch(batch_size) for c in test.client_ids]
    eval_state = eval_process.initialize()

    def evaluate(state: Any) -> Any:
        s = eval_process.set_model_weights(eval_state, process.get_model_weights(state))
        out = eval_process.next(s, datasets)
        return out.metrics["client_work"]["eval"]["current_round_metrics"]

    return evaluate


def _check_checkpoints(ckpt_dir: pathlib.Path, rounds: int, resume: bool) -> None:
    """Refuses, before any work, what `run_training` would refuse, naming the CLI's flags."""
    latest = checkpoint.latest(ckpt_dir)
    if latest is None:
        return
    if not resume:
        raise ConfigError(
            f"Expected no checkpoints in {ckpt_dir} for a fresh run (output.resume = false or "
            f"--no-resume), found {len(checkpoint.checkpoints(ckpt_dir))}. Pass --resume to "
            "continue that run, or --output-dir DIR to start a new one.")
    done = checkpoint.load(latest).round_num
    if done > rounds:
        raise ConfigError(
            f"Expected training.rounds (--rounds) >= {done}, the round of the checkpoint "
            f"{latest}, found {rounds}. Pass --rounds {done} or more to extend that run, or "
            "--output-dir DIR to start a new one.")


def unfinished(ckpt_dir: pathlib.Path, config: Mapping[str, Any]) -> bool:
    """Whether the newest checkpoint in `ckpt_dir` is of `config`'s run (any rounds) and
    short of its `training.rounds`: a run stopped early, which running it again resumes."""
    latest = checkpoint.latest(ckpt_dir)
    if latest is None:
        return False
    try:
        saved = checkpoint.load(latest)
    except checkpoint.CheckpointError:
        return False  # unreadable: start over
    this_run = json.loads(json.dumps(metrics.to_python(fingerprint_config(config))))
    return saved.round_num < config["training"]["rounds"] and saved.config.get("config") == this_run


def describe(config: Mapping[str, Any]) -> str:
    """The experiment in a few words, e.g. 'fedavg, mlp on digits: cohorts of 10 of 32
    clients (fedlang-demo)'."""
    d, a, m, t = config["data"], config["algorithm"], config["model"], config["training"]
    source = d["dataset"] if d["dataset"] in ("digits", "synthetic") else pathlib.Path(
        d["path"]).name
    return (f"{a['name']}, {m['kind']} on {source}: cohorts of {t['cohort_size']} "
            f"({pathlib.Path(config['output']['dir']).name})")


def divergence(result: Any, config: Mapping[str, Any]) -> str | None:
    """A warning when the training loss went non-finite or far above a uniform guess's.

    A softmax over `num_classes` classes that guesses uniformly has loss
    `ln(num_classes)`; a train loss `DIVERGED` times that (or NaN/inf, or clients
    excluded for non-finite updates) means the run diverged, typically from raw,
    unscaled features or a learning rate too large.

    Returns:
      The warning sentence, or None.
    """
    guess = math.log(max(config["model"]["num_classes"], 2))
    for h in result.history:
        work = h["metrics"].get("train", {}).get("client_work", {})
        loss = work.get("train", {}).get("loss")
        nonfinite = work.get("diagnostics", {}).get("num_nonfinite", 0) or 0
        if loss is None:
            continue
        if not math.isfinite(loss) or loss > DIVERGED * guess or nonfinite:
            what = (f"{nonfinite} clients' updates were not finite" if nonfinite and math.isfinite(loss)
                    else f"the train loss is {loss:,.4g}")
            return (
                f"The training diverged: in round {h['round']} {what}, where a uniform guess "
                f"scores {guess:.2f}. Standardize the features (standardize = true in [data]) "
                "or lower the learning rate in [algorithm.client_optimizer].")
    return None


def metrics_writers(config: Mapping[str, Any], admin_token: str | None = None,
                    flags: frozenset[str] = frozenset()) -> list[Any]:
    """The run's metrics writers: CSV, JSON lines, TensorBoard and a plot in output.dir,
    and, with output.server, one that releases each round's metrics to that server's
    output.population (`fedlang.deploy.driver.metrics.ServerMetricsWriter`). Errors
    name the flags among `flags` (`flagged`) as flags.

    Raises:
      ConfigError: output.server without an admin token, or a population the server
        does not have; checked before training.
      OSError: the server cannot be reached.
    """
    o, out = config["output"], pathlib.Path(config["output"]["dir"])
    writers: list[Any] = sim.writers.default_writers(out, title=describe(config))
    if not o["server"]:
        return writers
    if not admin_token:
        raise ConfigError(
            f"Expected the admin token of {o['server']} to release metrics there, found none; "
            "set FEDLANG_ADMIN_TOKEN or pass --admin-token.")
    from fedlang.deploy import protocol
    from fedlang.deploy.client import connection
    from fedlang.deploy.driver import metrics as release

    writer = release.ServerMetricsWriter(o["server"], admin_token, o["population"], patience=30.0)
    try:
        names = [p["name"] for p in writer.admin.populations()]
    except (protocol.ProtocolError, connection.ServerUnavailable, connection.ServerError) as e:
        writer.close()
        raise ConfigError(f"Expected to reach {o['server']} with its admin token, found: {e}") from e
    if o["population"] not in names:
        writer.close()
        raise ConfigError(
            f"Expected {named('output.population', flags)} to be a population of "
            f"{o['server']}, found {o['population']!r}; its populations are {names}.")
    return [*writers, writer]


def run(config: Mapping[str, Any], *, progress: bool | None = None, fresh: bool = False,
        admin_token: str | None = None, flags: frozenset[str] = frozenset()) -> Any:
    """Runs the experiment of `config`, writing metrics, plot and checkpoints.

    Args:
      config: from `load_config`.
      progress: show the progress bar (None: when a terminal).
      fresh: delete the output directory's checkpoints first (the demo does), unless
        they are of this config's run stopped short of its rounds (a demo interrupted
        with Ctrl-C): that run resumes.
      admin_token: the admin token of output.server, where metrics are released.
      flags: the keys set by `fedlang train`'s flags (`flagged`), which errors name as
        flags.

    Returns:
      The `TrainingResult`.

    Raises:
      ConfigError: for a config or data problem (before training where possible).
    """
    d, t, out = config["data"], config["training"], pathlib.Path(config["output"]["dir"])
    ckpt_dir = out / "checkpoints"
    if not fresh:
        _check_checkpoints(ckpt_dir, t["rounds"], config["output"]["resume"])
    writers = metrics_writers(config, admin_token, flags)  # first: a wrong server fails at once
    train, test = load_data(config)
    process, eval_process = build_processes(config, build_model_fn(config, train.structure))
    if fresh and not unfinished(ckpt_dir, config):
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    bs, buf, epochs = d["batch_size"], d["shuffle_buffer"], d["epochs"]

    def preprocess(ds: sim.Dataset, seed: int) -> sim.Dataset:
        return ds.shuffle(buf, seed=seed).batch(bs, drop_remainder=True).repeat(epochs)

    sampler = sim.UniformSampler(train.client_ids, min(t["cohort_size"], len(train.client_ids)), seed=t["seed"])
    return sim.run_training(
        process, train, sampler, t["rounds"], preprocess=preprocess,
        evaluation=None if test is None else _eval_fn(process, eval_process, test, 64),
        evaluate_every=t["evaluate_every"],
        metrics=writers,
        checkpoint_dir=ckpt_dir, checkpoint_every=t["checkpoint_every"],
        resume=config["output"]["resume"] or fresh, config=fingerprint_config(config),
        seed=t["seed"], progress=progress,
    )
