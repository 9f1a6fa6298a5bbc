"""How `auto` decides: short, bounded measurements, said aloud, remembered on disk.

A decision (loop or scan for a client's reduce; vectorized groups or one client at a
time for a chunk) is taken once per program shape and device. It is measured on a
small probe (few clients, few batches) and bounded by a time budget: each candidate
runs once untimed (it compiles), then the candidates are timed in turn until the
budget is spent, and a candidate more than twice as slow as the best is dropped as
soon as that shows. The decision is written to a small JSON file keyed by a
fingerprint of the step program (its jaxpr), the shapes, the device kind and the JAX
version, so the next run on the same machine starts without measuring.

The file is `$FEDLANG_CACHE_DIR/auto-decisions.json` (by default under
`$XDG_CACHE_HOME/fedlang` or `~/.cache/fedlang`); a damaged or unreadable file is
ignored and rewritten. Measuring is logged to the `fedlang.runtime` logger and said:
to a live progress display if there is one (`fedlang.core.status`: the experiment
driver's bar shows it in its status column, where a printed line would break the bar),
else on stderr (with `progress=True` always; by default when stderr is a terminal).
`progress=False` says nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fedlang.core import local, status
from fedlang.runtime import chunks

if TYPE_CHECKING:
    import jax  # for annotations only: the functions import it where they use it

logger = logging.getLogger("fedlang.runtime")

CACHE_FILE = "auto-decisions.json"
_FORMAT = 1


@dataclasses.dataclass
class Choice:
    """A decision: the strategy picked and the seconds measured per candidate."""

    strategy: str
    seconds_per_batch: dict[str, float]
    source: str = "measured"  # or "cached" (read from the decision file)


def default_cache_path() -> str:
    """Where decisions are kept across runs (see the module docstring)."""
    root = os.environ.get("FEDLANG_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "fedlang")
    return os.path.join(root, CACHE_FILE)


MIN_SAMPLES = 3  # timed runs of each candidate before one may be dropped as clearly slower


class Tuner:
    """Takes and remembers `auto`'s decisions (one per runner).

    Args:
      budget_s: seconds of timed runs per decision (compiling runs come on top).
      cache: a path for the decision file, True for `default_cache_path()`, or False
        to keep decisions in memory only.
      progress: announce measurements: True, False, or None (on stderr when it is a
        terminal); a live progress display shows them instead of stderr.
    """

    def __init__(self, budget_s: float = 1.0, cache: bool | str = True, progress: bool | None = None):
        if budget_s <= 0:
            raise ValueError(f"Expected a positive time budget in seconds, found {budget_s}.")
        self.budget_s = budget_s
        self.path = default_cache_path() if cache is True else (cache or None)
        self.progress = progress
        self.choices: dict[tuple, Choice] = {}
        self._disk: dict[str, Any] | None = None
        self._lock = threading.RLock()

    @property
    def lock(self) -> threading.RLock:
        """Held while a decision is taken (device threads decide one at a time)."""
        return self._lock

    # -- the decision file --------------------------------------------------------------

    def _load(self) -> dict[str, Any]:
        if self._disk is None:
            self._disk = {}
            if self.path is not None:
                try:
                    with open(self.path) as f:
                        data = json.load(f)
                    if isinstance(data, dict) and data.get("format") == _FORMAT:
                        entries = data.get("decisions")
                        self._disk = entries if isinstance(entries, dict) else {}
                except (OSError, ValueError):
                    pass  # no file yet, or a damaged one: measure again and rewrite it
        return self._disk

    def cached(self, key: tuple, disk_key: str | None) -> Choice | None:
        """The decision for `key`, from this process or from the decision file."""
        found = self.choices.get(key)
        if found is not None or disk_key is None:
            return found
        entry = self._load().get(disk_key)
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("picked"), str)
            and isinstance(entry.get("seconds"), dict)
        ):
            seconds = {str(k): float(v) for k, v in entry["seconds"].items()}
            found = self.choices[key] = Choice(entry["picked"], seconds, "cached")
        return found

    def record(self, key: tuple, disk_key: str | None, choice: Choice) -> None:
        self.choices[key] = choice
        if disk_key is None or self.path is None:
            return
        entries = self._load()
        entries[disk_key] = {"picked": choice.strategy, "seconds": choice.seconds_per_batch}
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": _FORMAT, "decisions": entries}, f, indent=0)
            os.replace(tmp, self.path)  # readers see the old file or the new one, never half
        except OSError as e:
            logger.info("Could not write the decision file %s: %s", self.path, e)

    # -- measuring ----------------------------------------------------------------------

    def say(self, message: str) -> None:
        logger.info(message)
        if self.progress is False or status.say(message):
            return  # not wanted, or a live progress display shows it in place
        if self.progress or _stderr_is_terminal():
            print(f"fedlang: {message}", file=sys.stderr, flush=True)

    def measure(
        self,
        what: str,
        candidates: dict[str, Callable[[], Any]],
        units: float | dict[str, float],
        cpu_clock: bool = False,
        decide: Callable[[dict[str, float]], str] | None = None,
    ) -> dict[str, float]:
        """Seconds per unit of each candidate (`inf` for one dropped as clearly slower).

        Each candidate runs once untimed (compiling), in the given order; then they are
        timed in turn, at most 5 times each, until the budget is spent; one is dropped as
        clearly slower (twice the fastest) only after `MIN_SAMPLES` timed runs. `units`
        is the work one run does (batches), the same for all or one number per candidate;
        "clearly slower" compares seconds per unit. `cpu_clock` times with the process's
        CPU seconds instead of the wall clock: for candidates that do the same arithmetic
        on a CPU and differ in host overhead, it is not fooled by other processes.
        `decide(times)` is the caller's rule for the pick it reports (default: fastest).
        """
        clock = time.process_time if cpu_clock else time.perf_counter
        per = units if isinstance(units, dict) else {n: units for n in candidates}
        import jax

        self.say(f"measuring {' vs '.join(candidates)} for {what} (budget {self.budget_s:g} s)")
        start = time.perf_counter()
        best: dict[str, float] = {}
        for name, fn in candidates.items():
            t0 = clock()
            jax.block_until_ready(fn())
            best[name] = clock() - t0  # compiling: an upper bound until timed
        timed_from = time.perf_counter()  # the budget is wall time, whatever the clock
        live = list(candidates)
        for k in range(5):
            for name in live:
                t0 = clock()
                jax.block_until_ready(candidates[name]())
                best[name] = min(best[name], clock() - t0)
            if k + 1 >= MIN_SAMPLES:
                # Clearly slower on its best of several runs: dropped. One run is not
                # enough: a single hiccup (a collection, another process) would decide.
                fastest = min(best[n] / per[n] for n in live)
                live = [n for n in live if best[n] / per[n] <= 2 * fastest]
            if len(live) < 2 or time.perf_counter() - timed_from >= self.budget_s:
                break
        out = {n: (best[n] / per[n] if n in live else float("inf")) for n in candidates}
        picked = decide(out) if decide is not None else min(out, key=out.__getitem__)
        self.say(
            f"picked {picked} for {what} in {time.perf_counter() - start:.2f} s ("
            + ", ".join(f"{n} {v * 1e3:.3g} ms" for n, v in out.items())
            + " per batch)"
        )
        return out


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def step_text(comp: local.LocalProgram, leaves: chunks.Leaves, batch: chunks.Batch) -> str | None:
    """The jaxpr of a `LocalProgram`'s step on these argument and batch leaves (None if
    it cannot be had)."""
    if comp.state_type is None:
        return None
    from fedlang.backends.jax import computation as jax_computation

    try:
        state = jax_computation.state_avals(comp.state_type)
        return program_text(comp.part("step"), [*leaves, *state, *batch])
    except (TypeError, ValueError, NotImplementedError):
        return None


def abstract_step_text(comp: local.LocalProgram) -> str | None:
    """The jaxpr of a `LocalProgram`'s step on abstract arguments (unknown dimensions
    symbolic), without any client's data; None if it cannot be had."""
    if comp.state_type is None:
        return None
    from fedlang.backends.jax import computation as jax_computation

    try:
        avals = jax_computation.program_avals(comp)["step"]
        return program_text(comp.part("step"), avals)
    except (TypeError, ValueError, NotImplementedError, KeyError):
        return None


def prior(text: str | None, platform: str) -> str | None:
    """What is known without measuring: XLA:CPU runs a convolution inside a loop program
    or vectorized over clients about 10x slower than one call per batch (measured in
    bench/README.md), so on a CPU such a step runs by 'loop', one client at a time.
    Returns 'loop' then, else None (measure)."""
    if text is not None and platform == "cpu" and "conv_general_dilated" in text:
        return "loop"
    return None


def decision_key(kind: str, text: str, batch: chunks.Batch, device: jax.Device) -> str:
    """The decision file's key: the kind of decision, the step's text, the batch's
    shapes, the device kind and the JAX version."""
    import numpy as np

    shapes = [tuple(np.shape(x)) for x in batch]
    return fingerprint([kind, text, shapes, device_id(device)])


def fingerprint(parts: list[object]) -> str:
    """A stable short hash of program texts, shapes and names (for the decision file)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def program_text(fn: Callable, args: chunks.Leaves) -> str:
    """The jaxpr of `fn` on arguments shaped like `args` (runs nothing)."""
    import jax
    import numpy as np

    avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in args]
    return str(jax.make_jaxpr(fn)(*avals))


def _dtype(x: chunks.Leaf) -> Any:
    import numpy as np

    return getattr(x, "dtype", None) or np.asarray(x).dtype


def device_id(device: jax.Device) -> str:
    """The device kind and JAX version a measurement holds for."""
    import jax

    return f"{device.platform}:{getattr(device, 'device_kind', '')}:jax{jax.__version__}"
