"""PNG plots of metrics over rounds (matplotlib, Agg backend: no display needed).

One panel per metric (`loss`, `accuracy`...), with one line per place it was measured
(`train`, `eval`) and a legend, a y label, whole-number rounds on the x axis, and a
title naming the run. The figure is built with matplotlib's object API (`Figure` + the
Agg canvas), never `pyplot`, so plotting neither changes nor depends on the global
backend.
"""

from __future__ import annotations

import math
import os
import pathlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fedlang.simulation import metrics as metrics_lib

_DEFAULT_WORDS = ("loss", "accuracy")


def _selected(keys: Sequence[str], wanted: Sequence[str] | None) -> list[str]:
    if wanted is None:
        return [k for k in keys if any(w in k.rsplit("/", 1)[-1] for w in _DEFAULT_WORDS)]
    return [k for k in keys if k in wanted or k.rsplit("/", 1)[-1] in wanted]


def _series(records: Sequence[Mapping[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        flat = metrics_lib.scalars(metrics_lib.flatten_metrics(record.get("metrics", {})))
        for key, value in flat.items():
            xs, ys = series.setdefault(key, ([], []))
            xs.append(int(record["round"]))
            ys.append(float(value))
    return series


def _panels(keys: Sequence[str]) -> dict[str, dict[str, str]]:
    """`{metric: {line label: key}}`: keys grouped by their last component.

    A line is labelled by the key's first component ('train', 'eval'), or by the whole
    path without the metric when two keys of a panel share it.
    """
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.rsplit("/", 1)[-1], []).append(key)
    panels = {}
    for metric, members in groups.items():
        heads = [k.split("/", 1)[0] for k in members]
        unique = len(set(heads)) == len(heads)
        panels[metric] = {
            (h if unique else (k.rsplit("/", 1)[0] if "/" in k else k)): k
            for h, k in zip(heads, members)
        }
    return panels


def _title(metric: str) -> str:
    return metric.replace("_", " ").capitalize()


def build_figure(records: Sequence[Mapping[str, Any]], keys: Sequence[str] | None = None,
                 title: str | None = None) -> Any:
    """The matplotlib `Figure` of `plot_metrics` (see there), not yet saved.

    Raises:
      ImportError: without matplotlib (`pip install matplotlib`).
      ValueError: if no record has a selected scalar metric.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError("Plots need matplotlib: pip install matplotlib.") from e
    series = _series(records)
    chosen = _selected(list(series), keys) or (list(series) if keys is None else [])
    if not chosen:
        raise ValueError(
            f"Expected metrics to plot ({list(keys) if keys else 'losses or accuracies'}), found "
            f"{sorted(series) or 'no scalar metrics'}. Pass keys= with some of these."
        )
    panels = _panels(chosen)
    n = len(panels)
    cols = n if n <= 3 else (2 if n == 4 else 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(4.6 * cols, 3.3 * rows + (0.4 if title else 0)), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (metric, lines) in enumerate(panels.items()):
        ax = fig.add_subplot(rows, cols, i + 1)
        for label, key in lines.items():
            xs, ys = series[key]
            ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, label=label)
        ax.set_title(_title(metric))
        ax.set_xlabel("round")
        ax.set_ylabel(metric.replace("_", " "))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(lines) > 1 or next(iter(lines)) != metric:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def plot_metrics(records: Sequence[Mapping[str, Any]], path: str | os.PathLike,
                 keys: Sequence[str] | None = None, title: str | None = None) -> pathlib.Path:
    """Draws metrics over rounds into a PNG, one panel per metric.

    Args:
      records: `{'round': r, 'metrics': nested}` dicts, as written by
        `JSONLinesWriter` (read them back with `writers.read_jsonl`).
      path: the `.png` file to write (atomically).
      keys: flattened keys (or their last components) to plot; default: every
        metric named like a loss or an accuracy, else every scalar metric. Keys with
        the same last component (`train/.../loss`, `eval/loss`) share a panel.
      title: the figure title (e.g. the experiment's name).

    Returns:
      `path`.

    Raises:
      ImportError: without matplotlib (`pip install matplotlib`).
      ValueError: if no record has a selected scalar metric.
    """
    fig = build_figure(records, keys, title)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{uuid.uuid4().hex}.png")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
