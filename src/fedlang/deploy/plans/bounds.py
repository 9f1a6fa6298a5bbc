"""Bounded reports: what one client's report may hold, declared by its plan and checked
by the server for every upload (`server/intake.py`).

A client's report is finite and of the plan's type (`folding.Folder.check`), but a
finite report can still ruin a model: a weight of -1e300, a client count of 10^6, an
update of 1.7e308. So each plan carries a signed `bounds` section (`Bounds`):

* `ranges`: per report leaf (named by its path, e.g. `[1]`, `[3].num_clients`,
  `.update_weight`), every element in `[low, high]`;
* `norms`: groups of leaves whose joint L2 norm is at most `bound`, or, with a `scale`
  leaf (a scalar), at most `bound * scale`.

A report outside them is refused (`ReportError`, reason `out_of_bounds`) naming the leaf
and the bound, before anything is folded.

The driver declares them with `ReportBounds` (`DeploymentContext(bounds=...)`,
`deployment_context(..., bounds=...)`, `BufferedDriver(bounds=...)`): explicit ranges
and norms by leaf path, plus the defaults for the learning algorithms:

* counts: a leaf named `num_examples`, `num_batches` or `update_weight` in
  `[0, max_examples_per_client]`; `num_clients`, `num_nonfinite` in `[0, 1]`; the
  norm a client reports of its update (`update_norm`, `update_norm_sum`) in
  `[0, clip]`;
* a weighted sum (how `MeanFactory` and so FedAvg average: `sum(w * u)` and `sum(w)`,
  two `federated_sum`s, the first over values computed from the second's weight):
  the weight in `[0, max_examples_per_client]`, and the L2 norm of the weighted sum
  at most `clip * w` — a client's report holds `w * u`, so this is `|u| <= clip`
  for the update `u` itself; likewise a `federated_weighted_mean`'s `total` and
  `weight`;
* a buffered session's raw report (`update`, `update_weight`): `|update| <= clip`.

Norms are compared with a relative slack of `NORM_SLACK` (the client computes `w * u`
in float32). The inputs of secure aggregations are masked: the server sees only their
sum, so a per-client bound cannot be checked there (see docs/deploy.md, "Threat model").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np

from fedlang.core import intrinsic_defs, serialization, structure, types

DEFAULT_MAX_EXAMPLES = 10**6
DEFAULT_CLIP = 1e4
NORM_SLACK = 1e-5  # float32 rounding of w * u on the client

# Leaf names the learning algorithms give their counts: per client at most ...
_EXAMPLE_COUNTS = ("num_examples", "num_batches", "update_weight")  # ... its examples
_ONE_COUNTS = ("num_clients", "num_nonfinite")  # ... one
_NORMS = ("update_norm", "update_norm_sum")  # the norm it reports of its update: <= clip


class OutOfBounds(ValueError):
    """A report outside its plan's bounds (the server refuses it: 400 `out_of_bounds`)."""

    reason = "out_of_bounds"


@dataclasses.dataclass(frozen=True)
class Range:
    """Every element of report leaf `leaf` lies in `[low, high]`."""

    leaf: str
    low: float
    high: float

    def to_json(self) -> dict[str, Any]:
        return {"leaf": self.leaf, "min": self.low, "max": self.high}


@dataclasses.dataclass(frozen=True)
class Norm:
    """The joint L2 norm of report leaves `leaves` is at most `bound` (times the scalar
    leaf `scale`'s value, when given)."""

    leaves: tuple[str, ...]
    bound: float
    scale: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"leaves": list(self.leaves), "max_norm": self.bound}
        if self.scale is not None:
            doc["scale"] = self.scale
        return doc


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A plan's bounds on one client's report (see the module docstring)."""

    ranges: tuple[Range, ...] = ()
    norms: tuple[Norm, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.ranges or self.norms)

    def to_json(self) -> dict[str, Any]:
        return {"ranges": [r.to_json() for r in self.ranges],
                "norms": [n.to_json() for n in self.norms]}

    @staticmethod
    def from_json(doc: Any, paths: Sequence[str]) -> Bounds:
        """Reads a `bounds` section whose leaves are among `paths` (the report's).

        Raises:
          SerializationError: if it is not a valid section.
        """
        known = set(paths)

        def leaf(name: Any) -> str:
            if not isinstance(name, str) or name not in known:
                raise serialization.malformed(f"a report leaf (one of {sorted(known)})",
                                              repr(name)[:60])
            return name

        def number(x: Any, what: str) -> float:
            if isinstance(x, bool) or not isinstance(x, int | float) or math.isnan(x):
                raise serialization.malformed(what, repr(x)[:60])
            return float(x)

        if not isinstance(doc, dict) or set(doc) != {"ranges", "norms"}:
            raise serialization.malformed("a bounds section {ranges, norms}", repr(doc)[:60])
        try:
            ranges = tuple(
                Range(leaf(r["leaf"]), number(r["min"], "a minimum"), number(r["max"], "a maximum"))
                for r in doc["ranges"])
            norms = tuple(
                Norm(tuple(leaf(x) for x in n["leaves"]), number(n["max_norm"], "a norm bound"),
                     None if n.get("scale") is None else leaf(n["scale"]))
                for n in doc["norms"])
        except (KeyError, TypeError) as e:
            raise serialization.malformed("a bounds section", f"{type(e).__name__}: {e}") from e
        for r in ranges:
            if not r.low <= r.high:
                raise serialization.malformed(f"a range with min <= max for {r.leaf}",
                                              f"[{r.low}, {r.high}]")
        for n in norms:
            if not (n.leaves and n.bound >= 0):
                raise serialization.malformed("a norm bound >= 0 over some leaves", n.to_json())
        return Bounds(ranges, norms)

    def check(self, leaves: Mapping[str, Any], where: str = "the report") -> None:
        """Every range and norm holds for the report's `leaves` (path -> array).

        Raises:
          OutOfBounds: naming the leaf and the bound it breaks.
        """
        for r in self.ranges:
            x = leaves[r.leaf]
            if isinstance(x, Summary):
                if x.size == 0:
                    continue
                lo, hi = x.low, x.high
            else:
                x = np.asarray(x)
                if x.size == 0:
                    continue
                lo, hi = float(x.min()), float(x.max())
            if not (r.low <= lo and hi <= r.high):
                found = lo if not r.low <= lo else hi
                raise OutOfBounds(
                    f"Expected {where}'s leaf {r.leaf} within [{r.low:g}, {r.high:g}] (the "
                    f"plan's bounds), found {found:g}; a client reports at most its own "
                    "examples, and weights are never negative.")
        for n in self.norms:
            norm = _l2(leaves[x] for x in n.leaves)
            bound = n.bound
            if n.scale is not None:
                bound *= max(float(np.asarray(leaves[n.scale])), 0.0)
            if not norm <= bound * (1 + NORM_SLACK):
                scaled = f"{n.bound:g} x {n.scale} = {bound:g}" if n.scale else f"{bound:g}"
                raise OutOfBounds(
                    f"Expected the L2 norm of {where}'s leaves {', '.join(n.leaves)} at most "
                    f"{scaled} (the plan's bounds), found {norm:g}; a client must clip its "
                    "update to the plan's norm before reporting.")


def _l2(arrays: Any) -> float:
    # einsum, not np.dot: numpy's dot of a long vector goes to OpenBLAS, whose threads
    # then spin for milliseconds after each call; between a server's reports that burned
    # ~5 ms of CPU per 10^5-value check (56 us with einsum; bench/README.md, "Edge
    # aggregators").
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for a in arrays:
            if isinstance(a, Summary):
                total += a.sumsq
                continue
            for part in slices(a):  # widened a slice at a time: no float64 copy of a model
                x = np.asarray(part, np.float64)
                total += float(np.einsum("i,i->", x, x))
    return math.sqrt(total) if total < math.inf else math.inf


SLICE = 1 << 20  # elements a check takes at a time (8 MB widened to float64)


@dataclasses.dataclass
class Summary:
    """What the checks need of a report's leaf that is checked as it arrives, never held
    whole (a model-sized tensor streamed to storage): how many elements, the least and
    the greatest, the sum of their squares (in float64), and whether all are finite.
    `Bounds.check` and the server's finiteness and overflow checks take it in place of
    the leaf's array."""

    size: int = 0
    low: float = math.inf
    high: float = -math.inf
    sumsq: float = 0.0
    finite: bool = True

    @staticmethod
    def of(x: Any) -> Summary:
        """The summary of a whole array."""
        summary = Summary()
        for part in slices(x):
            summary.add(part)
        return summary

    def add(self, x: np.ndarray) -> None:
        """Takes the next elements (a flat array, at most a `SLICE` or so at a time)."""
        if x.size == 0:
            return
        self.size += int(x.size)
        if x.dtype.kind == "c":
            self.finite = self.finite and bool(np.isfinite(x).all())
            x = np.abs(x)
        elif x.dtype.kind == "f":
            self.finite = self.finite and bool(np.isfinite(x).all())
        elif x.dtype.kind == "b":
            x = x.view(np.uint8)
        with np.errstate(over="ignore", invalid="ignore"):
            self.low = min(self.low, float(x.min()))
            self.high = max(self.high, float(x.max()))
            wide = np.asarray(x, np.float64)
            self.sumsq += float(np.einsum("i,i->", wide, wide))

    @property
    def max_abs(self) -> float:
        """The largest magnitude of an element (0 for none)."""
        return max(abs(self.low), abs(self.high)) if self.size else 0.0


def slices(a: Any) -> Iterator[np.ndarray]:
    """The elements of array `a`, flat, as views of at most `SLICE` elements: for checks
    that would otherwise make a temporary array the size of a model's update."""
    x = np.asarray(a).reshape(-1)
    for start in range(0, max(x.size, 1), SLICE):
        yield x[start:start + SLICE]


def leaf_paths(t: types.Type, top: Sequence[str] | None = None) -> list[str]:
    """The path of each leaf of `t` in flatten order (`[0].total.w`, `.update_weight`);
    `top` names the top-level fields instead of their names or positions."""
    out: list[str] = []

    def walk(x: types.Type, path: str) -> None:
        if isinstance(x, types.StructType):
            for i, (name, et) in enumerate(x.elements):
                walk(et, path + structure.field_path(name, i))
        else:
            out.append(path)

    if top is not None and isinstance(t, types.StructType):
        for prefix, et in zip(top, t.types):
            walk(et, prefix)
    else:
        walk(t, "")
    return out


def _named(t: types.Type, path: str, names: Sequence[str]) -> list[str]:
    """The paths below `path` of the leaves of `t` whose field name is in `names`."""
    paths = leaf_paths(t)
    return [path + p for p in paths if p.rsplit(".", 1)[-1] in names]


@dataclasses.dataclass(frozen=True)
class ReportBounds:
    """What the driver declares reports may hold (see the module docstring).

    Args:
      max_examples_per_client: the largest weight or example count one client may
        report (`None`: no default on counts).
      clip: the largest L2 norm of one client's model update, per unit of its weight
        (`None`: no default on norms).
      ranges: explicit `{leaf path: (min, max)}`, over the defaults.
      norms: explicit `{(leaf path, ...): max_norm}`.
      defaults: whether to add the defaults for the learning algorithms.

    Example:
      >>> ReportBounds(max_examples_per_client=5000, clip=10.0).max_examples_per_client
      5000
    """

    max_examples_per_client: float | None = DEFAULT_MAX_EXAMPLES
    clip: float | None = DEFAULT_CLIP
    ranges: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    norms: Mapping[tuple[str, ...], float] = dataclasses.field(default_factory=dict)
    defaults: bool = True

    def __post_init__(self) -> None:
        for name in ("max_examples_per_client", "clip"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value >= 0
                                          and math.isfinite(value)):
                raise ValueError(f"Expected {name} to be a finite number >= 0 or None, "
                                 f"found {value!r}.")

    def _counts(self, t: types.Type, path: str) -> list[Range]:
        out = []
        if self.max_examples_per_client is not None:
            m = float(self.max_examples_per_client)
            out += [Range(p, 0.0, m) for p in _named(t, path, _EXAMPLE_COUNTS)]
        out += [Range(p, 0.0, 1.0) for p in _named(t, path, _ONE_COUNTS)]
        if self.clip is not None:
            top = float(self.clip) * (1 + NORM_SLACK)
            out += [Range(p, 0.0, top) for p in _named(t, path, _NORMS)]
        return out

    def _finish(self, ranges: list[Range], norms: list[Norm], paths: Sequence[str]) -> Bounds:
        if not self.defaults:
            ranges, norms = [], []
        known = set(paths)
        for leaf, (low, high) in self.ranges.items():
            ranges = [r for r in ranges if r.leaf != leaf] + [Range(leaf, float(low), float(high))]
        for leaves, bound in self.norms.items():
            norms.append(Norm(tuple(leaves), float(bound)))
        for name in [r.leaf for r in ranges] + [x for n in norms for x in n.leaves]:
            if name not in known:
                raise ValueError(f"Expected a report leaf among {paths}, found {name!r}; "
                                 "name leaves by their path in the report.")
        return Bounds(tuple(ranges), tuple(norms))

    def for_round(self, aggregations: Sequence[Any], report_type: types.StructType,
                  plain: Sequence[int], weighted_by: Mapping[int, int]) -> Bounds:
        """The bounds of a round's plain report.

        Args:
          aggregations: the round's `AggregationPlan`s.
          report_type: the plain report's type (the partials of `plain`).
          plain: the indices of the aggregations that are not secure.
          weighted_by: aggregation index -> the index of the `federated_sum` of the
            weight its values were multiplied by (found in the round's dataflow).
        """
        tops = [f"[{i}]" for i in plain]
        paths = leaf_paths(report_type, tops)
        ranges: list[Range] = []
        norms: list[Norm] = []
        m, clip = self.max_examples_per_client, self.clip
        for i, t in zip(plain, report_type.types):
            top = f"[{i}]"
            ranges += self._counts(t, top)
            if aggregations[i].uri == intrinsic_defs.FEDERATED_WEIGHTED_MEAN.uri:
                total = [top + ".total" + p for p in leaf_paths(cast(types.StructType, t)["total"])]
                if m is not None:
                    ranges.append(Range(top + ".weight", 0.0, float(m)))
                if clip is not None:
                    norms.append(Norm(tuple(total), float(clip), top + ".weight"))
        for i, j in weighted_by.items():
            if j not in plain:
                continue
            if m is not None:
                ranges.append(Range(f"[{j}]", 0.0, float(m)))
            if i in plain and clip is not None:
                t = report_type.types[list(plain).index(i)]
                norms.append(Norm(tuple(f"[{i}]" + p for p in leaf_paths(t)), float(clip), f"[{j}]"))
        return self._finish(_unique(ranges), norms, paths)

    def for_buffered(self, report_type: types.Type) -> Bounds:
        """The bounds of a buffered session's raw report (named leaves)."""
        paths = leaf_paths(report_type)
        ranges = self._counts(report_type, "")
        norms = []
        if self.clip is not None and isinstance(report_type, types.StructType) \
                and "update" in report_type.names:
            update = [".update" + p for p in leaf_paths(report_type["update"])]
            norms.append(Norm(tuple(update), float(self.clip)))
        return self._finish(ranges, norms, paths)


def _unique(ranges: list[Range]) -> list[Range]:
    seen: dict[str, Range] = {}
    for r in ranges:
        seen.setdefault(r.leaf, r)
    return list(seen.values())


def leaves_of(value: Any, t: types.Type, paths: Sequence[str]) -> dict[str, Any]:
    """`{path: leaf}` of a value in internal form of type `t`."""
    return dict(zip(paths, structure.flatten(value, t)))


DEFAULT = ReportBounds()  # the defaults for the learning algorithms (the drivers' default)
