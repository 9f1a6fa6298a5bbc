"""Bad requests at the client: it refuses anything that would reveal more than the protocol allows."""

import numpy as np
import pytest

from fedlang.deploy.secagg import SecAggClient, SecAggError, SecAggServer, Segment, messages, wire

SEGMENTS = [Segment(4, 2**8)]
IDS = ["a", "b", "c", "d", "e"]


def _after_shares():
    """A server whose share stage is closed, and clients that have shared their keys."""
    srv = SecAggServer(SEGMENTS)  # complete graph: 4 neighbours each, threshold 3
    clients = {c: SecAggClient(c, srv.request_for(c)) for c in IDS}
    for c in IDS:
        srv.receive(c, clients[c].advertise_keys())
    srv.advance()
    for c in IDS:
        srv.receive(c, clients[c].share_keys(srv.request_for(c)))
    srv.advance()
    return srv, clients


def _after_masked_input():
    srv, clients = _after_shares()
    for c in IDS:
        srv.receive(c, clients[c].masked_input(srv.request_for(c), [np.arange(4)]))
    srv.advance()
    return srv, clients


def test_a_share_forwarded_to_the_wrong_client_is_refused():
    srv, clients = _after_shares()
    senders, sealed = messages.read_mask_request(srv.request_for("b"), srv.round_id, "b")
    # The server hands "a" the share "c" encrypted for "b", as if it came from "c".
    from_c = sealed[senders.index("c")]
    a_senders, for_a = messages.read_mask_request(srv.request_for("a"), srv.round_id, "a")
    forged = [from_c if s == "c" else x for s, x in zip(a_senders, for_a)]
    request = messages.mask_request(srv.round_id, "a", a_senders, forged)
    with pytest.raises(SecAggError, match=r"share from 'c' .* fails authentication"):
        clients["a"].masked_input(request, [np.arange(4)])


def test_an_altered_share_is_refused():
    srv, clients = _after_shares()
    senders, sealed = messages.read_mask_request(srv.request_for("a"), srv.round_id, "a")
    flipped = bytes([sealed[0][0], sealed[0][1] ^ 1]) + sealed[0][2:]
    request = messages.mask_request(srv.round_id, "a", senders, [flipped, *sealed[1:]])
    with pytest.raises(SecAggError, match="fails authentication"):
        clients["a"].masked_input(request, [np.arange(4)])


def test_a_client_refuses_to_reveal_both_shares_of_one_neighbour():
    srv, clients = _after_masked_input()
    request = messages.unmask_request(srv.round_id, "a", ["a", "b", "c"], ["b"])
    with pytest.raises(SecAggError, match=r"as both. Revealing both shares would unmask"):
        clients["a"].unmask(request)


def test_a_client_refuses_to_reveal_its_own_mask_key():
    srv, clients = _after_masked_input()
    request = messages.unmask_request(srv.round_id, "a", ["b", "c", "d"], ["a"])
    with pytest.raises(SecAggError, match="listed as dropped"):
        clients["a"].unmask(request)


def test_a_client_answers_the_unmasking_request_once():
    srv, clients = _after_masked_input()
    clients["a"].unmask(srv.request_for("a"))
    # A second request, now claiming "b" dropped, would give the server b's mask key too.
    second = messages.unmask_request(srv.round_id, "a", ["a", "c", "d"], ["b"])
    with pytest.raises(SecAggError, match="each stage is answered once"):
        clients["a"].unmask(second)


def test_unmasking_requests_with_unknown_clients_or_too_few_survivors_are_refused():
    srv, clients = _after_masked_input()
    with pytest.raises(SecAggError, match="whose shares this client holds, found \\['zed'\\]"):
        clients["a"].unmask(messages.unmask_request(srv.round_id, "a", ["a", "b", "zed"], []))
    with pytest.raises(SecAggError, match="at least 3 survivors"):
        clients["a"].unmask(messages.unmask_request(srv.round_id, "a", ["a", "b"], ["c", "d"]))


def test_requests_out_of_order_are_refused():
    srv = SecAggServer(SEGMENTS)
    client = SecAggClient("a", srv.request_for("a"))
    with pytest.raises(
        SecAggError, match=r"Expected a request for stage SHARE_KEYS .* at stage ADVERTISE_KEYS"
    ):
        client.share_keys(b"")
    client.advertise_keys()
    with pytest.raises(SecAggError, match="at stage SHARE_KEYS"):
        client.advertise_keys()


def test_a_share_request_with_this_clients_own_key_is_refused():
    srv = SecAggServer(SEGMENTS)
    a = SecAggClient("a", srv.request_for("a"))
    enc, mask = messages.read_advertise(a.advertise_keys(), srv.round_id, "a")
    request = messages.share_request(
        srv.round_id, "a", 1, 2, [messages.NeighbourKeys("b", 2, enc, mask)]
    )
    with pytest.raises(SecAggError, match="reused key"):
        a.share_keys(request)


def test_malformed_share_requests_are_refused():
    srv = SecAggServer(SEGMENTS)
    a = SecAggClient("a", srv.request_for("a"))
    a.advertise_keys()
    rid = srv.round_id
    key = bytes(range(64))
    with pytest.raises(SecAggError, match="threshold of at most 2"):
        a.share_keys(
            messages.share_request(
                rid, "a", 1, 3, [messages.NeighbourKeys("b", 2, key[:32], key[32:])]
            )
        )
    with pytest.raises(SecAggError, match="distinct neighbours other than this client"):
        a.share_keys(
            messages.share_request(
                rid, "a", 1, 1, [messages.NeighbourKeys("b", 1, key[:32], key[32:])]
            )
        )
    with pytest.raises(SecAggError, match="valid X25519 public key, found one X25519 refuses"):
        a.share_keys(
            messages.share_request(
                rid, "a", 1, 1, [messages.NeighbourKeys("b", 2, bytes(32), key[32:])]
            )
        )
    bad = wire.encode(
        wire.SHARE_REQUEST,
        {"round": rid.hex(), "client": "a", "index": 0, "threshold": 1, "neighbours": []},
        [b""],
    )
    with pytest.raises(SecAggError, match="positive integer in field 'index'"):
        a.share_keys(bad)


def test_a_malformed_configuration_is_refused():
    with pytest.raises(SecAggError, match="Expected a valid segment"):
        SecAggClient("a", wire.encode(wire.CONFIG, {"round": "00", "segments": [[3, "-1"]]}))
    with pytest.raises(SecAggError, match="round configuration message"):
        SecAggClient("a", b"FLSA" + bytes([1, 2, 0, 0, 0, 0]))


def test_a_client_checks_its_own_input_against_the_segments():
    srv, clients = _after_shares()
    with pytest.raises(
        TypeError, match="Expected integers for segment 0, found an array of float64"
    ):
        clients["a"].masked_input(srv.request_for("a"), [np.ones(4)])
    with pytest.raises(ValueError, match="one array per segment \\(1\\), found 2"):
        clients["a"].masked_input(srv.request_for("a"), [np.ones(4, int), np.ones(4, int)])


def test_a_client_with_too_few_neighbours_left_sends_nothing():
    srv, clients = _after_shares()
    request = messages.mask_request(
        srv.round_id,
        "a",
        ["b"],
        [messages.read_mask_request(srv.request_for("a"), srv.round_id, "a")[1][0]],
    )
    with pytest.raises(SecAggError, match="at least 2 neighbours still in the round, found 1"):
        clients["a"].masked_input(request, [np.arange(4)])
