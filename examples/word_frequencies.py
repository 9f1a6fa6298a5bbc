"""Word frequencies: the most typed words of a keyboard population, found federatedly.

A keyboard-style data set is generated here: `--clients` users (10,000), each typing
10 to 200 words drawn from a Zipf distribution over a vocabulary of `--vocab` (50,000)
made-up words. The server finds the `--top-k` (100) most frequent words without ever
seeing a user's words, twice:

* with TrieHH (`fedlang.analytics.TrieHH`): the trie of frequent prefixes grows one
  byte per federated round;
* with an IBLT sketch (`fedlang.analytics.IBLT`): one round of sketches summed by
  secure aggregation, decoded at the server.

Each result is compared with the true top words (precision of the top-k found).
`--epsilon` adds differential privacy (Gaussian noise calibrated by the accountant).
Run it with `python examples/word_frequencies.py` (about 3 minutes on 2 cores), or smaller with
`--clients 500 --vocab 2000`.
"""

from __future__ import annotations

import argparse
import collections
import math
import time
from typing import Any

import numpy as np

import fedlang as fl
from fedlang import aggregators, analytics

LETTERS = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))


def make_vocabulary(size: int, seed: int = 0) -> list[str]:
    """`size` distinct made-up words of 3 to 10 letters (English-like letter frequencies)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(LETTERS) + 1) ** 0.7
    weights /= weights.sum()
    words: dict[str, None] = {}
    while len(words) < size:
        for n in rng.integers(3, 11, size=size):
            words.setdefault("".join(rng.choice(LETTERS, size=n, p=weights)), None)
            if len(words) == size:
                break
    return list(words)


def make_clients(
    num_clients: int = 10_000,
    vocab_size: int = 50_000,
    min_words: int = 10,
    max_words: int = 200,
    zipf: float = 1.0,
    seed: int = 0,
) -> list[list[str]]:
    """Each client's words: 10-200 draws from a Zipf(`zipf`) distribution over the vocabulary."""
    vocab = np.asarray(make_vocabulary(vocab_size, seed), dtype=object)
    rng = np.random.default_rng(seed + 1)
    p = 1.0 / np.arange(1, vocab_size + 1) ** zipf
    p /= p.sum()
    sizes = rng.integers(min_words, max_words + 1, size=num_clients)
    draws = rng.choice(vocab_size, size=int(sizes.sum()), p=p)
    return [list(vocab[c]) for c in np.split(draws, np.cumsum(sizes)[:-1])]


def true_top(clients: list[list[str]], k: int) -> list[str]:
    counts = collections.Counter(w for c in clients for w in c)
    return [w for w, _ in counts.most_common(k)]


def privacy_for(epsilon: float, rounds: int, clip: float, delta: float = 1e-6,
                seed: int = 0) -> analytics.Privacy | None:
    """The `Privacy` whose `rounds` Gaussian sums spend `epsilon` (None for infinity)."""
    if math.isinf(epsilon):
        return None
    lo, hi = 0.05, 200.0  # the accountant's epsilon decreases with the noise multiplier
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if aggregators.dp_epsilon(mid, 1.0, rounds, delta) > epsilon:
            lo = mid
        else:
            hi = mid
    return analytics.Privacy(noise_multiplier=hi, clip=clip, delta=delta, seed=seed)


def run_triehh(encoded: analytics.data.EncodedClients, top_k: int, max_len: int,
               max_prefixes: int, epsilon: float = math.inf) -> analytics.HeavyHitters:
    """Top words with TrieHH: every word votes without DP; one sampled word per client
    (L2 norm 1) and one round per byte with DP."""
    privacy = privacy_for(epsilon, max_len + 1, clip=1.0)
    algo = analytics.TrieHH(max_len=max_len, max_prefixes=max_prefixes,
                            votes="all" if privacy is None else "one", privacy=privacy)
    return algo.run(encoded.datasets, top_k)


def run_iblt(encoded: analytics.data.EncodedClients, top_k: int, max_len: int,
             capacity: int, epsilon: float = math.inf) -> analytics.HeavyHitters:
    """Top words with the IBLT sketch (DP counts of the decoded words with `epsilon`)."""
    privacy = privacy_for(epsilon, 1, clip=10.0)
    algo = analytics.IBLT(max_len=max_len, capacity=capacity, privacy=privacy)
    return algo.run(encoded.datasets, top_k)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Generates the data, runs both methods, prints and returns what they found."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--min-words", type=int, default=10)
    parser.add_argument("--max-words", type=int, default=200)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=10, help="bytes per word (longer: cut)")
    parser.add_argument("--max-prefixes", type=int, default=256)
    parser.add_argument("--capacity", type=int, default=None,
                        help="IBLT capacity (default: the vocabulary size)")
    parser.add_argument("--epsilon", type=float, default=math.inf)
    args = parser.parse_args(argv)

    clients = make_clients(args.clients, args.vocab, args.min_words, args.max_words)
    truth = true_top(clients, args.top_k)
    encoded = analytics.data.encode_clients(clients, args.max_len)
    print(f"{args.clients} clients, {sum(map(len, clients))} words, "
          f"{encoded.truncated} cut to {args.max_len} bytes")
    results: dict[str, Any] = {"truth": truth, "truncated": encoded.truncated}
    with fl.runtime.simulation_context():
        for name, run in [
            ("triehh", lambda: run_triehh(encoded, args.top_k, args.max_len, args.max_prefixes,
                                          args.epsilon)),
            ("iblt", lambda: run_iblt(encoded, args.top_k, args.max_len,
                                      args.capacity or args.vocab, args.epsilon)),
        ]:
            start = time.perf_counter()
            found = run()
            seconds = time.perf_counter() - start
            hits = len(set(found.items) & set(truth))
            spent = "" if found.privacy is None else f", (eps, delta) = " \
                f"({found.privacy.epsilon:.2f}, {found.privacy.delta:g})"
            print(f"{name}: {hits} of the true top {args.top_k} in {found.rounds} rounds, "
                  f"{seconds:.1f} s{spent}; top 5: {found.items[:5]}")
            results[name] = {"found": found, "hits": hits, "seconds": seconds}
    return results


if __name__ == "__main__":
    main()
