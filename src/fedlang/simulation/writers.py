"""Metrics writers: CSV, JSON lines, TensorBoard event files and PNG plots.

A writer receives one record per round, `write(round_num, metrics)`, where `metrics`
is a nested mapping (e.g. `{'train': {...}, 'eval': {...}, 'round_time_s': 0.4}`).
JSON lines keep the nesting; CSV columns and TensorBoard tags are the flattened keys
`'train/client_work/train/loss'` and keep scalars only (arrays are skipped).

Writers are resumable: `truncate(round_num)` drops what was written after
`round_num` (the driver calls it with the checkpoint's round before resuming, or 0
for a fresh run), so files never hold two versions of a round.

TensorBoard event files are written with tensorboardX (no TensorFlow); plots with
matplotlib's Agg backend (no display). Both are imported only when such a writer is
created. Metrics become JSON-able values, flattened keys and scalars by `metrics`.
"""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from fedlang.simulation import metrics as metrics_lib


class MetricsWriter(Protocol):
    """What the driver calls on each writer."""

    def write(self, round_num: int, metrics: Mapping[str, Any]) -> None: ...

    def truncate(self, round_num: int) -> None: ...

    def close(self) -> None: ...


def _atomic_write_text(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- JSON lines -------------------------------------------------------------------


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSON-lines metrics file (a torn last line is skipped).

    Raises:
      FileNotFoundError: if the file does not exist.
      ValueError: if a line other than the last is not JSON.
    """
    path = pathlib.Path(path)
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # a write interrupted mid-line
                break
            raise ValueError(f"Expected a JSON object on line {i + 1} of {path}, found {line[:60]!r}.") from e
    return records


class JSONLinesWriter:
    """One JSON object per round: `{"round": r, "metrics": {...nested...}}`.

    Args:
      path: the `.jsonl` file (parent directories are created).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Any = None

    def truncate(self, round_num: int) -> None:
        self.close()
        if self.path.exists():
            kept = [r for r in read_jsonl(self.path) if r.get("round", 0) <= round_num]
            _atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, round_num: int, metrics: Mapping[str, Any]) -> None:
        if self._file is None:
            self._file = open(self.path, "a")  # noqa: SIM115 (kept open across rounds)
        self._file.write(json.dumps({"round": int(round_num), "metrics": metrics_lib.to_python(metrics)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# -- CSV --------------------------------------------------------------------------


class CSVWriter:
    """One row per round, a `round` column then flattened scalar metrics.

    Columns are the union of keys seen so far; when a round brings new keys (e.g. the
    first evaluation) the file is rewritten with the wider header, so earlier rows
    have empty cells there.

    Args:
      path: the `.csv` file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._columns: list[str] | None = None

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        if not self.path.exists():
            return ["round"], []
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            return list(reader.fieldnames or ["round"]), rows

    def _rewrite(self, columns: list[str], rows: Iterable[Mapping[str, Any]]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, columns, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._columns = columns

    def truncate(self, round_num: int) -> None:
        columns, rows = self._read()
        self._rewrite(columns, [r for r in rows if int(r.get("round") or 0) <= round_num])

    def write(self, round_num: int, metrics: Mapping[str, Any]) -> None:
        row: dict[str, Any] = {"round": int(round_num), **metrics_lib.scalars(metrics_lib.flatten_metrics(metrics))}
        if self._columns is None:
            self._columns, _ = self._read()
        new = [k for k in row if k not in self._columns]
        if new or not self.path.exists():
            columns, rows = self._read()
            self._rewrite(columns + [k for k in new if k not in columns], [*rows, row])
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self._columns, extrasaction="ignore").writerow(row)

    def close(self) -> None:
        pass


# -- TensorBoard ------------------------------------------------------------------


class TensorBoardWriter:
    """TensorBoard event files (via tensorboardX), one scalar tag per flattened key.

    On resume, events after the checkpoint's round are purged (TensorBoard hides
    them), so a resumed run's curves do not double back.

    Args:
      logdir: the directory for event files (`tensorboard --logdir` it).

    Raises:
      ImportError: without tensorboardX (`pip install tensorboardX`).
    """

    def __init__(self, logdir: str | os.PathLike):
        try:
            import tensorboardX  # noqa: F401
        except ImportError as e:
            raise ImportError("TensorBoardWriter needs tensorboardX: pip install tensorboardX.") from e
        self.logdir = pathlib.Path(logdir)
        self._purge_step: int | None = None
        self._writer: Any = None

    def truncate(self, round_num: int) -> None:
        self.close()
        self._purge_step = round_num + 1

    def write(self, round_num: int, metrics: Mapping[str, Any]) -> None:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            # A unique, increasing suffix: two writers opened in the same second (a quick
            # resume) would otherwise share a file name and the second would clobber it.
            self._writer = SummaryWriter(str(self.logdir), purge_step=self._purge_step,
                                         filename_suffix=f".{time.time_ns()}")
        for tag, value in metrics_lib.scalars(metrics_lib.flatten_metrics(metrics)).items():
            if isinstance(value, float) and not math.isfinite(value):
                continue  # TensorBoard cannot plot NaN/inf; the JSON and CSV files keep them
            self._writer.add_scalar(tag, float(value), int(round_num))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# -- plots ------------------------------------------------------------------------


class PlotWriter:
    """A PNG of metrics over rounds, one panel per metric, redrawn on `close()`.

    Args:
      path: the `.png` file.
      keys: flattened metric keys to plot (a key matches if it equals a flattened key
        or is its last component, e.g. 'accuracy'); default: every key whose last
        component contains 'loss' or 'accuracy'.
      jsonl_path: if given, the rounds are read back from this JSON-lines file when
        drawing (so a resumed run plots its whole history); otherwise the rounds
        written to this writer are plotted.
      title: the figure's title (e.g. the experiment's name).
    """

    def __init__(self, path: str | os.PathLike, keys: Sequence[str] | None = None,
                 jsonl_path: str | os.PathLike | None = None, title: str | None = None):
        self.path = pathlib.Path(path)
        self.title = title
        self.keys = list(keys) if keys is not None else None
        self.jsonl_path = None if jsonl_path is None else pathlib.Path(jsonl_path)
        self._records: list[dict[str, Any]] = []
        self._dirty = False

    def truncate(self, round_num: int) -> None:
        self._records = [r for r in self._records if r["round"] <= round_num]

    def write(self, round_num: int, metrics: Mapping[str, Any]) -> None:
        self._records.append({"round": int(round_num), "metrics": metrics_lib.to_python(metrics)})
        self._dirty = True

    def close(self) -> None:
        if not self._dirty:
            return
        records = self._records
        if self.jsonl_path is not None and self.jsonl_path.exists():
            records = read_jsonl(self.jsonl_path)
        from fedlang.simulation import plots

        plots.plot_metrics(records, self.path, keys=self.keys, title=self.title)
        self._dirty = False


def default_writers(output_dir: str | os.PathLike, title: str | None = None) -> list[MetricsWriter]:
    """CSV, JSON lines, TensorBoard and a plot in `output_dir`: `metrics.csv`,
    `metrics.jsonl`, `tensorboard/` (view it with `tensorboard --logdir`, from
    `pip install 'fedlang[tensorboard]'`), `metrics.png` (titled `title`)."""
    out = pathlib.Path(output_dir)
    return [
        JSONLinesWriter(out / "metrics.jsonl"),
        CSVWriter(out / "metrics.csv"),
        TensorBoardWriter(out / "tensorboard"),
        PlotWriter(out / "metrics.png", jsonl_path=out / "metrics.jsonl", title=title),
    ]
