"""Do the simulation runtime's strategies agree? Per round, and after several rounds.

Runs W1 (logistic regression, EMNIST-shaped data) FedAvg with `loop` as the baseline
and, in the same process and on the same cohorts, with other strategies (`vmap` at
wide groups, `scan`) and with `loop` started from initial weights moved by a tiny
relative perturbation. For each round it prints:

  one-round  the largest difference between a strategy's new model and loop's new model,
             both computed from loop's model of that round (relative to loop's largest
             weight): the error a strategy adds in one round, float reassociation only;
  drift      the same difference after running each strategy from its own previous
             model: how far the trajectories have moved apart by then;

and the held-out accuracy at the end. If one-round differences are at float rounding
(1e-7..1e-5) while a 1e-7 perturbation of the initial weights drifts as far and changes
the final accuracy as much as a strategy does, the strategies agree and the training is
sensitive to rounding: the accuracy gap is not a bug of the strategy.

Usage:
  python bench/strategy_agreement.py                         # W1 cohort 100, 5 rounds
  python bench/strategy_agreement.py --rounds 8 --variants vmap:100,scan,perturb:1e-6:4
  JAX_DEFAULT_MATMUL_PRECISION=highest python bench/strategy_agreement.py   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def flat(params: dict[str, Any]) -> Any:
    import numpy as np

    return np.concatenate([np.ravel(np.asarray(params[k], np.float64)) for k in sorted(params)])


def perturbed(params: dict[str, Any], scale: float, seed: int = 1) -> dict[str, Any]:
    """`params` with every weight moved by `scale` times its tensor's largest magnitude
    times a standard normal draw (relative, so the perturbation is a rounding-sized one)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = {}
    for k in sorted(params):
        x = np.asarray(params[k])
        size = max(float(np.max(np.abs(x))), 1e-3)
        out[k] = (x + scale * size * rng.standard_normal(x.shape)).astype(x.dtype)
    return out


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """'vmap:100' -> strategy vmap, width 100; 'scan'; 'perturb:1e-7:2' -> loop from
    initial weights perturbed by 1e-7 (relative) with random seed 2."""
    name, _, arg = text.partition(":")
    if name == "vmap":
        return text, {"strategy": "vmap", "vmap_width": int(arg) if arg else None}
    if name == "perturb":
        eps, _, seed = arg.partition(":")
        return text, {"strategy": "loop", "perturb": float(eps or 1e-7), "seed": int(seed or 1)}
    if name in ("loop", "scan", "auto"):
        return text, {"strategy": name}
    raise SystemExit(f"unknown variant {text!r}: use vmap[:W], scan, auto, loop or perturb[:EPS]")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="W1", choices=["W1", "W2"])
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--variants", default="vmap:100,vmap:16,scan,perturb:1e-7:1,perturb:1e-7:2,perturb:1e-7:3"
    )
    parser.add_argument("--test-size", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSON results file")
    args = parser.parse_args(argv)

    import data
    import jax
    import numpy as np
    import workloads

    import fedlang as fl

    model = workloads.MODELS["logreg" if args.workload == "W1" else "cnn"]
    ds = data.FederatedEmnist(args.seed)
    test = ds.test_set(args.test_size, flat=model.flat)
    accuracy = workloads.make_accuracy(model)
    process = workloads.build_fedavg(model)
    variants = [parse_variant(v) for v in args.variants.split(",") if v]
    options = {"loop": {"strategy": "loop"}}
    for name, opts in variants:
        options[name] = {k: v for k, v in opts.items() if k in ("strategy", "vmap_width")}

    def step(name: str, params: Any, client_data: list[Any]) -> Any:
        with fl.runtime.simulation_context(decision_cache=False, **options[name]):
            new, _ = process.next(params, client_data)
        return {k: np.asarray(v) for k, v in new.items()}

    with fl.runtime.simulation_context(strategy="loop"):
        initial = {k: np.asarray(v) for k, v in process.initialize().items()}
    states = {"loop": initial}
    for name, opts in variants:
        states[name] = perturbed(initial, opts["perturb"], opts["seed"]) if "perturb" in opts else initial
    rows: list[dict[str, Any]] = []
    print(f"{args.workload} cohort {args.cohort}, {jax.default_backend()}, "
          f"matmul precision {jax.config.jax_default_matmul_precision or 'default'}")
    print(f"{'round':>5} " + " ".join(f"{n + ' 1-round':>18} {n + ' drift':>16}" for n, _ in variants))
    for r in range(args.rounds):
        client_data = [ds.client_batches(i, 20, r, model.flat) for i in ds.sample_cohort(r, args.cohort)]
        base = states["loop"]
        new_base = step("loop", base, client_data)
        scale = float(np.max(np.abs(flat(new_base))))
        row: dict[str, Any] = {"round": r}
        for name, opts in variants:
            # The perturbed run's one-round error is loop's own: its programs are loop's.
            one = 0.0 if "perturb" in opts else float(
                np.max(np.abs(flat(step(name, base, client_data)) - flat(new_base)))
            ) / scale
            states[name] = step(name, states[name], client_data)
            drift = float(np.max(np.abs(flat(states[name]) - flat(new_base)))) / scale
            row[name] = {"one_round": one, "drift": drift}
        states["loop"] = new_base
        rows.append(row)
        print(f"{r:>5} " + " ".join(
            f"{row[n]['one_round']:>18.1e} {row[n]['drift']:>16.1e}" for n, _ in variants
        ))
    accs = {name: accuracy(states[name], test) for name in states}
    print("accuracy after", args.rounds, "rounds:", ", ".join(f"{n} {a:.4f}" for n, a in accs.items()))
    out = {"args": vars(args), "rounds": rows, "accuracy": accs, "platform": jax.default_backend()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
