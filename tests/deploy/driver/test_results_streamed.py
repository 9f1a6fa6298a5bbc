"""A round's results made by the driver as its aggregate streams in (`driver.results`):
bit for bit what `folding.results_sliced` makes of the whole aggregate, a cut transfer
resumed, a corrupted or changed aggregate refused, and no model-sized aggregate held."""

import http.server
import socket
import threading
import tracemalloc

import jax
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import serialization, structure
from fedlang.deploy.driver import admin as admin_lib
from fedlang.deploy.driver import results as results_lib
from fedlang.deploy.driver import rounds as rounds_lib
from fedlang.deploy.plans import folding

from ..conftest import capture
from ..test_driver_memory import _aggregate, _sums, _train, _wide_fed_avg

BIG = 3 * folding.RESULT_SLICE + 12_345  # elements: several slices, the last partial
ROUND = 7
PATH = f"/v1/admin/rounds/{ROUND}/aggregate"


def _more_dtypes(n):
    """Sums and means of float16, complex64, int64 and uint8 tensors, and an int16 min."""

    @fl.federated_computation(
        fl.type_at_clients(fl.TensorType(np.float16, [n])),
        fl.type_at_clients(fl.TensorType(np.complex64, [n])),
        fl.type_at_clients(fl.TensorType(np.int64, [n])),
        fl.type_at_clients(fl.TensorType(np.float32)),
        fl.type_at_clients(fl.TensorType(np.uint8, [n])),
        fl.type_at_clients(fl.TensorType(np.int16, [4])),
    )
    def many(h, c, i, w, u, b):
        return (fl.federated_sum(h), fl.federated_mean(h), fl.federated_mean(h, w),
                fl.federated_sum(c), fl.federated_mean(c), fl.federated_sum(i),
                fl.federated_sum(u), fl.federated_min(b), fl.federated_mean(w))

    d = deploy.client_data
    # the values are drawn (the point is how results stream): the leaves no bound is derived
    # for are accepted finite, declared as a user would
    bounds = deploy.ReportBounds(unbounded=("[0]", "[1].total", "[1].count", "[3]", "[4].total",
                                            "[4].count", "[5]", "[6]", "[7].best", "[8].total",
                                            "[8].count"))
    plan, _ = capture(many, d("h"), d("c"), d("i"), d("w"), d("u"), d("b"), bounds=bounds)
    return folding.Folder(plan)


def _complex_aggregate(folder, seed, count, weight):
    """`_aggregate` with the complex totals' imaginary parts drawn too."""
    value = serialization.deserialize_value(_aggregate(folder, seed, count, weight),
                                            expected_type=folder.aggregate_type)
    rng = np.random.default_rng(seed + 100)
    leaves = structure.flatten(structure.to_internal(value, folder.aggregate_type),
                               folder.aggregate_type)
    leaves = [x + 1j * rng.normal(scale=1e3, size=np.shape(x)) if np.iscomplexobj(x) else x
              for x in leaves]
    internal = structure.unflatten(leaves, folder.aggregate_type)
    python = structure.to_python(internal, folder.aggregate_type)
    return serialization.serialize_value(python, folder.aggregate_type)


class _AggregateServer:
    """A real HTTP server of one round's aggregate at the admin route, answering `Range`
    (`bytes=START-END`, `bytes=START-`) with 206 as the task store's server does
    (`routing.binary`), in pieces of an odd size. It can cut its first `cuts` answers
    from the frame's start after `cut_at` bytes (as a dropped link would), ignore ranges,
    or those to the end only (`resumes=False`: a resumed transfer starts over), and serve
    `then` in place of `value` once it answered a range of the frame."""

    def __init__(self, value, *, cut_at=0, cuts=0, ranges=True, resumes=True, then=None,
                 piece=65_537):
        self.value, self.then = memoryview(value), then
        self.cut_at, self.cuts, self.ranges, self.piece = cut_at, cuts, ranges, piece
        self.resumes = resumes
        self.asked = []  # the Range header of each request
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                assert self.path == PATH and self.headers["Authorization"] == "Bearer admin"
                asked = self.headers.get("Range")
                outer.asked.append(asked)
                value = outer.value
                start, stop = 0, len(value)
                if asked and outer.ranges and (outer.resumes or not asked.endswith("-")):
                    first, _, last = asked[len("bytes="):].partition("-")
                    start, stop = int(first), int(last) + 1 if last else len(value)
                self.send_response(206 if (start, stop) != (0, len(value)) else 200)
                if (start, stop) != (0, len(value)):
                    self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(value)}")
                    if outer.then is not None and stop < len(value):
                        outer.value = memoryview(outer.then)
                self.send_header("Content-Length", str(stop - start))
                self.end_headers()
                end = stop
                if start == 0 and outer.cuts:
                    outer.cuts -= 1
                    end = outer.cut_at
                try:
                    for at in range(start, end, outer.piece):
                        self.wfile.write(value[at:min(end, at + outer.piece)])
                except (BrokenPipeError, ConnectionResetError):  # a reader that stopped
                    self.close_connection = True
                    return
                if end != stop:
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)  # cut mid-body
                    self.close_connection = True

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _read(server, folder):
    admin = admin_lib.Admin(server.url, "admin", backoff=(0.01, 0.05), patience=10)
    try:
        return results_lib.read(admin, ROUND, folder)
    finally:
        admin.close()
        server.close()


def _same_results(got, want):
    assert [type(r) for r in got] == [type(r) for r in want]
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert type(g) is type(w)
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()


def _large(results):
    return [x for x in jax.tree.leaves(results) if np.size(x) > folding.RESULT_SLICE]


@pytest.mark.parametrize("count,weight", [(3, 2.5), (0, 0.0), (7, -0.0)])
def test_results_made_as_the_aggregate_streams_in_are_results_sliced_bit_for_bit(count, weight):
    # arrange: sums of float32, int32 and float64, means, a weighted mean (a zero weight
    # gives NaN; a mean of no reports is empty), a max and small sums, several slices
    # a tensor with the last partial
    folder = _sums(BIG)
    data = _aggregate(folder, seed=count, count=count, weight=weight)
    server = _AggregateServer(data)

    # act
    got = _read(server, folder)

    # assert: what the whole aggregate gives, its divisors read first, the frame once
    _same_results(got, folding.results_sliced(folder, bytearray(data), reuse=True))
    _same_results(got, folder.results(data))
    # the three means' divisors (count, weight, count) first, then the frame once
    assert len(server.asked) == 4 and server.asked[-1] is None
    assert all(a.startswith("bytes=") for a in server.asked[:-1])
    large = _large(got)
    assert len(large) == 5
    if count:  # made in arrays XLA takes as they are (a mean of no reports: its empty value)
        assert all(x.ctypes.data % 64 == 0 for x in large)


@pytest.mark.parametrize("count,weight", [(2, 0.75), (5, 0.0)])
def test_results_of_more_dtypes_are_results_sliced_bit_for_bit(count, weight):
    folder = _more_dtypes(BIG)
    data = _complex_aggregate(folder, seed=count, count=count, weight=weight)

    got = _read(_AggregateServer(data), folder)

    _same_results(got, folding.results_sliced(folder, data))
    assert len(_large(got)) == 7


@pytest.mark.parametrize("resumes", [True, False])
def test_a_transfer_cut_part_way_resumes_and_makes_the_same_results(resumes):
    # arrange: the frame cut once in the middle of an element of a large total; a
    # server that does not resume sends the whole value again (read from the start anew)
    folder = _sums(BIG)
    data = _aggregate(folder, seed=5, count=4, weight=1.5)
    layout = serialization.dense_layout(folder.aggregate_type)
    cut_at = layout.offsets[2] + layout.lengths[2] // 2 + 3
    server = _AggregateServer(data, cut_at=cut_at, cuts=1, resumes=resumes)

    # act
    got = _read(server, folder)

    # assert
    _same_results(got, folder.results(data))
    assert server.asked[-2:] == [None, f"bytes={cut_at}-"]


def test_a_server_that_ignores_ranges_gets_the_aggregate_read_whole():
    folder = _sums(BIG)
    server = _AggregateServer(_aggregate(folder, seed=5), ranges=False)

    assert _read(server, folder) is None  # (its answer to the first range is not read)
    assert len(server.asked) == 1


def test_pieces_split_anywhere_make_the_same_results():
    # arrange: the frame fed in pieces that split elements (odd sizes)
    folder = _sums(BIG)
    data = _aggregate(folder, seed=11, count=2, weight=3.0)
    reading = results_lib.Reading(folder)
    layout = reading.layout
    first = {k: data[layout.offsets[k]:layout.offsets[k] + layout.lengths[k]]
             for k in reading.divisors()}
    reading.prepare(first)

    # act
    scan = results_lib.ResultsScan(reading, first, len(data))
    for start in range(0, len(data), 12_347):
        scan.feed(data[start:start + 12_347])
    scan.finish()

    # assert
    _same_results(reading.results(scan), folder.results(data))


def test_a_corrupted_aggregate_is_refused():
    folder = _sums(BIG)
    data = bytearray(_aggregate(folder, seed=3))
    layout = serialization.dense_layout(folder.aggregate_type)
    data[layout.offsets[0] + 100] ^= 1  # a bit of a large total: the checksum differs

    with pytest.raises(folding.ReportError, match=r"an aggregate.*checksum"):
        _read(_AggregateServer(bytes(data)), folder)


def test_a_frame_of_another_type_is_refused():
    # arrange: the aggregate of a round whose tensors have one element more
    folder = _sums(BIG)
    data = _aggregate(_sums(BIG + 1), seed=3)
    reading = results_lib.Reading(folder)

    # act, assert: refused by its announced size, or by its header
    with pytest.raises(folding.ReportError, match=f"in {reading.layout.size} bytes, found "
                                                  f"{len(data)} bytes"):
        results_lib.ResultsScan(reading, {}, len(data))
    scan = results_lib.ResultsScan(reading, {}, None)
    with pytest.raises(folding.ReportError, match="Expected an aggregate of type"):
        scan.feed(data)


def test_an_aggregate_that_changed_between_its_reads_is_refused():
    # arrange: the divisors read first from one aggregate, the frame from another (as
    # if the round's aggregate were replaced between the requests)
    folder = _sums(BIG)
    data = _aggregate(folder, seed=4, count=3, weight=2.5)
    changed = _aggregate(folder, seed=4, count=4, weight=2.5)
    server = _AggregateServer(data, then=changed)

    with pytest.raises(folding.ReportError, match="changed while it was read"):
        _read(server, folder)


def test_a_round_without_large_totals_is_read_whole_without_a_request():
    folder = _sums(1000)
    server = _AggregateServer(_aggregate(folder, seed=1))

    assert _read(server, folder) is None
    assert server.asked == []


def test_the_results_hold_no_model_sized_aggregate():
    # arrange: a float32 model's average of 8 MiB: a 16 MiB float64 total
    n = 2 << 20
    folder = _sums(n)
    data = _aggregate(folder, seed=6)
    server = _AggregateServer(data)
    results_bytes = sum(x.nbytes for x in _large(folder.results(data)))

    # act: the memory that NumPy and Python allocate while the results are made
    tracemalloc.start()
    try:
        got = _read(server, folder)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    # assert: the results, and a few pieces in flight (the aggregate whole: 2.8 x that)
    assert sum(x.nbytes for x in _large(got)) == results_bytes
    assert peak < results_bytes + (4 << 20), (peak, results_bytes, len(data))


def test_server_rounds_make_a_real_rounds_results_as_it_streams_in(server_factory, client_threads):
    # arrange: FedAvg's first round of a model larger than a slice, on a real server
    d_in = folding.RESULT_SLICE // 4 + 1000
    process = _wide_fed_avg(d_in)
    clients = {f"c{i}": {"train": _train(i, d_in)} for i in range(2)}
    plan, broadcast = capture(process.next, process.initialize(), deploy.client_data("train"))
    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    errors = [client_threads(deploy.Client(server.url, "pop", token, data, backoff=(0.02, 0.2)))
              for data in clients.values()]
    runner = rounds_lib.ServerRounds(server.url, server.admin_token, "pop", target=2)

    # act
    try:
        result = runner.run_round(plan, broadcast)
        whole = runner.admin.aggregate(result.details["id"])
        runner.finish()
    finally:
        runner.close()

    # assert: the results made as it streamed in, bit for bit those of the whole aggregate
    assert result.aggregate == b"" and result.results is not None
    _same_results(list(result.results), folding.results_sliced(folding.Folder(plan), whole))
    assert len(_large(result.results)) == 1
    assert not any(errors)
