"""Asynchronous FedBuff against synchronous FedAvg on a virtual clock (digits).

Clients are slow in different ways: each device has its own speed, each participation
draws a lognormal compute time, and one in ten is a straggler ten times slower. On a
virtual clock (`fedlang.simulation.clock`) this script trains the same small model on
scikit-learn's digits, split non-IID across clients, three ways:

* synchronous FedAvg: each round waits for its slowest client;
* synchronous FedAvg selecting 30% more clients than it needs, closing the round at
  the first `cohort` reports or a deadline (over-selection);
* FedBuff: `concurrency` clients always training, the server stepping whenever `K`
  reports arrived, down-weighting stale ones.

It prints the virtual time each takes to reach a target accuracy and the client
updates it used, and plots accuracy against virtual time.

Run it with `python examples/async_vs_sync.py accuracy_vs_time.png`.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedlang.simulation as sim
from fedlang.learning import algorithms, models
from fedlang.simulation import async_sim, clock

INPUT_SPEC = {"x": (np.float32, [None, 64]), "y": (np.int32, [None])}
HIDDEN = 32


def init(rng: Any) -> dict[str, Any]:
    k1, k2 = jax.random.split(rng)
    return {
        "b1": jnp.zeros(HIDDEN), "b2": jnp.zeros(10),
        "w1": jax.random.normal(k1, (64, HIDDEN)) * 0.1,
        "w2": jax.random.normal(k2, (HIDDEN, 10)) * 0.1,
    }


def apply(params: Any, x: Any) -> Any:
    return jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def model_fn() -> models.Model:
    return models.FunctionalModel(
        init_fn=init, apply_fn=apply,
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=INPUT_SPEC, metrics=[models.Accuracy()],
    )


def make_evaluate(test: sim.ClientData) -> Any:
    """`model_weights -> {'accuracy'}` on every test client's examples, pooled."""
    xs, ys = [], []
    for cid in test.client_ids:
        for e in test.create_dataset_for_client(cid):
            xs.append(e["x"])
            ys.append(e["y"])
    x, y = jnp.asarray(np.stack(xs)), jnp.asarray(np.asarray(ys))
    correct = jax.jit(lambda p: jnp.mean(jnp.argmax(apply(p, x), -1) == y))

    def evaluate(weights: models.ModelWeights) -> dict[str, float]:
        return {"accuracy": float(correct(weights.trainable))}

    return evaluate


CLIENT_TIMES = clock.ClientTimes(
    compute=clock.Stragglers(clock.LogNormal(median=1.0, sigma=0.5), fraction=0.1, slowdown=10.0),
    network=clock.LogNormal(median=0.2, sigma=0.3),
    device_speed=clock.LogNormal(median=1.0, sigma=0.5),
)


def run(
    max_time: float = 60.0,
    num_clients: int = 60,
    cohort: int = 10,
    buffer_size: int = 5,
    target: float = 0.85,
    seed: int = 0,
) -> dict[str, async_sim.History]:
    """The three runs, each until `max_time` virtual seconds; returns their histories."""
    train, test = sim.datasets.digits_train_test(num_clients=num_clients, alpha=0.5, seed=seed)
    train = train.preprocess(lambda ds: ds.repeat(2).shuffle(64, seed=seed).batch(16))
    evaluate = make_evaluate(test)
    many = 10_000  # the runs stop at max_time
    fed_avg = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.3))
    fed_buff = algorithms.build_fed_buff(model_fn, optax.sgd(0.3), buffer_size=buffer_size)
    common: dict[str, Any] = {"client_times": CLIENT_TIMES, "seed": seed, "evaluate": evaluate,
                              "max_time": max_time}
    return {
        "FedAvg": async_sim.run_sync(fed_avg, train, cohort_size=cohort, num_rounds=many, **common),
        "FedAvg +30% deadline 3s": async_sim.run_sync(
            fed_avg, train, cohort_size=cohort, num_rounds=many, over_selection=0.3,
            deadline=3.0, **common),
        f"FedBuff K={buffer_size}": async_sim.run_async(
            fed_buff, train, concurrency=cohort, num_steps=many, **common),
    }


def plot(histories: dict[str, async_sim.History], path: str, target: float) -> None:
    """Accuracy against virtual time, one line per run, saved as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, h in histories.items():
        ax.plot([r.time for r in h], [r.metrics["eval"]["accuracy"] for r in h], label=name)
    ax.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"target {target}")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title("digits: asynchronous FedBuff vs synchronous FedAvg")
    ax.legend(loc="lower right")
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Runs the comparison, prints a table, saves the plot; returns the table's rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plot", help="where to save the plot (a .png file)")
    parser.add_argument("--max-time", type=float, default=60.0, help="virtual seconds per run")
    parser.add_argument("--clients", type=int, default=60)
    parser.add_argument("--cohort", type=int, default=10, help="cohort and FedBuff concurrency")
    parser.add_argument("--buffer-size", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    histories = run(args.max_time, args.clients, args.cohort, args.buffer_size, args.target,
                    args.seed)
    rows = {}
    print(f"{'run':28s} {'steps':>6s} {'updates':>8s} {'discarded':>9s} "
          f"{'final acc':>9s} {'time to ' + str(args.target):>14s}")
    for name, h in histories.items():
        t = h.time_to("accuracy", args.target)
        last = h[-1]
        rows[name] = {"steps": last.step, "updates": last.client_updates,
                      "discarded": last.discarded, "accuracy": last.metrics["eval"]["accuracy"],
                      "time_to_target": t}
        print(f"{name:28s} {last.step:6d} {last.client_updates:8d} {last.discarded:9d} "
              f"{rows[name]['accuracy']:9.3f} {'-' if t is None else f'{t:.1f} s':>14s}")
    plot(histories, args.plot, args.target)
    print(f"plot: {args.plot}")
    return rows


if __name__ == "__main__":
    main()
