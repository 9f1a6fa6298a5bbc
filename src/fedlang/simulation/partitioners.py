"""Partitioners: split a centralized dataset's examples across simulated clients.

Each returns a dict client id (`'0'`, `'1'`, ...) -> int64 array of example
indices; every example is assigned to exactly one client. Feed the result to
`fedlang.simulation.from_numpy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Partition = dict[str, np.ndarray]


def _check_clients(num_clients: int, num_examples: int) -> None:
    if num_clients < 1:
        raise ValueError(f"Expected num_clients >= 1, found {num_clients}.")
    if num_examples < num_clients:
        raise ValueError(
            f"Expected at least one example per client, found {num_examples} examples for "
            f"{num_clients} clients. Use fewer clients."
        )


def _labels(labels: Any) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"Expected a 1-D array of labels, found shape {labels.shape}.")
    return labels


def _result(parts: Sequence[Any]) -> Partition:
    return {str(i): np.sort(np.asarray(p, dtype=np.int64)) for i, p in enumerate(parts)}


def iid(num_examples: int, num_clients: int, seed: int | None = None) -> Partition:
    """Shuffles examples and deals them into `num_clients` near-equal parts.

    Raises:
      ValueError: if there are fewer examples than clients.
    """
    _check_clients(num_clients, num_examples)
    order = np.random.default_rng(seed).permutation(num_examples)
    return _result(np.array_split(order, num_clients))


def dirichlet(labels: Any, num_clients: int, alpha: float, min_size: int = 1,
              seed: int | None = None, max_tries: int = 1000) -> Partition:
    """Label-skewed split: each class is divided among clients in Dir(alpha) proportions.

    Small `alpha` (0.1) gives clients few classes; large `alpha` (100) approaches IID.
    Draws are repeated until every client has at least `min_size` examples.

    Args:
      labels: one integer (or any hashable) label per example.
      num_clients: the number of clients.
      alpha: the Dirichlet concentration, > 0.
      min_size: the fewest examples any client may get (0 allows empty clients).
      seed: the random seed.
      max_tries: how many draws to attempt before giving up.

    Raises:
      ValueError: for bad arguments, or if no draw meets `min_size`.
    """
    labels = _labels(labels)
    _check_clients(num_clients, len(labels))
    if alpha <= 0:
        raise ValueError(f"Expected alpha > 0, found {alpha}.")
    if min_size * num_clients > len(labels):
        raise ValueError(f"Expected min_size * num_clients <= {len(labels)} examples, found {min_size} * {num_clients}.")
    rng = np.random.default_rng(seed)
    classes = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in classes:
            idx = rng.permutation(idx)
            cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha))) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        merged = [np.concatenate(p) for p in parts]
        if min(len(p) for p in merged) >= min_size:
            return _result(merged)
    raise ValueError(
        f"Expected a draw giving every client >= {min_size} examples, found none in {max_tries} "
        "tries. Increase alpha, lower min_size or use fewer clients."
    )


def shards(labels: Any, num_clients: int, shards_per_client: int = 2,
           seed: int | None = None) -> Partition:
    """McMahan et al. (2017): sort by label, cut into shards, give each client a few.

    Raises:
      ValueError: if there are fewer examples than shards.
    """
    labels = _labels(labels)
    num_shards = num_clients * shards_per_client
    if shards_per_client < 1:
        raise ValueError(f"Expected shards_per_client >= 1, found {shards_per_client}.")
    _check_clients(num_shards, len(labels))
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(len(labels)), labels))  # by label, ties broken randomly
    pieces = np.array_split(order, num_shards)
    assignment = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return _result([np.concatenate([pieces[s] for s in row]) for row in assignment])


def pathological(labels: Any, num_clients: int, classes_per_client: int,
                 seed: int | None = None) -> Partition:
    """Each client sees only `classes_per_client` classes; each class is shared evenly.

    Classes are dealt round-robin from a random permutation, so every class has at
    least one client whenever `num_clients * classes_per_client >= num_classes`.

    Raises:
      ValueError: if classes would be left without a client, or
        `classes_per_client` exceeds the number of classes.
    """
    labels = _labels(labels)
    classes = np.unique(labels)
    if not 1 <= classes_per_client <= len(classes):
        raise ValueError(f"Expected 1 <= classes_per_client <= {len(classes)} classes, found {classes_per_client}.")
    if num_clients * classes_per_client < len(classes):
        raise ValueError(
            f"Expected num_clients * classes_per_client >= {len(classes)} classes so each class has "
            f"a client, found {num_clients} * {classes_per_client}."
        )
    _check_clients(num_clients, len(labels))
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(classes))
    holders: dict[int, list[int]] = {}
    for client in range(num_clients):
        for j in range(classes_per_client):
            holders.setdefault(int(perm[(client * classes_per_client + j) % len(classes)]), []).append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, owners in holders.items():
        idx = rng.permutation(np.flatnonzero(labels == classes[c]))
        for owner, chunk in zip(owners, np.array_split(idx, len(owners))):
            parts[owner].append(chunk)
    return _result([np.concatenate(p) if p else np.empty(0, np.int64) for p in parts])


def natural(keys: Any) -> Partition:
    """Groups examples by a key column (writer, speaker, user): client id = str(key).

    Client ids come in sorted key order.
    """
    keys = np.asarray(keys)
    if keys.ndim != 1:
        raise ValueError(f"Expected a 1-D array of keys, found shape {keys.shape}.")
    unique, inverse = np.unique(keys, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=len(unique)))[:-1]
    return {str(k): idx.astype(np.int64) for k, idx in zip(unique, np.split(order, bounds))}
