"""Generated and bundled client data for examples and tests (nothing is downloaded).

- `synthetic(alpha, beta, ...)`: Synthetic(alpha, beta) of the FedProx paper (Li et al.,
  2020), where alpha controls how much client models differ and beta how much client
  feature distributions differ.
- `digits(...)`: scikit-learn's bundled 8x8 digits, split across clients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib
from fedlang.simulation import partitioners, specs
from fedlang.simulation.formats import arrays


def synthetic(alpha: float, beta: float, num_clients: int = 30, *, num_features: int = 60,
              num_classes: int = 10, examples_per_client: Sequence[int] | None = None,
              seed: int = 0) -> client_data_lib.ClientData:
    """Synthetic(alpha, beta) from FedProx (Li et al., 2020), generated lazily per client.

    For client k: u_k ~ N(0, alpha), W_k ~ N(u_k, 1) (features x classes),
    b_k ~ N(u_k, 1); B_k ~ N(0, beta), v_k ~ N(B_k, 1); x ~ N(v_k, S) with S diagonal,
    S_jj = j^-1.2; y = argmax(softmax(W_k x + b_k)). As in the reference code, alpha and
    beta are standard deviations and client sizes follow a power law
    (lognormal(4, 2) + 50).

    Args:
      alpha: spread of client models (0 = all clients share one model's mean).
      beta: spread of client feature means.
      num_clients: the number of clients, ids '0', '1', ...
      num_features: feature dimension (60 in the paper).
      num_classes: number of classes (10 in the paper).
      examples_per_client: override the power-law sizes.
      seed: everything is a deterministic function of it.

    Returns:
      A `ClientData` with elements `{'x': float32[num_features], 'y': int32}`.
    """
    rng = np.random.default_rng(seed)
    if examples_per_client is None:
        sizes = (rng.lognormal(4, 2, num_clients).astype(np.int64) + 50)
    else:
        sizes = np.asarray(examples_per_client, dtype=np.int64)
        if sizes.shape != (num_clients,) or (sizes < 0).any():
            raise ValueError(f"Expected {num_clients} non-negative sizes, found {sizes.shape} values.")
    u = rng.normal(0, alpha, num_clients)
    big_b = rng.normal(0, beta, num_clients)
    std = np.arange(1, num_features + 1, dtype=np.float64) ** -0.6  # sqrt of j^-1.2
    ids = [str(k) for k in range(num_clients)]

    def make(k: int) -> dict[str, np.ndarray]:
        r = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(k,)))
        w = r.normal(u[k], 1, (num_features, num_classes))
        b = r.normal(u[k], 1, num_classes)
        v = r.normal(big_b[k], 1, num_features)
        x = v + std * r.standard_normal((int(sizes[k]), num_features))
        y = np.argmax(x @ w + b, axis=1)  # softmax is monotone
        return {"x": x.astype(np.float32), "y": y.astype(np.int32)}

    structure = {"x": specs.to_structure((np.float32, [num_features])),
                 "y": specs.to_structure(np.int32)}

    def dataset_fn(cid: str) -> dataset_lib.Dataset:
        return dataset_lib.Dataset.from_slices_fn(lambda: make(int(cid)), structure,
                                                  cardinality=int(sizes[int(cid)]))

    return client_data_lib.ClientData(ids, dataset_fn, element_spec=structure,
                                      num_examples={c: int(s) for c, s in zip(ids, sizes)})


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn import datasets as sk_datasets
    except ImportError as e:
        raise ImportError("digits() needs scikit-learn: pip install 'fedlang[examples]'.") from e
    bunch = sk_datasets.load_digits()
    return (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int32)


def _partition(y: np.ndarray, num_clients: int, partition: str | Mapping[str, Any],
               alpha: float, seed: int) -> Mapping[str, Any]:
    if not isinstance(partition, str):
        return partition
    if partition == "dirichlet":
        return partitioners.dirichlet(y, num_clients, alpha, min_size=2, seed=seed)
    if partition == "iid":
        return partitioners.iid(len(y), num_clients, seed)
    if partition == "shards":
        return partitioners.shards(y, num_clients, 2, seed)
    if partition == "pathological":
        return partitioners.pathological(y, num_clients, 2, seed)
    raise ValueError(
        f"Expected partition 'dirichlet', 'iid', 'shards', 'pathological' or a dict, found {partition!r}."
    )


def digits(num_clients: int = 10, partition: str | Mapping[str, Any] = "dirichlet",
           alpha: float = 0.5, seed: int = 0) -> client_data_lib.ClientData:
    """scikit-learn's bundled digits (1,797 8x8 images, 10 classes) split across clients.

    Args:
      num_clients: the number of clients.
      partition: 'dirichlet' (label skew with `alpha`), 'iid', 'shards' (2 per
        client), 'pathological' (2 classes per client), or a ready partition.
      alpha: the Dirichlet concentration.
      seed: the partition seed.

    Returns:
      A `ClientData` with elements `{'x': float32[64] in [0, 1], 'y': int32}`.

    Raises:
      ImportError: without scikit-learn.
    """
    x, y = _load_digits()
    return arrays.from_numpy(x, y, _partition(y, num_clients, partition, alpha, seed))


def digits_train_test(num_clients: int = 10, partition: str | Mapping[str, Any] = "dirichlet",
                      alpha: float = 0.5, test_fraction: float = 0.2, seed: int = 0
                      ) -> tuple[client_data_lib.ClientData, client_data_lib.ClientData]:
    """`digits` with each client's examples split into train and test (same client ids,
    like TFF's EMNIST), `test_fraction` of each client held out (at least one example
    on each side when the client has two or more).

    Returns:
      `(train, test)`.
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"Expected 0 < test_fraction < 1, found {test_fraction}.")
    x, y = _load_digits()
    parts = _partition(y, num_clients, partition, alpha, seed)
    rng = np.random.default_rng(seed + 1)
    train, test = {}, {}
    for cid, idx in parts.items():
        idx = rng.permutation(np.asarray(idx))
        k = round(len(idx) * test_fraction)
        k = min(max(k, 1), len(idx) - 1) if len(idx) >= 2 else 0
        test[cid], train[cid] = idx[:k], idx[k:]
    return arrays.from_numpy(x, y, train), arrays.from_numpy(x, y, test)
