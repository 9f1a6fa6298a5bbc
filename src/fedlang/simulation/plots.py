"""PNG plots of metrics over rounds (matplotlib, Agg backend: no display needed).

The figure is built with matplotlib's object API (`Figure` + the Agg canvas), never
`pyplot`, so plotting neither changes nor depends on the global backend.
"""

from __future__ import annotations

import math
import os
import pathlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fedlang.simulation import writers

_DEFAULT_WORDS = ("loss", "accuracy")


def _selected(keys: Sequence[str], wanted: Sequence[str] | None) -> list[str]:
    if wanted is None:
        return [k for k in keys if any(w in k.rsplit("/", 1)[-1] for w in _DEFAULT_WORDS)]
    return [k for k in keys if k in wanted or k.rsplit("/", 1)[-1] in wanted]


def plot_metrics(records: Sequence[Mapping[str, Any]], path: str | os.PathLike,
                 keys: Sequence[str] | None = None, title: str | None = None) -> pathlib.Path:
    """Draws metrics over rounds into a PNG, one panel per metric.

    Args:
      records: `{'round': r, 'metrics': nested}` dicts, as written by
        `JSONLinesWriter` (read them back with `writers.read_jsonl`).
      path: the `.png` file to write (atomically).
      keys: flattened keys (or their last components) to plot; default: every
        metric named like a loss or an accuracy, else every scalar metric.
      title: the figure title.

    Returns:
      `path`.

    Raises:
      ImportError: without matplotlib (`pip install matplotlib`).
      ValueError: if no record has a selected scalar metric.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("Plots need matplotlib: pip install matplotlib.") from e
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        flat = writers.scalars(writers.flatten_metrics(record.get("metrics", {})))
        for key, value in flat.items():
            xs, ys = series.setdefault(key, ([], []))
            xs.append(int(record["round"]))
            ys.append(float(value))
    chosen = _selected(list(series), keys) or (list(series) if keys is None else [])
    if not chosen:
        raise ValueError(
            f"Expected metrics to plot ({list(keys) if keys else 'losses or accuracies'}), found "
            f"{sorted(series) or 'no scalar metrics'}. Pass keys= with some of these."
        )
    cols = min(3, len(chosen))
    rows = math.ceil(len(chosen) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    for i, key in enumerate(chosen):
        ax = fig.add_subplot(rows, cols, i + 1)
        xs, ys = series[key]
        ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
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
