import collections

import numpy as np
import pytest

import fedlang as fl
from fedlang import analytics

from ._words import true_counts, zipf_clients

MAX_LEN = 8


def test_triehh_finds_exact_counts_without_dp(rt):
    clients = zipf_clients()
    truth = true_counts(clients, MAX_LEN)
    hh = analytics.triehh(clients, max_len=MAX_LEN, max_prefixes=64)
    assert hh.truncated == sum(c.count("longer than eight bytes") for c in clients) > 0
    assert hh.privacy is None
    assert dict(zip(hh.items, hh.counts.tolist())) == dict(truth)  # every string, exactly
    assert [truth[w] for w in hh.items[:5]] == [c for _, c in truth.most_common(5)]


def test_one_vote_per_client_counts_clients():
    clients = [["a", "a", "b"], ["a"], ["c"], []]
    with fl.runtime.reference_context():
        hh = analytics.triehh(clients, max_len=2, votes="one", seed=3)
    # Each of the 3 non-empty clients votes for one of its strings, once.
    assert sum(hh.counts) == 3 and set(hh.items) <= {"a", "b", "c"} and "c" in hh.items


def _prefix_heavy_clients(num_clients=300, seed=0):
    # Frequent words share prefixes (the, then, there, this, that), as in English.
    rng = np.random.default_rng(seed)
    vocab = ["the", "to", "and", "of", "that", "this", "then", "there", "a", "in", "it", "is",
             "i", "you", "was", "for", "on", "with", "he", "she", "they"] + [f"w{i:03d}" for i in range(400)]
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1
    p /= p.sum()
    return [[str(w) for w in rng.choice(vocab, size=rng.integers(5, 60), p=p)] for _ in range(num_clients)]


def test_one_vote_per_client_counts_clients_draws_of_the_whole_run():
    # Each client draws one of its strings, once, and votes with it in every round: a
    # string's count is the number of clients that drew it, an estimate of its client
    # share. Drawing afresh each round among the live strings over-counted long words
    # (few candidates in late rounds: 'there' got 137 votes, 'the' 75) and lost frequent
    # ones whose prefixes' votes were spread over their siblings.
    clients = _prefix_heavy_clients()
    share = collections.Counter()
    for words in clients:
        for w, k in collections.Counter(words).items():
            share[w] += k / len(words)
    hh = analytics.triehh(clients, max_len=5, threshold=3, votes="one", seed=0)
    found = dict(zip(hh.items, hh.counts.tolist()))
    assert sum(found.values()) <= len(clients)  # one vote per client, in all
    assert hh.items[:3] == [w for w, _ in share.most_common(3)]  # the, to, and
    for w, s in share.most_common(6):
        # a sum of independent draws: variance sum p(1-p) <= s; 4 standard deviations
        assert abs(found.get(w, 0) - s) <= 4 * np.sqrt(s) + 1, (w, found.get(w), s)


def test_a_flat_list_of_strings_is_refused():
    # triehh(["hello", "world"]) made two clients of one letter each.
    with pytest.raises(TypeError, match=r"one list of strings per client, found the string 'hello'"):
        analytics.triehh(["hello", "world"], max_len=8)
    with pytest.raises(TypeError, match="one list of strings per client"):
        analytics.iblt_heavy_hitters("hello", max_len=8)


def test_capacity_keeps_the_most_voted_prefixes():
    clients = [["aa"] * 5 + ["ab"] * 3 + ["b"]]
    with fl.runtime.reference_context():
        hh = analytics.triehh(clients, max_len=2, max_prefixes=1)
    assert hh.items == ["aa"] and hh.counts.tolist() == [5.0]


def test_dp_triehh_noise_threshold_and_accounting():
    clients = [["hi"] * 1 for _ in range(60)] + [["rare"]]
    privacy = analytics.Privacy(noise_multiplier=1.0, clip=1.0, seed=5)
    with fl.runtime.reference_context():
        hh = analytics.triehh(clients, max_len=4, max_prefixes=8, privacy=privacy)
    assert hh.items == ["hi"] and abs(hh.counts[0] - 60) < 6 * privacy.stddev
    assert hh.privacy == privacy.spent(hh.rounds) and hh.rounds == 3  # '', 'h', 'hi'


def test_dp_vote_noise_has_the_configured_scale():
    privacy = analytics.Privacy(noise_multiplier=0.5, clip=2.0, seed=2)
    algo = analytics.TrieHH(max_len=4, max_prefixes=4, privacy=privacy)
    comp, state = algo.round_computation()
    table, valid = analytics.trie.prefix_table([b""], 4, 4)
    trie_arg = {"prefixes": table, "valid": valid, "length": np.int32(0), "seed": np.uint32(0)}
    with fl.runtime.reference_context():
        out = comp([[]], trie_arg, state)
        again = comp([[]], trie_arg, out["state"])
    votes = np.asarray(out["votes"])
    assert abs(votes.std() / privacy.stddev - 1) < 0.1
    assert not np.allclose(votes, np.asarray(again["votes"]))  # fresh noise each round


def test_bad_settings():
    with pytest.raises(ValueError, match="votes"):
        analytics.TrieHH(votes="some")
    with pytest.raises(ValueError, match="max_prefixes"):
        analytics.TrieHH(max_prefixes=0)
