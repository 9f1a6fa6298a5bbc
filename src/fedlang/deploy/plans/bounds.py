"""Bounded reports: what one client's report may hold, declared by its plan and checked
by the server for every upload (`server/intake.py`).

A client's report is finite and of the plan's type (`folding.Folder.check`), but a
finite report can still ruin a model: a weight of -1e300, a client count of 10^6, an
update of 1.7e308. So each plan carries a signed `bounds` section (`Bounds`):

* `ranges`: per report leaf (named by its path, e.g. `[1]`, `[3].num_clients`,
  `.update_weight`), every element in `[low, high]`, or, with a `scale` leaf (a
  scalar count), in `[low * scale, high * scale]`;
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
* a buffered session's raw report (`update`, `update_weight`), and a round's
  `federated_sum` of the clients' `update`s themselves (unweighted FedAvg) or of them
  clipped (`aggregators.clipping`'s `{value, hit, report}`, DP-FedAvg): `|update| <=
  clip`, the clipping's `hit` in `[0, 1]`, its quantile `report` in `[-0.5, 0.5]`;
* a model's summed statistics (a struct with `loss_sum` and `num_examples`,
  `learning.metrics.zero_stats`): `loss_sum` and every leaf of each metric's
  statistics within `[-b, b] x num_examples`, `b` the per-example bound
  (`per_example`, or `per_metric[name]`, `'loss'` for the loss); a metric's `count`
  and `correct` also in `[0, max_examples_per_client]`;
* a loss summed on its own (`federated_sum(outputs.loss_sum)`, `learning.sparse`)
  next to the sum of the same value's `num_examples`: within `[-b, b] x` that sum;
* a `federated_max`/`federated_min` of a named value (`update_norm_max`: the max of
  `update_norm`) as that value (`best` in `[0, clip]`); a boolean leaf in `[0, 1]`;
  a `federated_sum` whose input is the same constant at every client (a count of
  clients, `1`; the compiler reads it from the function's program) exactly it;
* a secure sum's clear flags (`aggregators.secure`, DP over SecAgg+): `included` and
  `nonfinite` in `[0, 1]`, `upper` and `lower` (elements outside the range) in
  `[0, elements of the codes]`;
* a `federated_aggregate`'s partial (`<value, count>`): its `count` in `[0, 1]`; and,
  when it collects the clients' updates as rows (the robust aggregators, median,
  trimmed mean, geometric median, Krum, Bulyan: `aggregators.robust.collect_process`,
  one row per client), `|value| <= clip`.

A leaf none of these bound, and no explicit range or norm names, makes a strict
`ReportBounds` (the constructor's default) refuse to make the plan (`UnboundedLeaf`,
naming the leaf and how to declare a bound, or `unbounded=` to accept any finite
value); `strict=False` accepts such a leaf, checked only for finiteness. The drivers'
default, `DEFAULT`, is not strict yet, so users' computations written before keep
running. Every leaf of FedAvg's (with the mean, or a robust aggregator),
FedProx's, FedOpt's, FedSGD's, Mime Lite's, q-FFL's, federated evaluation's, FedBuff's
and DP-FedAvg's reports is bounded (tests/deploy/plans/test_bounds.py); the analytics'
sketches are not (the analytics have no deployment path: they run in simulation only).

Norms and scaled ranges are compared with a relative slack of `NORM_SLACK` (the client
computes `w * u` and its sums in float32). The inputs of secure aggregations are
masked: the server sees only their sum, so a per-client bound cannot be checked there (see docs/deploy.md, "Threat model").
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
DEFAULT_PER_EXAMPLE = 1e6  # of one example's loss or metric value: generous, tighten it
NORM_SLACK = 1e-5  # float32 rounding of w * u on the client

# Leaf names the learning algorithms give their counts: per client at most ...
_EXAMPLE_COUNTS = ("num_examples", "num_batches", "update_weight")  # ... its examples
_ONE_COUNTS = ("num_clients", "num_nonfinite")  # ... one
_NORMS = ("update_norm", "update_norm_sum")  # the norm it reports of its update: <= clip
_METRIC_COUNTS = ("count", "correct")  # a metric's counts of examples: >= 0
# A clipping aggregator's value per client (`aggregators.clipping`): the clipped value,
# whether it was clipped, and its report to the quantile estimate of the norm.
_LIMITED = ("value", "hit", "report")
_LIMITED_RANGES = {"hit": (0.0, 1.0), "report": (-0.5, 0.5)}
# A secure sum's encoding of a client's value (`aggregators.secure`): its codes (summed
# securely) and, in the clear, whether it was finite (`included`, `nonfinite`: 0 or 1)
# and how many of its elements were above or below the range (`upper`, `lower`).
_ENCODED = ("codes", "upper", "lower", "fits", "included", "nonfinite")


class OutOfBounds(ValueError):
    """A report outside its plan's bounds (the server refuses it: 400 `out_of_bounds`)."""

    reason = "out_of_bounds"


@dataclasses.dataclass(frozen=True)
class Range:
    """Every element of report leaf `leaf` lies in `[low, high]` (times the scalar leaf
    `scale`'s value, when given: a sum of per-example values, scaled by its count)."""

    leaf: str
    low: float
    high: float
    scale: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"leaf": self.leaf, "min": self.low, "max": self.high}
        if self.scale is not None:
            doc["scale"] = self.scale
        return doc


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
                Range(leaf(r["leaf"]), number(r["min"], "a minimum"), number(r["max"], "a maximum"),
                      None if r.get("scale") is None else leaf(r["scale"]))
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
                if x.ndim == 0:  # most ranges are on scalars: no reduction (~4 us each)
                    lo = hi = float(x)
                elif x.size == 0:
                    continue
                else:
                    lo, hi = float(x.min()), float(x.max())
            low, high, within = r.low, r.high, f"[{r.low:g}, {r.high:g}]"
            if r.scale is not None:
                s = _scale(leaves[r.scale])
                # the client sums per-example values in float32: NORM_SLACK's relative slack
                low, high = low * s * (1 + NORM_SLACK), high * s * (1 + NORM_SLACK)
                if r.low > 0:
                    low = r.low * s * (1 - NORM_SLACK)
                if r.high < 0:
                    high = r.high * s * (1 - NORM_SLACK)
                within += f" x {r.scale} = [{r.low * s:g}, {r.high * s:g}]"
            if not (low <= lo and hi <= high):
                found = lo if not low <= lo else hi
                raise OutOfBounds(
                    f"Expected {where}'s leaf {r.leaf} within {within} (the plan's bounds), "
                    f"found {found:g}; a client reports at most its own examples, each "
                    "example's values within the plan's per-example bound, and counts and "
                    "weights are never negative.")
        for n in self.norms:
            norm = _l2(leaves[x] for x in n.leaves)
            bound = n.bound
            if n.scale is not None:
                bound *= _scale(leaves[n.scale])
            if not norm <= bound * (1 + NORM_SLACK):
                scaled = f"{n.bound:g} x {n.scale} = {bound:g}" if n.scale else f"{bound:g}"
                raise OutOfBounds(
                    f"Expected the L2 norm of {where}'s leaves {', '.join(n.leaves)} at most "
                    f"{scaled} (the plan's bounds), found {norm:g}; a client must clip its "
                    "update to the plan's norm before reporting.")


def _scale(x: Any) -> float:
    """A scale leaf's value (a scalar: a count or a weight; a negative one is 0)."""
    return max(float(np.asarray(x).reshape(-1)[0]), 0.0)


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


def _leaves(t: types.Type, path: str) -> list[tuple[str, str | None, types.Type]]:
    """`(path, field name, type)` of each leaf of `t` below `path`, in flatten order (a
    leaf that is not a struct's field, e.g. `t` itself, has no field name: None)."""
    out: list[tuple[str, str | None, types.Type]] = []

    def walk(x: types.Type, p: str, name: str | None) -> None:
        if isinstance(x, types.StructType):
            for i, (n, et) in enumerate(x.elements):
                walk(et, p + structure.field_path(n, i), n)
        else:
            out.append((p, name, x))

    walk(t, path, None)
    return out


def _stats(t: types.Type, path: str) -> Iterator[tuple[str, types.StructType]]:
    """The structs below `path` that hold a model's summed statistics
    (`learning.metrics.zero_stats`: `loss_sum`, `num_examples`, `metrics`)."""
    if isinstance(t, types.StructType):
        if {"loss_sum", "num_examples"} <= set(t.names):
            yield path, t
        for i, (n, et) in enumerate(t.elements):
            yield from _stats(et, path + structure.field_path(n, i))


class UnboundedLeaf(ValueError):
    """A report leaf for which no bound can be derived, and none is declared (the plan
    is not made)."""


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
      per_example: the largest magnitude of one example's loss or metric value: a
        client's `loss_sum` and each metric's statistics are at most this times the
        examples it reports (`None`: no default on them). Generous by default
        (`DEFAULT_PER_EXAMPLE`); tighten it to what your loss can be.
      per_metric: `{name: bound}` over `per_example`, per metric name (`'loss'` for the
        loss), e.g. `{'loss': 20.0, 'accuracy': 1.0}`.
      unbounded: leaf paths accepted with no bound (only finite): what a plan holds
        that has no derivable bound must be declared, here or in `ranges` or `norms`.
      strict: whether a leaf with no derivable or declared bound makes the plan fail
        (`UnboundedLeaf`, naming it); with `strict=False` such a leaf is checked only
        for finiteness. The drivers' default, `DEFAULT`, is not strict yet:
        computations written before every leaf was bounded keep running (the learning
        algorithms' leaves are bounded either way: see the module docstring).

    Example:
      >>> ReportBounds(max_examples_per_client=5000, clip=10.0).max_examples_per_client
      5000
    """

    max_examples_per_client: float | None = DEFAULT_MAX_EXAMPLES
    clip: float | None = DEFAULT_CLIP
    ranges: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    norms: Mapping[tuple[str, ...], float] = dataclasses.field(default_factory=dict)
    defaults: bool = True
    per_example: float | None = DEFAULT_PER_EXAMPLE
    per_metric: Mapping[str, float] = dataclasses.field(default_factory=dict)
    unbounded: Sequence[str] = ()
    strict: bool = True

    def __post_init__(self) -> None:
        values = {"max_examples_per_client": self.max_examples_per_client, "clip": self.clip,
                  "per_example": self.per_example}
        values.update({f"per_metric[{k!r}]": v for k, v in self.per_metric.items()})
        for name, value in values.items():
            if value is not None and not (isinstance(value, int | float) and value >= 0
                                          and math.isfinite(value)):
                raise ValueError(f"Expected {name} to be a finite number >= 0 or None, "
                                 f"found {value!r}.")
        if isinstance(self.unbounded, str):
            raise TypeError(f"Expected unbounded to be a sequence of leaf paths, found the "
                            f"string {self.unbounded!r}; write unbounded=({self.unbounded!r},).")

    def _per_example(self, metric: str) -> float | None:
        value = self.per_metric.get(metric, self.per_example)
        return None if value is None else float(value)

    def _derived(self, t: types.Type, top: str, name: str | None = None,
                 uri: str | None = None, constant: Sequence[float] | None = None) -> list[Range]:
        """The ranges derived for an aggregation's report `t` at `top`: by the names the
        learning algorithms give their counts and norms (`name`: the field of the
        clients' value it aggregates, when it aggregates one), its statistics, its
        booleans, and its value when every client's is the same constant."""
        m = None if self.max_examples_per_client is None else float(self.max_examples_per_client)
        clip = None if self.clip is None else float(self.clip)
        extreme = uri in (intrinsic_defs.FEDERATED_MAX.uri, intrinsic_defs.FEDERATED_MIN.uri)
        out = []
        leaves = _leaves(t, top)
        if constant is not None:
            out += [Range(p, c, c) for (p, _, _), c in zip(leaves, constant)]
        for p, field, lt in leaves:
            if field is None or (extreme and field == "best"):
                field = name  # a max's state: the best value seen of the field it takes
            if field in _EXAMPLE_COUNTS and m is not None:
                out.append(Range(p, 0.0, m))
            elif field in _ONE_COUNTS:
                out.append(Range(p, 0.0, 1.0))
            elif field in _NORMS and clip is not None:
                out.append(Range(p, 0.0, clip * (1 + NORM_SLACK)))
            if isinstance(lt, types.TensorType) and lt.dtype == np.bool_:
                out.append(Range(p, 0.0, 1.0))
        for p, st in _stats(t, top):
            count = p + ".num_examples"
            b = self._per_example("loss")
            if b is not None:
                out.append(Range(p + ".loss_sum", -b, b, count))
            if "metrics" not in st.names:
                continue
            for i, (metric, et) in enumerate(cast(types.StructType, st["metrics"]).elements):
                b = self._per_example(str(metric))
                for q, field, _ in _leaves(et, p + ".metrics" + structure.field_path(metric, i)):
                    if field in _METRIC_COUNTS:  # counts: >= 0, at most the examples
                        if m is not None:
                            out.append(Range(q, 0.0, m))
                        if b is not None:
                            out.append(Range(q, 0.0, b, count))
                    elif b is not None:
                        out.append(Range(q, -b, b, count))
        return out

    def _finish(self, ranges: list[Range], norms: list[Norm],
                leaves: Sequence[tuple[str, types.Type]]) -> Bounds:
        if not self.defaults:
            ranges, norms = [], []
        paths = [p for p, _ in leaves]
        known = set(paths)
        for leaf, (low, high) in self.ranges.items():
            ranges = [r for r in ranges if r.leaf != leaf] + [Range(leaf, float(low), float(high))]
        for leaves_, bound in self.norms.items():
            norms.append(Norm(tuple(leaves_), float(bound)))
        for name in ([r.leaf for r in ranges] + [x for n in norms for x in n.leaves]
                     + list(self.unbounded)):
            if name not in known:
                raise ValueError(f"Expected a report leaf among {paths}, found {name!r}; "
                                 "name leaves by their path in the report.")
        bounded = {r.leaf for r in ranges} | {x for n in norms for x in n.leaves}
        bounded |= set(self.unbounded)
        missing = [(p, t) for p, t in leaves if p not in bounded]
        if missing and self.strict:
            first = missing[0][0]
            raise UnboundedLeaf(
                "Expected a bound on every leaf of a client's report (a leaf the learning "
                "algorithms report is bounded by default), found none for "
                + ", ".join(f"{p} ({t})" for p, t in missing)
                + f". Declare one in the driver's ReportBounds: ranges={{{first!r}: (low, "
                f"high)}} (every element), norms={{({first!r},): max_norm}} (the L2 norm), "
                f"or unbounded=({first!r},) to accept any finite value; bounds=None "
                "declares no bounds at all.")
        return Bounds(tuple(_unique(ranges)), tuple(norms))

    def for_round(self, aggregations: Sequence[Any], report_type: types.StructType,
                  plain: Sequence[int], weighted_by: Mapping[int, int],
                  names: Mapping[int, tuple[str, Sequence[str]]] | None = None,
                  constants: Mapping[int, Sequence[float]] | None = None) -> Bounds:
        """The bounds of a round's plain report.

        Args:
          aggregations: the round's `AggregationPlan`s.
          report_type: the plain report's type (the partials of `plain`).
          plain: the indices of the aggregations that are not secure.
          weighted_by: aggregation index -> the index of the `federated_sum` of the
            weight its values were multiplied by (found in the round's dataflow).
          names: aggregation index -> the field of the clients' value it aggregates
            (`update_norm` for `federated_max(outputs.update_norm)`), where it is one,
            and the names of that value's fields.
          constants: aggregation index -> the value of each leaf of its input, where
            every client's is the same constant (`1`: a count of clients).

        Raises:
          UnboundedLeaf: naming a leaf with no derivable bound, and how to declare one.
        """
        names, constants = names or {}, constants or {}
        leaves = [(p, lt) for i, t in zip(plain, report_type.types)
                  for p, _, lt in _leaves(t, f"[{i}]")]
        ranges: list[Range] = []
        norms: list[Norm] = []
        m, clip = self.max_examples_per_client, self.clip
        for i, t in zip(plain, report_type.types):
            top = f"[{i}]"
            field, siblings = names.get(i, (None, ()))
            if set(siblings) == set(_LIMITED) and field in _LIMITED_RANGES:
                # a clipping aggregator's flag and quantile report (`aggregators.clipping`)
                low, high = _LIMITED_RANGES[field]
                ranges += [Range(p, low, high) for p, _, _ in _leaves(t, top)]
            ranges += self._derived(t, top, field, aggregations[i].uri, constants.get(i))
            if aggregations[i].uri == intrinsic_defs.FEDERATED_AGGREGATE.uri \
                    and _is_partial(t):
                # a `federated_aggregate`'s partial counts its contributions: one client's
                # is 1 (the intake refuses any other, `not_one_client`)
                ranges.append(Range(top + ".count", 0.0, 1.0))
                if _is_update(field, siblings) and clip is not None \
                        and _collects(aggregations[i].client_type, t):
                    # the robust aggregators collect each client's update as a row
                    # (`aggregators.robust.collect_process`): |update| <= clip
                    value = cast(types.StructType, t)["value"]
                    norms.append(Norm(tuple(top + ".value" + p for p in leaf_paths(value)),
                                      float(clip)))
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
        sums = {u for u in plain if aggregations[u].uri == intrinsic_defs.FEDERATED_SUM.uri}
        for u, (field, siblings) in names.items():
            # a sum of the clients' updates themselves (`UnweightedMeanFactory`), or of
            # them clipped (`aggregators.clipping`, DP-FedAvg: never longer): |u| <= clip
            if _is_update(field, siblings) and u in sums and u not in weighted_by \
                    and clip is not None:
                t = report_type.types[list(plain).index(u)]
                norms.append(Norm(tuple(f"[{u}]" + p for p in leaf_paths(t)), float(clip)))
        for u, (field, siblings) in names.items():
            if set(siblings) != set(_ENCODED) or u not in sums:
                continue
            if field in ("included", "nonfinite"):
                ranges.append(Range(f"[{u}]", 0.0, 1.0))
            elif field in ("upper", "lower"):  # at most every element of the codes
                codes = [j for j, (f, s) in names.items()
                         if f == "codes" and set(s) == set(_ENCODED)]
                if codes:
                    size = sum(math.prod(d or 0 for d in lt.shape) for lt in
                               structure.leaf_types(aggregations[codes[0]].client_type))
                    ranges.append(Range(f"[{u}]", 0.0, float(size)))
        loss = self._per_example("loss")
        for u, (field, siblings) in names.items():
            # a loss summed on its own, next to the sum of the same value's examples
            # (`learning.sparse`): within [-b, b] x that sum, as a statistics struct's
            count = [j for j, (f, s) in names.items()
                     if f == "num_examples" and tuple(s) == tuple(siblings) and j in sums]
            if field == "loss_sum" and u in sums and count and loss is not None \
                    and _is_scalar(report_type.types[list(plain).index(u)]):
                ranges.append(Range(f"[{u}]", -loss, loss, f"[{count[0]}]"))
        return self._finish(ranges, norms, leaves)

    def for_buffered(self, report_type: types.Type) -> Bounds:
        """The bounds of a buffered session's raw report (named leaves).

        Raises:
          UnboundedLeaf: naming a leaf with no derivable bound, and how to declare one.
        """
        ranges = self._derived(report_type, "")
        norms = []
        if self.clip is not None and isinstance(report_type, types.StructType) \
                and "update" in report_type.names:
            update = [".update" + p for p in leaf_paths(report_type["update"])]
            norms.append(Norm(tuple(update), float(self.clip)))
        return self._finish(ranges, norms, [(p, lt) for p, _, lt in _leaves(report_type, "")])


def _is_update(field: str | None, siblings: Sequence[str]) -> bool:
    """Whether the clients' value an aggregation takes (its field `field` of a struct
    with fields `siblings`) is a model update: the learning algorithms' `update`, or an
    update clipped by `aggregators.clipping` (`{value, hit, report}`: never longer)."""
    return field == "update" or (field == "value" and set(siblings) == set(_LIMITED))


def _is_partial(t: types.Type) -> bool:
    """Whether `t` is a `federated_aggregate`'s partial, `<value, count>`."""
    return isinstance(t, types.StructType) and t.names == ("value", "count")


def _is_scalar(t: types.Type) -> bool:
    return isinstance(t, types.TensorType) and not t.shape


def _collects(member: types.Type, partial: types.Type) -> bool:
    """Whether a `federated_aggregate`'s partial (`<value, count>`) holds the clients'
    values `member` as rows: each leaf of its value is the leaf of `member` with a
    leading dimension of any size (a growing buffer, one row per client: the intake
    refuses more rows than the count, `folding._check_rows`)."""
    rows = structure.leaf_types(cast(types.StructType, partial)["value"])
    values = structure.leaf_types(member)
    return len(rows) == len(values) and all(
        r.dtype == v.dtype and tuple(r.shape) == (None, *v.shape) for r, v in zip(rows, values))


def _unique(ranges: list[Range]) -> list[Range]:
    seen: dict[tuple[str, str | None], Range] = {}
    for r in ranges:
        seen.setdefault((r.leaf, r.scale), r)
    return list(seen.values())


def leaves_of(value: Any, t: types.Type, paths: Sequence[str]) -> dict[str, Any]:
    """`{path: leaf}` of a value in internal form of type `t`."""
    return dict(zip(paths, structure.flatten(value, t)))


# The drivers' default: the defaults for the learning algorithms, a user's leaf with no
# derivable bound accepted (finite). Strict (`ReportBounds()`) once every test, bench and
# example computation declares the bounds of its own leaves (issue 36, item 2).
DEFAULT = ReportBounds(strict=False)
