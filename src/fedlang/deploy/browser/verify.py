"""The preflight: can browsers run this client task, and do their programs compute what
JAX computes?

Before a round is offered to browser clients, the driver compiles its task
(`task.compile_task`), refuses any primitive without a conversion rule (naming it),
exports each program to ONNX, and runs the task twice side by side on the round's real
broadcast value and random batches (of 1 and of 7 examples): once with JAX, once with
onnxruntime, each program fed the same (JAX) inputs. An output that differs by more
than 1e-4 (relative to the larger of 1 and its largest JAX value) refuses the task,
naming the program, the output and the difference.

`BrowserTasks` is what a deployment context calls for each round: it adds the browser
section to the plan, running the preflight once per task (later rounds of the same
computation reuse the exported programs). `preflight(...)` runs it on its own, e.g.
before creating a population for browsers.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from fedlang.core import context as core_context
from fedlang.core import structure, types
from fedlang.deploy.browser import onnx_export, runner, task
from fedlang.deploy.driver import context as deploy_context
from fedlang.deploy.plans import folding
from fedlang.deploy.plans import round as plan_lib

BrowserExportError = onnx_export.BrowserExportError
BATCH_SIZES = (1, 7)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silences the converter's informational log lines (e.g. values it cannot type)."""
    loggers = [logging.getLogger(n) for n in ("onnx_ir", "onnx_ir.serde", "jax2onnx")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _random_batch(element: types.Type, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Random leaves of one batch: floats standard normal, integers 0 or 1 (a valid label
    of any classifier), booleans fair coins."""
    avals = [
        jax.ShapeDtypeStruct(tuple(size if d is None else d for d in lt.shape), lt.dtype)
        for lt in structure.leaf_types(element)
    ]
    out = []
    for a in avals:
        dt = np.dtype(a.dtype)
        if dt.kind in "iu":
            out.append(rng.integers(0, 2, a.shape).astype(dt))
        else:
            out.extend(onnx_export.random_inputs([a], {}, rng))
    return out


def check(bt: task.BrowserTask, broadcast: bytes | None = None, *,
          batch_sizes: Sequence[int] = BATCH_SIZES, tolerance: float = onnx_export.TOLERANCE,
          seed: int = 0) -> None:
    """Runs the task with JAX and with onnxruntime side by side (see the module docstring).

    Raises:
      BrowserExportError: naming the program and output that differ, and by how much.
    """
    rng = np.random.default_rng(seed)
    slots: dict[int, Any] = {}
    if broadcast is not None:
        slots.update(zip(bt.broadcast, runner.read_value(broadcast)))
    else:
        leaf_types = [bt.compiler.slots[s][0] for s in bt.broadcast]
        avals = [jax.ShapeDtypeStruct(tuple(d or 1 for d in t.shape), t.dtype) for t in leaf_types]
        slots.update(zip(bt.broadcast, onnx_export.random_inputs(avals, {}, rng)))
    slots.update(bt.compiler.consts)
    if bt.state is not None:  # a first-seen client's state (stored ones have its type)
        initial = runner.read_value(base64.b64decode(bt.state["initial"]))
        slots.update(zip(bt.state["inputs"], initial))
    programs = {p.name: p for p in bt.plan.programs}
    with _quiet():
        sessions = {p.name: onnx_export.session(p.onnx) for p in bt.plan.programs}
    compiled = {name: jax.jit(p.fn) for name, p in programs.items()}

    def call(step: dict[str, Any], extra: list[np.ndarray], batch: int) -> None:
        p = programs[step["program"]]
        inputs = [slots[step["inputs"][n]] for n in p.input_names[: len(step["inputs"])]]
        inputs = [np.asarray(x) for x in inputs] + extra
        want = [np.asarray(x) for x in compiled[p.name](*inputs)]
        got = onnx_export.run(sessions[p.name], p.input_names, inputs)
        for label, w, g in zip(p.output_labels, want, got):
            difference = onnx_export.difference(np.asarray(g), w)
            if not difference <= tolerance:
                raise BrowserExportError(
                    f"Expected {task.describe(p)} to compute with onnxruntime what it computes "
                    f"with JAX, found {label} differing by {difference:.3g} (tolerance "
                    f"{tolerance:g}, relative to the larger of 1 and its largest value) on a batch "
                    f"of {batch}. A conversion rule is wrong for this model: train such clients "
                    "with the Python client, and report the model to fedlang."
                )
        slots.update(zip((step["outputs"][n] for n in p.output_names), want))

    for step in bt.plan.steps:
        if step["kind"] == "run":
            call(step, [], 0)
            continue
        element = bt.data[step["dataset"]]
        for size in batch_sizes:
            batch = _random_batch(element, size, rng)
            call(step, [*batch, np.ones(size, np.float32)], size)


def _key(round_plan: plan_lib.RoundPlan) -> Any:
    """What a browser task depends on: the local task's IR (structural; local
    computations by identity) and the aggregations."""
    return (
        task.local_task(round_plan),
        tuple((a.uri, a.parameter_type) for a in round_plan.aggregations),
    )


@dataclasses.dataclass
class BrowserTasks:
    """Adds the browser section to each round's plan (a deployment context's `browser`).

    The first plan of each task is compiled, exported and checked (`check`); later ones
    reuse the section. Keeps the sections of the last `size` tasks.
    """

    size: int = 8
    batch_sizes: Sequence[int] = BATCH_SIZES
    tolerance: float = onnx_export.TOLERANCE

    def __post_init__(self) -> None:
        self._sections: collections.OrderedDict[Any, dict[str, Any]] = collections.OrderedDict()

    def section(self, round_plan: plan_lib.RoundPlan, broadcast: bytes | None = None) -> dict[str, Any]:
        """The browser section of a plan (made and checked the first time).

        Raises:
          BrowserExportError: naming what browsers cannot run, or what they compute wrong.
        """
        key = _key(round_plan)
        if key in self._sections:
            self._sections.move_to_end(key)
            return self._sections[key]
        bt = task.compile_task(round_plan)
        with _quiet():
            bt.export()
        check(bt, broadcast, batch_sizes=self.batch_sizes, tolerance=self.tolerance)
        section = bt.description()
        self._sections[key] = section
        while len(self._sections) > self.size:
            self._sections.popitem(last=False)
        return section

    def __call__(self, round_plan: plan_lib.RoundPlan, broadcast: bytes) -> plan_lib.RoundPlan:
        return dataclasses.replace(round_plan, browser=self.section(round_plan, broadcast))


class _Checking:
    """A round runner that preflights each round's plan and returns an empty aggregate:
    the computation goes on (its values are those of rounds without clients)."""

    def __init__(self, tasks: BrowserTasks):
        self.tasks = tasks
        self.sections: list[dict[str, Any]] = []

    def run_round(self, round_plan: plan_lib.RoundPlan, broadcast: bytes) -> deploy_context.RoundResult:
        self.sections.append(self.tasks.section(round_plan, broadcast))
        return deploy_context.RoundResult(folding.Folder(round_plan).empty(), 0, 0.0)


def preflight(comp: Any, *args: Any, tasks: BrowserTasks | None = None) -> list[dict[str, Any]]:
    """Checks that browsers can run every round of `comp(*args)`; returns the sections.

    Runs `comp` in a deployment context whose rounds have no clients, so nothing is
    trained: each round's plan is compiled, exported and checked against JAX.

    Example:
      >>> state = process.initialize()  # doctest: +SKIP
      >>> preflight(process.next, state, fedlang.deploy.client_data("train"))  # doctest: +SKIP

    Raises:
      BrowserExportError: naming what browsers cannot run (a primitive, an intrinsic, a
        kind of aggregation), or the program and output whose ONNX conversion differs.
    """
    checking = _Checking(tasks or BrowserTasks())
    # what browsers can run, not what reports may hold: the driver declares the bounds
    ctx = deploy_context.DeploymentContext(checking, bounds=None)
    with (core_context.with_context(ctx),
          np.errstate(invalid="ignore", divide="ignore")):
        comp(*args)
    return checking.sections
