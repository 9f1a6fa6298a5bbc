"""Client data for the analytics: per-client datasets of numbers or encoded strings.

Each analytic reads one dataset per client (a `sequence<...>` of batches), so clients
of any size stream through a `dataset.reduce` on every runtime. These helpers turn
plain Python data (one list or array per client) into such datasets; a
`fedlang.simulation.ClientData` whose elements have the same type works as well.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from fedlang.backends.jax import strings
from fedlang.core import types

BATCH_SIZE = 256


def number_type(dtype: Any = np.float32, shape: Sequence[int] = ()) -> types.SequenceType:
    """`sequence<dtype[?,*shape]>`: a client's batches of numeric records."""
    return types.SequenceType(types.TensorType(dtype, [None, *shape]))


def string_type(max_len: int) -> types.SequenceType:
    """`sequence<<bytes=uint8[?,max_len],length=int32[?]>>`: a client's encoded strings."""
    return types.SequenceType(
        {"bytes": (np.uint8, [None, max_len]), "length": (np.int32, [None])}
    )


def number_batches(
    values: Any, dtype: Any = np.float32, shape: Sequence[int] = (), batch_size: int = BATCH_SIZE
) -> list[np.ndarray]:
    """One client's records (`[n, *shape]` array-like, or a list) as a list of batches."""
    arr = np.asarray(values, dtype=dtype)
    if arr.size == 0:
        return []
    arr = arr.reshape(-1, *shape)
    return [arr[i : i + batch_size] for i in range(0, len(arr), batch_size)]


class EncodedClients(NamedTuple):
    """Clients' strings as datasets of encoded batches.

    Attributes:
      datasets: one list of `{'bytes', 'length'}` batches per client.
      truncated: how many strings (over all clients) were longer than `max_len` bytes
        and were cut to fit (the analytics then see the cut string).
    """

    datasets: list[list[dict[str, np.ndarray]]]
    truncated: int


def encode_clients(
    clients: Iterable[Iterable[str]], max_len: int, batch_size: int = BATCH_SIZE
) -> EncodedClients:
    """Encodes each client's strings (`strings.encode`) into batches for the analytics.

    Example:
      >>> enc = encode_clients([["a", "bb"], [], ["toolong"]], max_len=4)
      >>> [len(d) for d in enc.datasets], enc.truncated
      ([1, 0, 1], 1)
    """
    if isinstance(clients, str | bytes):
        raise TypeError(
            f"Expected one list of strings per client, found the string {_short(clients)}; "
            "pass a list of clients' lists, e.g. [[\"hello\", \"world\"]] for one client."
        )
    datasets, truncated = [], 0
    for words in clients:
        if isinstance(words, str | bytes):
            raise TypeError(
                f"Expected one list of strings per client, found the string {_short(words)} "
                "where a client's list belongs (a flat list of strings would make each "
                "string a client and each character a string); pass [[\"hello\", \"world\"]] "
                "for one client holding both, or [[\"hello\"], [\"world\"]] for two."
            )
        words = list(words)
        batches = []
        for i in range(0, len(words), batch_size):
            enc = strings.encode(np.asarray(words[i : i + batch_size], dtype=types.STRING), max_len)
            truncated += enc.truncated
            batches.append({"bytes": enc.bytes, "length": enc.lengths})
        datasets.append(batches)
    return EncodedClients(datasets, truncated)


def _short(text: str | bytes) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37]) + "..."
