"""The `fedlang` command line: `demo`, `train CONFIG.toml`, `data inspect`, `data convert`,
and the deployment's `serve`, `client` and `status` (in `_deploy_cli`).

Run `fedlang --help` (or `python -m fedlang --help`). See docs/cli.md.
"""

from __future__ import annotations

import pathlib
import time
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedlang import _deploy_cli

app = typer.Typer(
    help="fedlang: federated learning on JAX. Start with `fedlang demo`.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
data_app = typer.Typer(help="Inspect and convert client data.", no_args_is_help=True)
app.add_typer(data_app, name="data")

_console = Console()
_errors = Console(stderr=True)


# Input problems become one sentence on stderr, never a traceback.
INPUT_ERRORS = (OSError, ValueError, TypeError, ImportError)


def _fail(error: BaseException, code: int = 1, advice: str = "") -> typer.Exit:
    # escape: messages quote config tables such as [training], which are not markup
    text = escape(f"{error}{' ' + advice if advice else ''}")
    _errors.print(f"[bold red]Error:[/] {text}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _warn(text: str) -> None:
    _errors.print(f"[bold yellow]Warning:[/] {escape(text)}", highlight=False, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        import fedlang

        _console.print(f"fedlang {fedlang.__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print fedlang's version and exit.")] = False,
) -> None:
    """fedlang: federated learning on JAX. Start with `fedlang demo`."""


# -- training ---------------------------------------------------------------------


def _results_table(history: list[dict[str, Any]]) -> Table:
    table = Table(title="Accuracy by round", box=box.SIMPLE_HEAVY)
    for name in ("round", "train loss", "train accuracy", "eval loss", "eval accuracy"):
        table.add_column(name, justify="right")
    for h in history:
        m = h["metrics"]
        if "eval" not in m:
            continue
        train = m["train"].get("client_work", {}).get("train", {})
        cells = [train.get("loss"), train.get("accuracy"), m["eval"].get("loss"), m["eval"].get("accuracy")]
        table.add_row(str(h["round"]), *("" if v is None else f"{v:.4f}" for v in cells))
    return table


def _train(config: dict[str, Any], progress: bool | None, fresh: bool) -> None:
    from fedlang import _experiment

    out = pathlib.Path(config["output"]["dir"])
    t0 = time.perf_counter()
    result = _experiment.run(config, progress=progress, fresh=fresh)
    elapsed = time.perf_counter() - t0
    if result.resumed_from is not None:
        _console.print(f"Resumed from the checkpoint of round {result.resumed_from}.")
    if result.history:
        _console.print(_results_table(result.history))
    else:
        _console.print(f"Nothing to do: the run in {escape(str(out))} already has "
                       f"{result.round_num} rounds.", highlight=False)
    _console.print(
        escape(f"{len(result.history)} rounds in {elapsed:.1f}s. Metrics: {out / 'metrics.csv'}, "
               f"{out / 'metrics.jsonl'}; plot: {out / 'metrics.png'}; checkpoints: "
               f"{out / 'checkpoints'}. TensorBoard: `tensorboard --logdir {out / 'tensorboard'}` "
               "(install it with `pip install 'fedlang[tensorboard]'`)."),
        highlight=False, soft_wrap=True,
    )
    warning = _experiment.divergence(result, config)
    if warning:
        _warn(warning)


def _run_and_report(config: dict[str, Any], progress: bool | None, fresh: bool) -> None:
    from fedlang import _experiment
    from fedlang.simulation import checkpoint, store

    try:
        _train(config, progress, fresh)
    except checkpoint.CheckpointMismatchError as e:
        raise _fail(e, 1, "(fedlang train: --output-dir DIR starts this config in a new "
                          "directory.)") from e
    except (*INPUT_ERRORS, checkpoint.CheckpointError, store.StoreError) as e:
        raise _fail(e, 2 if isinstance(e, _experiment.ConfigError) else 1) from e


ProgressOpt = Annotated[bool | None, typer.Option("--progress/--no-progress",
                                                  help="Progress bar (default: when a terminal).")]


@app.command()
def demo(
    output_dir: Annotated[pathlib.Path, typer.Option(help="Where metrics, plot and checkpoints go.")]
    = pathlib.Path("fedlang-demo"),
    rounds: Annotated[int, typer.Option(help="Training rounds.")] = 30,
    progress: ProgressOpt = None,
) -> None:
    """FedAvg on scikit-learn's digits split non-IID over 40 clients (about a minute).

    32 clients train (10 per round, 2 local epochs of SGD); 8 held-out clients
    evaluate every 5 rounds. Prints an accuracy table and saves metrics, a plot and
    checkpoints in OUTPUT_DIR.
    """
    from fedlang import _experiment

    config = _experiment.load_config(training={"rounds": rounds}, output={"dir": str(output_dir)})
    _console.print(
        f"[bold]fedlang demo[/]: FedAvg, MLP 64-32-10, digits over {config['data']['num_clients']} "
        f"clients (Dirichlet alpha={config['data']['alpha']}), {rounds} rounds of "
        f"{config['training']['cohort_size']} clients.", highlight=False)
    _run_and_report(config, progress, fresh=True)


@app.command()
def train(
    config_path: Annotated[pathlib.Path, typer.Argument(metavar="CONFIG.toml", help="The experiment config.")],
    rounds: Annotated[int | None, typer.Option(help="Override training.rounds.")] = None,
    output_dir: Annotated[pathlib.Path | None, typer.Option(help="Override output.dir.")] = None,
    resume: Annotated[bool | None, typer.Option("--resume/--no-resume",
                                                help="Override output.resume.")] = None,
    progress: ProgressOpt = None,
) -> None:
    """Trains as CONFIG.toml says; re-running it resumes from the newest checkpoint.

    The config sets the dataset, partition, model, algorithm, optimizers, rounds,
    cohort, evaluation, output directory and resume (docs/cli.md). A checkpoint from
    a different config is refused.
    """
    from fedlang import _experiment

    try:
        config = _experiment.load_config(
            config_path, training={"rounds": rounds},
            output={"dir": None if output_dir is None else str(output_dir), "resume": resume})
    except INPUT_ERRORS as e:
        raise _fail(e, 2 if isinstance(e, _experiment.ConfigError) else 1) from e
    _run_and_report(config, progress, fresh=False)


# -- data -------------------------------------------------------------------------

FormatOpt = Annotated[str, typer.Option("--format", help="auto, store, sqlite, csv, leaf or directory.")]
SplitOpt = Annotated[str | None, typer.Option(help="The split of a TFF SQLite file.")]
ColumnOpt = Annotated[str | None, typer.Option(help="The client-id column of a CSV file.")]


def _open(path: pathlib.Path, fmt: str, split: str | None, client_column: str | None) -> Any:
    from fedlang.simulation import inspection

    return inspection.open_source(path, fmt, split=split, client_column=client_column)


@data_app.command("inspect")
def data_inspect(
    path: Annotated[pathlib.Path, typer.Argument(help="A store, .sqlite, .csv, LEAF or client directory.")],
    fmt: FormatOpt = "auto",
    split: SplitOpt = None,
    client_column: ColumnOpt = None,
    bins: Annotated[int, typer.Option(help="Histogram bins.")] = 10,
) -> None:
    """Clients, examples, a per-client size histogram and the element spec of PATH."""
    from fedlang.simulation import inspection, store
    from fedlang.simulation.formats import sqlite

    try:
        kind = inspection.detect_format(path) if fmt == "auto" else fmt
        if kind == "sqlite" and split is None:
            _console.print(f"{path}: TFF SQLite file with splits {sqlite.split_names(path)}; "
                           "pass --split NAME for details.", highlight=False)
            return
        summary = inspection.summarize(_open(path, fmt, split, client_column))
    except (*INPUT_ERRORS, store.StoreError) as e:
        raise _fail(e) from e
    table = Table(title=f"{path} ({kind})", box=box.SIMPLE_HEAVY, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    sizes = summary.sizes
    table.add_row("clients", f"{summary.num_clients:,}")
    table.add_row("examples", f"{summary.num_examples:,}")
    if len(sizes):
        table.add_row("per client", f"min {sizes.min():,}  median {int(sorted(sizes)[len(sizes) // 2]):,}  "
                                    f"mean {sizes.mean():,.1f}  max {sizes.max():,}")
    table.add_row("element spec", summary.element_spec)
    _console.print(table)
    hist = Table(title="Clients by number of examples", box=box.SIMPLE)
    hist.add_column("examples", justify="right")
    hist.add_column("clients", justify="right")
    hist.add_column("")
    rows = summary.histogram(bins)
    top = max((c for _, _, c in rows), default=1) or 1
    for lo, hi, count in rows:
        hist.add_row(f"{lo:,}-{hi:,}" if hi > lo else f"{lo:,}", f"{count:,}", "#" * round(40 * count / top))
    _console.print(hist)


@data_app.command("convert")
def data_convert(
    src: Annotated[pathlib.Path, typer.Argument(help="The source (any format `inspect` reads).")],
    dst: Annotated[pathlib.Path, typer.Argument(help="The store directory to create.")],
    fmt: FormatOpt = "auto",
    split: SplitOpt = None,
    client_column: ColumnOpt = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing store at DST.")] = False,
) -> None:
    """Converts SRC into fedlang's on-disk store at DST (streaming, atomic)."""
    from rich.progress import Progress

    from fedlang.simulation import inspection, store

    if dst.exists() and not overwrite:
        raise _fail(FileExistsError(f"Expected no file at {dst}, found one. Pass --overwrite to "
                                    "replace it (a store only), or choose another DST."))
    try:
        cd = _open(src, fmt, split, client_column)
        with Progress(console=_errors, transient=True, disable=not _errors.is_terminal) as bar:
            task = bar.add_task("converting clients", total=len(cd.client_ids))
            source = inspection.with_progress(cd, lambda cid: bar.advance(task))
            t0 = time.perf_counter()
            store.write(dst, source, overwrite=overwrite)
        summary = inspection.summarize(store.open_store(dst).client_data())
    except (*INPUT_ERRORS, store.StoreError) as e:
        raise _fail(e) from e
    _console.print(f"Wrote {summary.num_clients:,} clients, {summary.num_examples:,} examples "
                   f"({summary.element_spec}) to {dst} in {time.perf_counter() - t0:.1f}s.",
                   highlight=False, soft_wrap=True)


_deploy_cli.register(app)


def main() -> None:
    """The console-script entry point."""
    app()
