"""`Dataset`: a small lazy, re-iterable pipeline over one client's examples.

A `Dataset` is a *recipe*: building one reads nothing; each `iter(dataset)` starts a
fresh pass that pulls elements through the chain of transformations, so data much
larger than memory streams through in constant memory. Elements are (nested) dicts,
tuples, lists or namedtuples of numpy arrays and scalars.

Why not `tf.data` or a torch `DataLoader`? fedlang depends on JAX and numpy only;
pulling TensorFlow (~500 MB) or torch into every install to iterate over arrays would
dwarf the rest of the package, and the runtimes only need Python iteration plus a
background thread. The operations and their names follow `tf.data` so TFF users feel
at home.

Element types. `element_spec` is a fedlang type (`fedlang.core.types`) describing one
element, e.g. `<pixels=float32[28,28],label=int32>`. String fields (text before
tokenization) are described by `specs.StringSpec` in `Dataset.structure` and are `str`
tensors in `element_spec` (`<snippets=str>`): computations move and store them, and JAX
code reads them once encoded (`fedlang.backends.jax.strings`).
A scalar string field holds a Python `str` or `bytes`; after `batch` it is a numpy
object array.

Shuffling is deterministic for a given seed: pass `k` of a `repeat` reshuffles with a
seed derived from `(seed, k)`, so `ds.shuffle(100, seed=1).repeat(3)` sees three
different orders, while iterating the same dataset twice gives the same elements.
With `seed=None` every pass draws fresh OS entropy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from fedlang.core import types
from fedlang.simulation import _prefetch, _tree, specs

# A pass is identified by its path of enclosing `repeat` counters; shuffles seed from it.
_Path = tuple[int, ...]
_IterFn = Callable[[_Path], Iterator[Any]]


def _stack(values: list[Any], where: str) -> np.ndarray:
    if isinstance(values[0], str | bytes):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out
    try:
        return np.stack([np.asarray(v) for v in values])
    except ValueError as e:
        shapes = sorted({np.shape(v) for v in values})
        raise ValueError(
            f"Expected elements of one shape to batch{where}, found shapes {shapes}. "
            "Pad or crop them to a common shape with `map` before `batch`."
        ) from e


def _columns(arrays: Any) -> Any:
    if isinstance(arrays, dict):
        return type(arrays)((k, _columns(v)) for k, v in arrays.items())
    if isinstance(arrays, tuple):
        values = [_columns(v) for v in arrays]
        return type(arrays)(*values) if hasattr(arrays, "_fields") else tuple(values)
    return _as_column(arrays)


def _as_column(x: Any) -> np.ndarray:
    if isinstance(x, list | tuple) and x and isinstance(x[0], str | bytes):
        out = np.empty(len(x), dtype=object)
        out[:] = list(x)
        return out
    return np.asarray(x)


class Dataset:
    """A lazy, re-iterable sequence of elements (one client's data).

    Build one with `from_tensor_slices`, `from_generator`, `from_generator_fn`,
    `from_iterable` or `from_slices_fn`, then chain `map`, `flat_map`, `filter`,
    `shuffle`, `batch`, `unbatch`, `repeat`, `take` and `prefetch`. Each returns a
    new `Dataset`; nothing runs until iterated.

    Example:
      >>> import numpy as np
      >>> ds = Dataset.from_tensor_slices({'x': np.arange(5, dtype=np.float32)})
      >>> [b['x'].tolist() for b in ds.map(lambda e: {'x': e['x'] * 2}).batch(2)]
      [[0.0, 2.0], [4.0, 6.0], [8.0]]
      >>> str(ds.batch(2).element_spec)
      '<x=float32[?]>'
    """

    def __init__(
        self,
        iter_fn: _IterFn,
        structure: Any = None,
        *,
        structure_fn: Callable[[], Any] | None = None,
        slices_fn: Callable[[], Any] | None = None,
        cardinality: int | None = None,
    ):
        """Low-level constructor; prefer the `from_*` class methods."""
        self._iter_fn = iter_fn
        self._structure = structure
        self._structure_fn = structure_fn
        self._slices_fn = slices_fn
        self._cardinality = cardinality

    # -- constructors ------------------------------------------------------------

    @classmethod
    def from_tensor_slices(cls, arrays: Any) -> Dataset:
        """One element per row of a (nested) structure of arrays with equal length.

        Args:
          arrays: a (nested) dict or tuple of arrays, or a single array. As in
            `tf.data`, a list is one array, not a structure; lists of strings become
            object arrays.

        Returns:
          A `Dataset` whose i-th element is the structure of `leaf[i]`.

        Raises:
          ValueError: if the leaves differ in length or are scalars.
        """
        columns = _columns(arrays)
        leaves = _tree.flatten(columns)
        lengths = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
        if None in lengths or len(lengths) != 1:
            shapes = [leaf.shape for leaf in leaves]
            raise ValueError(
                f"Expected arrays with one common leading (example) dimension, found shapes "
                f"{shapes}. Pass one array per field, with one row per example."
            )
        structure = _tree.map_structure(_column_spec, columns)
        return cls.from_slices_fn(lambda: columns, structure, cardinality=lengths.pop())

    @classmethod
    def from_slices_fn(
        cls, fn: Callable[[], Any], element_spec: Any = None, *, cardinality: int | None = None
    ) -> Dataset:
        """Like `from_tensor_slices`, but `fn()` produces the arrays at each pass.

        This is how lazy sources (an on-disk store, a file) build datasets: nothing is
        read until iteration starts, and `batch` slices the arrays without per-element
        work.

        Args:
          fn: returns a structure of arrays (equal leading dimension) when called.
          element_spec: the spec of one element (see `specs.to_structure`); inferred by
            calling `fn` when omitted.
          cardinality: the number of elements, if known without calling `fn`.

        Returns:
          A lazy `Dataset`.
        """

        def iter_fn(path: _Path) -> Iterator[Any]:
            columns = fn()
            leaves = _tree.flatten(columns)
            n = len(leaves[0]) if leaves else 0
            for i in range(n):
                yield _tree.unflatten(columns, [leaf[i] for leaf in leaves])

        structure = None if element_spec is None else specs.to_structure(element_spec)
        return cls(
            iter_fn,
            structure,
            structure_fn=lambda: _tree.map_structure(_column_spec, fn()),
            slices_fn=fn,
            cardinality=cardinality,
        )

    @classmethod
    def from_generator_fn(cls, fn: Callable[[], Iterable[Any]], element_spec: Any = None) -> Dataset:
        """Elements from `fn()`, which must return a fresh iterable on every call.

        Args:
          fn: called at the start of each pass.
          element_spec: the spec of one element; inferred from the first element
            (which reads it) when omitted.

        Returns:
          A lazy `Dataset`.
        """
        structure = None if element_spec is None else specs.to_structure(element_spec)
        return cls(lambda path: iter(fn()), structure)

    @classmethod
    def from_generator(cls, generator: Callable[..., Iterable[Any]], element_spec: Any = None,
                       args: Sequence[Any] = ()) -> Dataset:
        """Elements from `generator(*args)`, called afresh at each pass (`tf.data`'s name).

        As in `tf.data.Dataset.from_generator`, `generator` is a callable, not an
        iterator, so the dataset can be iterated more than once; `element_spec` plays
        the part of TF's `output_signature`.

        Args:
          generator: returns an iterable of elements when called with `args`.
          element_spec: the spec of one element; inferred from the first element
            (which reads it) when omitted.
          args: positional arguments for `generator`.

        Returns:
          A lazy `Dataset`.

        Raises:
          TypeError: if `generator` is not callable (e.g. a generator object).

        Example:
          >>> ds = Dataset.from_generator(lambda n: ({'v': i} for i in range(n)), args=(3,))
          >>> [e['v'] for e in ds]
          [0, 1, 2]
        """
        if not callable(generator):
            raise TypeError(
                f"Expected a callable that returns a fresh iterator at each pass, found "
                f"{type(generator).__name__}. Pass the function that makes it (`lambda: make_rows()`), "
                "or use `Dataset.from_iterable(list_of_elements)`."
            )
        return cls.from_generator_fn(lambda: generator(*args), element_spec)

    @classmethod
    def from_iterable(cls, iterable: Iterable[Any], element_spec: Any = None) -> Dataset:
        """Elements of a re-iterable collection (a list, a range, another Dataset).

        Raises:
          TypeError: if `iterable` is a one-shot iterator, which could not be
            iterated twice.
        """
        if iter(iterable) is iterable:
            raise TypeError(
                f"Expected a re-iterable collection, found a one-shot iterator "
                f"({type(iterable).__name__}). Use `list(...)` or `Dataset.from_generator_fn`."
            )
        return cls.from_generator_fn(lambda: iterable, element_spec)

    # -- description -------------------------------------------------------------

    @property
    def structure(self) -> Any:
        """One element's structure: containers of `TensorType` and `specs.StringSpec` leaves.

        Raises:
          ValueError: if it must be inferred (no spec was given) and the dataset is
            empty.
        """
        if self._structure is None:
            self._structure = (self._structure_fn or self._peek_structure)()
        return self._structure

    @property
    def element_spec(self) -> types.Type:
        """The fedlang type of one element (`to_type(dataset)` is `sequence<...>`); string
        fields are `str` tensors."""
        return specs.element_type(self.structure)

    @property
    def cardinality(self) -> int | None:
        """The number of elements when known without iterating, else None."""
        return self._cardinality

    def _peek_structure(self) -> Any:
        it = self._iter_fn(())
        try:
            first = next(it)
        except StopIteration:
            raise ValueError(
                "Cannot infer the element spec of an empty dataset. Pass `element_spec=` "
                "to the constructor (or to `map`)."
            ) from None
        finally:
            _prefetch.close(it)
        return specs.structure_of(first)

    def __iter__(self) -> Iterator[Any]:
        return self._iter_fn(())

    def __repr__(self) -> str:
        spec = "?" if self._structure is None else specs.structure_str(self._structure)
        return f"Dataset({spec})"

    # -- transformations ----------------------------------------------------------

    def _derive(self, iter_fn: _IterFn, structure_fn: Callable[[], Any] | None = None,
                cardinality: int | None = None) -> Dataset:
        return Dataset(iter_fn, structure_fn=structure_fn or (lambda: self.structure),
                       cardinality=cardinality)

    def map(self, fn: Callable[[Any], Any], element_spec: Any = None) -> Dataset:
        """Applies `fn(element) -> element` to each element (tuples are not unpacked).

        Without `element_spec`, the output's spec is inferred from `fn` of the first
        element, keeping what the input's spec leaves unknown: an output field whose
        leading dimension has the size of an unknown (`?`) dimension of that first
        element is recorded as unknown too, as `tf.data` records the batch dimension.
        So `ds.batch(5).map(f)` has a spec of `[?, ...]` fields (its last batch may be
        shorter), and `ds.batch(5, drop_remainder=True).map(f)` of `[5, ...]` fields.

        Args:
          fn: a Python function over numpy values.
          element_spec: the spec of the output; inferred from the first output when
            omitted (which reads one element).

        Example:
          >>> ds = Dataset.from_tensor_slices({'x': np.ones((12, 3), np.float32)})
          >>> str(ds.batch(5).map(lambda e: (e['x'], e['x'].sum(1))).element_spec)
          '<float32[?,3],float32[?]>'
          >>> str(ds.batch(5, drop_remainder=True).map(lambda e: e['x']).element_spec)
          'float32[5,3]'
        """

        def iter_fn(path: _Path) -> Iterator[Any]:
            it = self._iter_fn(path)
            try:
                for x in it:
                    yield fn(x)
            finally:
                _prefetch.close(it)

        def infer_structure() -> Any:
            it = self._iter_fn(())
            try:
                first = next(it)
            except StopIteration:
                raise ValueError(
                    "Cannot infer the element spec of an empty dataset. Pass `element_spec=` "
                    "to `map`."
                ) from None
            finally:
                _prefetch.close(it)
            unknown = _unknown_sizes(self.structure, first)
            return _tree.map_structure(lambda s: _relax_leading(s, unknown),
                                       specs.structure_of(fn(first)))

        out = Dataset(iter_fn, cardinality=self._cardinality, structure_fn=infer_structure)
        if element_spec is not None:
            out._structure = specs.to_structure(element_spec)
        return out

    def filter(self, predicate: Callable[[Any], Any]) -> Dataset:
        """Keeps the elements for which `predicate(element)` is true."""

        def iter_fn(path: _Path) -> Iterator[Any]:
            it = self._iter_fn(path)
            try:
                for x in it:
                    if predicate(x):
                        yield x
            finally:
                _prefetch.close(it)

        return self._derive(iter_fn)

    def shuffle(self, buffer_size: int, seed: int | None = None) -> Dataset:
        """Shuffles with a buffer of `buffer_size` elements, as `tf.data` does.

        A buffer at least as large as the dataset gives a uniform permutation. Pass `k`
        of an enclosing `repeat` uses the seed `(seed, k)`; see the module docstring.

        Raises:
          ValueError: if `buffer_size < 1`.
        """
        if buffer_size < 1:
            raise ValueError(f"Expected buffer_size >= 1, found {buffer_size}.")

        def iter_fn(path: _Path) -> Iterator[Any]:
            entropy = None if seed is None else np.random.SeedSequence(seed, spawn_key=path)
            rng = np.random.default_rng(entropy)
            buffer: list[Any] = []
            it = self._iter_fn(path)
            try:
                for x in it:
                    if len(buffer) < buffer_size:
                        buffer.append(x)
                        continue
                    j = int(rng.integers(buffer_size))
                    buffer[j], x = x, buffer[j]
                    yield x
            finally:
                _prefetch.close(it)
            for j in rng.permutation(len(buffer)):
                yield buffer[j]

        return self._derive(iter_fn, cardinality=self._cardinality)

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stacks consecutive elements into arrays with a leading batch dimension.

        The leading dimension of `element_spec` is None, or `batch_size` when
        `drop_remainder` is True (then a final short batch is dropped).

        Raises:
          ValueError: if `batch_size < 1`; when iterating, if elements of one
            batch differ in shape.
        """
        if batch_size < 1:
            raise ValueError(f"Expected batch_size >= 1, found {batch_size}.")
        slices_fn = self._slices_fn

        def iter_fn(path: _Path) -> Iterator[Any]:
            if slices_fn is not None:  # slice whole columns: no per-element work
                columns = slices_fn()
                leaves = _tree.flatten(columns)
                n = len(leaves[0]) if leaves else 0
                stop = n - n % batch_size if drop_remainder else n
                for i in range(0, stop, batch_size):
                    yield _tree.unflatten(columns, [leaf[i : i + batch_size] for leaf in leaves])
                return
            it = self._iter_fn(path)
            try:
                while True:
                    chunk = list(itertools.islice(it, batch_size))
                    if not chunk or (drop_remainder and len(chunk) < batch_size):
                        return
                    per_leaf = zip(*(_tree.flatten(x) for x in chunk))
                    where = ""
                    leaves = []
                    for p, values in zip(_tree.paths(chunk[0]), per_leaf):
                        where = f" in field {p!r}" if p else ""
                        leaves.append(_stack(list(values), where))
                    yield _tree.unflatten(chunk[0], leaves)
            finally:
                _prefetch.close(it)

        dim = batch_size if drop_remainder else None

        def batched(s: Any) -> Any:
            if isinstance(s, specs.StringSpec):
                return specs.StringSpec((dim, *s.shape))
            return types.TensorType(s.dtype, (dim, *s.shape))

        n = self._cardinality
        if n is not None:
            n = n // batch_size if drop_remainder else -(-n // batch_size)
        return self._derive(iter_fn, lambda: _tree.map_structure(batched, self.structure), n)

    def unbatch(self) -> Dataset:
        """Splits each element along its first axis into elements; the inverse of `batch`.

        Every field of one element must have the same leading dimension; elements may
        differ in it, so variable-length sequences unbatch into their items (as in
        TFF's Shakespeare preprocessing: `map(to_ids).unbatch().batch(n + 1)`).

        Raises:
          ValueError: if a field is a scalar, or (when iterating) the fields of an
            element differ in their leading dimension.

        Example:
          >>> ds = Dataset.from_iterable([np.array([1, 2, 3]), np.array([4, 5])])
          >>> [int(v) for v in ds.unbatch()]
          [1, 2, 3, 4, 5]
        """

        def iter_fn(path: _Path) -> Iterator[Any]:
            it = self._iter_fn(path)
            try:
                for x in it:
                    leaves = [_as_column(leaf) if isinstance(leaf, list | tuple) else leaf for leaf in _tree.flatten(x)]
                    names = _tree.paths(x)
                    for name, leaf in zip(names, leaves):
                        if np.ndim(leaf) == 0:
                            raise ValueError(f"Expected fields with a leading dimension to unbatch, found a scalar in "
                                             f"field {name!r}. Unbatch only batched elements.")
                    lengths = [len(leaf) for leaf in leaves]
                    if len(set(lengths)) > 1:
                        raise ValueError(f"Expected every field of an element to have the same leading dimension "
                                         f"to unbatch, found {lengths} for fields {names}.")
                    for i in range(lengths[0] if lengths else 0):
                        yield _tree.unflatten(x, [leaf[i] for leaf in leaves])
            finally:
                _prefetch.close(it)

        def unbatched(s: Any) -> Any:
            if not s.shape:
                raise ValueError(f"Expected fields with a leading dimension to unbatch, found {s}.")
            if isinstance(s, specs.StringSpec):
                return specs.StringSpec(s.shape[1:])
            return types.TensorType(s.dtype, s.shape[1:])

        return self._derive(iter_fn, lambda: _tree.map_structure(unbatched, self.structure))

    def flat_map(self, fn: Callable[[Any], Dataset], element_spec: Any = None) -> Dataset:
        """Maps each element to a `Dataset` with `fn` and yields their elements in turn.

        Args:
          fn: `fn(element) -> Dataset`.
          element_spec: the spec of the output elements; inferred from the first one
            when omitted (which reads it).

        Raises:
          TypeError: (when iterating) if `fn` returns something other than a `Dataset`.
        """

        def iter_fn(path: _Path) -> Iterator[Any]:
            it = self._iter_fn(path)
            try:
                for x in it:
                    inner = fn(x)
                    if not isinstance(inner, Dataset):
                        raise TypeError(f"Expected the function given to flat_map to return a Dataset, found "
                                        f"{type(inner).__name__}. Wrap its values: `Dataset.from_tensor_slices(...)`.")
                    inner_it = inner._iter_fn(path)
                    try:
                        yield from inner_it
                    finally:
                        _prefetch.close(inner_it)
            finally:
                _prefetch.close(it)

        out = Dataset(iter_fn)
        if element_spec is not None:
            out._structure = specs.to_structure(element_spec)
        return out

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeats the dataset `count` times (forever when None).

        An empty pass ends the repetition, so `repeat()` of an empty dataset is empty
        rather than an endless loop.
        """

        def iter_fn(path: _Path) -> Iterator[Any]:
            for k in itertools.count() if count is None else range(count):
                empty = True
                it = self._iter_fn((*path, k))
                try:
                    for x in it:
                        empty = False
                        yield x
                finally:
                    _prefetch.close(it)
                if empty:
                    return

        n = self._cardinality
        n = None if n is None or count is None else n * count
        return self._derive(iter_fn, cardinality=0 if self._cardinality == 0 else n)

    def take(self, count: int) -> Dataset:
        """The first `count` elements."""

        def iter_fn(path: _Path) -> Iterator[Any]:
            if count <= 0:
                return
            it = self._iter_fn(path)
            try:
                yield from itertools.islice(it, count)
            finally:
                _prefetch.close(it)

        n = self._cardinality
        return self._derive(iter_fn, cardinality=None if n is None else min(n, max(count, 0)))

    def skip(self, count: int) -> Dataset:
        """All but the first `count` elements (tf.data's `skip`; `take`'s complement)."""

        def iter_fn(path: _Path) -> Iterator[Any]:
            it = self._iter_fn(path)
            try:
                yield from itertools.islice(it, max(count, 0), None)
            finally:
                _prefetch.close(it)

        n = self._cardinality
        return self._derive(iter_fn, cardinality=None if n is None else max(n - max(count, 0), 0))

    def prefetch(self, buffer_size: int = 2) -> Dataset:
        """Produces up to `buffer_size` elements ahead on a background thread.

        Exceptions raised while producing are re-raised to the consumer. Stopping
        early (break, `take`, garbage collection of the iterator) stops and joins the
        thread.
        """
        if buffer_size < 1:
            raise ValueError(f"Expected buffer_size >= 1, found {buffer_size}.")

        def iter_fn(path: _Path) -> Iterator[Any]:
            return _prefetch.prefetch(lambda: self._iter_fn(path), buffer_size)

        return self._derive(iter_fn, cardinality=self._cardinality)

    def reduce(self, initial: Any, fn: Callable[[Any, Any], Any]) -> Any:
        """Folds `state = fn(state, element)` over one pass (plain Python)."""
        state = initial
        for x in self:
            state = fn(state, x)
        return state


def _unknown_sizes(structure: Any, element: Any) -> set[int]:
    """The sizes `element` has where `structure` leaves a dimension unknown (None)."""
    sizes: set[int] = set()
    for spec, value in zip(_tree.flatten(structure), _tree.flatten(element)):
        shape = np.shape(value)
        if len(shape) == len(spec.shape):
            sizes.update(n for d, n in zip(spec.shape, shape) if d is None)
    return sizes


def _relax_leading(spec: Any, unknown: set[int]) -> Any:
    """`spec` with its leading dimension unknown when its size is one of `unknown`."""
    if not spec.shape or spec.shape[0] not in unknown:
        return spec
    if isinstance(spec, specs.StringSpec):
        return specs.StringSpec((None, *spec.shape[1:]))
    return types.TensorType(spec.dtype, (None, *spec.shape[1:]))


def _column_spec(column: np.ndarray) -> types.TensorType | specs.StringSpec:
    if column.dtype.kind in "OSU":
        return specs.StringSpec(column.shape[1:])
    return types.TensorType(column.dtype, column.shape[1:])

