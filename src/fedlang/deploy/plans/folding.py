"""Folding client reports into a round's aggregate, as the task store's server does.

A client's report is one partial aggregate per aggregation of the round
(`RoundPlan.report_type`): its own value folded into each aggregation's accumulator,
each tensor in its values' dtype (a float32 model's update as float32). The server
keeps the round's running aggregate as bytes (in the same database transaction that
records a report), wider (`RoundPlan.aggregate_type`: sums' totals in float64 or
int64), and folds each accepted report into it, widening it; memory never grows with
the cohort. An edge's partial aggregate stands for many reports: it travels wide. Reports come from clients the server does not trust, so `check` decodes them
with explicit limits and refuses anything that is not exactly one client's well-formed,
finite contribution.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from fedlang.core import errors, serialization, structure, types
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import round as plan_lib
from fedlang.runtime import accumulate, chunks


class ReportError(ValueError):
    """A client's report that the server refuses (the client gets a 4xx with this text).

    `reason` names the kind of refusal for the server's counters: `malformed`,
    `too_large`, `non_finite`, `not_one_client`, `overflow` or `out_of_bounds`.
    """

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


class Folder:
    """Folds reports of one round (see the module docstring).

    A round's aggregate holds every aggregation's partial (`RoundPlan.aggregate_type`).
    A client's plain report holds the partials of the aggregations that are not secure
    (`RoundPlan.report_type`); the inputs of secure ones are summed by SecAgg+ and folded
    in at once when the protocol ends (`fold_secure`).

    Args:
      round_plan: the round's plan (or its bytes, from a trusted source).
    """

    def __init__(self, round_plan: plan_lib.RoundPlan | bytes):
        if not isinstance(round_plan, plan_lib.RoundPlan):
            round_plan = plan_lib.RoundPlan.from_bytes(round_plan)
        self.plan = round_plan
        self.aggregate_type = round_plan.aggregate_type
        self.report_type = round_plan.report_type
        self.secure = round_plan.secure
        self.plain = tuple(i for i in range(len(round_plan.aggregations)) if i not in self.secure)
        # What reports held before they travelled in the model's dtype: the aggregate's
        # own partials. Recognised only to refuse them clearly (`check`).
        self.wide_report_type = types.StructType([self.aggregate_type.types[i] for i in self.plain])
        # One client adds one row to a growing buffer (`float32[?, ...]`): a report's
        # unknown dimensions hold at most one row each.
        self.max_report_bytes = max_bytes(self.report_type, unknown=1)
        self.partial_type = partial_type(self.aggregate_type)
        self.max_partial_bytes = max_bytes(self.partial_type)
        self.bounds = round_plan.bounds or bounds_lib.Bounds()
        self.report_paths = round_plan.report_paths
        self._small: dict[int, range] = {}
        self.report_layout, self.aggregate_layout = self._layouts()

    def _layouts(self) -> tuple[serialization.DenseLayout | None,
                                serialization.DenseLayout | None]:
        """The layouts of a report and of the aggregate when a report can be checked as it
        arrives and folded from storage a slice at a time (`streamable`): no aggregation
        secure, every leaf a dense tensor of known shape, and every aggregation a sum
        (`federated_sum`, `_mean`, `_weighted_mean`: each leaf of the aggregate the sum
        of that leaf of the reports, widened) or small (at most `SMALL_LEAF` bytes a
        report, such as a metric's `federated_max`: merged in memory)."""
        if self.secure:
            return None, None
        try:
            report = serialization.dense_layout(self.report_type)
            aggregate = serialization.dense_layout(self.aggregate_type)
        except TypeError:
            return None, None
        if [lt.shape for lt in report.leaves] != [lt.shape for lt in aggregate.leaves]:
            return None, None
        self._small = {}  # aggregation -> its leaves, merged in memory
        first = 0
        for i, (a, t) in enumerate(zip(self.plan.aggregations, self.report_type.types)):
            leaves = range(first, first + len(structure.leaf_types(t)))
            first = leaves.stop
            if type(a.make()) in _SUMS:
                continue
            if sum(report.lengths[k] for k in leaves) > SMALL_LEAF:
                return None, None
            self._small[i] = leaves
        return report, aggregate

    @property
    def streamable(self) -> bool:
        """Whether reports of this round can be taken as they arrive, checked without
        being held (`scan`), stored, and folded a slice at a time when the round closes
        (`fold_stored`): a large model's round."""
        return self.report_layout is not None

    def _accumulators(self, aggregate: bytes | None = None) -> list[Any]:
        accumulators = [a.make() for a in self.plan.aggregations]
        if aggregate is not None:
            value = self._decode(aggregate, self.aggregate_type, None, "an aggregate")
            for acc, partial in zip(accumulators, value):
                acc.merge(partial)
        return accumulators

    def _serialize(self, accumulators: Sequence[Any]) -> bytes:
        partial = tuple(acc.partial() for acc in accumulators)
        python = structure.to_python(partial, self.aggregate_type)
        return serialization.serialize_value(python, self.aggregate_type)

    @staticmethod
    def _decode(data: bytes, t: types.StructType, limit: int | None, what: str) -> Any:
        return structure.to_internal(decode(data, t, limit, what), t)

    def empty(self) -> bytes:
        """The aggregate of no reports."""
        return self._serialize(self._accumulators())

    def check(self, report: bytes) -> Any:
        """Decodes and validates one client's plain report; returns it in internal form.

        Raises:
          ReportError: if the report is malformed, of another type, too large, not
            finite, or not exactly one client's contribution.
        """
        try:
            raw = read_report(report, self.report_type, unknown=1)
        except ReportError as e:
            if e.reason == "malformed":
                self._refuse_wide(report, e)
            raise
        value = structure.to_internal(raw, self.report_type)
        for i, partial, t in zip(self.plain, value, self.report_type.types):
            _check_one_client(partial, t, f"aggregation {i} ({self.plan.aggregations[i].uri})")
        return value

    def _refuse_wide(self, report: bytes, error: ReportError) -> None:
        """Refuses a report in the wide format (`wide_report_type`), naming the tensors
        whose dtype differs; returns for anything else (`error` then stands).

        Raises:
          ReportError: `malformed`, if `report` is of `wide_report_type`.
        """
        wide = self.wide_report_type
        if wide == self.report_type:
            return
        try:
            decode(report, wide, max_bytes(wide, unknown=1), "a report")
        except ReportError:
            return
        differ = [
            f"{path} is {got}, not {want}"
            for path, want, got in zip(self.report_paths, structure.leaf_types(self.report_type),
                                       structure.leaf_types(wide))
            if want != got
        ]
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise ReportError(
            "Expected a report with each tensor in the model's dtype, found one in the wide "
            f"format of older clients: {'; '.join(differ[:3])}{more}. Update the client: the "
            "wide totals live on the server only.",
            reason="malformed",
        ) from error

    def leaves(self, report: Any) -> dict[str, Any]:
        """A checked report's leaves by path (`RoundPlan.report_paths`), for `bounds`."""
        return bounds_lib.leaves_of(report, self.report_type, self.report_paths)

    def check_bounds(self, report: Any) -> None:
        """A checked report is within the plan's bounds.

        Raises:
          ReportError: `out_of_bounds`, naming the leaf and the bound.
        """
        check_bounds(self.bounds, self.leaves(report))

    def fold(self, aggregate: bytes, report: Any) -> bytes:
        """The aggregate with one checked plain report folded in.

        Raises:
          ReportError: `overflow`, if folding the report in would make the aggregate
            infinite (each report is finite, but finite reports can add up to infinity):
            the report is refused, and the aggregate stays as it was.
        """
        accumulators = self._accumulators(aggregate)
        self.fold_into(accumulators, report)
        return self._serialize(accumulators)

    def accumulators(self, aggregate: bytes | None = None) -> list[Any]:
        """A running aggregate to fold reports into in memory (`fold_into`): empty, or
        holding the stored `aggregate`."""
        return self._accumulators(aggregate)

    def fold_into(self, accumulators: list[Any], report: Any) -> None:
        """Folds one checked upload into a running aggregate, in place: a client's plain
        report (`check`), or an edge's partial aggregate (`check_partial`: every
        aggregation merged).

        Raises:
          ReportError: `overflow`, as `fold`; the upload is refused and `accumulators`
            may hold it in part: the caller rebuilds them from what it kept.
        """
        if isinstance(report, Partial):
            self._merge_into(accumulators, report.value)
            return
        for i, partial in zip(self.plain, report):
            acc = accumulators[i]
            with np.errstate(all="ignore"):  # checked just below
                acc.merge(partial)
            if not _within_range(acc, self.aggregate_type.types[i]):
                raise ReportError(
                    f"Expected a report the aggregate of aggregation {i} "
                    f"({self.plan.aggregations[i].uri}) stays finite with, found one that "
                    "makes it overflow to infinity; a client must clip its values before "
                    "reporting.",
                    reason="overflow",
                )

    @staticmethod
    def counts(checked: Any) -> tuple[int, int]:
        """(reports, dropouts) a checked upload stands for: a client's report is one
        report; an edge's partial aggregate the reports of its clients, and those of them
        that dropped out."""
        if isinstance(checked, Partial):
            return checked.reports, checked.dropped
        return 1, 0

    def serialize(self, accumulators: Sequence[Any]) -> bytes:
        """A running aggregate's bytes, as the store keeps them."""
        return self._serialize(accumulators)

    def merge(self, aggregates: Sequence[bytes]) -> bytes:
        """One aggregate of several partial aggregates of a round (a round's shards).

        Raises:
          ReportError: `overflow`, if their sum overflows to infinity.
        """
        accumulators = self._accumulators()
        for data in aggregates:
            self._merge_into(accumulators, self._decode(data, self.aggregate_type, None, "an aggregate"))
        return self._serialize(accumulators)

    def _merge_into(self, accumulators: Sequence[Any], value: Sequence[Any]) -> None:
        """Merges one aggregate's value (internal form) into `accumulators`.

        Raises:
          ReportError: `overflow`, if an accumulator would overflow to infinity.
        """
        for i, (acc, partial) in enumerate(zip(accumulators, value)):
            with np.errstate(all="ignore"):  # checked just below
                acc.merge(partial)
            if not _within_range(acc, self.aggregate_type.types[i]):
                raise ReportError(
                    f"Expected partial aggregates whose sum stays finite, found aggregation "
                    f"{i} ({self.plan.aggregations[i].uri}) overflowing to infinity.",
                    reason="overflow",
                )

    def fold_secure(self, aggregate: bytes, sums: Sequence[Any], num_clients: int) -> bytes:
        """The aggregate with the secure aggregations' sums over `num_clients` clients
        (what SecAgg+ revealed: one flat array per secure tensor, in `secure_segments`
        order) folded in."""
        accumulators = self._accumulators(aggregate)
        flat = iter(sums)
        for i in self.secure:
            client_t = self.plan.aggregations[i].client_type
            totals = tuple(
                np.asarray(next(flat), np.uint64).reshape([d or 0 for d in lt.shape])
                for lt in structure.leaf_types(client_t)
            )
            accumulators[i].merge((totals, np.int64(num_clients)))
        return self._serialize(accumulators)

    def check_partial(self, body: bytes) -> Partial:
        """Decodes and validates an edge aggregator's partial aggregate of this round
        (`partial_type`: how many reports it folded, how many of its clients dropped,
        and the aggregate of those reports, from a server that authenticated as an
        edge).

        Raises:
          ReportError: if it is malformed, of another type, too large, not finite, or
            counts negative reports or another number of reports than its aggregate's
            counts hold.
        """
        value = structure.to_internal(read_report(body, self.partial_type), self.partial_type)
        reports, dropped, aggregate = int(value[0]), int(value[1]), value[2]
        for i, (p, t) in enumerate(zip(aggregate, self.aggregate_type.types)):
            check_finite(p, t, f"aggregation {i} ({self.plan.aggregations[i].uri})")
            _check_rows(p, t, f"aggregation {i} ({self.plan.aggregations[i].uri})")
        if reports < 0 or dropped < 0:
            raise ReportError(
                f"Expected non-negative counts in a partial aggregate, found {reports} reports "
                f"and {dropped} dropouts."
            )
        counted = _count(aggregate, self.aggregate_type)
        if counted is not None and counted != reports:
            raise ReportError(
                f"Expected a partial aggregate of {reports} reports, found one whose counts "
                f"say {counted}.", reason="not_one_client",
            )
        return Partial(reports, dropped, aggregate)

    def encode_partial(self, aggregate: bytes, reports: int, dropped: int) -> bytes:
        """An edge's upload of its aggregate of `reports` reports (`partial_type`)."""
        value = decode(aggregate, self.aggregate_type, None, "an aggregate")
        return serialization.serialize_value(
            {"reports": np.int64(reports), "dropped": np.int64(dropped), "aggregate": value},
            self.partial_type,
        )

    def results(self, aggregate: bytes) -> list[Any]:
        """Each aggregation's result (internal form) from the round's final aggregate."""
        return [acc.result() for acc in self._accumulators(aggregate)]

    def count(self, aggregate: bytes) -> int | None:
        """How many reports an aggregate holds, when its partials count them."""
        value = self._decode(aggregate, self.aggregate_type, None, "an aggregate")
        return _count(value, self.aggregate_type)


    # -- reports taken as they arrive (a large model's round: `streamable`)

    def scan(self) -> ReportScan:
        """A check of one client's report fed its bytes as they arrive (`ReportScan`)."""
        if self.report_layout is None:
            raise ValueError(f"Expected a round whose reports are sums of dense tensors, "
                             f"found one of {self.report_type}; check its reports whole.")
        return ReportScan(self)

    def overflow_limit(self) -> float:
        """The largest sum of the reports' largest magnitudes (`Scanned.max_abs`) that
        cannot overflow the aggregate: the least of the greatest values of the report's
        float dtypes (a float32 total must fit float32). A round whose stored reports'
        sum would exceed it refuses the next one (400 `overflow`), conservatively:
        without reading the stored reports back."""
        floats = [float(np.finfo(lt.dtype).max) for lt in structure.leaf_types(self.report_type)
                  if np.dtype(lt.dtype).kind in "fc"]
        return min(floats, default=math.inf)

    def fold_stored(self, read: Callable[[Any, int, int], bytes], aggregate: Any,
                    shards: Sequence[Any], reports: Sequence[Any]) -> Iterator[Any]:
        """The bytes of the round's aggregate with its shards and stored reports folded
        in, made a slice of a leaf at a time (`serialization.DenseLayout.parts`): each
        leaf's slice is the aggregate's, plus each shard's (aggregates too), plus each
        report's (widened as it is added). `read(handle, start, stop)` gives bytes
        `start:stop` of a stored frame; `aggregate`, `shards` and `reports` are handles.
        Folds in the order of `reports` (float sums depend on it).

        Raises:
          ReportError: `overflow`, if a leaf's sum leaves its range (as `fold_into`).
        """
        assert self.report_layout is not None and self.aggregate_layout is not None
        wide_in = [(h, self.aggregate_layout) for h in (aggregate, *shards)]
        inputs = wide_in + [(h, self.report_layout) for h in reports]
        tops = [float(np.finfo(lt.dtype).max) if np.dtype(lt.dtype).kind == "f" else None
                for lt in self.report_layout.leaves]
        small: dict[int, bytes] = {}  # the small aggregations' leaves, merged once

        def leaf(k: int) -> Iterator[Any]:
            for i, leaves in self._small.items():
                if k in leaves:
                    if k not in small:
                        small.update(self._merge_small(read, i, inputs))
                    yield small.pop(k)
                    return
            yield from self._leaf_sums(read, k, inputs, tops[k])

        return self.aggregate_layout.parts(leaf(k) for k in range(len(tops)))

    def _merge_small(self, read: Callable[[Any, int, int], bytes], i: int,
                     inputs: Sequence[tuple[Any, serialization.DenseLayout]]) -> dict[int, bytes]:
        """Aggregation `i` (a small one: `_layouts`) of the inputs merged in memory by its
        accumulator: the bytes of each of its leaves in the aggregate, by leaf index."""
        leaves = self._small[i]
        acc = self.plan.aggregations[i].make()
        for handle, frame in inputs:
            t = frame.type.types[i]  # type: ignore[attr-defined]
            arrays = []
            for k in leaves:
                dtype = np.dtype(frame.leaves[k].dtype).newbyteorder("<")
                data = read(handle, frame.offsets[k], frame.offsets[k] + frame.lengths[k])
                x = (np.frombuffer(data, np.uint8) != 0 if dtype.kind == "b"
                     else np.frombuffer(data, dtype)).reshape(frame.shapes[k])
                arrays.append(x[()] if x.ndim == 0 else x)
            with np.errstate(all="ignore"):  # checked below
                acc.merge(structure.unflatten(arrays, t))
        if not _within_range(acc, self.aggregate_type.types[i]):
            raise ReportError(f"Expected stored reports whose aggregation {i} stays finite, "
                              "found it overflowing.", reason="overflow")
        wide = self.aggregate_layout.leaves  # type: ignore[union-attr]
        merged = structure.flatten(acc.partial(), self.aggregate_type.types[i])
        return {k: np.ascontiguousarray(x, np.dtype(wide[k].dtype).newbyteorder("<")).tobytes()
                for k, x in zip(leaves, merged)}

    def _leaf_sums(self, read: Callable[[Any, int, int], bytes], k: int,
                   inputs: Sequence[tuple[Any, serialization.DenseLayout]],
                   top: float | None) -> Iterator[Any]:
        """Leaf `k` of the folded aggregate, a slice at a time (see `fold_stored`)."""
        layout = self.aggregate_layout
        assert layout is not None
        wide = np.dtype(layout.leaves[k].dtype).newbyteorder("<")
        size = math.prod(layout.shapes[k])
        for start in range(0, size, bounds_lib.SLICE):
            stop = min(size, start + bounds_lib.SLICE)
            total = np.zeros(stop - start, wide)
            for handle, frame in inputs:
                dtype = np.dtype(frame.leaves[k].dtype).newbyteorder("<")
                at = frame.offsets[k]
                data = read(handle, at + start * dtype.itemsize, at + stop * dtype.itemsize)
                x = np.frombuffer(data, np.uint8 if dtype.kind == "b" else dtype)
                with np.errstate(all="ignore"):  # checked below
                    np.add(total, x, out=total, casting="unsafe")
            if wide.kind in "fc":
                bound = np.finfo(wide).max if top is None else top
                with np.errstate(invalid="ignore"):
                    ok = bool(np.all(np.abs(total) <= bound))
                if not ok:
                    raise ReportError(
                        f"Expected stored reports whose sum stays finite, found leaf {k} of "
                        "the aggregate overflowing; a client must clip its values before "
                        "reporting.", reason="overflow")
            yield total.data.cast("B")

    def empty_parts(self) -> Iterator[Any]:
        """The bytes of `empty()` made a slice at a time, for a streamable round (a large
        model's zero aggregate is never held)."""
        assert self.aggregate_layout is not None

        def zeros(n: int) -> Iterator[bytes]:
            block = bytes(min(n, 8 * bounds_lib.SLICE))
            for start in range(0, n, len(block) or 1):
                yield block[:min(len(block), n - start)]

        return self.aggregate_layout.parts(zeros(n) for n in self.aggregate_layout.lengths)


SMALL_LEAF = 1 << 16  # a scanned report's leaves of at most this many bytes are kept whole
_SUMS = (accumulate.Sum, accumulate.Mean, accumulate.WeightedMean)  # folded a slice at a time


@dataclasses.dataclass(frozen=True)
class Scanned:
    """A client's report checked as it arrived (`ReportScan.result`), not held: its value
    in internal form, each leaf larger than `SMALL_LEAF` bytes a `bounds.Summary` (the
    counts and weights are kept whole), and the largest magnitude of its floats."""

    value: Any
    max_abs: float


class ReportScan(serialization.LayoutScan):
    """Checks one client's report of a streamable round (`Folder.scan`) fed its bytes as
    they arrive, holding one piece of it: its frame as `serialization.LayoutScan` checks
    it (the round's report type, each tensor's dtype, shape and length, the checksum);
    each large tensor summarised (`bounds.Summary`: for the finiteness check and the
    plan's bounds) as it passes. `result` then makes the checks `Folder.check` makes.

    Raises (`feed`, `result`):
      ReportError: `malformed`, or as `Folder.check`.
    """

    def __init__(self, folder: Folder):
        assert folder.report_layout is not None
        super().__init__(folder.report_layout)
        self.folder = folder
        self._leaves: list[bytearray | bounds_lib.Summary] = []
        self._carry = b""  # an element split between two pieces

    def feed(self, data: Any) -> None:
        with self._as_report_error():
            super().feed(data)

    def finish(self) -> None:
        with self._as_report_error():
            super().finish()

    @contextlib.contextmanager
    def _as_report_error(self) -> Iterator[None]:
        try:
            yield
        except errors.SerializationError as e:
            raise ReportError(f"Expected a report of type {self.folder.report_type}: {e}") from e

    def blob_start(self, index: int, length: int) -> None:
        super().blob_start(index, length)
        self._leaves.append(bytearray() if length <= SMALL_LEAF else bounds_lib.Summary())
        self._carry = b""

    def blob_data(self, index: int, data: memoryview) -> None:
        leaf = self._leaves[index]
        if isinstance(leaf, bytearray):
            leaf += data
            return
        dtype = np.dtype(self.layout.leaves[index].dtype).newbyteorder("<")
        if dtype.kind == "b":
            dtype = np.dtype(np.uint8)
        if self._carry:  # the element begun in the last piece
            need = dtype.itemsize - len(self._carry)
            self._carry += bytes(data[:need])
            data = data[need:]
            if len(self._carry) < dtype.itemsize:
                return
            leaf.add(np.frombuffer(self._carry, dtype))
            self._carry = b""
        whole = len(data) - len(data) % dtype.itemsize
        x = np.frombuffer(data[:whole], dtype)
        for start in range(0, x.size, bounds_lib.SLICE):
            leaf.add(x[start:start + bounds_lib.SLICE])
        self._carry = bytes(data[whole:])

    def result(self) -> Scanned:
        """The report, checked as `Folder.check` checks one held whole."""
        self.finish()
        leaves: list[Any] = []
        max_abs = 0.0
        for leaf, lt, shape in zip(self._leaves, self.layout.leaves, self.layout.shapes):
            if isinstance(leaf, bounds_lib.Summary):
                leaves.append(leaf)
                if np.dtype(lt.dtype).kind in "fc" and leaf.finite:
                    max_abs = max(max_abs, leaf.max_abs)
                continue
            dtype = np.dtype(lt.dtype).newbyteorder("<")
            if dtype.kind == "b":
                array = np.frombuffer(bytes(leaf), np.uint8).reshape(shape) != 0
            else:
                array = np.frombuffer(bytes(leaf), dtype).reshape(shape).astype(dtype.newbyteorder("="))
            if dtype.kind in "fc" and array.size:
                with np.errstate(invalid="ignore"):
                    max_abs = max(max_abs, float(np.nan_to_num(np.abs(array)).max()))
            leaves.append(array[()] if array.ndim == 0 else array)
        value = structure.unflatten(leaves, self.folder.report_type)
        folder = self.folder
        for i, partial, t in zip(folder.plain, value, folder.report_type.types):
            _check_one_client(partial, t, f"aggregation {i} ({folder.plan.aggregations[i].uri})")
        return Scanned(value, max_abs)


@dataclasses.dataclass(frozen=True)
class Partial:
    """An edge aggregator's checked upload for a round (`Folder.check_partial`): the
    aggregate of `reports` reports of its clients (internal form of the round's
    `aggregate_type`), and how many of its clients dropped out."""

    reports: int
    dropped: int
    value: Any


def partial_type(aggregate_type: types.StructType) -> types.StructType:
    """The type of an edge's partial upload for a round whose aggregate is of
    `aggregate_type`: `<reports=int64,dropped=int64,aggregate=...>`."""
    count = types.TensorType(np.int64, [])
    return types.StructType([("reports", count), ("dropped", count), ("aggregate", aggregate_type)])


def _count(value: Any, t: types.StructType) -> int | None:
    """How many reports an aggregate (internal form) holds, when its partials count them."""
    for partial, pt in zip(value, t.types):
        if isinstance(pt, types.StructType) and "count" in pt.names:
            return int(partial[pt.names.index("count")])
    return None


def _within_range(acc: Any, t: types.Type) -> bool:
    """Whether an accumulator's running values are finite and, for a sum, fit the dtype
    of the values it sums (a float32 sum's float64 total overflows its float32 result
    long before it overflows itself). Two passes over each leaf (its min and max), no
    copies: this runs for every report."""
    leaves = [np.asarray(x) for x in structure.flatten(acc.partial(), t)]
    bounds: list[float | None] = [None] * len(leaves)
    if type(acc) is accumulate.Sum:  # its partial has its values' leaves, widened
        bounds = [float(np.finfo(lt.dtype).max) if np.dtype(lt.dtype).kind == "f" else None
                  for lt in acc.leaf_types]
    for leaf, bound in zip(leaves, bounds):
        if leaf.size == 0 or leaf.dtype.kind not in "fc":
            continue
        if leaf.dtype.kind == "c":
            if not np.isfinite(leaf).all():
                return False
            continue
        top = float(np.finfo(leaf.dtype).max) if bound is None else bound
        lo, hi = leaf.min(), leaf.max()
        if not (-top <= lo and hi <= top):  # NaN fails too
            return False
    return True


def read_report(report: bytes, t: types.Type, unknown: int = 1 << 20) -> Any:
    """Decodes one client's report of type `t` (untrusted bytes) with explicit limits:
    at most the bytes `t` can hold (`max_bytes(t, unknown)`, plus 1 MiB of framing),
    exactly type `t`.
    Returns it as `deserialize_value` gives it (Python containers of NumPy arrays).

    Raises:
      ReportError: if it is too large (`too_large`) or not a value of type `t` (`malformed`).
    """
    limit = max_bytes(t, unknown)
    if len(report) > limit + (1 << 20):
        raise ReportError(
            f"Expected a report of at most {limit} bytes of values, found {len(report)} bytes.",
            reason="too_large",
        )
    return decode(report, t, limit, "a report")


def decode(data: bytes, t: types.Type, limit: int | None, what: str) -> Any:
    """`deserialize_value(data)` of type `t` (at most `limit` tensor bytes), or a
    `ReportError` naming `what` was expected. Its tensors are views of `data`, not
    copies: what is decoded here is checked and folded, never kept or written to (an
    accumulator copies what it merges first), so a report is held once."""
    try:
        return serialization.deserialize_value(data, expected_type=t, max_bytes=limit,
                                               copy=False)
    except serialization.SerializationError as e:
        raise ReportError(f"Expected {what} of type {t}: {e}") from e


def check_bounds(bounds: bounds_lib.Bounds, leaves: dict[str, Any]) -> None:
    """`bounds.check(leaves)`, its refusal a `ReportError` (`out_of_bounds`)."""
    try:
        bounds.check(leaves)
    except bounds_lib.OutOfBounds as e:
        raise ReportError(str(e), reason=e.reason) from e


def check_finite(value: Any, t: types.Type, where: str) -> None:
    """Every float of `value` (internal form, of type `t`) is finite.

    Raises:
      ReportError: `non_finite`, naming `where` the value was found.
    """
    for leaf in structure.flatten(value, t):
        if isinstance(leaf, bounds_lib.Summary):  # a leaf checked as it arrived
            if not leaf.finite:
                raise ReportError(
                    f"Expected finite values in {where}, found NaN or infinity; a client must "
                    "exclude or clip non-finite updates before reporting.",
                    reason="non_finite",
                )
            continue
        arr = np.asarray(leaf)
        if arr.dtype.kind in "fc" and not all(  # a slice at a time: no model-sized mask
                np.all(np.isfinite(part)) for part in bounds_lib.slices(arr)):
            raise ReportError(
                f"Expected finite values in {where}, found NaN or infinity; a client must "
                "exclude or clip non-finite updates before reporting.",
                reason="non_finite",
            )


def _check_one_client(partial: Any, t: types.Type, where: str) -> None:
    """Every float is finite; counts say one client; weights are non-negative."""
    check_finite(partial, t, where)
    if not isinstance(t, types.StructType):
        return
    fields = dict(zip(t.names, partial))
    if "count" in fields and int(fields["count"]) != 1:
        raise ReportError(
            f"Expected one client's contribution in {where}, found a count of {int(fields['count'])}.",
            reason="not_one_client",
        )
    _check_rows(partial, t, where)
    if "seen" in fields and not bool(fields["seen"]):
        raise ReportError(f"Expected one client's value in {where}, found none.", "not_one_client")
    if "weight" in fields and not float(fields["weight"]) >= 0:
        raise ReportError(
            f"Expected a non-negative weight in {where}, found {float(fields['weight'])}.",
            reason="not_one_client",
        )


def _check_rows(partial: Any, t: types.Type, where: str) -> None:
    """A `federated_aggregate` partial (`<value, count>`) whose value holds growing
    buffers (unknown dimensions) holds at most one row per client it counts: a client
    cannot weigh more than one value in a median or a trimmed mean.

    Raises:
      ReportError: `not_one_client`, naming `where` and the sizes found.
    """
    if not isinstance(t, types.StructType) or set(t.names) != {"value", "count"}:
        return
    fields = dict(zip(t.names, partial))
    count = int(fields["count"])
    value_t = t.types[t.names.index("value")]
    for leaf, lt in zip(structure.flatten(fields["value"], value_t), structure.leaf_types(value_t)):
        shape = np.shape(leaf)
        for d, size in zip(lt.shape, shape):
            if d is None and size > count:
                raise ReportError(
                    f"Expected at most one row per client in {where} ({count} counted), "
                    f"found a buffer of shape {list(shape)}.",
                    reason="not_one_client",
                )


def max_bytes(t: types.Type, unknown: int = 1 << 20) -> int:
    """An upper bound on the tensor bytes of a value of type `t`, each unknown dimension
    at most `unknown` (a client's report: 1, its one row of a growing buffer)."""
    total = 0
    for lt in structure.leaf_types(t):
        dims = [unknown if d is None else d for d in lt.shape]
        total += math.prod(dims) * np.dtype(lt.dtype).itemsize
    return total


# -- results a slice at a time (driver)


def results_sliced(folder: Folder, aggregate: bytes | bytearray, reuse: bool = False) -> list[Any]:
    """`folder.results(aggregate)`, bit for bit, without its model-sized copies.

    `Folder.results` merges the aggregate into accumulators (a copy of each wide total)
    and finishes them whole (a wide quotient, then the result): for a float32 model's
    average, two float64 arrays each twice the model's size besides the aggregate. Here
    a sum's result (`_SUMS`: its total, total / count or total / weight, in its values'
    dtype) is made `RESULT_SLICE` elements at a time from the aggregate's own bytes by
    the accumulator's formula, so each element is the same; other aggregations, and
    leaves of at most `RESULT_SLICE` elements, are finished as the accumulators do.

    With `reuse`, `aggregate` is a bytearray that the caller gives up: each large result
    is written over the aggregate's bytes from where its total was read (a result is
    never wider than its total, so a slice written never reaches bytes still to be
    read), the bytearray is cut to the results' bytes, and those results are views of
    it. The results then take no memory beyond the aggregate's, and keep only their own
    share of it (a float32 model's average: half). `aggregate` is not to be read after.

    Raises:
      ReportError: as `Folder.results`, for bytes that are not an aggregate of the round.
    """
    made, placed, end = _results_sliced(folder, aggregate, reuse)
    if placed:  # no view of the aggregate outlived `_results_sliced`'s frame
        assert isinstance(aggregate, bytearray)
        del aggregate[end:]  # less than half left: the allocation shrinks, its pages return
        for leaves, k, dtype, shape, offset in placed:
            leaves[k] = np.frombuffer(aggregate, dtype, math.prod(shape), offset).reshape(shape)
    return [r.result() if isinstance(r, _SumResult) else r for r in made]


@dataclasses.dataclass
class _SumResult:
    """A sum's result whose leaves are being made (`results_sliced`)."""

    member: types.Type
    leaves: list[Any]

    def result(self) -> Any:
        return structure.unflatten(self.leaves, self.member)


# Elements of a result made at a time: its temporaries (the wide piece's quotient, the
# piece in the result's dtype) stay under the sizes that glibc's malloc, once it has
# freed one, keeps in the heap for the next (a few MiB a round, held by the process).
RESULT_SLICE = 1 << 17

# Where a large result starts: XLA on the CPU takes a NumPy argument at such an address
# as it is, and copies one at another (NumPy aligns large arrays to 16 bytes).
_ALIGN = chunks.ALIGNMENT
_Placed = tuple[list[Any], int, np.dtype, tuple[int, ...], int]


def _results_sliced(
    folder: Folder, aggregate: bytes | bytearray, reuse: bool
) -> tuple[list[Any], list[_Placed], int]:
    """The work of `results_sliced`, in a frame of its own so that no view of the
    aggregate outlives it: each aggregation's result (`_SumResult` for a sum), the
    results written in place (their leaves' list, index, dtype, shape and offset in the
    aggregate), and where the last of them ends."""
    data: Any = aggregate  # bytes-like: a bytearray is read in place as bytes are
    value = Folder._decode(data, folder.aggregate_type, None, "an aggregate")
    base = np.frombuffer(aggregate, np.uint8).ctypes.data
    made: list[Any] = []
    large: list[tuple[np.ndarray, np.dtype, Callable[[Any, np.dtype], Any], list[Any], int]] = []
    for agg, partial, t in zip(folder.plan.aggregations, value, folder.aggregate_type.types):
        acc = agg.make()
        if not isinstance(acc, accumulate.Sum) or type(acc) not in _SUMS:
            if reuse:  # its result may be a view of bytes that a large result overwrites
                partial = copy.deepcopy(partial)
            acc.merge(partial)
            made.append(acc.result())
            continue
        finish = finisher(acc, partial)
        if finish is None:  # a mean of no reports: its empty value, as `Mean.result` gives
            made.append(acc.result())
            continue
        total, total_t = (partial, t) if type(acc) is accumulate.Sum else (
            partial[0], t.types[0])  # type: ignore[attr-defined]  # <total, count|weight>
        pending = _SumResult(acc.member, [])
        for x, lt in zip(structure.flatten(total, total_t), acc.leaf_types):
            x = np.asarray(x)
            if x.size <= RESULT_SLICE:  # whole, exactly as the accumulator does
                pending.leaves.append(finish(np.array(x, x.dtype), np.dtype(lt.dtype)))
                continue
            pending.leaves.append(None)  # made below, once every small value was read
            large.append((x, np.dtype(lt.dtype), finish, pending.leaves, len(pending.leaves) - 1))
        made.append(pending)
    placed: list[_Placed] = []
    at = 0  # where the next result written in place may begin
    # in the order of their bytes: a result written never reaches a total still unread
    for x, dtype, finish, leaves, k in sorted(large, key=lambda job: job[0].ctypes.data):
        offset = at + (-(base + at) % _ALIGN)
        out: np.ndarray
        if reuse and offset <= x.ctypes.data - base and dtype.itemsize <= x.itemsize:
            out = np.frombuffer(aggregate, dtype, x.size, offset)
            placed.append((leaves, k, dtype, x.shape, offset))
            at = offset + out.nbytes
        else:
            out = chunks.aligned_empty((x.size,), dtype)
            leaves[k] = out.reshape(x.shape)
        flat = x.reshape(-1)
        for start in range(0, x.size, RESULT_SLICE):
            # the piece is read whole before it is written: its bytes end before the
            # source's bytes still to be read begin
            piece = slice(start, start + RESULT_SLICE)
            out[piece] = finish(flat[piece], dtype)
    return made, placed, at


def sliced_sum(acc: Any) -> bool:
    """Whether `results_sliced` makes the result of an aggregation whose accumulator is
    `acc` a slice at a time, by `finisher`'s formula: a `federated_sum`, `_mean` or
    `_weighted_mean` (the driver's `results` makes it as the aggregate streams in)."""
    return isinstance(acc, accumulate.Sum) and type(acc) in _SUMS


def finisher(acc: Any, partial: Any) -> Callable[[Any, np.dtype], Any] | None:
    """`(wide total, dtype) -> result` of a sum, by `acc`'s `result` formula with the
    divisor its `merge(partial)` would hold (elementwise: a piece of the total gives
    that piece of the result); None for a mean of no reports (`result` is then empty).
    Only `partial[1]` (a mean's count, a weighted mean's weight) is read."""
    if type(acc) is accumulate.Sum:
        return lambda total, dtype: total.astype(dtype)
    if type(acc) is accumulate.Mean:
        count = int(partial[1])
        if count == 0:
            return None
        return lambda total, dtype: (total / count).astype(dtype)
    weight = 0.0 + float(partial[1])  # (0.0 + -0.0 is 0.0, as the accumulator's running total)

    def weighted(total: Any, dtype: np.dtype) -> Any:
        with np.errstate(invalid="ignore", divide="ignore"):
            return (total / weight).astype(dtype)

    return weighted
