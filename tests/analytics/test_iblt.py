import numpy as np
import pytest

import fedlang as fl
from fedlang import analytics
from fedlang.analytics import iblt

from ._words import true_counts, zipf_clients

MAX_LEN = 8


def test_iblt_decodes_every_string_exactly(rt):
    clients = zipf_clients(seed=1)
    truth = true_counts(clients, MAX_LEN)
    hh = analytics.iblt_heavy_hitters(clients, max_len=MAX_LEN, capacity=2 * len(truth))
    assert dict(zip(hh.items, hh.counts.tolist())) == dict(truth)
    assert hh.truncated > 0 and hh.privacy is None
    assert [truth[w] for w in hh.items[:3]] == [c for _, c in truth.most_common(3)]


def test_overloaded_table_reports_what_it_could_not_decode():
    clients = [[f"s{i}" for i in range(400)]]
    algo = analytics.IBLT(max_len=6, capacity=20)
    with fl.runtime.reference_context():
        decoded = algo.decode(algo.build()([analytics.data.encode_clients(clients, 6).datasets[0]]))
    assert decoded.undecoded_cells > 0
    assert all(s.startswith(b"s") for s in decoded.items)  # nothing garbled was decoded


def test_a_sketch_that_does_not_decode_raises_and_names_capacity():
    # ~430 distinct words in a table for 50 returned items=[] without a word.
    clients = [[f"word{i}" for i in range(j, 430, 3)] for j in range(3)]
    with pytest.raises(ValueError, match=r"more distinct strings than capacity=50.*capacity=100"):
        analytics.iblt_heavy_hitters(clients, max_len=8, capacity=50)
    assert len(analytics.iblt_heavy_hitters(clients, max_len=8, capacity=600).items) == 430


def test_peel_is_linear_in_clients():
    algo = analytics.IBLT(max_len=4, capacity=10)
    a = analytics.data.encode_clients([["x", "y"]], 4).datasets[0]
    b = analytics.data.encode_clients([["x"]], 4).datasets[0]
    with fl.runtime.reference_context():
        one = np.asarray(algo.sketch_computation()(a), np.int64)
        two = np.asarray(algo.sketch_computation()(b), np.int64)
    decoded = iblt.peel((one + two) % iblt.MODULUS, 4, algo.cells_per_hash)
    assert dict(zip(decoded.items, decoded.counts.tolist())) == {b"x": 2, b"y": 1}


def test_dp_iblt_thresholds_rare_strings_and_accounts():
    clients = [["common"] for _ in range(50)] + [["rare"]]
    privacy = analytics.Privacy(noise_multiplier=1.0, clip=1.0, seed=4)
    with fl.runtime.reference_context():
        hh = analytics.iblt_heavy_hitters(clients, max_len=8, capacity=8, privacy=privacy)
    assert hh.items == ["common"] and abs(hh.counts[0] - 50) < 6
    assert hh.privacy == privacy.spent(1) and hh.rounds == 2


def test_bad_settings():
    with pytest.raises(ValueError, match="capacity"):
        analytics.IBLT(capacity=0)


def test_secure_sum_gives_the_same_sketch():
    clients = [["ab", "ab", "c"], ["c", "dd"]]
    with fl.runtime.reference_context():
        plain = analytics.iblt_heavy_hitters(clients, max_len=4, capacity=8)
        secure = analytics.iblt_heavy_hitters(clients, max_len=4, capacity=8, secure=True)
    assert plain.items == secure.items == ["ab", "c", "dd"]
    assert plain.counts.tolist() == secure.counts.tolist() == [2.0, 2.0, 1.0]


def test_counts_survive_wrapping_modulo_2_32():
    # 3 million copies of one string: its cells exceed 2^32 only through the bytes
    # (3e6 * 255 < 2^32 still); a second string in the same cells wraps them.
    algo = analytics.IBLT(max_len=4, capacity=3)
    enc = analytics.data.encode_clients([["zz"], ["y"]], 4)
    with fl.runtime.reference_context():
        a = np.asarray(algo.sketch_computation()(enc.datasets[0]), np.int64)
        b = np.asarray(algo.sketch_computation()(enc.datasets[1]), np.int64)
    total = (a * 3_000_000 + b * 5_000_000) % iblt.MODULUS
    decoded = iblt.peel(total, 4, algo.cells_per_hash)
    assert dict(zip(decoded.items, decoded.counts.tolist())) == {b"zz": 3_000_000, b"y": 5_000_000}
