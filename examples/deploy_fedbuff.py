"""Buffered asynchronous FedAvg (FedBuff) on real clients: no step waits for the slowest.

The asynchronous counterpart of examples/deploy_digits.py. It starts a task store server
on 127.0.0.1 with a `BufferedDriver` in this process, writes each client's share of
scikit-learn's digits (non-IID) to its own .npz file and starts one client process per
client; each client sleeps a random time before training (a slow phone, a busy
machine). Clients train whenever they can on the model version they downloaded and
report; the server steps whenever K reports are in, down-weighting stale ones, and the
driver prints the held-out accuracy after each step.

Run it:  python examples/deploy_fedbuff.py [--steps 30] [--clients 20] [--buffer-size 10]
         [--max-delay 1.0]

Two more modes, used by the tests (and handy to try a restart by hand):
  python examples/deploy_fedbuff.py serve --db PATH --port P --steps N
      the server and the driver in one process; on a restart on the same database the
      driver resumes its session (the buffer rebuilt from the stored reports).
  python examples/deploy_fedbuff.py client --server URL --token T --data PATH
      one client with random delays.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import optax

from fedlang import deploy
from fedlang.deploy import protocol
from fedlang.deploy.client import data as data_lib
from fedlang.deploy.driver import buffered as buffered_driver
from fedlang.learning import algorithms


def _sibling(name: str) -> Any:
    """Another example script of this directory, as a module."""
    path = pathlib.Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


deploy_digits = _sibling("deploy_digits")  # the model, the data split and the accuracy

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
SESSION = "digits-fedbuff"  # the driver's request id: a restarted driver resumes this session


def build_process(buffer_size: int = 10, max_staleness: int = 4) -> Any:
    """FedBuff on the digits model: client SGD 0.5, server SGD 1.0 on each buffer's mean."""
    return algorithms.build_fed_buff(
        deploy_digits.model_fn, optax.sgd(0.5), optax.sgd(1.0),
        buffer_size=buffer_size, max_staleness=max_staleness,
    )


class SlowData:
    """A client's .npz data that waits a random time before each pass (a slow client)."""

    def __init__(self, path: str | os.PathLike[str], batch_size: int, max_delay: float,
                 seed: int):
        self.data = data_lib.NpzDataset(path, batch_size)
        self.max_delay = max_delay
        self.rng = random.Random(seed)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        time.sleep(self.rng.uniform(0, self.max_delay))
        yield from self.data


def client_main(server: str, token: str, data: str, batch_size: int = 20,
                max_delay: float = 1.0, seed: int = 0, patience: float = 120.0) -> int:
    """One client: enrolls, then trains each version it gets after a random delay."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with deploy.Client(server, "digits", token,
                       {"train": SlowData(data, batch_size, max_delay, seed)},
                       patience=patience) as c:
        return c.run()


@contextlib.contextmanager
def client_processes(url: str, token: str, files: list[pathlib.Path], max_delay: float,
                     logs: pathlib.Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One client process per data file, each killed on exit if still running."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = []
    try:
        for i, path in enumerate(files):
            with open(logs / f"client{i}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "client", "--server", url, "--token", token,
                     "--data", str(path), "--max-delay", str(max_delay), "--seed", str(i)],
                    stdout=log, stderr=subprocess.STDOUT, env=env,
                ))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def write_clients(work: pathlib.Path, num_clients: int) -> tuple[list[pathlib.Path], Any]:
    """Each client's share of the digits as an .npz file, and the held-out test set."""
    clients, test = deploy_digits.partition(num_clients)
    files = []
    for i, data in enumerate(clients):
        files.append(work / f"client{i}.npz")
        np.savez(files[-1], x=data["x"], y=data["y"])
    return files, test


def drive(driver: buffered_driver.BufferedDriver, steps: int, test: Any, verbose: bool,
          target: float | None = None, timeout: float | None = None) -> list[float]:
    """Runs the driver for `steps` server steps (fewer once `target` accuracy is met),
    printing the held-out accuracy after each; returns the accuracies."""
    history: list[float] = []

    class Reached(Exception):
        pass

    def on_step(state: Any, step: buffered_driver.Step) -> None:
        acc = deploy_digits.accuracy(driver.process.get_model_weights(state), test)
        history.append(acc)
        if verbose:
            s = driver.status()  # the process's counts; the server counts its refusals
            refused = driver.session()["refused_stale"]
            print(f"version {step.version:3d}: held-out accuracy {acc:.3f}; accepted "
                  f"{s['accepted']}, refused stale {refused}, staleness "
                  f"{s['staleness_histogram']}", flush=True)
        if target is not None and acc >= target:
            raise Reached

    with contextlib.suppress(Reached):
        driver.run(steps, on_step=on_step, timeout=timeout)
    return history


def run(steps: int = 30, num_clients: int = 20, buffer_size: int = 10, max_staleness: int = 4,
        max_delay: float = 1.0, workdir: str | os.PathLike[str] | None = None,
        verbose: bool = True, target: float | None = None,
        timeout: float | None = None) -> dict[str, Any]:
    """Trains on `num_clients` client processes; returns the final state and accuracies."""
    work = pathlib.Path(workdir or tempfile.mkdtemp(prefix="fedlang-fedbuff-"))
    files, test = write_clients(work, num_clients)
    process = build_process(buffer_size, max_staleness)
    with deploy.Server(db=work / "store.db", port=0, pace=deploy.Pace(min_retry=0.1)) as server, \
            deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
        if verbose:
            print(f"server {server.url}; {num_clients} clients; K={buffer_size}; data and "
                  f"logs in {work}", flush=True)
        with client_processes(server.url, token, files, max_delay, work) as procs, \
                buffered_driver.BufferedDriver(process, server.url, server.admin_token,
                                            "digits", request_id=SESSION) as driver:
            history = drive(driver, steps, test, verbose, target, timeout)
            driver.close_session()
            admin.finish_population("digits")  # the clients stop at their next check-in
            for p in procs:
                p.wait(timeout=120)
        status = server.app_state.status()
    return {"state": driver.state, "process": process, "accuracy": history,
            "status": status, "driver": driver}


def serve(db: str, port: int, admin_token: str, steps: int, buffer_size: int = 10,
          max_staleness: int = 4, out: str | None = None, key_file: str | None = None) -> None:
    """The server and the driver in one process (see the module docstring)."""
    process = build_process(buffer_size, max_staleness)
    with deploy.Server(db=db, port=port, admin_token=admin_token, key=key_file,
                       pace=deploy.Pace(min_retry=0.05, max_retry=0.5), tick=0.2) as server:
        try:
            print(f"population digits token: {server.store.create_population('digits')}",
                  flush=True)
        except protocol.Conflict:
            print("population digits exists", flush=True)
        with buffered_driver.BufferedDriver(process, server.url, admin_token, "digits",
                                         request_id=SESSION, patience=60) as driver:
            driver.start()
            assert driver.resumed is not None
            print(f"session {driver.session_id} resumed at version {driver.resumed[0]} after "
                  f"report {driver.resumed[1]}; {driver.refolded} stored reports folded",
                  flush=True)
            while driver.version < steps:
                driver.run(1, timeout=600)
                print(f"version {driver.version}: {driver.status()}", flush=True)
            driver.close_session()
            server.store.finish_population("digits")
            if out is not None:
                pathlib.Path(out).write_text(json.dumps({
                    "session": driver.session_id, "version": driver.version,
                    "status": driver.status(),
                }))
        time.sleep(1.0)  # let the clients see "finished"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--buffer-size", type=int, default=10)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--max-delay", type=float, default=1.0)
    s = sub.add_parser("serve")
    s.add_argument("--db", required=True)
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--admin-token", default=os.environ.get("FEDLANG_ADMIN_TOKEN", "admin"))
    s.add_argument("--key-file", help="the plan-signing key file (PostgreSQL needs one)")
    s.add_argument("--steps", type=int, default=30)
    s.add_argument("--buffer-size", type=int, default=10)
    s.add_argument("--max-staleness", type=int, default=4)
    s.add_argument("--out")
    c = sub.add_parser("client")
    c.add_argument("--server", required=True)
    c.add_argument("--token", required=True)
    c.add_argument("--data", required=True)
    c.add_argument("--batch-size", type=int, default=20)
    c.add_argument("--max-delay", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.mode == "serve":
        serve(args.db, args.port, args.admin_token, args.steps, args.buffer_size,
              args.max_staleness, args.out, args.key_file)
    elif args.mode == "client":
        client_main(args.server, args.token, args.data, args.batch_size, args.max_delay,
                    args.seed)
    else:
        result = run(args.steps, args.clients, args.buffer_size, args.max_staleness,
                     args.max_delay)
        print(f"final held-out accuracy: {result['accuracy'][-1]:.3f}")


if __name__ == "__main__":
    main()
