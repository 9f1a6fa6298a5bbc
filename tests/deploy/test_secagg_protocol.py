"""The whole protocol, run in process: exact sums, dropouts, failure, privacy, restarts."""

import doctest

import numpy as np
import pytest

from fedlang.deploy import secagg
from fedlang.deploy.secagg import (
    SecAggError,
    SecAggServer,
    Segment,
    Stage,
    bitwidth_modulus,
    client,
    driver,
    messages,
    wire,
)
from fedlang.deploy.secagg import masks as masks_lib

from . import secagg_privacy


def _cohort(n, segments, seed=0):
    rng = np.random.default_rng(seed)
    ids = [f"client-{i:02d}" for i in range(n)]
    return {
        c: [rng.integers(-(2**62), 2**62, s.length, dtype=np.int64) for s in segments] for c in ids
    }


def _plain_sum(inputs, segments, clients=None):
    clients = list(inputs) if clients is None else clients
    out = []
    for i, s in enumerate(segments):
        total = np.zeros(s.length, dtype=object)
        for c in clients:
            total = total + inputs[c][i].astype(object)
        out.append([int(v) % s.modulus for v in total])
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 7, 50])
def test_the_sum_equals_the_plain_modular_sum(n):
    segments = [
        Segment(40, bitwidth_modulus(8, n)),
        Segment(30, bitwidth_modulus(32, n)),
        Segment(20, 2**64),
        Segment(25, 1_000_003),
        Segment(10, (1 << 62) + 15),
        Segment(5, 3),
        Segment(0, 2**16),
    ]
    inputs = _cohort(n, segments, seed=n)
    report = secagg.run_round(inputs, segments)
    assert report.survivors == tuple(inputs) and not report.rejected
    assert [v.tolist() for v in report.sum] == _plain_sum(inputs, segments)
    assert all(v.dtype == np.uint64 for v in report.sum)


def test_the_sum_equals_the_simulation_runtimes_secure_sum_bitwidth():
    import fedlang as fl  # the secure intrinsic as simulation computes it

    n, bitwidth = 9, 6
    inputs = {f"c{i}": [np.arange(12, dtype=np.int32) * (i + 1) - 20] for i in range(n)}

    @fl.federated_computation(fl.type_at_clients(fl.TensorType(np.int32, [12])))
    def secure_sum(x):
        return fl.federated_secure_sum_bitwidth(x, np.int32(bitwidth))

    with fl.runtime.reference_context():
        simulated = secure_sum([v[0] for v in inputs.values()])
    # The deployment wraps each input to `bitwidth` bits, then sums in the wider group.
    wrapped = {c: [np.mod(v[0], 2**bitwidth)] for c, v in inputs.items()}
    report = secagg.run_round(wrapped, [Segment(12, bitwidth_modulus(bitwidth, n))])
    assert report.sum[0].astype(np.int64).tolist() == np.asarray(simulated).tolist()


def test_degree_and_threshold_follow_the_defaults_and_the_graph_is_sparse_for_large_cohorts():
    segments = [Segment(4, 2**8)]
    report = secagg.run_round(_cohort(60, segments), segments)
    assert (report.degree, report.threshold) == (secagg.default_degree(60), 13)
    assert report.degree == 24 < 59


@pytest.mark.parametrize(
    "stage",
    [Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING],
    ids=["after-keys", "after-shares", "after-masked-input"],
)
def test_dropouts_at_each_stage_leave_the_survivors_sum(stage):
    segments = [Segment(16, 2**20), Segment(8, 65_521)]
    inputs = _cohort(12, segments, seed=int(stage))
    ids = list(inputs)
    gone = ids[1:4]
    report = secagg.run_round(inputs, segments, degree=8, drop={stage: gone})
    expected_survivors = ids if stage == Stage.UNMASKING else [c for c in ids if c not in gone]
    # A client that vanishes after its masked input is still in the sum: its input arrived.
    assert list(report.survivors) == expected_survivors
    assert [v.tolist() for v in report.sum] == _plain_sum(inputs, segments, expected_survivors)


def test_up_to_n_minus_t_clients_may_drop_after_sending_masked_inputs():
    segments = [Segment(10, 2**32)]
    inputs = _cohort(10, segments)
    ids = list(inputs)  # complete graph: t = 6 of the 10 holders
    report = secagg.run_round(inputs, segments, drop={Stage.UNMASKING: ids[:4]})
    assert report.threshold == 6
    assert [v.tolist() for v in report.sum] == _plain_sum(inputs, segments)


def test_up_to_n_minus_t_clients_may_drop_before_sending_masked_inputs():
    segments = [Segment(10, 2**32)]
    inputs = _cohort(10, segments)
    ids = list(inputs)
    drop = {Stage.SHARE_KEYS: ids[:2], Stage.MASKED_INPUT: ids[2:4]}
    report = secagg.run_round(inputs, segments, drop=drop)
    assert report.survivors == tuple(ids[4:])
    assert [v.tolist() for v in report.sum] == _plain_sum(inputs, segments, ids[4:])


def _record(log):
    def on_send(stage, cid, data):
        log.append((stage, cid, data))
        return data

    return on_send


def test_fewer_than_t_masked_inputs_fail_the_round_before_any_share_is_requested():
    segments = [Segment(10, 2**32)]
    inputs = _cohort(10, segments)
    log = []
    with pytest.raises(SecAggError, match="at least 6 clients to send masked inputs, found 5"):
        secagg.run_round(
            inputs, segments, drop={Stage.MASKED_INPUT: list(inputs)[:5]}, on_send=_record(log)
        )
    assert {stage for stage, _, _ in log} == {
        Stage.ADVERTISE_KEYS,
        Stage.SHARE_KEYS,
        Stage.MASKED_INPUT,
    }


def test_fewer_than_t_clients_in_unmasking_fail_the_round_with_a_clear_message():
    segments = [Segment(10, 2**32)]
    inputs = _cohort(10, segments)
    servers = []

    def keep(srv):
        servers.append(srv)
        return srv

    with pytest.raises(
        SecAggError, match=r"Expected at least 6 shares to remove client .* masks, found 5"
    ):
        secagg.run_round(
            inputs, segments, drop={Stage.UNMASKING: list(inputs)[:5]}, between_stages=keep
        )
    srv = servers[-1]
    assert srv.stage == Stage.FAILED and "too many clients dropped out" in srv.failure
    with pytest.raises(SecAggError, match="round failed"):
        srv.result()
    with pytest.raises(SecAggError, match="round is over"):
        srv.request_for(list(inputs)[-1])


def test_too_few_clients_to_start_fail_at_the_first_stage():
    with pytest.raises(SecAggError, match="at least 3 clients to advertise keys, found 2"):
        secagg.run_round(_cohort(2, [Segment(1, 2)]), [Segment(1, 2)], threshold=3, degree=4)
    with pytest.raises(SecAggError, match=r"threshold of at most 3 .* found 4"):
        secagg.run_round(_cohort(5, [Segment(1, 2)]), [Segment(1, 2)], threshold=4, degree=2)


def test_a_client_whose_neighbourhood_dropped_is_dropped_not_the_round():
    # Degree 2, threshold 2: a client needs one of its two neighbours to share keys.
    segments = [Segment(6, 2**16)]
    inputs = _cohort(9, segments)
    servers = []
    secagg.run_round(
        inputs, segments, degree=2, threshold=2, between_stages=lambda s: servers.append(s) or s
    )
    srv = servers[0]  # the same round id and clients give the same graph
    victim = next(iter(inputs))
    gone = list(srv.neighbours(victim))
    report = secagg.run_round(
        inputs,
        segments,
        degree=2,
        threshold=2,
        round_id=srv.round_id,
        drop={Stage.SHARE_KEYS: gone},
    )
    assert victim not in report.survivors and not set(gone) & set(report.survivors)
    assert [v.tolist() for v in report.sum] == _plain_sum(inputs, segments, list(report.survivors))


def test_the_server_state_survives_save_and_restore_between_every_stage():
    segments = [Segment(50, 2**24), Segment(20, 999_983)]
    inputs = _cohort(12, segments)
    ids = list(inputs)
    saved = []

    def restart(srv):
        data = srv.to_bytes()
        saved.append(data)
        return SecAggServer.from_bytes(data)

    drop = {Stage.MASKED_INPUT: ids[:2], Stage.UNMASKING: ids[2:4]}
    report = secagg.run_round(
        inputs, segments, degree=6, threshold=3, drop=drop, between_stages=restart
    )
    assert len(saved) == 4
    assert [v.tolist() for v in report.sum] == _plain_sum(inputs, segments, ids[2:])


def test_the_server_state_survives_a_restart_in_the_middle_of_the_masked_inputs():
    segments = [Segment(30, 2**32)]
    inputs = _cohort(8, segments)
    srv = SecAggServer(segments, degree=4)
    clients = {c: client.SecAggClient(c, srv.request_for(c)) for c in inputs}
    for c, cl in clients.items():
        srv.receive(c, cl.advertise_keys())
    srv.advance()
    for c, cl in clients.items():
        srv.receive(c, cl.share_keys(srv.request_for(c)))
    srv.advance()
    for i, (c, cl) in enumerate(clients.items()):
        if i == 4:  # half the inputs are folded in: restart
            before = srv.to_bytes()
            srv = SecAggServer.from_bytes(before)
            assert srv.to_bytes() == before
        srv.receive(c, cl.masked_input(srv.request_for(c), inputs[c]))
    srv.advance()
    srv = SecAggServer.from_bytes(srv.to_bytes())
    for c, cl in clients.items():
        srv.receive(c, cl.unmask(srv.request_for(c)))
    assert srv.advance() == Stage.DONE
    assert [v.tolist() for v in srv.result()] == _plain_sum(inputs, segments)


def test_the_server_never_sees_or_can_compute_a_clients_input():
    segments = [Segment(64, 2**32)]
    inputs = _cohort(10, segments)
    ids = list(inputs)
    log, servers, states = [], [], []

    def keep(srv):
        servers.append(srv)
        states.append(srv.to_bytes())
        return srv

    drop = {Stage.MASKED_INPUT: ids[:2], Stage.UNMASKING: ids[2:3]}  # keys of 0, 1 get rebuilt
    report = secagg.run_round(
        inputs,
        segments,
        degree=4,
        threshold=2,
        drop=drop,
        on_send=_record(log),
        between_stages=keep,
    )
    plain = {c: masks_lib.reduce(inputs[c][0], segments[0], "x") for c in ids}
    # 1. No byte string the server received or stored holds any client's input.
    payloads = [data for _, _, data in log] + states
    for c in ids:
        assert inputs[c][0].tobytes() not in b"".join(payloads)
    secagg_privacy.assert_no_payload_holds_an_input(payloads, plain)
    # 2. Removing every mask the server could compute (the self-mask seeds of the
    # survivors, the mask keys of the dropouts) leaves each masked input masked.
    rebuilt = secagg_privacy.assert_masks_hide_every_input(
        log, plain, segments[0], servers[-1], report.survivors
    )
    assert rebuilt == set(ids[:2])
    assert report.sum[0].tolist() == _plain_sum(inputs, segments, list(report.survivors))[0]


def test_wire_constants_are_the_documented_ones():
    assert messages.CIPHERTEXT_BYTES == 12 + 2 * 33 + 16
    assert wire.MAGIC == b"FLSA"


def test_docstring_examples_run():
    assert doctest.testmod(driver).failed == 0
    assert doctest.testmod(client).failed == 0
