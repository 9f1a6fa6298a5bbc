"""The standard benchmark workload: a synthetic EMNIST-shaped federated dataset.

1,000 clients of 28x28 float32 pixels in [0, 1] with 10 labels, deterministic from a
seed. Nothing is stored: a client's examples are generated from (seed, client index)
when asked for, so a cohort of 1,000 clients never needs to be in memory at once.

* Client sizes: lognormal with mean ~200 examples, clipped to [20, 1000].
* Labels: each client draws its label proportions from Dirichlet(0.5) (non-IID).
* Pixels: a per-label prototype (a shared random background plus a weak per-label
  pattern of 4x4-pixel blocks) plus Gaussian noise (sigma 0.5), clipped to [0, 1].
  Learnable by a linear model, but not solved in one round.

Example:
  >>> ds = FederatedEmnist(seed=0)
  >>> x, y = ds.client_arrays(3)
  >>> x.shape[1:], x.dtype, y.dtype
  ((28, 28), dtype('float32'), dtype('int32'))
  >>> batches = ds.client_batches(3, batch_size=20, round_num=0)
  >>> batches[0]['x'].shape
  (20, 28, 28)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

NUM_CLIENTS = 1000
NUM_CLASSES = 10
SIDE = 28
MEAN_SIZE = 210  # lognormal mean before clipping; ~200 after it
SIZE_SIGMA = 0.7
MIN_SIZE, MAX_SIZE = 20, 1000
DIRICHLET_ALPHA = 0.5
NOISE_SIGMA = 0.5
PATTERN_AMPLITUDE = 0.06  # strength of the per-label block pattern (the signal)
BLOCK = 4

_TEST_STREAM = 1 << 30  # rng stream id of the test set (client ids are below it)
_SHUFFLE_STREAM = 1 << 29


class FederatedEmnist:
    """The federated dataset, generated lazily and deterministically from `seed`."""

    def __init__(self, seed: int = 0, num_clients: int = NUM_CLIENTS):
        self.seed = seed
        self.num_clients = num_clients
        rng = np.random.default_rng([seed, 0])
        mu = np.log(MEAN_SIZE) - SIZE_SIGMA**2 / 2
        self.sizes = np.clip(
            np.round(rng.lognormal(mu, SIZE_SIGMA, num_clients)), MIN_SIZE, MAX_SIZE
        ).astype(np.int64)
        background = rng.uniform(0.2, 0.5, (SIDE, SIDE)).astype(np.float32)
        cells = SIDE // BLOCK
        signs = rng.choice([-1.0, 1.0], size=(NUM_CLASSES, cells, cells))
        pattern = np.kron(signs, np.ones((BLOCK, BLOCK)))  # [10, 28, 28] of 4x4 blocks
        self.prototypes = (background + PATTERN_AMPLITUDE * pattern).astype(np.float32)

    def _examples(self, rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
        noise = rng.standard_normal((len(labels), SIDE, SIDE), dtype=np.float32)
        x = self.prototypes[labels]
        x += NOISE_SIGMA * noise
        np.clip(x, 0.0, 1.0, out=x)
        return x

    def client_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Client `index`'s examples: (x float32[n,28,28], y int32[n])."""
        if not 0 <= index < self.num_clients:
            raise IndexError(f"Expected a client index in [0, {self.num_clients}), found {index}.")
        rng = np.random.default_rng([self.seed, 1, index])
        n = int(self.sizes[index])
        proportions = rng.dirichlet(np.full(NUM_CLASSES, DIRICHLET_ALPHA))
        labels = rng.choice(NUM_CLASSES, size=n, p=proportions).astype(np.int32)
        return self._examples(rng, labels), labels

    def client_batches(
        self, index: int, batch_size: int = 20, round_num: int = 0, flat: bool = False
    ) -> list[dict[str, np.ndarray]]:
        """One local epoch of client `index`: shuffled full batches {'x', 'y'}.

        The last partial batch is dropped (as `batch(drop_remainder=True)`), so every
        batch has one shape. `flat` gives x as float32[b, 784].
        """
        x, y = self.client_arrays(index)
        order = np.random.default_rng([self.seed, _SHUFFLE_STREAM, index, round_num]).permutation(
            len(y)
        )
        if flat:
            x = x.reshape(len(y), SIDE * SIDE)
        return [
            {"x": x[idx], "y": y[idx]}
            for idx in (
                order[i : i + batch_size] for i in range(0, len(y) - batch_size + 1, batch_size)
            )
        ]

    def lazy_client(
        self, index: int, batch_size: int = 20, round_num: int = 0, flat: bool = False
    ) -> LazyClient:
        """Client `index`'s batches as an iterable that generates them when iterated."""
        return LazyClient(self, index, batch_size, round_num, flat)

    def num_examples(self, index: int, batch_size: int = 20) -> int:
        """Examples in client `index`'s full batches."""
        return int(self.sizes[index]) // batch_size * batch_size

    def test_set(self, n: int = 10_000, flat: bool = False) -> dict[str, np.ndarray]:
        """Held-out examples with uniform labels, from the same prototypes."""
        rng = np.random.default_rng([self.seed, _TEST_STREAM])
        labels = rng.integers(0, NUM_CLASSES, n).astype(np.int32)
        x = self._examples(rng, labels)
        return {"x": x.reshape(n, -1) if flat else x, "y": labels}

    def sample_cohort(self, round_num: int, size: int) -> np.ndarray:
        """`size` distinct clients, uniformly at random, for round `round_num`."""
        rng = np.random.default_rng([self.seed, 2, round_num])
        return rng.choice(self.num_clients, size=size, replace=False)


class LazyClient:
    """A client dataset generated on each iteration (never held by the caller)."""

    def __init__(self, ds: FederatedEmnist, index: int, batch_size: int, round_num: int, flat: bool):
        self.ds, self.index = ds, index
        self.batch_size, self.round_num, self.flat = batch_size, round_num, flat

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return iter(self.ds.client_batches(self.index, self.batch_size, self.round_num, self.flat))
