"""`ClientData`: a federated dataset, one lazy `Dataset` per client.

A `ClientData` holds client ids and a recipe that builds a client's `Dataset` on
demand. Creating a client's dataset reads nothing; its data is read when the dataset
is iterated, so a simulation touches only the clients of the current round.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np

from fedlang.core import tff_names, types
from fedlang.simulation import _store_reader, errors, specs
from fedlang.simulation import dataset as dataset_lib


def _preview(ids: Sequence[str], k: int = 3) -> str:
    shown = ", ".join(repr(i) for i in ids[:k])
    return shown + (", ..." if len(ids) > k else "")


class ClientData:
    """Client ids plus a recipe for each client's `Dataset`.

    Args:
      client_ids: unique string ids, in the order `datasets()` visits them.
      dataset_fn: `dataset_fn(client_id) -> Dataset`; it should return a lazy recipe
        (reading data only when the dataset is iterated).
      element_spec: the spec of one element, if known; otherwise it is taken from the
        first client's dataset.
      num_examples: client id -> number of examples, as a mapping or a function, where
        cheaply known; otherwise `num_examples` counts by iterating.

    Raises:
      TypeError: if a client id is not a string.
      ValueError: if client ids repeat.

    Example:
      >>> import numpy as np
      >>> cd = ClientData.from_tensor_slices({'a': {'x': np.arange(3)}, 'b': {'x': np.arange(2)}})
      >>> cd.client_ids, cd.num_examples('a')
      (['a', 'b'], 3)
    """

    def __init__(
        self,
        client_ids: Sequence[str],
        dataset_fn: Callable[[str], dataset_lib.Dataset],
        *,
        element_spec: Any = None,
        num_examples: Mapping[str, int] | Callable[[str], int] | None = None,
    ):
        ids = list(client_ids)
        for cid in ids:
            if not isinstance(cid, str):
                raise TypeError(
                    f"Expected string client ids, found {type(cid).__name__} {cid!r}. "
                    "Convert ids with str()."
                )
        index = {cid: i for i, cid in enumerate(ids)}
        if len(index) != len(ids):
            dupes = sorted({c for c in ids if ids.count(c) > 1})[:5]
            raise ValueError(f"Expected unique client ids, found duplicates {dupes}.")
        self._ids = ids
        self._index = index
        self._dataset_fn = dataset_fn
        self._structure = None if element_spec is None else specs.to_structure(element_spec)
        if isinstance(num_examples, Mapping):
            counts = dict(num_examples)
            self._num_examples_fn: Callable[[str], int] | None = counts.__getitem__
        else:
            self._num_examples_fn = num_examples

    # -- constructors ------------------------------------------------------------

    @classmethod
    def from_clients_and_fn(
        cls, client_ids: Sequence[str], fn: Callable[[str], dataset_lib.Dataset], *,
        element_spec: Any = None,
    ) -> ClientData:
        """A `ClientData` whose datasets are `fn(client_id)` (as TFF's of the same name)."""
        return cls(client_ids, fn, element_spec=element_spec)

    @classmethod
    def from_tensor_slices(cls, data: Mapping[str, Any]) -> ClientData:
        """In-memory client data: client id -> structure of arrays (one row per example)."""
        datasets = {cid: dataset_lib.Dataset.from_tensor_slices(arrays) for cid, arrays in data.items()}
        return cls(list(datasets), datasets.__getitem__,
                   num_examples={c: cast(int, d.cardinality) for c, d in datasets.items()})

    @classmethod
    def from_store(cls, path: str | os.PathLike | _store_reader.Reader) -> ClientData:
        """Opens an on-disk store written by `fedlang.simulation.store.write`
        (memory-mapped); an open store (`store.open_store`) is used as it is."""
        store = path if isinstance(path, _store_reader.Reader) else _store_reader.Reader(path)
        return cls(store.client_ids, store.read_client, element_spec=store.structure,
                   num_examples=store.num_examples)

    # -- access ------------------------------------------------------------------

    _TFF_SPELLINGS = {
        "create_tf_dataset_for_client": "create_dataset_for_client(client_id), a fedlang "
        "Dataset (no TensorFlow)",
        "create_tf_dataset_from_all_clients": "create_dataset_from_all_clients(seed)",
        "serializable_dataset_fn": "create_dataset_for_client (any Python function works "
        "in a simulation)",
    }

    def __getattr__(self, name: str) -> Any:
        # Called only when normal lookup fails: TFF's spellings get fedlang's name.
        raise tff_names.missing(self, name, self._TFF_SPELLINGS)

    @property
    def client_ids(self) -> list[str]:
        """The client ids (a copy)."""
        return list(self._ids)

    def __repr__(self) -> str:
        return f"ClientData({len(self._ids)} clients: {_preview(self._ids)})"

    def _check_id(self, client_id: str) -> None:
        if client_id not in self._index:
            raise errors.UnknownClientError(
                f"Expected a client id of this ClientData, found {client_id!r}. It has "
                f"{len(self._ids)} clients ({_preview(self._ids)}); list them with "
                "`client_data.client_ids`."
            )

    def create_dataset_for_client(self, client_id: str) -> dataset_lib.Dataset:
        """The lazy `Dataset` of one client (nothing is read until it is iterated).

        Raises:
          UnknownClientError: (a `KeyError` and `ValueError`) for an unknown id.
        """
        self._check_id(client_id)
        return self._dataset_fn(client_id)

    def datasets(self, limit_count: int | None = None, seed: int | None = None
                 ) -> Iterator[dataset_lib.Dataset]:
        """Lazily yields client datasets, in id order or shuffled by `seed`.

        Args:
          limit_count: stop after this many clients.
          seed: if given, visit clients in a random order determined by it.
        """
        ids = self._ordered_ids(seed)
        for cid in ids[:limit_count]:
            yield self._dataset_fn(cid)

    def _ordered_ids(self, seed: int | None) -> list[str]:
        if seed is None:
            return list(self._ids)
        order = np.random.default_rng(seed).permutation(len(self._ids))
        return [self._ids[i] for i in order]

    @property
    def structure(self) -> Any:
        """One element's structure (see `Dataset.structure`).

        Raises:
          ValueError: if there are no clients and no spec was given.
        """
        if self._structure is None:
            if not self._ids:
                raise ValueError("Cannot infer the element spec of a ClientData with no clients.")
            self._structure = self._dataset_fn(self._ids[0]).structure
        return self._structure

    @property
    def element_spec(self) -> types.Type:
        """The fedlang type of one element of every client's dataset (strings: `str`)."""
        return specs.element_type(self.structure)

    def num_examples(self, client_id: str) -> int:
        """A client's number of examples: from metadata when known, else by counting.

        Raises:
          UnknownClientError: for an unknown id.
        """
        self._check_id(client_id)
        if self._num_examples_fn is not None:
            return int(self._num_examples_fn(client_id))
        ds = self._dataset_fn(client_id)
        if ds.cardinality is not None:
            return ds.cardinality
        return sum(1 for _ in ds)

    # -- derived client data ------------------------------------------------------

    def preprocess(self, fn: Callable[[dataset_lib.Dataset], dataset_lib.Dataset]) -> ClientData:
        """A new `ClientData` whose datasets are `fn(dataset)` (applied lazily).

        Raises:
          TypeError: (when a dataset is created) if `fn` does not return a `Dataset`.
        """

        def dataset_fn(client_id: str) -> dataset_lib.Dataset:
            out = fn(self._dataset_fn(client_id))
            if not isinstance(out, dataset_lib.Dataset):
                raise TypeError(
                    f"Expected preprocess fn to return a Dataset, found {type(out).__name__}."
                )
            return out

        return ClientData(self._ids, dataset_fn)

    def subset(self, client_ids: Sequence[str]) -> ClientData:
        """The same data restricted to `client_ids` (in the given order).

        Raises:
          UnknownClientError: if an id is unknown.
        """
        for cid in client_ids:
            self._check_id(cid)
        return ClientData(client_ids, self._dataset_fn, element_spec=self._structure,
                          num_examples=self._num_examples_fn)

    def create_dataset_from_all_clients(self, seed: int | None = None) -> dataset_lib.Dataset:
        """All clients' examples as one streamed `Dataset` (clients concatenated).

        Args:
          seed: if given, clients are concatenated in an order shuffled by it
            (examples within a client keep their order).
        """
        ids = self._ordered_ids(seed)

        def iter_fn(path: tuple[int, ...]) -> Iterator[Any]:
            for cid in ids:
                yield from self._dataset_fn(cid)

        return dataset_lib.Dataset(iter_fn, structure_fn=lambda: self.structure)

    @staticmethod
    def train_test_client_split(client_data: ClientData, num_test_clients: int,
                                seed: int | None = None) -> tuple[ClientData, ClientData]:
        """Splits clients (not examples) into disjoint train and test `ClientData`.

        Args:
          client_data: the data to split.
          num_test_clients: how many clients go to the test side.
          seed: shuffles clients before splitting; None keeps id order (the last
            `num_test_clients` ids are the test clients).

        Returns:
          `(train, test)`.

        Raises:
          ValueError: unless `1 <= num_test_clients < number of clients`.
        """
        n = len(client_data._ids)
        if not 1 <= num_test_clients < n:
            raise ValueError(
                f"Expected 1 <= num_test_clients < {n} (the number of clients), found "
                f"{num_test_clients}; both sides need at least one client."
            )
        ids = client_data._ordered_ids(seed)
        return client_data.subset(ids[: n - num_test_clients]), client_data.subset(
            ids[n - num_test_clients :]
        )


def train_test_client_split(client_data: ClientData, num_test_clients: int,
                            seed: int | None = None) -> tuple[ClientData, ClientData]:
    """Same as `ClientData.train_test_client_split`."""
    return ClientData.train_test_client_split(client_data, num_test_clients, seed)
