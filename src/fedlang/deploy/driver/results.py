"""A closed round's results made as its aggregate streams in: the driver holds no
model-sized aggregate.

A float32 model's average travels in the aggregate as float64 totals (2 x S): held whole
and finished (`folding.results_sliced`), it is the driver's peak with the server update's
new weights (3 x S over the model it holds). Here each large total of a sum
(`folding.sliced_sum`: `federated_sum`, `_mean`, `_weighted_mean`) becomes its result a
piece at a time as its bytes arrive, by the accumulator's formula (`folding.finisher`),
into an aligned array of the result's dtype (`chunks.aligned_empty`, which XLA on the
CPU takes without a copy): the results are the only model-sized memory the round adds.

The aggregate's frame is the round's dense layout (`serialization.dense_layout` of
`Folder.aggregate_type`: each tensor's place follows from the type). A mean's divisor
(`<total, count|weight>`) comes after its totals, so it is read first with `Range`
(`Admin.aggregate_part`); the frame is then read in order (`Admin.aggregate_into`, which
resumes a cut transfer) by a `serialization.LayoutScan` that checks it as the server's
intake checks a report (header, each tensor's length, the checksum), makes the large
results, keeps the small tensors, and checks that the divisors it passes are those read
first. Each result is bit for bit what `folding.results_sliced` makes of the whole
aggregate. A round whose aggregate is not dense, holds no large total, or whose server
does not answer `Range` is read whole (`read` returns None).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from fedlang.core import errors, serialization, structure, types
from fedlang.deploy.driver import admin as admin_lib
from fedlang.deploy.plans import folding
from fedlang.runtime import accumulate, chunks

GAP = 1 << 16  # bytes between two divisors read in one `Range` request rather than two


@dataclasses.dataclass
class _Large:
    """A large tensor of a sum's total, made into its result as its bytes pass."""

    wide: np.dtype  # the total's dtype (little-endian, as the frame holds it)
    dtype: np.dtype  # the result's
    shape: tuple[int, ...]
    aggregation: int
    out: np.ndarray | None = None  # flat and aligned; None: a mean of no reports
    finish: Callable[[Any, np.dtype], Any] | None = None
    done: int = 0  # elements made


@dataclasses.dataclass(frozen=True)
class _Aggregation:
    """Aggregation `index` of the round: its accumulator, and the aggregate's leaves
    that hold its partial (`leaves`; for a mean, the last is the divisor)."""

    index: int
    acc: Any
    type: types.Type
    leaves: range
    sum: bool  # made as `folding.sliced_sum`

    @property
    def divisor(self) -> int | None:
        """The leaf of a mean's count or weight (None for a plain sum or another kind)."""
        if self.sum and type(self.acc) is not accumulate.Sum:  # <total, count|weight>
            return self.leaves.stop - 1
        return None

    @property
    def total(self) -> range:
        """The leaves of a sum's total."""
        return self.leaves if self.divisor is None else self.leaves[:-1]


class Reading:
    """How one round's results are made from its aggregate as it streams in (`read`):
    for one read (its accumulators are merged into by `results`).

    Args:
      folder: the round's `folding.Folder`.

    Raises:
      TypeError: the aggregate is not dense tensors of known shape (`dense_layout`): it
        is read whole.
    """

    def __init__(self, folder: folding.Folder):
        self.folder = folder
        self.layout = serialization.dense_layout(folder.aggregate_type)
        self.aggregations: list[_Aggregation] = []
        self.large: dict[int, _Large] = {}  # leaf -> its result in the making
        first = 0
        for i, (a, t) in enumerate(zip(folder.plan.aggregations, folder.aggregate_type.types)):
            acc = a.make()
            leaves = range(first, first + len(structure.leaf_types(t)))
            first = leaves.stop
            agg = _Aggregation(i, acc, t, leaves, folding.sliced_sum(acc))
            self.aggregations.append(agg)
            if not agg.sum:
                continue
            for k, lt in zip(agg.total, agg.acc.leaf_types):
                wide = np.dtype(self.layout.leaves[k].dtype).newbyteorder("<")
                shape = self.layout.shapes[k]
                # as `results_sliced`: a total of at most `RESULT_SLICE` elements is
                # finished whole (its result a NumPy scalar where that gives one)
                if math.prod(shape) > folding.RESULT_SLICE and wide.kind in "iufc":
                    self.large[k] = _Large(wide, np.dtype(lt.dtype), shape, i)

    @property
    def streams(self) -> bool:
        """Whether any result is large enough to be made as it streams in."""
        return bool(self.large)

    def divisors(self) -> list[int]:
        """The leaves to read before the frame: the divisors of means with a large total."""
        return sorted({agg.divisor for agg in self.aggregations
                       if agg.divisor is not None
                       and any(self.large.get(k) for k in agg.total)})

    def spans(self, leaves: list[int]) -> list[tuple[int, int]]:
        """The byte ranges of the frame that hold `leaves`, those within `GAP` bytes of
        each other joined (the divisors of means of small tensors: one request)."""
        offsets, lengths = self.layout.offsets, self.layout.lengths
        spans: list[tuple[int, int]] = []
        for k in leaves:
            start, stop = offsets[k], offsets[k] + lengths[k]
            if spans and start - spans[-1][1] <= GAP:
                spans[-1] = (spans[-1][0], stop)
            else:
                spans.append((start, stop))
        return spans

    def prepare(self, first: dict[int, bytes]) -> None:
        """Given the divisors' bytes read first (by leaf), sets each large result's
        formula and array (none for a mean of no reports: its result is empty)."""
        for agg in self.aggregations:
            for k in agg.total:
                large = self.large.get(k)
                if large is None:
                    continue
                partial = None if agg.divisor is None else (
                    None, _decode_leaf(first[agg.divisor], self.layout.leaves[agg.divisor]))
                large.finish = folding.finisher(agg.acc, partial)
                if large.finish is not None and large.out is None:
                    large.out = chunks.aligned_empty((math.prod(large.shape),), large.dtype)

    def results(self, scan: ResultsScan) -> list[Any]:
        """Each aggregation's result (internal form), as `folding.results_sliced` makes it,
        from what `scan` made and kept of the whole frame."""
        made: list[Any] = []
        layout = self.layout
        for agg in self.aggregations:
            acc = agg.acc
            if not agg.sum:  # merged whole, as the accumulators do
                held = [[scan.held[k]] for k in agg.leaves]
                sub = serialization.dense_layout(agg.type)
                frame = b"".join(bytes(p) for p in sub.parts(held))
                acc.merge(structure.to_internal(
                    folding.decode(frame, agg.type, None, "an aggregate"), agg.type))
                made.append(acc.result())
                continue
            divisor = None if agg.divisor is None else (
                None, _decode_leaf(scan.held[agg.divisor], layout.leaves[agg.divisor]))
            finish = folding.finisher(acc, divisor)
            if finish is None:  # a mean of no reports: its empty value
                made.append(acc.result())
                continue
            leaves = []
            for k, lt in zip(agg.total, acc.leaf_types):
                large = self.large.get(k)
                if large is not None:
                    assert large.out is not None and large.done == large.out.size
                    leaves.append(large.out.reshape(large.shape))
                    continue
                x = np.asarray(_decode_leaf(scan.held[k], layout.leaves[k]))
                leaves.append(finish(np.array(x, x.dtype), np.dtype(lt.dtype)))
            made.append(structure.unflatten(leaves, acc.member))
        return made


class ResultsScan(serialization.LayoutScan):
    """Reads one round's aggregate as it arrives (`Reading`), holding none of its large
    totals: its frame checked as `serialization.LayoutScan` checks it; each large total
    made into its result a piece at a time; the other tensors kept; the divisors read
    first (`first`) checked against those it passes.

    Raises (`feed`, `finish`):
      folding.ReportError: the bytes are not an aggregate of the round, or not the one
        whose divisors were read first.
    """

    def __init__(self, reading: Reading, first: dict[int, bytes], size: int | None):
        super().__init__(reading.layout)
        self.reading, self.first = reading, first
        self.held: dict[int, bytearray] = {}
        self._carry = b""  # an element split between two pieces
        t = reading.folder.aggregate_type
        if size is not None and size != reading.layout.size:
            raise folding.ReportError(
                f"Expected an aggregate of type {t} in {reading.layout.size} bytes, found "
                f"{size} bytes.")

    def feed(self, data: Any) -> None:
        with self._as_report_error():
            super().feed(data)

    def finish(self) -> None:
        with self._as_report_error():
            super().finish()
        for k, want in self.first.items():
            if bytes(self.held[k]) != want:
                raise folding.ReportError(
                    f"Expected the aggregate's tensor {k} ({self.layout.leaves[k]}) as it was "
                    "read first, found other bytes: the aggregate changed while it was read; "
                    "read the round's results again.")

    @contextlib.contextmanager
    def _as_report_error(self) -> Iterator[None]:
        try:
            yield
        except errors.SerializationError as e:
            raise folding.ReportError(
                f"Expected an aggregate of type {self.reading.folder.aggregate_type}: {e}") from e

    def blob_start(self, index: int, length: int) -> None:
        super().blob_start(index, length)
        self._carry = b""
        large = self.reading.large.get(index)
        if large is None:
            self.held[index] = bytearray()
        else:
            large.done = 0  # (a transfer started over: made again)

    def blob_data(self, index: int, data: memoryview) -> None:
        large = self.reading.large.get(index)
        if large is None:
            self.held[index] += data
            return
        if large.out is None:  # a mean of no reports: its totals are not read
            return
        item = large.wide.itemsize
        if self._carry:  # the element begun in the last piece
            need = item - len(self._carry)
            self._carry += bytes(data[:need])
            data = data[need:]
            if len(self._carry) < item:
                return
            self._make(large, np.frombuffer(self._carry, large.wide))
            self._carry = b""
        whole = len(data) - len(data) % item
        if whole:
            x = np.frombuffer(data[:whole], large.wide)
            for start in range(0, x.size, folding.RESULT_SLICE):
                self._make(large, x[start:start + folding.RESULT_SLICE])
        self._carry = bytes(data[whole:])

    @staticmethod
    def _make(large: _Large, total: np.ndarray) -> None:
        assert large.out is not None and large.finish is not None
        large.out[large.done:large.done + total.size] = large.finish(total, large.dtype)
        large.done += total.size


def read(admin: admin_lib.Admin, round_id: int, folder: folding.Folder) -> list[Any] | None:
    """The results of closed round `round_id` (each aggregation's, internal form: what
    `folding.results_sliced(folder, aggregate)` gives), made as its aggregate streams in
    (see the module docstring); None when the aggregate is to be read whole instead (not
    dense, no large total, or `Range` not answered).

    Raises:
      folding.ReportError: the bytes are not an aggregate of the round.
      what `Admin.aggregate_into` raises.
    """
    try:
        reading = Reading(folder)
    except TypeError:
        return None
    if not reading.streams:
        return None
    first: dict[int, bytes] = {}
    for start, stop in reading.spans(reading.divisors()):
        part = admin.aggregate_part(round_id, start, stop)
        if part is None or part[1] != reading.layout.size:
            return None  # read whole: it says what is wrong with it, if anything
        for k in reading.divisors():
            at = reading.layout.offsets[k]
            if start <= at < stop:
                first[k] = part[0][at - start:at - start + reading.layout.lengths[k]]
    reading.prepare(first)
    scan = admin.aggregate_into(round_id, lambda size: ResultsScan(reading, first, size))
    scan.finish()
    return reading.results(scan)


def _decode_leaf(data: Any, t: types.TensorType) -> Any:
    """One tensor of the aggregate from its bytes, as `deserialize_value` reads it."""
    layout = serialization.dense_layout(t)
    frame = b"".join(bytes(p) for p in layout.parts([[bytes(data)]]))
    return structure.to_internal(folding.decode(frame, t, None, "an aggregate"), t)
