"""A batch of buffered-session reports, as an edge aggregator forwards them to the root.

A batch is one upload carrying `n` reports of one session, each with the model version
its client trained (`edge/sessions.py` explains why an edge forwards the reports
themselves rather than their sum). The bytes are

    b"FLB1"  n: uint32  then n times:  version: int64  length: uint64  report bytes

little-endian, each report exactly as its client uploaded it (the binary value format
of the plan's report type). `encode` is deterministic: the same reports in the same
order give the same bytes, so a resent batch has the same digest (a replay).
`decode` reads untrusted bytes with explicit limits and decodes nothing inside the
reports (the session's plan checks each one).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from fedlang.deploy.plans import folding

MAGIC = b"FLB1"
_COUNT = struct.Struct("<I")
_ITEM = struct.Struct("<qQ")


def encode(items: Sequence[tuple[int, bytes]]) -> bytes:
    """The batch of `items`, each (version, report bytes), in order.

    Example:
      >>> decode(encode([(0, b"a"), (1, b"bc")]), 2, 2)
      [(0, b'a'), (1, b'bc')]
    """
    parts = [MAGIC, _COUNT.pack(len(items))]
    for version, report in items:
        parts += [_ITEM.pack(int(version), len(report)), bytes(report)]
    return b"".join(parts)


def max_bytes(max_reports: int, max_report_bytes: int) -> int:
    """The largest batch of at most `max_reports` reports of `max_report_bytes` each."""
    return len(MAGIC) + _COUNT.size + max_reports * (_ITEM.size + max_report_bytes)


def decode(body: bytes, max_reports: int, max_report_bytes: int) -> list[tuple[int, bytes]]:
    """The (version, report bytes) items of a batch.

    Raises:
      ReportError: `malformed` (not a batch, truncated, trailing bytes, no report, a
        negative version) or `too_large` (more than `max_reports` reports, or a report
        above `max_report_bytes`).
    """
    view = memoryview(body)
    head = len(MAGIC) + _COUNT.size
    if len(view) < head or bytes(view[:len(MAGIC)]) != MAGIC:
        raise folding.ReportError(
            f"Expected a batch of reports (starting {MAGIC!r}), found {bytes(view[:8])!r}.",
            reason="malformed",
        )
    (n,) = _COUNT.unpack_from(view, len(MAGIC))
    if not 1 <= n <= max_reports:
        raise folding.ReportError(
            f"Expected 1 to {max_reports} reports in a batch (the session's buffer), found {n}.",
            reason="too_large" if n > max_reports else "malformed",
        )
    items, at = [], head
    for i in range(n):
        if at + _ITEM.size > len(view):
            raise folding.ReportError(f"Expected {n} reports in the batch, found {i}.",
                                      reason="malformed")
        version, length = _ITEM.unpack_from(view, at)
        at += _ITEM.size
        if version < 0:
            raise folding.ReportError(
                f"Expected a model version >= 0 for report {i} of the batch, found {version}.",
                reason="malformed",
            )
        if length > max_report_bytes:
            raise folding.ReportError(
                f"Expected at most {max_report_bytes} bytes in report {i} of the batch (the "
                f"plan's report type), found {length}.", reason="too_large",
            )
        if at + length > len(view):
            raise folding.ReportError(f"Expected {length} bytes of report {i} of the batch, "
                                      f"found {len(view) - at}.", reason="malformed")
        items.append((int(version), bytes(view[at:at + length])))
        at += length
    if at != len(view):
        raise folding.ReportError(
            f"Expected the batch to end after its {n} reports, found {len(view) - at} more "
            "bytes.", reason="malformed",
        )
    return items
