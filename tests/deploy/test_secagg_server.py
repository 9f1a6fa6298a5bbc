"""Bad input at the server: every rejected message raises SecAggError and changes nothing."""

import numpy as np
import pytest

from fedlang.deploy import secagg
from fedlang.deploy.secagg import (
    SecAggClient,
    SecAggError,
    SecAggServer,
    Segment,
    Stage,
    messages,
    shamir,
    wire,
)

SEGMENTS = [Segment(8, 2**16)]
IDS = [f"c{i}" for i in range(6)]
INPUTS = {c: [np.arange(8) * (i + 1)] for i, c in enumerate(IDS)}


def _round(until, segments=SEGMENTS, **options):
    """A server and its clients, with every client's answers in up to (not incl.) `until`."""
    srv = SecAggServer(segments, **options)
    clients = {c: SecAggClient(c, srv.request_for(c)) for c in IDS}
    steps = [
        (Stage.ADVERTISE_KEYS, lambda c: clients[c].advertise_keys()),
        (Stage.SHARE_KEYS, lambda c: clients[c].share_keys(srv.request_for(c))),
        (Stage.MASKED_INPUT, lambda c: clients[c].masked_input(srv.request_for(c), INPUTS[c])),
        (Stage.UNMASKING, lambda c: clients[c].unmask(srv.request_for(c))),
    ]
    for stage, answer in steps:
        if stage == until:
            break
        for c in IDS:
            srv.receive(c, answer(c))
        srv.advance()
    return srv, clients


def _rejected(srv, sender, message, match):
    before = srv.to_bytes()
    with pytest.raises(SecAggError, match=match):
        srv.receive(sender, message)
    assert srv.to_bytes() == before  # bad input never changes the state


def _plain(clients):
    return [int(sum(INPUTS[c][0][j] for c in clients)) % 2**16 for j in range(8)]


def test_a_reused_public_key_is_rejected():
    srv, clients = _round(Stage.ADVERTISE_KEYS)
    first = clients["c0"].advertise_keys()
    srv.receive("c0", first)
    copied = messages.read_advertise(first, srv.round_id, "c0")
    _rejected(
        srv,
        "c1",
        messages.advertise(srv.round_id, "c1", *copied),
        "a key that 'c0' already advertised",
    )
    fresh = SecAggClient("c1", srv.request_for("c1"))
    one_key = messages.read_advertise(fresh.advertise_keys(), srv.round_id, "c1")[0]
    _rejected(srv, "c1", messages.advertise(srv.round_id, "c1", one_key, one_key), "same key twice")
    _rejected(
        srv, "c1", messages.advertise(srv.round_id, "c1", bytes(32), one_key), "low-order point"
    )


def test_a_second_answer_to_a_stage_is_rejected_and_the_first_stands():
    srv, clients = _round(Stage.ADVERTISE_KEYS)
    first = clients["c0"].advertise_keys()
    srv.receive("c0", first)
    again = SecAggClient("c0", srv.request_for("c0")).advertise_keys()
    _rejected(srv, "c0", again, "second one from 'c0'; the first one stands")

    srv, clients = _round(Stage.MASKED_INPUT)
    message = clients["c0"].masked_input(srv.request_for("c0"), INPUTS["c0"])
    srv.receive("c0", message)
    _rejected(srv, "c0", message, "second one from 'c0'")


def test_messages_for_another_client_round_or_stage_are_rejected():
    srv, clients = _round(Stage.ADVERTISE_KEYS)
    message = clients["c0"].advertise_keys()
    _rejected(srv, "c1", message, "for client 'c1', found one for 'c0'")
    other = SecAggServer(SEGMENTS)
    _rejected(other, "c0", message, "found one for round")
    srv.receive("c0", message)
    _rejected(
        srv,
        "c0",
        messages.masked_input(srv.round_id, "c0", [np.zeros(8, np.uint64)], SEGMENTS),
        "Expected a advertise-keys message, found masked-input",
    )
    _rejected(srv, "c0", b"garbage", "at least 10 bytes")


def test_shares_for_non_neighbours_are_rejected_and_the_round_goes_on_without_the_sender():
    srv, clients = _round(Stage.SHARE_KEYS, degree=2, threshold=2)
    c0_neighbours = srv.neighbours("c0")
    stranger = next(c for c in IDS if c != "c0" and c not in c0_neighbours)
    good = clients["c0"].share_keys(srv.request_for("c0"))
    receivers, blob = messages.read_shares(good, srv.round_id, "c0")
    wrong = [stranger if r == receivers[0] else r for r in receivers]
    _rejected(
        srv,
        "c0",
        messages.shares(srv.round_id, "c0", wrong, [blob[:94], blob[94:]]),
        "non-neighbours",
    )
    _rejected(
        srv,
        "c0",
        messages.shares(srv.round_id, "c0", receivers[:1], [blob[:94]]),
        "one share for each",
    )
    for c in IDS[1:]:
        srv.receive(c, clients[c].share_keys(srv.request_for(c)))
    srv.advance()
    assert "c0" not in srv.participants()
    with pytest.raises(SecAggError, match="not \\(it dropped out"):
        srv.request_for("c0")
    survivors = list(srv.participants())
    for c in survivors:
        srv.receive(c, clients[c].masked_input(srv.request_for(c), INPUTS[c]))
    srv.advance()
    for c in survivors:
        srv.receive(c, clients[c].unmask(srv.request_for(c)))
    srv.advance()
    assert srv.result()[0].tolist() == _plain(survivors)


def test_bad_masked_inputs_are_rejected():
    srv, _ = _round(Stage.MASKED_INPUT)
    rid = srv.round_id
    _rejected(
        srv,
        "c0",
        messages.masked_input(rid, "c0", [np.zeros(7, np.uint64)], SEGMENTS),
        r"8 values of 2 bytes\) of 16 bytes in a masked-input message, found 14 bytes",
    )
    _rejected(
        srv, "c0", messages.masked_input(rid, "c0", [], []), "Expected 1 masked segments, found 0"
    )
    _rejected(
        srv,
        "intruder",
        messages.masked_input(rid, "intruder", [np.zeros(8, np.uint64)], SEGMENTS),
        "dropped out earlier or never joined",
    )


def test_masked_values_at_or_above_the_modulus_are_rejected():
    segment = Segment(8, 1000)
    srv, _ = _round(Stage.MASKED_INPUT, segments=[segment])
    too_big = messages.masked_input(srv.round_id, "c0", [np.full(8, 1000, np.uint64)], [segment])
    _rejected(srv, "c0", too_big, "below the modulus 1000")


def test_bad_unmasking_answers_are_rejected():
    srv, clients = _round(Stage.UNMASKING)
    rid = srv.round_id
    answer = clients["c0"].unmask(srv.request_for("c0"))
    survived, seeds, dropped, keys = messages.read_unmask(answer, rid, "c0")
    _rejected(
        srv,
        "c0",
        messages.unmask(rid, "c0", survived[1:], seeds[1:], dropped, keys),
        "exactly the clients asked",
    )
    _rejected(
        srv, "c0", messages.unmask(rid, "c0", [], [], survived, seeds), "exactly the clients asked"
    )
    bad = wire.encode(
        wire.UNMASK,
        {"round": rid.hex(), "client": "c0", "survived": survived, "dropped": []},
        [b"\xff" * (33 * len(survived)), b""],
    )
    _rejected(srv, "c0", bad, "above the prime")
    srv.receive("c0", answer)
    _rejected(srv, "c0", answer, "second one")


@pytest.mark.parametrize("which", ["seed", "key"])
def test_a_wrong_but_well_formed_share_fails_the_round_safely(which):
    srv, clients = _round(Stage.MASKED_INPUT, threshold=3)
    for c in IDS[:-1]:  # c5 drops: its mask key is rebuilt
        srv.receive(c, clients[c].masked_input(srv.request_for(c), INPUTS[c]))
    srv.advance()
    for c in IDS[:-1]:
        answer = clients[c].unmask(srv.request_for(c))
        if c == "c0":
            survived, seeds, dropped, keys = messages.read_unmask(answer, srv.round_id, c)
            if which == "seed":
                seeds = [(seeds[0] + 1) % shamir.PRIME, *seeds[1:]]
            else:
                keys = [(keys[0] + 1) % shamir.PRIME, *keys[1:]]
            answer = messages.unmask(srv.round_id, c, survived, seeds, dropped, keys)
        srv.receive(c, answer)
    with pytest.raises(SecAggError, match=r"inconsistent shares|does not match its public key"):
        srv.advance()
    assert srv.stage == Stage.FAILED


def test_a_corrupted_message_in_a_round_makes_its_sender_a_dropout():
    segments = [Segment(8, 2**16)]

    def corrupt(stage, cid, data):
        return data[:-1] if (stage, cid) == (Stage.MASKED_INPUT, "c2") else data

    report = secagg.run_round(INPUTS, segments, on_send=corrupt)
    assert "c2" not in report.survivors and "truncated" in report.rejected["c2"]
    assert report.sum[0].tolist() == _plain([c for c in IDS if c != "c2"])


def test_the_round_takes_no_messages_once_finished_and_restores_only_valid_states():
    srv, _ = _round(None)
    assert srv.stage == Stage.DONE
    with pytest.raises(SecAggError, match="found it DONE"):
        srv.receive("c0", b"")
    with pytest.raises(SecAggError, match="found it DONE"):
        srv.advance()
    assert SecAggServer.from_bytes(srv.to_bytes()).result()[0].tolist() == _plain(IDS)
    with pytest.raises(SecAggError, match="server state message, found advertise-keys"):
        SecAggServer.from_bytes(messages.advertise(b"r", "c", bytes(32), bytes(32)))
    with pytest.raises(SecAggError, match="truncated"):
        SecAggServer.from_bytes(srv.to_bytes()[:-3])


def test_options_are_checked_up_front():
    with pytest.raises(ValueError, match="even degree"):
        SecAggServer(SEGMENTS, degree=3)
    with pytest.raises(ValueError, match="threshold >= 1"):
        SecAggServer(SEGMENTS, threshold=0)
    with pytest.raises(ValueError, match="round id of 1 to 64 bytes"):
        SecAggServer(SEGMENTS, round_id=b"")
