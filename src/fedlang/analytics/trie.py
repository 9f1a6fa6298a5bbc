"""TrieHH: heavy hitters over strings by growing a trie one byte per round.

Zhu et al., "Federated Heavy Hitters Discovery with Differential Privacy" (AISTATS
2020). The server keeps the prefixes found so far (all of length `r` in round `r`);
each client votes for the one-byte extensions of those prefixes that its strings have
(or for the end of the string when a string *is* the prefix); the server keeps the
extensions with at least `threshold` votes (at most `max_prefixes` of them, the most
voted), and a string whose end was voted is a heavy hitter with that count.

One round is one federated computation: the live prefixes travel as two 32-bit hashes
each (clients compare hashes of their strings' prefixes, computed in JAX with
`strings.hash_bytes`), and the votes as an `int32[max_prefixes * 257]` sum (256 bytes
plus the end marker). A client votes with every string it holds (`votes='all'`: the
counts are the strings' occurrences), or with one string (`votes='one'`).

What `votes='one'` counts. The paper's users each contribute one word for the whole run
(its analysis holds a user's word fixed; TFF's TrieHH likewise lets a client vote with
the same few words, `max_user_contribution` of its most frequent, in every round). So
each client draws one of its strings uniformly at random (with the run's `seed`), once:
the same string in every round, whether or not its prefix is live. In round `r` it votes
for that string's byte `r` (or its end) while the string's first `r` bytes are a live
prefix. A prefix's votes are then the number of clients whose drawn string extends it,
never more than any of its own prefixes had, and a string's count is the number of
clients that drew it: an unbiased estimate of its *client share*, the sum over clients
of (its occurrences on the client / the client's number of strings), not of its
occurrences. The ranking follows client shares, with sampling noise of about
sqrt(count); a string that is frequent overall but thinly spread over clients holding
many strings (expected draws below `threshold`) is lost, e.g. a word said 1,000 times by
300 clients holding 50 words each has a share of about 20. (Until fedlang 0.1 each round
drew afresh among the strings extending a live prefix: late rounds had few candidates,
so long strings were over-counted and frequent prefixes lost.)

Privacy: with `Privacy(z, clip)` the vote vector is summed by the DP factory (clipped to
L2 norm `clip`, Gaussian noise `z * clip` per entry; with `votes='one'` one client's
vector has norm 1) and thresholded, each round; the cost of the rounds run is composed
by the accountant (`Privacy.spent(rounds)`). Without noise the paper's
sampling-and-thresholding argument applies, which fedlang does not account.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from fedlang.analytics import data
from fedlang.analytics import privacy as privacy_lib
from fedlang.backends.jax import computation as jax_backend
from fedlang.backends.jax import strings
from fedlang.core import computation, operators, tracing, types

END = 256  # the extension that ends a string
EXTENSIONS = 257
PREFIX_SEEDS = (0x7121, 0x7122)


class HeavyHitters(NamedTuple):
    """Heavy hitters found, most frequent first.

    Attributes:
      items: the strings.
      counts: their estimated counts (noisy with DP).
      rounds: federated rounds run.
      privacy: the spent `(epsilon, delta)` with DP, else None.
      truncated: strings cut to `max_len` bytes when encoding the clients' data.
    """

    items: list[str]
    counts: np.ndarray
    rounds: int
    privacy: privacy_lib.Spent | None
    truncated: int = 0


def check_positive_ints(config: Any, *names: str) -> None:
    """Refuses a configuration whose fields `names` are not positive integers."""
    for name in names:
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Expected {name} to be a positive integer, found {v!r}.")


def prefix_table(prefixes: list[bytes], max_len: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The prefixes' two hashes (`uint32[capacity, 2]`, padded with all-ones rows) and
    which rows are real. Callers pass prefixes sorted by `sort_by_hash`, so that the
    first hashes are ascending and clients can look them up with `searchsorted`."""
    table = np.full((capacity, len(PREFIX_SEEDS)), 0xFFFFFFFF, np.uint32)
    valid = np.zeros(capacity, np.bool_)
    if prefixes:
        raw = np.zeros((len(prefixes), max_len), np.uint8)
        lengths = np.zeros(len(prefixes), np.int32)
        for i, p in enumerate(prefixes):
            raw[i, : len(p)] = np.frombuffer(p, np.uint8)
            lengths[i] = len(p)
        table[: len(prefixes)] = np.stack(
            [strings.hash_bytes(raw, lengths, s) for s in PREFIX_SEEDS], -1
        )
        valid[: len(prefixes)] = True
    return table, valid


def sort_by_hash(prefixes: list[bytes], max_len: int) -> list[bytes]:
    """`prefixes` ordered by their first hash (the order of the vote rows)."""
    if not prefixes:
        return []
    table, _ = prefix_table(prefixes, max_len, len(prefixes))
    return [prefixes[i] for i in np.argsort(table[:, 0], kind="stable")]


@dataclasses.dataclass(frozen=True)
class TrieHH:
    """TrieHH over clients' strings encoded to `max_len` bytes (see the module docstring).

    Attributes:
      max_len: the strings' width in bytes (`data.encode_clients(..., max_len)`).
      max_prefixes: the most prefixes kept per round (the vote vector's rows).
      threshold: the votes an extension needs to be kept (default 1 without DP,
        `4 * z * clip` with DP).
      votes: 'all' (every string votes; counts are occurrences) or 'one' (one string
        per client, drawn once per run; counts are clients, see the module docstring).
      privacy: a `Privacy`, or None.
      seed: the seed of the clients' draws with `votes='one'`.
    """

    max_len: int = 16
    max_prefixes: int = 256
    threshold: float | None = None
    votes: str = "all"
    privacy: privacy_lib.Privacy | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.votes not in ("all", "one"):
            raise ValueError(f"Expected votes='all' or 'one', found {self.votes!r}.")
        check_positive_ints(self, "max_len", "max_prefixes")
        privacy_lib.check_privacy(self.privacy)

    @property
    def min_votes(self) -> float:
        """The threshold in use."""
        if self.threshold is not None:
            return float(self.threshold)
        return 1.0 if self.privacy is None else 4.0 * self.privacy.stddev

    def vote_computation(self) -> computation.Computation:
        """The local computation of one client's votes.

        Type signature: `(<sequence<<bytes=uint8[?,L],length=int32[?]>>,
        <prefixes=uint32[K,2],valid=bool[K],length=int32,seed=uint32>> ->
        int32[K*257])`.
        """
        k, width, one = self.max_prefixes, self.max_len, self.votes == "one"
        round_t = types.to_type({
            "prefixes": (np.uint32, [k, len(PREFIX_SEEDS)]), "valid": (np.bool_, [k]),
            "length": np.int32, "seed": np.uint32,
        })

        @jax_backend.jax_computation(data.string_type(width), round_t)
        def client_votes(dataset, trie):
            r = trie["length"]

            def cells(batch, mask):
                b, n = batch["bytes"], batch["length"]
                pl = jnp.minimum(n, r)
                h1 = strings.hash_bytes(b, pl, PREFIX_SEEDS[0])
                h2 = strings.hash_bytes(b, pl, PREFIX_SEEDS[1])
                table = trie["prefixes"]
                row = jnp.clip(jnp.searchsorted(table[:, 0], h1), 0, k - 1).astype(jnp.int32)
                match = (table[row, 0] == h1) & (table[row, 1] == h2) & trie["valid"][row]
                ok = match & (n >= r) & (mask > 0)
                ext = jnp.where(n > r, b[:, jnp.clip(r, 0, width - 1)].astype(jnp.int32), END)
                return row * EXTENSIONS + ext, ok, b, n

            if not one:
                def step(state, batch, mask):
                    cell, ok, _, _ = cells(batch, mask)
                    return state.at[cell].add(ok.astype(jnp.int32))

                return dataset.reduce(jnp.zeros(k * EXTENSIONS, jnp.int32), step, masked=True)

            # The client's one string is drawn uniformly among all of its strings, the
            # same in every round of a run (not among those extending a live prefix, nor
            # afresh each round: see the module docstring); it votes while that string's
            # prefix is live. A string's priority hashes it with its position and a salt
            # of the client's data so far, so that clients holding the same string at the
            # same position still draw independently.
            def pick(state, batch, mask):
                cell, ok, b, n = cells(batch, mask)
                real = mask > 0
                index = state["seen"] + jnp.cumsum(real.astype(jnp.uint32))
                position = index * jnp.uint32(0x9E3779B9)
                content = strings.hash_bytes(b, n, trie["seed"] ^ position)
                salt = state["salt"] + jnp.sum(jnp.where(real, content, jnp.uint32(0)),
                                               dtype=jnp.uint32)
                prio = strings.hash_bytes(b, n, salt ^ position)
                prio = jnp.where(real, prio, jnp.uint32(0xFFFFFFFF))
                i = jnp.argmin(prio)
                better = real[i] & (~state["has"] | (prio[i] < state["prio"]))
                return {"prio": jnp.where(better, prio[i], state["prio"]),
                        "cell": jnp.where(better, cell[i], state["cell"]),
                        "ok": jnp.where(better, ok[i], state["ok"]),
                        "has": state["has"] | real[i],
                        "seen": index[-1], "salt": salt}

            init = {"prio": jnp.uint32(0xFFFFFFFF), "cell": jnp.int32(0), "ok": jnp.bool_(False),
                    "has": jnp.bool_(False), "seen": jnp.uint32(0), "salt": jnp.uint32(0)}
            best = dataset.reduce(init, pick, masked=True)
            return jnp.zeros(k * EXTENSIONS, jnp.int32).at[best["cell"]].add(
                (best["has"] & best["ok"]).astype(jnp.int32))

        return client_votes

    def round_computation(self) -> tuple[computation.Computation, Any]:
        """The federated computation of one round's summed votes, and its first state.

        Type signature: `(<{sequence<...>}@CLIENTS,<prefixes=...,...>@SERVER,S@SERVER> ->
        <votes=int32[K*257],state=S>@SERVER)` (float32 votes with DP), where `S` is the DP
        aggregation's state (its noise key advances each round; `<>` without DP).
        """
        votes = self.vote_computation()
        dataset_t, round_t = votes.type_signature.parameter.types  # type: ignore[union-attr]
        process = None
        if self.privacy is not None:
            process = self.privacy.factory().create(
                types.TensorType(np.float32, [self.max_prefixes * EXTENSIONS])
            )
        state_t = (
            process.initialize.type_signature.result  # type: ignore[union-attr]
            if process is not None
            else types.type_at_server(types.StructType([]))
        )

        @tracing.federated_computation(
            types.type_at_clients(dataset_t), types.type_at_server(round_t), state_t
        )
        def one_round(datasets, trie, state):
            client = operators.federated_map(votes, (datasets, operators.federated_broadcast(trie)))
            if process is None:
                return operators.federated_zip(
                    {"votes": operators.federated_sum(client), "state": state}
                )
            out = process.next(state, operators.federated_map(_as_float, client))
            return operators.federated_zip({"votes": out.result, "state": out.state})

        initial = process.initialize() if process is not None else ()
        return one_round, initial

    def run(self, client_datasets: Sequence[Any], top_k: int | None = None) -> HeavyHitters:
        """Runs the rounds on clients' encoded datasets (`data.encode_clients`) in the
        current runtime; returns the heavy hitters (the `top_k` most frequent, or all)."""
        width, cap = self.max_len, self.max_prefixes
        threshold = self.min_votes
        live: list[bytes] = [b""]
        found: dict[bytes, float] = {}
        comp, state = self.round_computation()
        datasets = list(client_datasets)
        rounds = 0
        for r in range(width + 1):
            if not live:
                break
            live = sort_by_hash(live, width)
            table, valid = prefix_table(live, width, cap)
            trie = {"prefixes": table, "valid": valid, "length": np.int32(r),
                    "seed": np.uint32(self.seed % 2**32)}
            out = comp(datasets, trie, state)
            state = out["state"]
            votes = np.asarray(out["votes"], np.float64).reshape(cap, EXTENSIONS)
            rounds += 1
            grown = []
            for row, col in zip(*np.nonzero(votes[: len(live)] >= threshold)):
                if col == END:
                    found[live[row]] = float(votes[row, col])
                elif r < width:
                    grown.append((votes[row, col], live[row] + bytes([col])))
            grown.sort(key=lambda x: (-x[0], x[1]))
            live = [p for _, p in grown[:cap]]
        items = sorted(found.items(), key=lambda x: (-x[1], x[0]))[:top_k]
        spent = None if self.privacy is None else self.privacy.spent(rounds)
        texts = [p.decode("utf-8", errors="replace") for p, _ in items]
        return HeavyHitters(texts, np.asarray([c for _, c in items]), rounds, spent)


@jax_backend.jax_computation
def _as_float(v):
    return jnp.asarray(v, jnp.float32)


def triehh(
    client_strings: Sequence[Sequence[str]],
    top_k: int | None = None,
    *,
    max_len: int = 16,
    max_prefixes: int = 256,
    threshold: float | None = None,
    votes: str = "all",
    privacy: privacy_lib.Privacy | None = None,
    seed: int = 0,
) -> HeavyHitters:
    """Heavy hitters of the clients' strings (one list per client) with TrieHH.

    With `votes='one'` the counts are clients' draws, not occurrences (see the module
    docstring).

    Raises:
      TypeError: if `client_strings` is a flat list of strings, not one list per client.

    Example:
      >>> hh = triehh([["a", "bb", "a"], ["a", "c"], []], max_len=4)
      >>> hh.items, hh.counts.tolist()
      (['a', 'bb', 'c'], [3.0, 1.0, 1.0])
    """
    enc = data.encode_clients(client_strings, max_len)
    algo = TrieHH(max_len, max_prefixes, threshold, votes, privacy, seed)
    return algo.run(enc.datasets, top_k)._replace(truncated=enc.truncated)

