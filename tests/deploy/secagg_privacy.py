"""The privacy check of SecAgg+, shared by the library's test (in process) and the secure
rounds' test (over HTTP): nothing the server received or stored holds a client's input,
and removing every mask the server could compute leaves each masked vector masked."""

import numpy as np

from fedlang.deploy.secagg import Stage, crypto, messages, shamir
from fedlang.deploy.secagg import masks as masks_lib


def encodings(vector):
    """The byte strings a client's input could travel as (whole and in part)."""
    v = np.asarray(vector)
    out = [v.astype("<u8").tobytes(), v.astype("<u4").tobytes(), v.astype("<i4").tobytes()]
    if v.size > 8:
        out += [v[:8].astype("<u8").tobytes(), v[:8].astype("<u4").tobytes()]
    return out


def assert_no_payload_holds_an_input(payloads, plain):
    """No byte string in `payloads` contains any encoding of any client's input."""
    for client, vector in plain.items():
        for raw in encodings(vector):
            assert not any(raw in p for p in payloads), client


def assert_masks_hide_every_input(log, plain, segment, server, survivors):
    """Removes from each masked input every mask the server could compute from what it
    received (`log`: (stage, client, message bytes)): survivors' self masks (their seeds
    are revealed) and pairwise masks with dropouts (their keys are rebuilt). Each vector
    must still be masked, and together they must add up to the survivors' sum, which
    shows that exactly the computable masks were removed.

    Args:
      plain: client -> its input, reduced modulo the segment's modulus.
      segment: the round's one segment.
      server: a `SecAggServer` of the round past its first stage (its neighbour graph,
        threshold and round id).
      survivors: the clients whose inputs are in the sum.
    """
    ids = sorted(plain, key=str.encode)
    position = {c: i + 1 for i, c in enumerate(ids)}
    seed_points, key_points, advertised = {}, {}, {}
    for stage, holder, data in log:
        if stage == Stage.ADVERTISE_KEYS:
            advertised[holder] = messages.read_advertise(data, server.round_id, holder)[1]
        if stage == Stage.UNMASKING:
            survived, seeds, dropped, keys = messages.read_unmask(data, server.round_id, holder)
            for owner, y in zip(survived, seeds):
                seed_points.setdefault(owner, []).append((position[holder], y))
            for owner, y in zip(dropped, keys):
                key_points.setdefault(owner, []).append((position[holder], y))
    dropped_keys = {
        v: crypto.private_from_bytes(shamir.reconstruct(p, server.threshold).to_bytes(32, "big"))
        for v, p in key_points.items()
    }
    total = np.zeros(segment.length, np.uint64)
    masked = 0
    for stage, u, data in log:
        if stage != Stage.MASKED_INPUT:
            continue
        masked += 1
        (y,) = messages.read_masked_input(data, server.round_id, u, [segment])
        assert not np.array_equal(y, plain[u])
        seed = shamir.reconstruct(seed_points[u], server.threshold).to_bytes(32, "big")
        z = masks_lib.Accumulator(y.copy(), segment)
        z.add(seed, 0, -1)  # the self mask
        for v, key in dropped_keys.items():
            if v in server.neighbours(u):  # the pairwise mask with a dropout: computable
                pair = crypto.agree(key, advertised[u], crypto.PAIR_SEED_INFO, server.round_id)
                z.add(pair, 0, -1 if position[u] < position[v] else 1)
        z_u = z.result()
        # Still hidden by the pairwise masks with surviving neighbours: not the input, and
        # no element matches more often than chance would have it.
        assert not np.array_equal(z_u, plain[u]), u
        assert np.count_nonzero(z_u == plain[u]) <= 2, u
        masks_lib.add_into(total, z_u, segment)
    assert masked == len(survivors)
    want = np.zeros(segment.length, np.uint64)
    for c in survivors:
        masks_lib.add_into(want, plain[c], segment)
    assert total.tolist() == want.tolist()
    return set(key_points)
