"""W2's CNN on CPU: plain JAX against a plain torch loop of the same CNN, batch 20.

The FedAvg paper's CNN (conv5x5x32, maxpool 2, conv5x5x64, maxpool 2, dense 512,
dense 10) trained with SGD (lr 0.1) over the same batches of 20 examples, one jitted
step per batch in JAX and one `optimizer.step()` per batch in torch. JAX runs once per
set of XLA CPU options, each in its own process (XLA reads its flags when it starts),
so the options that make XLA:CPU's convolutions fast can be found and compared with
torch (oneDNN underneath) on the same machine and threads.

torch is not a dependency of fedlang: without it the torch row is skipped.

Usage:
  python bench/cnn_cpu.py                 # every option set, 200 batches each
  python bench/cnn_cpu.py --batches 100 --variants default,xnnpack
  PYTHONPATH=/path/to/torch python bench/cnn_cpu.py --variants default,fedlang-tuned,fedlang-tuned-2-clients
  python bench/cnn_cpu.py --parts          # where a step's time goes (taskset -c 0: one core)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

VARIANTS = {
    "default": "",
    # fedlang's tuned step (backends/jax/rewrite.py: the max-pool gradient without a
    # scatter), one client; then two clients' batches side by side on two threads, as
    # the simulation runtime runs clients of a convolutional step (ms per batch: the
    # wall time over both clients' batches).
    "fedlang-tuned": "",
    "fedlang-tuned-2-clients": "",
    "fedlang-tuned-onednn-2-clients": "--xla_cpu_use_onednn=true",
    "onednn+no-eigen-threads": "--xla_cpu_use_onednn=true --xla_cpu_multi_thread_eigen=false",
    "onednn": "--xla_cpu_use_onednn=true",
    "xnnpack": "--xla_cpu_use_xnnpack=true",
    "no-eigen-threads": "--xla_cpu_multi_thread_eigen=false",
    "fast-math": "--xla_cpu_enable_fast_math=true",
    "legacy-runtime": "--xla_cpu_use_thunk_runtime=false",
}


def batches(n: int, seed: int = 0) -> list[tuple[Any, Any]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        (rng.random((20, 28, 28), dtype=np.float32), rng.integers(0, 10, 20).astype(np.int32))
        for _ in range(n)
    ]


def time_jax(n: int, repeats: int, variant: str = "default") -> dict[str, Any]:
    sys.path.insert(0, HERE)
    import concurrent.futures

    import jax
    import workloads

    from fedlang.backends.jax import rewrite

    step = workloads.sgd_step(workloads.CNN)
    params = workloads.CNN.init(jax.random.key(0))
    names = sorted(params)

    def flat_step(*leaves: Any) -> list[Any]:
        p = dict(zip(names, leaves[:-2]))
        new = step(p, {"x": leaves[-2], "y": leaves[-1]})[0]
        return [new[k] for k in names]

    jitted = jax.jit(rewrite.tuned(flat_step) if variant.startswith("fedlang") else flat_step)
    clients = 2 if variant.endswith("2-clients") else 1
    data = batches(n)
    start = [params[k] for k in names]
    jax.block_until_ready(jitted(*start, *data[0]))  # compile

    def client(part: list[tuple[Any, Any]]) -> Any:
        p = start
        for x, y in part:
            p = jitted(*p, x, y)
        return jax.block_until_ready(p)

    parts = [data[k::clients] for k in range(clients)]
    pool = concurrent.futures.ThreadPoolExecutor(clients)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        list(pool.map(client, parts))
        times.append(time.perf_counter() - t0)
    pool.shutdown()
    return {"s_per_batch": min(times) / n, "runs_s": times}


def time_parts(repeats: int = 3, calls: int = 40) -> dict[str, float]:
    """ms per call of the CNN step and of its parts on a batch of 20 (`--parts`): where
    XLA:CPU spends a step, with the max-pool by `reduce_window` (its gradient a
    `select_and_scatter_add`) and by reshape, and fedlang's tuned step."""
    sys.path.insert(0, HERE)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import workloads
    from jax import lax

    from fedlang.backends.jax import rewrite

    rng = np.random.default_rng(0)
    x = rng.random((20, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, 20).astype(np.int32)
    p = workloads.CNN.init(jax.random.key(0))

    def conv(a: Any, k: Any) -> Any:
        return lax.conv_general_dilated(a, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def pool_window(a: Any) -> Any:
        return lax.reduce_window(a, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    def pool_reshape(a: Any) -> Any:
        n, h, w, c = a.shape
        return a.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))

    def grad_step(pool: Any) -> Any:
        def apply(q: Any) -> Any:
            h = pool(jax.nn.relu(conv(x[..., None], q["conv1_w"]) + q["conv1_b"]))
            h = pool(jax.nn.relu(conv(h, q["conv2_w"]) + q["conv2_b"])).reshape(20, -1)
            h = jax.nn.relu(h @ q["dense1_w"] + q["dense1_b"])
            logits = h @ q["dense2_w"] + q["dense2_b"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return lambda q: jax.grad(apply)(q)

    names = sorted(p)

    def flat(fn: Any) -> Any:
        return lambda *leaves: jax.tree_util.tree_leaves(fn(dict(zip(names, leaves))))

    h1 = rng.random((20, 28, 28, 1), dtype=np.float32)
    h2 = rng.random((20, 14, 14, 32), dtype=np.float32)
    a = rng.random((20, 28, 28, 32), dtype=np.float32)
    leaves = [p[k] for k in names]
    parts: dict[str, tuple[Any, tuple[Any, ...]]] = {
        "step gradient, max-pool by reduce_window": (flat(grad_step(pool_window)), tuple(leaves)),
        "step gradient, the same, fedlang's tuned program": (
            rewrite.tuned(flat(grad_step(pool_window))), tuple(leaves)),
        "step gradient, max-pool by reshape and max": (flat(grad_step(pool_reshape)), tuple(leaves)),
        "conv2 forward": (conv, (h2, p["conv2_w"])),
        "conv2 kernel gradient": (lambda a, k: jax.grad(lambda k: conv(a, k).sum())(k), (h2, p["conv2_w"])),
        "conv2 input gradient": (lambda a, k: jax.grad(lambda a: conv(a, k).sum())(a), (h2, p["conv2_w"])),
        "conv1 kernel gradient": (lambda a, k: jax.grad(lambda k: conv(a, k).sum())(k), (h1, p["conv1_w"])),
        "max-pool gradient, select_and_scatter_add": (
            lambda a: jax.grad(lambda a: pool_window(a).sum())(a), (a,)),
        "max-pool gradient, by reshape": (lambda a: jax.grad(lambda a: pool_reshape(a).sum())(a), (a,)),
    }
    out = {}
    for name, (fn, args) in parts.items():
        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(*args))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                r = jitted(*args)
            jax.block_until_ready(r)
            best = min(best, (time.perf_counter() - t0) / calls)
        out[name] = best * 1e3
        print(f"  {name:50s} {out[name]:7.2f} ms", flush=True)
    return out


def torch_cnn() -> Any:
    """The FedAvg paper's CNN in torch (NCHW inputs [batch, 1, 28, 28])."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 5, padding=2),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 5, padding=2),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(7 * 7 * 64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def time_torch(n: int, repeats: int, threads: int) -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    net = torch_cnn()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()
    data = [(torch.from_numpy(x)[:, None], torch.from_numpy(y).long()) for x, y in batches(n)]

    def epoch() -> None:
        for x, y in data:
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()

    epoch()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        epoch()
        times.append(time.perf_counter() - t0)
    return {"s_per_batch": min(times) / n, "runs_s": times, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--parts", action="store_true",
                        help="time the step's parts instead (run under `taskset -c 0` for one core)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parts:
        time_parts()
        return
    if args.worker in ("torch", "torch-1-thread"):
        threads = 1 if args.worker == "torch-1-thread" else os.cpu_count() or 1
        print(json.dumps(time_torch(args.batches, args.repeats, threads)))
        return
    if args.worker:
        print(json.dumps(time_jax(args.batches, args.repeats, args.worker)))
        return
    rows = []
    for name in ["torch", "torch-1-thread", *args.variants.split(",")]:
        env = dict(os.environ)
        if not name.startswith("torch"):
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {VARIANTS[name]}".strip()
        cmd = [sys.executable, __file__, "--worker", name, "--batches", str(args.batches),
               "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"{name}: failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        if r is None:
            print("torch: not installed, skipped")
            continue
        rows.append((name, r))
        print(f"{name:18s} {r['s_per_batch'] * 1e3:7.2f} ms/batch  "
              f"(runs {', '.join(f'{t:.2f}' for t in r['runs_s'])} s)", flush=True)
    base = dict(rows).get("torch")
    if base:
        for name, r in rows:
            if name != "torch":
                print(f"{name}: {r['s_per_batch'] / base['s_per_batch']:.2f}x torch's time")


if __name__ == "__main__":
    main()
