"""`fedlang demo` and `fedlang train CONFIG.toml`: an experiment of the `experiment`
module's config, run by `fedlang.simulation.run_training`, reported as a table."""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import time
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from fedlang.cli import console

E = TypeVar("E", bound=BaseException)


def results_table(history: list[dict[str, Any]]) -> Table:
    """The evaluated rounds of `history`, and its last round: train and eval loss and
    accuracy (blank where a round was not evaluated)."""
    table = Table(title="Accuracy by round", box=box.SIMPLE_HEAVY)
    for name in ("round", "train loss", "train accuracy", "eval loss", "eval accuracy"):
        table.add_column(name, justify="right")
    for i, h in enumerate(history):
        m = h["metrics"]
        if "eval" not in m and i < len(history) - 1:
            continue
        train = m["train"].get("client_work", {}).get("train", {})
        evaluation = m.get("eval", {})
        cells = [train.get("loss"), train.get("accuracy"), evaluation.get("loss"),
                 evaluation.get("accuracy")]
        table.add_row(str(h["round"]), *("" if v is None else f"{v:.4f}" for v in cells))
    return table


def demo_header(config: dict[str, Any]) -> None:
    """Says what `fedlang demo` runs, on one line: a terminal wraps it at its width, and
    a file or a pipe gets it whole (rich would cut it at 80 columns, mid-phrase)."""
    d, t = config["data"], config["training"]
    console.out.print(
        f"[bold]fedlang demo[/]: FedAvg, MLP 64-32-10, digits over {d['num_clients']} clients "
        f"(Dirichlet alpha={d['alpha']}), {t['rounds']} rounds of {t['cohort_size']} clients.",
        highlight=False, soft_wrap=not console.out.is_terminal)


def _report(config: dict[str, Any], result: Any, elapsed: float) -> None:
    from fedlang.cli import experiment

    out = pathlib.Path(config["output"]["dir"])
    if result.resumed_from is not None:
        console.out.print(f"Resumed from the checkpoint of round {result.resumed_from}.")
    if result.history:
        console.out.print(results_table(result.history))
    else:
        console.out.print(f"Nothing to do: the run in {escape(str(out))} already has "
                          f"{result.round_num} rounds.", highlight=False,
                          soft_wrap=not console.out.is_terminal)
    console.out.print(
        escape(f"{len(result.history)} rounds in {elapsed:.1f}s. Metrics: {out / 'metrics.csv'}, "
               f"{out / 'metrics.jsonl'}; plot: {out / 'metrics.png'}; checkpoints: "
               f"{out / 'checkpoints'}. TensorBoard: `tensorboard --logdir {out / 'tensorboard'}` "
               "(install it with `pip install 'fedlang[tensorboard]'`)."),
        highlight=False, soft_wrap=True,
    )
    warning = experiment.divergence(result, config)
    if warning:
        console.warn(warning)


def _interrupted(out: pathlib.Path | None, at: str, history: list[dict[str, Any]] | None = None,
                 checkpoint_round: int | None = None) -> NoReturn:
    """After Ctrl-C: the rounds so far, where the run stands and how to go on; status 130."""
    from fedlang.simulation import checkpoint

    if history:
        console.out.print(results_table(history))
    ckpt_dir = None if out is None else out / "checkpoints"
    if ckpt_dir is None or checkpoint.latest(ckpt_dir) is None:
        where = "no checkpoint yet; run the same command to start again"
    else:
        which = "" if checkpoint_round is None else f" (round {checkpoint_round})"
        where = f"last checkpoint in {ckpt_dir}{which}; run the same command to resume"
    console.fail(f"{at}; {where}.", 130, label="Interrupted")


def _cause(error: BaseException, kind: type[E]) -> E | None:
    """The `kind` exception among `error`'s contexts (what it interrupted), if any."""
    seen: BaseException | None = error.__context__
    while seen is not None and not isinstance(seen, kind):
        seen = seen.__context__
    return seen


def _run_and_report(path: pathlib.Path | None, overrides: dict[str, dict[str, Any]],
                    progress: bool | None, *, demo: bool, admin_token: str | None = None) -> None:
    """Loads the config (`experiment.load_config(path, **overrides)`), runs it and
    reports. Ctrl-C at any point (it stops at the end of the round in progress; twice:
    at once) ends with status 130 and says where the run stands and how to resume."""
    from fedlang.core import status

    out: pathlib.Path | None = None

    def stop_now() -> None:
        """A second Ctrl-C: exit at once (raising inside JAX or a metrics writer's thread
        can crash or hang); checkpoints are written atomically, so the last one is whole."""
        from fedlang.simulation import checkpoint

        ckpt_dir = None if out is None else out / "checkpoints"
        where = (f"last checkpoint in {ckpt_dir}; run the same command to resume"
                 if ckpt_dir is not None and checkpoint.latest(ckpt_dir) is not None
                 else "no checkpoint yet; run the same command to start again")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # mid-write in the main thread: skip it
                stream.flush()
        os.write(2, f"\nInterrupted: stopped at once (the round in progress is lost); {where}.\n"
                    .encode())
        os._exit(130)

    # entered first: the imports below take seconds, and a Ctrl-C in them could be lost
    with status.defer_interrupts("stopping after this round (Ctrl-C again to stop now)",
                                 stop_now) as interrupts:
        from fedlang import simulation as sim
        from fedlang.cli import experiment
        from fedlang.simulation import checkpoint, store

        try:
            config = experiment.load_config(path, **overrides)
            out = pathlib.Path(config["output"]["dir"])
            if demo:
                demo_header(config)
            t0 = time.perf_counter()
            result = experiment.run(config, progress=progress, fresh=demo, admin_token=admin_token,
                                    flags=experiment.flagged(overrides))
            elapsed = time.perf_counter() - t0
        except KeyboardInterrupt as e:  # Ctrl-C: TrainingInterrupted, or twice in set-up
            stopped = e if isinstance(e, sim.TrainingInterrupted) else _cause(
                e, sim.TrainingInterrupted)
            with interrupts.shielded():  # say it whole
                if stopped is None:
                    _interrupted(out, "before training started")
                _interrupted(out, f"at round {stopped.result.round_num} of {stopped.rounds}",
                             stopped.result.history, stopped.checkpoint_round)
        except checkpoint.CheckpointMismatchError as e:
            console.fail(e, 1, "(fedlang train: --output-dir DIR starts this config in a new "
                               "directory.)")
        except (*console.INPUT_ERRORS, checkpoint.CheckpointError, store.StoreError) as e:
            console.fail(e, 2 if isinstance(e, experiment.ConfigError) else 1)
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: said below
            _report(config, result, elapsed)
        if interrupts.requested():  # after the last round
            console.fail(f"after the last round; the run in {out} is complete.", 130,
                         label="Interrupted")


ProgressOpt = Annotated[bool | None, typer.Option("--progress/--no-progress",
                                                  help="Progress bar (default: when a terminal).")]


def demo(
    output_dir: Annotated[pathlib.Path, typer.Option(metavar="DIR", help="Where metrics, plot and checkpoints go.")]
    = pathlib.Path("fedlang-demo"),
    rounds: Annotated[int, typer.Option(metavar="N", help="Training rounds.")] = 30,
    progress: ProgressOpt = None,
) -> None:
    """FedAvg on scikit-learn's digits split non-IID over 40 clients (about 45 s on 2 CPU cores).

    32 clients train (10 per round, 2 local epochs of SGD); 8 held-out clients
    evaluate every 5 rounds. Prints an accuracy table and saves metrics, a plot and
    checkpoints in OUTPUT_DIR.
    """
    # load_config checks the dataset's reader is installed: before the banner, since in a
    # [deploy]-only install scikit-learn is missing
    _run_and_report(None, {"training": {"rounds": rounds}, "output": {"dir": str(output_dir)}},
                    progress, demo=True)


def train(
    config_path: Annotated[pathlib.Path, typer.Argument(metavar="CONFIG.toml", help="The experiment config.")],
    rounds: Annotated[int | None, typer.Option(metavar="N", help="Override training.rounds.")] = None,
    output_dir: Annotated[pathlib.Path | None, typer.Option(metavar="DIR", help="Override output.dir.")] = None,
    resume: Annotated[bool | None, typer.Option("--resume/--no-resume",
                                                help="Override output.resume.")] = None,
    progress: ProgressOpt = None,
    metrics_server: Annotated[str | None, typer.Option(
        metavar="URL", help="Override output.server: also release each round's metrics to this task store server.")]
    = None,
    metrics_population: Annotated[str | None, typer.Option(
        metavar="NAME", help="Override output.population: the server's population the metrics belong to.")]
    = None,
    admin_token: Annotated[str | None, typer.Option(
        envvar="FEDLANG_ADMIN_TOKEN", metavar="TOKEN", help="The admin token of output.server.")]
    = None,
) -> None:
    """Trains as CONFIG.toml says; re-running it resumes from the newest checkpoint.

    A checkpoint from a different config is refused. The config is TOML; every key is
    optional and defaults to the demo's run, so an empty file runs the demo. Its tables
    and keys:

    \b
    [data]       dataset (digits, synthetic, store, sqlite, csv, leaf, directory),
                 path, format, split, client_column, num_clients, partition
                 (dirichlet, iid, shards, pathological), alpha, seed, x, y,
                 standardize, held_out_clients, batch_size, epochs, shuffle_buffer
    [model]      kind (mlp, softmax), hidden, num_classes, seed
    [algorithm]  name (fedavg, fedavg_unweighted, fedprox, fedsgd), proximal_strength
    [algorithm.client_optimizer], [algorithm.server_optimizer]
                 name (sgd, adam, adagrad, yogi, adamw, rmsprop), learning_rate and
                 any other argument of optax.<name>
    [training]   rounds, cohort_size, seed, evaluate_every, checkpoint_every
    [output]     dir, resume, server, population
    """
    _run_and_report(config_path, {
        "training": {"rounds": rounds},
        "output": {"dir": None if output_dir is None else str(output_dir), "resume": resume,
                   "server": metrics_server, "population": metrics_population},
    }, progress, demo=False, admin_token=admin_token)


def register(app: typer.Typer) -> None:
    """Adds `fedlang demo` and `fedlang train` to the `fedlang` app."""
    app.command()(demo)
    app.command()(train)
