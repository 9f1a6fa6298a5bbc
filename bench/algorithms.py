"""Learning algorithms on strongly non-IID digits (issue 25), printed as bench/README.md's tables.

    .venv/bin/python bench/algorithms.py                  # the full run (~3 CPU minutes, < 8 min)
    .venv/bin/python bench/algorithms.py --quick          # a smoke run, under a minute
    .venv/bin/python bench/algorithms.py --only robust    # one table (rounds, personal, robust)
    .venv/bin/python bench/algorithms.py --workloads W1 --only rounds     # without the CNN

Everything goes through the public API as a user writes it: `fl.learning.algorithms`
builders, `fedlang.aggregators` factories, a `fedlang.simulation.ClientStateStore` for
the algorithms whose clients keep state, and clients as `fedlang.simulation` datasets.
The data is scikit-learn's bundled digits (1,797 8x8 images; nothing is downloaded)
split over the clients by label with Dirichlet(alpha=0.1), each client's examples 80%
train and 20% held out (`sim.datasets.digits_train_test`). "Global accuracy" is on all
the clients' held-out examples together (360); "personalized accuracy" evaluates each
client's held-out examples with that client's own model.

1. **Rounds to a target accuracy** for FedAvg, FedProx, SCAFFOLD and Mime Lite on the
   W1 workload (logistic regression 64 -> 10) and the W2 CNN (the FedAvg paper's
   conv5x5x32-pool-conv5x5x64-pool-dense512-dense10 on 8x8 inputs; not in `--quick`).
   Every algorithm gets the same clients each round (uniform sampling; W1 over three
   seeds), the same local training (batches, epochs, client step size;
   `--mime-lr-scale` changes Mime Lite's) and runs until it reaches the target or
   `Config.max_rounds`.
2. **Personalized accuracy** of Ditto (personal models in a client-state store),
   Federated Reconstruction (a per-client output bias reconstructed from each
   client's training data, never sent) and FedAvg + local fine-tuning
   (`build_personalization_eval`, whose baseline is plain FedAvg's global model on
   the same held-out examples).
3. **Robust aggregation under model poisoning**: unweighted FedAvg with Krum, Bulyan,
   the coordinate-wise median, the trimmed mean and the plain mean as
   `model_aggregator`, with no attackers and with 20% model-poisoning clients. Each
   round's cohort has exactly 20% attackers (drawn from a fixed fifth of the
   population), so Krum and Bulyan are told the true `f`. An attacker runs gradient
   *ascent* on its data with its loss scaled by `--attack-scale` (its labels are
   marked, and the shared model's loss multiplies a marked example's loss by
   `-scale`): it sends an update pointing against what its data teaches, `scale`
   times larger (after one local step, exactly `-scale` times an honest update).
4. The client-state store's memory from 1,000 to 100,000 clients is `bench/client_state.py`
   (its table is in bench/README.md); this script does not repeat it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedlang as fl
import fedlang.simulation as sim
from fedlang import aggregators
from fedlang.learning import algorithms, evaluation, models, personalization
from fedlang.simulation import ClientStateStore

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUM_CLASSES = 10
SECTIONS = ("rounds", "personal", "robust")


class Config(NamedTuple):
    """The sizes of one run (`--quick` and the full run differ only here).

    (A NamedTuple, not a dataclass: tests import this script by path, outside
    `sys.modules`, where dataclasses cannot resolve their annotations.)
    """

    clients: int = 50
    cohort: int = 10
    batch: int = 10
    epochs: int = 2
    workloads: tuple[str, ...] = ("W1", "W2")
    client_lr: dict[str, float] = {"W1": 0.1, "W2": 0.05}
    max_rounds: dict[str, int] = {"W1": 100, "W2": 40}
    target: dict[str, float] = {"W1": 0.9, "W2": 0.9}
    seeds: dict[str, int] = {"W1": 3, "W2": 1}
    personal_rounds: int = 40
    ditto_lambdas: tuple[float, ...] = (0.1, 1.0, 2.0)
    robust_rounds: int = 30
    robust_cohort: int = 20
    aggregators: tuple[str, ...] = ("mean", "Krum", "multi-Krum", "Bulyan", "median",
                                    "trimmed mean")
    seed: int = 0


QUICK = Config(clients=30, cohort=10, workloads=("W1",), max_rounds={"W1": 15, "W2": 5},
               target={"W1": 0.7, "W2": 0.5}, seeds={"W1": 1, "W2": 1}, personal_rounds=6,
               ditto_lambdas=(1.0,),
               robust_rounds=5, robust_cohort=15,
               aggregators=("mean", "Krum", "Bulyan", "median"))


# --- models ---------------------------------------------------------------------------------

def _loss(attack_scale: float | None) -> Callable[[Any, Any], Any]:
    """Cross-entropy; with `attack_scale`, labels >= 10 mark an attacker's examples, whose
    loss is multiplied by `-attack_scale` (gradient ascent, scaled)."""
    if attack_scale is None:
        return lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def poisoned(logits, y):
        attacker = y >= NUM_CLASSES
        labels = jnp.where(attacker, y - NUM_CLASSES, y)
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.mean(jnp.where(attacker, -attack_scale, 1.0) * per_example)

    return poisoned


INPUT_SPEC = {"x": (np.float32, [None, 64]), "y": (np.int32, [None])}


def w1(attack_scale: float | None = None, local_bias: bool = False) -> Callable[[], Any]:
    """W1: logistic regression 64 -> 10; `local_bias` adds a per-client output bias."""

    def init(rng):
        params = {"kernel": jnp.zeros([64, NUM_CLASSES]), "bias": jnp.zeros([NUM_CLASSES])}
        if local_bias:
            params["local_bias"] = jnp.zeros([NUM_CLASSES])
        return params

    def apply(p, x):
        logits = x @ p["kernel"] + p["bias"]
        return logits + p["local_bias"] if local_bias else logits

    return lambda: models.FunctionalModel(init, apply, _loss(attack_scale), INPUT_SPEC,
                                          metrics=[models.Accuracy()])


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _pool(x):
    n, h, w, c = x.shape
    return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def w2(attack_scale: float | None = None) -> Callable[[], Any]:
    """W2: the FedAvg paper's CNN (bench/workloads.py) on 8x8 digits, SAME padding."""

    def init(rng):
        k = jax.random.split(rng, 4)

        def he(key, shape, fan_in):
            return jax.random.normal(key, shape, jnp.float32) * jnp.sqrt(2.0 / fan_in)

        return {"c1": he(k[0], (5, 5, 1, 32), 25), "c1_b": jnp.zeros([32]),
                "c2": he(k[1], (5, 5, 32, 64), 800), "c2_b": jnp.zeros([64]),
                "d1": he(k[2], (256, 512), 256), "d1_b": jnp.zeros([512]),
                "d2": he(k[3], (512, NUM_CLASSES), 512), "d2_b": jnp.zeros([NUM_CLASSES])}

    def apply(p, x):
        h = x.reshape(-1, 8, 8, 1)
        h = _pool(jax.nn.relu(_conv(h, p["c1"]) + p["c1_b"]))   # 4x4x32
        h = _pool(jax.nn.relu(_conv(h, p["c2"]) + p["c2_b"]))   # 2x2x64
        h = jax.nn.relu(h.reshape(h.shape[0], 256) @ p["d1"] + p["d1_b"])
        return h @ p["d2"] + p["d2_b"]

    return lambda: models.FunctionalModel(init, apply, _loss(attack_scale), INPUT_SPEC,
                                          metrics=[models.Accuracy()])


WORKLOADS = {"W1": w1, "W2": w2}


# --- data -----------------------------------------------------------------------------------

class Digits:
    """The non-IID split: each client's train data as a fedlang dataset, held-out batches."""

    def __init__(self, cfg: Config, alpha: float = 0.1):
        self.cfg = cfg
        self.train, self.test = sim.datasets.digits_train_test(
            cfg.clients, alpha=alpha, test_fraction=0.2, seed=cfg.seed)
        self.ids = self.train.client_ids

    def training(self, cid: str, round_num: int, attacker: bool = False) -> sim.Dataset:
        """A round's local data: shuffled per round, `epochs` passes, batches of `batch`."""
        ds = self.train.create_dataset_for_client(cid)
        if attacker:
            ds = ds.map(lambda e: {"x": e["x"], "y": e["y"] + NUM_CLASSES})
        n = self.train.num_examples(cid)
        return ds.shuffle(max(n, 1), seed=round_num).repeat(self.cfg.epochs).batch(self.cfg.batch)

    def whole(self, data: Any, cid: str) -> dict[str, np.ndarray]:
        """A client's split as one batch of NumPy arrays."""
        ex = list(data.create_dataset_for_client(cid))
        return {"x": np.stack([e["x"] for e in ex]).astype(np.float32),
                "y": np.asarray([e["y"] for e in ex], np.int32)}

    def held_out(self) -> list[dict[str, np.ndarray]]:
        """All clients' held-out examples, in batches of 128."""
        parts = [self.whole(self.test, c) for c in self.ids]
        x = np.concatenate([p["x"] for p in parts])
        y = np.concatenate([p["y"] for p in parts])
        return [{"x": x[s:s + 128], "y": y[s:s + 128]} for s in range(0, len(y), 128)]


def _train(process: Any, data_fn: Callable[[str, int], Iterable[Any]],
           cohorts: Callable[[int], list[str]], rounds: int, *, store: Any = None,
           accuracy: Callable[[Any], float] | None = None,
           target: float | None = None) -> dict[str, Any]:
    """Runs `rounds` rounds, stopping at `target` or when the weights stop being finite;
    returns the state, accuracies, times and the rounds it took."""
    state = process.initialize()
    accs: list[float] = []
    times: list[float] = []
    reached = diverged = None
    for r in range(rounds):
        cohort = cohorts(r)
        data = [data_fn(c, r) for c in cohort]
        start = time.perf_counter()
        if store is None:
            state, _ = process.next(state, data)
        else:
            state, _, _ = process.next(state, data, store.cohort(cohort))
        times.append(time.perf_counter() - start)
        if accuracy is not None:
            weights = process.get_model_weights(state)
            if not _finite(weights):
                diverged = r + 1
                accs.append(0.0)
                break
            accs.append(accuracy(weights))
            if target is not None and accs[-1] >= target:
                reached = r + 1
                break
    return {"state": state, "accuracy": accs, "reached": reached, "diverged": diverged,
            "seconds": times}


def _finite(weights: Any) -> bool:
    return all(bool(np.all(np.isfinite(v))) for v in jax.tree.leaves(weights.trainable))


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _elapsed(start: tuple[float, float]) -> dict[str, float]:
    """Wall seconds, and CPU seconds of every thread of this process (steadier on a
    shared machine)."""
    return {"seconds": time.perf_counter() - start[0],
            "cpu_seconds": time.process_time() - start[1]}


def _took(r: dict[str, Any]) -> str:
    return f"{r['seconds']:.1f} ({r['cpu_seconds']:.1f})"


def _median_after_first(times: list[float]) -> float:
    return float(np.median(times[1:] if len(times) > 1 else times))


# --- 1. rounds to a target accuracy ---------------------------------------------------------

def rounds_to_target(cfg: Config, data: Digits, workload: str,
                     mime_lr_scale: float = 1.0) -> list[dict[str, Any]]:
    """Each algorithm from the same initial model, seed by seed (the seed picks the
    cohorts), until the global accuracy reaches the target or `max_rounds` pass."""
    model_fn = WORKLOADS[workload]()
    held_out = data.held_out()
    evaluate = evaluation.build_centralized_evaluation(model_fn)

    def accuracy(weights: Any) -> float:
        return float(evaluate(weights, held_out)["accuracy"])

    lr = cfg.client_lr[workload]
    builders: dict[str, Callable[[], Any]] = {
        "FedAvg": lambda: algorithms.build_weighted_fed_avg(model_fn, optax.sgd(lr)),
        "FedProx (mu 0.1)": lambda: algorithms.build_fed_prox(model_fn, 0.1, optax.sgd(lr)),
        "SCAFFOLD": lambda: algorithms.build_scaffold(model_fn, lr, total_clients=cfg.clients),
        "Mime Lite (SGD momentum 0.9" + (
            f", step x{mime_lr_scale:g})" if mime_lr_scale != 1 else ")"):
        lambda: algorithms.build_mime_lite(
            model_fn, optax.sgd(lr * mime_lr_scale, momentum=0.9)),
    }
    rows = []
    for name, build in builders.items():
        start = _clock()
        runs = []
        process = build()  # one process for every seed: it compiles once
        for seed in range(cfg.seed, cfg.seed + cfg.seeds[workload]):
            sampler = sim.UniformSampler(data.ids, cfg.cohort, seed=seed)
            with tempfile.TemporaryDirectory() as tmp:
                store = (ClientStateStore(pathlib.Path(tmp) / "states", process.client_state)
                         if process.client_state is not None else None)
                runs.append(_train(process, data.training, sampler.sample_round,
                                   cfg.max_rounds[workload], store=store, accuracy=accuracy,
                                   target=cfg.target[workload]))
        reached = [r["reached"] for r in runs]
        rows.append({"workload": workload, "algorithm": name, "target": cfg.target[workload],
                     "max_rounds": cfg.max_rounds[workload], "rounds_per_seed": reached,
                     "diverged_per_seed": [r["diverged"] for r in runs],
                     "rounds": (float(np.median(reached)) if all(reached) else None),
                     "final_accuracy": [r["accuracy"][-1] for r in runs],
                     "s_per_round": float(np.median([_median_after_first(r["seconds"])
                                                     for r in runs])),
                     **_elapsed(start)})
        print(f"  {workload} {name}: rounds {reached} ({rows[-1]['seconds']:.1f} s)",
              file=sys.stderr)
    return rows


# --- 2. personalized accuracy ---------------------------------------------------------------

def personalized(cfg: Config, data: Digits) -> list[dict[str, Any]]:
    sampler = sim.UniformSampler(data.ids, cfg.cohort, seed=cfg.seed)
    rounds, lr = cfg.personal_rounds, cfg.client_lr["W1"]
    tests = [data.whole(data.test, c) for c in data.ids]
    trains = [data.whole(data.train, c) for c in data.ids]
    n_test = np.asarray([len(t["y"]) for t in tests], np.float64)
    # Per-client evaluations run the largest clients first: a masked computation pads
    # every batch to the largest it has seen, so the others compile nothing new.
    order = np.argsort([-(len(tr["y"]) + len(te["y"])) for tr, te in zip(trains, tests)],
                       kind="stable")

    def row(method: str, acc: Any, start: tuple[float, float]) -> dict[str, Any]:
        acc = np.asarray(acc, np.float64)
        return {"method": method, "accuracy": float(acc @ n_test / n_test.sum()),
                "client_mean": float(acc.mean()),
                "worst_decile": float(np.sort(acc)[:max(len(acc) // 10, 1)].mean()),
                **_elapsed(start)}

    def batched(d: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [{"x": d["x"][s:s + cfg.batch], "y": d["y"][s:s + cfg.batch]}
                for s in range(0, len(d["y"]), cfg.batch)]

    rows = []
    # FedAvg, then its global model and local fine-tuning on each client's train split.
    start = _clock()
    model_fn = w1()
    fedavg = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(lr))
    out = _train(fedavg, data.training, sampler.sample_round, rounds)
    weights = fedavg.get_model_weights(out["state"])
    evaluate = algorithms.build_personalization_eval(
        model_fn, {"finetune": personalization.finetune(optax.sgd(lr), num_epochs=cfg.epochs)},
        max_num_clients=cfg.clients)
    metrics = evaluate(weights, [{"train_data": batched(tr), "test_data": batched(te)}
                                 for tr, te in zip(trains, tests)])
    rows.append(row("FedAvg, global model", metrics["baseline_metrics"]["accuracy"], start))
    rows.append(row(f"FedAvg + fine-tuning ({cfg.epochs} local epochs)",
                    metrics["finetune"]["accuracy"], start))

    # Ditto: the personal models are client state, kept in a store between rounds.
    per_client_eval = algorithms.build_ditto_eval(model_fn)
    for lam in cfg.ditto_lambdas:
        start = _clock()
        ditto = algorithms.build_ditto(model_fn, optax.sgd(lr), lam=lam)
        with tempfile.TemporaryDirectory() as tmp:
            store = ClientStateStore(pathlib.Path(tmp) / "personal", ditto.client_state)
            out = _train(ditto, data.training, sampler.sample_round, rounds, store=store)
            weights = ditto.get_model_weights(out["state"])
            accs = np.zeros(len(data.ids))
            for i in order:
                got = per_client_eval(weights, store.cohort([data.ids[i]]), [batched(tests[i])])
                accs[i] = float(got["personal"]["accuracy"])
        rows.append(row(f"Ditto (lambda {lam:g}), personal models", accs, start))

    # Federated Reconstruction: a local output bias, reconstructed on each client's
    # training data (one batch, `recon_epochs` steps), then evaluated on its held-out data.
    start = _clock()
    recon_fn = lambda: models.ReconstructionModel(  # noqa: E731
        w1(local_bias=True)(), local_trainable=["local_bias"])
    split = models.ReconstructionModel.build_dataset_split_fn(split_dataset=True)
    recon = algorithms.build_fed_recon(recon_fn, client_optimizer_fn=optax.sgd(lr),
                                       reconstruction_optimizer_fn=optax.sgd(lr),
                                       dataset_split_fn=split)
    out = _train(recon, data.training, sampler.sample_round, rounds)
    recon_eval = algorithms.build_fed_recon_eval(
        recon_fn, reconstruction_optimizer_fn=optax.sgd(1.0),
        dataset_split_fn=models.ReconstructionModel.build_dataset_split_fn(
            recon_epochs=10, split_dataset=True))
    eval_state = recon_eval.set_model_weights(recon_eval.initialize(),
                                              recon.get_model_weights(out["state"]))
    accs = np.zeros(len(data.ids))
    for i in order:  # batch 0 (all training examples) reconstructs, batch 1 evaluates
        _, m = recon_eval.next(eval_state, [[trains[i], tests[i]]])
        accs[i] = float(m["client_work"]["eval"]["current_round_metrics"]["accuracy"])
    rows.append(row("FedRecon, local output bias", accs, start))
    return rows


# --- 3. robust aggregation under model poisoning --------------------------------------------

def robust(cfg: Config, data: Digits, attack_scale: float) -> list[dict[str, Any]]:
    n_attackers = cfg.clients // 5
    attackers, honest = data.ids[:n_attackers], data.ids[n_attackers:]
    f = cfg.robust_cohort // 5
    honest_sampler = sim.UniformSampler(honest, cfg.robust_cohort - f, seed=cfg.seed)
    attacker_sampler = sim.UniformSampler(attackers, f, seed=cfg.seed + 1)
    clean_sampler = sim.UniformSampler(data.ids, cfg.robust_cohort, seed=cfg.seed)
    attacker_set = set(attackers)
    held_out = data.held_out()
    model_fn = w1(attack_scale)
    evaluate = evaluation.build_centralized_evaluation(w1())
    factories: dict[str, tuple[str, Callable[[], Any]]] = {
        "mean": ("mean", aggregators.UnweightedMeanFactory),
        "Krum": (f"Krum (f={f})", lambda: aggregators.KrumFactory(num_byzantine=f)),
        "multi-Krum": (f"multi-Krum (f={f}, m=n-f)",
                       lambda: aggregators.KrumFactory(f, num_selected=None)),
        "Bulyan": (f"Bulyan (f={f})", lambda: aggregators.BulyanFactory(num_byzantine=f)),
        "median": ("coordinate median", aggregators.MedianFactory),
        "trimmed mean": ("trimmed mean (0.2 each end)",
                         lambda: aggregators.TrimmedMeanFactory(0.2)),
    }

    def poisoned_cohort(r: int) -> list[str]:
        return honest_sampler.sample_round(r) + attacker_sampler.sample_round(r)

    def poisoned_data(cid: str, r: int) -> sim.Dataset:
        return data.training(cid, r, attacker=cid in attacker_set)

    rows = []
    for key in cfg.aggregators:
        name, factory = factories[key]
        row: dict[str, Any] = {"aggregator": name}
        start = _clock()
        # One process for both runs (honest clients' labels are never marked).
        process = algorithms.build_unweighted_fed_avg(
            model_fn, optax.sgd(cfg.client_lr["W1"]), model_aggregator=factory())
        for run, cohorts, data_fn in (("clean", clean_sampler.sample_round, data.training),
                                      ("attacked", poisoned_cohort, poisoned_data)):
            out = _train(process, data_fn, cohorts, cfg.robust_rounds)
            w = process.get_model_weights(out["state"])
            row[run] = float(evaluate(w, held_out)["accuracy"]) if _finite(w) else 0.0
        row.update(_elapsed(start))
        rows.append(row)
        print(f"  {name}: clean {row['clean']:.3f}, attacked {row['attacked']:.3f}",
              file=sys.stderr)
    return rows


# --- tables ---------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def print_tables(out: dict[str, Any], cfg: Config) -> None:
    if "rounds" in out:
        rows = []
        for r in out["rounds"]:
            base = next(b for b in out["rounds"]
                        if b["workload"] == r["workload"] and b["algorithm"] == "FedAvg")
            ratio = (f"{r['rounds'] / base['rounds']:.2f}x" if r["rounds"] and base["rounds"]
                     else "-")
            per_seed = ", ".join(
                str(n) if n else f"diverged in round {d}" if d else f">{r['max_rounds']}"
                for n, d in zip(r["rounds_per_seed"], r["diverged_per_seed"]))
            rounds = f"{r['rounds']:g}" if r["rounds"] else f"not all in {r['max_rounds']}"
            rows.append([r["workload"], r["algorithm"], f"{r['target']:.2f}", rounds, per_seed,
                         ratio, ", ".join(f"{a:.3f}" for a in r["final_accuracy"]),
                         f"{r['s_per_round']:.3f}", _took(r)])
        print(f"### Rounds to a target accuracy: digits, Dirichlet 0.1, {cfg.clients} clients, "
              f"{cfg.cohort} a round\n")
        print(_table(["workload", "algorithm", "target", "rounds (median)", "rounds per seed",
                      "rounds / FedAvg's", "accuracy when stopped", "s/round (median)",
                      "s in all, with compiling (CPU s)"], rows))
        print()
    if "personal" in out:
        base = out["personal"][0]["accuracy"]
        rows = [[r["method"], f"{r['accuracy']:.3f}", f"{r['accuracy'] - base:+.3f}",
                 f"{r['client_mean']:.3f}", f"{r['worst_decile']:.3f}", _took(r)]
                for r in out["personal"]]
        print(f"### Personalized accuracy after {cfg.personal_rounds} rounds: each client's "
              "held-out examples\n")
        print(_table(["method", "accuracy (all held-out examples)", "vs FedAvg's global model",
                      "mean over clients", "worst 10% of clients", "s (CPU s)"], rows))
        print()
    if "robust" in out:
        rows = [[r["aggregator"], f"{r['clean']:.3f}", f"{r['attacked']:.3f}",
                 _took(r)] for r in out["robust"]]
        print(f"### Final accuracy after {cfg.robust_rounds} rounds, 20% model-poisoning "
              f"clients ({cfg.robust_cohort} a round)\n")
        print(_table(["aggregator", "no attackers", "20% attackers", "s, both runs (CPU s)"], rows))
        print()


def machine() -> dict[str, Any]:
    return {"nproc": os.cpu_count(), "load_average": os.getloadavg(),
            "python": platform.python_version(), "jax": jax.__version__,
            "platform": platform.platform()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--only", action="append", choices=SECTIONS,
                        help="run only these tables (repeatable)")
    parser.add_argument("--workloads", nargs="*", choices=sorted(WORKLOADS),
                        help="workloads of the rounds-to-target table (default: W1 and the "
                             "W2 CNN; --quick: W1)")
    parser.add_argument("--strategy", default="loop",
                        help="the simulation runtime's strategy (default loop: these "
                             "models are tiny and their runs short, so compiling dominates, "
                             "and loop compiles the fewest programs)")
    parser.add_argument("--attack-scale", type=float, default=10.0,
                        help="how much larger than honest an attacker's (negated) loss is")
    parser.add_argument("--mime-lr-scale", type=float, default=1.0,
                        help="Mime Lite's client step as a multiple of the others' (its "
                             "momentum 0.9 makes its steady steps 10x larger; 0.1 evens that)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    sections = args.only or list(SECTIONS)
    start = _clock()
    workloads = args.workloads or list(cfg.workloads)
    with jax.numpy_dtype_promotion("standard"), \
            fl.runtime.simulation_context(strategy=args.strategy):  # optax mixes int32 and floats
        data = Digits(cfg)
        out: dict[str, Any] = {"config": cfg._asdict(), "machine": machine(),
                               "command": sys.argv if argv is None else argv}
        if "rounds" in sections:
            out["rounds"] = [r for w in workloads
                             for r in rounds_to_target(cfg, data, w, args.mime_lr_scale)]
        if "personal" in sections:
            out["personal"] = personalized(cfg, data)
        if "robust" in sections:
            out["robust"] = robust(cfg, data, args.attack_scale)
    out.update(_elapsed(start))
    out["machine"]["load_average_after"] = os.getloadavg()
    print_tables(out, cfg)
    print(f"{out['seconds']:.0f} s in all ({out['cpu_seconds']:.0f} CPU s); load average "
          f"{out['machine']['load_average']} "
          f"before, {out['machine']['load_average_after']} after", file=sys.stderr)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
