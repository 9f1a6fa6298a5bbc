"""`fedlang data inspect PATH` and `fedlang data convert SRC DST`: client data in any
format the simulation package reads."""

from __future__ import annotations

import pathlib
import time
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from fedlang.cli import console

data_app = typer.Typer(help="Inspect and convert client data.", no_args_is_help=True,
                       rich_markup_mode=None)  # as the app's: no <bool> on flags

FormatOpt = Annotated[str, typer.Option("--format", metavar="FORMAT", help="auto, store, sqlite, csv, leaf or directory.")]
SplitOpt = Annotated[str | None, typer.Option(metavar="NAME", help="The split of a TFF SQLite file.")]
ColumnOpt = Annotated[str | None, typer.Option(metavar="NAME", help="The client-id column of a CSV file.")]


def _open(path: pathlib.Path, fmt: str, split: str | None, client_column: str | None) -> Any:
    from fedlang.simulation import inspection

    return inspection.open_source(path, fmt, split=split, client_column=client_column)


@data_app.command("inspect")
def data_inspect(
    path: Annotated[pathlib.Path, typer.Argument(metavar="PATH", help="A store, .sqlite, .csv, LEAF or client directory.")],
    fmt: FormatOpt = "auto",
    split: SplitOpt = None,
    client_column: ColumnOpt = None,
    bins: Annotated[int, typer.Option(metavar="N", help="Histogram bins.")] = 10,
) -> None:
    """Clients, examples, a per-client size histogram and the element spec of PATH."""
    from fedlang.simulation import inspection, store
    from fedlang.simulation.formats import sqlite

    try:
        kind = inspection.detect_format(path) if fmt == "auto" else fmt
        if kind == "sqlite" and split is None:
            console.out.print(f"{path}: TFF SQLite file with splits {sqlite.split_names(path)}; "
                              "pass --split NAME for details.", highlight=False)
            return
        summary = inspection.summarize(_open(path, fmt, split, client_column))
    except (*console.INPUT_ERRORS, store.StoreError) as e:
        console.fail(e)
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
    console.out.print(table)
    hist = Table(title="Clients by number of examples", box=box.SIMPLE)
    hist.add_column("examples", justify="right")
    hist.add_column("clients", justify="right")
    hist.add_column("")
    rows = summary.histogram(bins)
    top = max((c for _, _, c in rows), default=1) or 1
    for lo, hi, count in rows:
        hist.add_row(f"{lo:,}-{hi:,}" if hi > lo else f"{lo:,}", f"{count:,}", "#" * round(40 * count / top))
    console.out.print(hist)


@data_app.command("convert")
def data_convert(
    src: Annotated[pathlib.Path, typer.Argument(metavar="SRC", help="The source (any format `inspect` reads).")],
    dst: Annotated[pathlib.Path, typer.Argument(metavar="DST", help="The store directory to create.")],
    fmt: FormatOpt = "auto",
    split: SplitOpt = None,
    client_column: ColumnOpt = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing store at DST.")] = False,
) -> None:
    """Converts SRC into fedlang's on-disk store at DST (streaming, atomic)."""
    from rich.progress import Progress

    from fedlang.simulation import inspection, store

    if dst.exists() and not overwrite:
        console.fail(f"Expected no file at {dst}, found one. Pass --overwrite to replace it (a "
                     "store only), or choose another DST.")
    try:
        cd = _open(src, fmt, split, client_column)
        with Progress(console=console.err, transient=True, disable=not console.err.is_terminal) as bar:
            task = bar.add_task("converting clients", total=len(cd.client_ids))
            source = inspection.with_progress(cd, lambda cid: bar.advance(task))
            t0 = time.perf_counter()
            store.write(dst, source, overwrite=overwrite)
        summary = inspection.summarize(store.open_store(dst).client_data())
    except (*console.INPUT_ERRORS, store.StoreError) as e:
        console.fail(e)
    console.out.print(f"Wrote {summary.num_clients:,} clients, {summary.num_examples:,} examples "
                      f"({summary.element_spec}) to {dst} in {time.perf_counter() - t0:.1f}s.",
                      highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Adds `fedlang data ...` to the `fedlang` app."""
    app.add_typer(data_app, name="data")
