"""The batch an edge forwards: deterministic bytes, and untrusted bytes read with limits."""

import pytest

from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.deploy.plans import folding


def test_a_batch_reads_back_and_the_same_reports_give_the_same_bytes():
    items = [(0, b"abc"), (3, b""), (2, b"\x00" * 10)]
    body = buffered_plan.encode_batch(items)
    assert buffered_plan.decode_batch(body, 3, 10) == items
    assert buffered_plan.encode_batch(list(items)) == body
    assert len(body) == 4 + 4 + 3 * 16 + 13  # magic, count, (version, length) each, bytes


@pytest.mark.parametrize("body, reason, match", [
    (b"junk", "malformed", "a batch of reports"),
    (buffered_plan.encode_batch([]), "malformed", "1 to 2 reports"),
    (buffered_plan.encode_batch([(0, b"a")] * 3), "too_large", "1 to 2 reports"),
    (buffered_plan.encode_batch([(0, b"abcd")]), "too_large", "at most 3 bytes"),
    (buffered_plan.encode_batch([(-1, b"a")]), "malformed", "version >= 0"),
    (buffered_plan.encode_batch([(0, b"abc")])[:-1], "malformed", "3 bytes of report 0"),
    (buffered_plan.encode_batch([(0, b"a")]) + b"x", "malformed", "1 more bytes"),
    (buffered_plan.encode_batch([(0, b"a"), (0, b"b")])[:22], "malformed", "2 reports in the batch"),
])
def test_a_bad_batch_is_refused_with_its_reason(body, reason, match):
    with pytest.raises(folding.ReportError, match=match) as e:
        buffered_plan.decode_batch(body, 2, 3)
    assert e.value.reason == reason
