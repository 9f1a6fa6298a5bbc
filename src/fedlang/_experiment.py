"""Experiments from a TOML config: data, model, algorithm, evaluation, driver (the CLI's).

A config has the tables `[data]`, `[model]`, `[algorithm]` (with
`[algorithm.client_optimizer]`, `[algorithm.server_optimizer]`), `[training]` and
`[output]`; every key has a default (`DEFAULTS`, which is `fedlang demo`'s run), and
an unknown key is an error. See docs/cli.md for the reference.
"""

from __future__ import annotations

import copy
import itertools
import pathlib
import shutil
import tomllib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedlang import simulation as sim
from fedlang.simulation import inspection

DEFAULTS: dict[str, dict[str, Any]] = {
    "data": {
        "dataset": "digits", "path": "", "format": "auto", "split": "", "client_column": "",
        "num_clients": 40, "partition": "dirichlet", "alpha": 0.5, "seed": 0,
        "x": "x", "y": "y", "held_out_clients": 8,
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
    "output": {"dir": "fedlang-demo", "resume": True},
}
DATASETS = ("digits", "synthetic", "store", "sqlite", "csv", "leaf", "directory")
ALGORITHMS = ("fedavg", "fedavg_unweighted", "fedprox", "fedsgd")
OPTIMIZERS = ("sgd", "adam", "adagrad", "yogi", "adamw", "rmsprop")
# Keys that do not change the trained weights, so a resumed run may change them.
_NOT_FINGERPRINTED = {"training": ("rounds", "evaluate_every", "checkpoint_every"), "output": None}


class ConfigError(ValueError):
    """An invalid experiment config (unknown key, wrong type, bad value)."""


def _merge(defaults: Mapping[str, Any], given: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = copy.deepcopy(dict(defaults))
    for key, value in given.items():
        name = f"{where}.{key}" if where else key
        if key not in defaults:
            raise ConfigError(f"Expected keys among {sorted(defaults)} in [{where or 'top level'}], "
                              f"found unknown key {name!r}. Check its spelling (docs/cli.md).")
        default = defaults[key]
        if isinstance(default, Mapping):
            if not isinstance(value, Mapping):
                raise ConfigError(f"Expected a table for {name!r}, found {value!r}.")
            out[key] = {**value} if key.endswith("_optimizer") else _merge(default, value, name)
        elif isinstance(default, bool) != isinstance(value, bool) or not isinstance(
                value, type(default) if not isinstance(default, float) else (int, float)):
            raise ConfigError(f"Expected {name} to be a {type(default).__name__}, found {value!r}.")
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
    """
    given: dict[str, Any] = {}
    if path is not None:
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"Expected a TOML config at {path}, found none. See docs/cli.md.")
        try:
            given = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"Expected a valid TOML file at {path}, found a syntax error: {e}.") from e
    config = _merge(DEFAULTS, given, "")
    for table, values in overrides.items():
        config[table] = _merge(config[table], {k: v for k, v in values.items() if v is not None}, table)
    _check(config)
    return config


def _check(c: dict[str, Any]) -> None:
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
    for key in ("client_optimizer", "server_optimizer"):
        opt = c["algorithm"][key]
        if opt.get("name") not in OPTIMIZERS:
            raise ConfigError(f"Expected algorithm.{key}.name in {list(OPTIMIZERS)}, found {opt.get('name')!r}.")


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


def load_data(config: Mapping[str, Any]) -> tuple[sim.ClientData, sim.ClientData | None]:
    """`(train, held_out)` client data with elements `{'x', 'y'}`."""
    d = config["data"]
    if d["dataset"] == "digits":
        cd = sim.datasets.digits(d["num_clients"], d["partition"], d["alpha"], d["seed"])
    elif d["dataset"] == "synthetic":
        cd = sim.datasets.synthetic(d["alpha"], d["alpha"], d["num_clients"], seed=d["seed"])
    else:
        fmt = "auto" if d["dataset"] == "store" else d["dataset"]
        cd = inspection.open_source(d["path"], d["format"] if d["format"] != "auto" else fmt,
                                    split=d["split"] or None, client_column=d["client_column"] or None)
    if (d["x"], d["y"]) != ("x", "y"):
        x, y = d["x"], d["y"]
        cd = cd.preprocess(lambda ds: ds.map(lambda e: {"x": e[x], "y": e[y]}))
    if d["held_out_clients"] <= 0:
        return cd, None
    train, test = sim.ClientData.train_test_client_split(cd, d["held_out_clients"], seed=d["seed"])
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


def run(config: Mapping[str, Any], *, progress: bool | None = None, fresh: bool = False) -> Any:
    """Runs the experiment of `config`, writing metrics, plot and checkpoints.

    Args:
      config: from `load_config`.
      progress: show the progress bar (None: when a terminal).
      fresh: delete the output directory's checkpoints first (the demo does).

    Returns:
      The `TrainingResult`.
    """
    d, t, out = config["data"], config["training"], pathlib.Path(config["output"]["dir"])
    train, test = load_data(config)
    process, eval_process = build_processes(config, build_model_fn(config, train.structure))
    ckpt_dir = out / "checkpoints"
    if fresh:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    bs, buf, epochs = d["batch_size"], d["shuffle_buffer"], d["epochs"]

    def preprocess(ds: sim.Dataset, seed: int) -> sim.Dataset:
        return ds.shuffle(buf, seed=seed).batch(bs, drop_remainder=True).repeat(epochs)

    sampler = sim.UniformSampler(train.client_ids, min(t["cohort_size"], len(train.client_ids)), seed=t["seed"])
    return sim.run_training(
        process, train, sampler, t["rounds"], preprocess=preprocess,
        evaluation=None if test is None else _eval_fn(process, eval_process, test, 64),
        evaluate_every=t["evaluate_every"], metrics=sim.writers.default_writers(out),
        checkpoint_dir=ckpt_dir, checkpoint_every=t["checkpoint_every"],
        resume=config["output"]["resume"] or fresh, config=fingerprint_config(config),
        seed=t["seed"], progress=progress,
    )
