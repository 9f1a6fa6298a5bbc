import threading
import time

import numpy as np
import pytest

from fedlang.core import types
from fedlang.simulation import dataset as dataset_lib
from fedlang.simulation import specs

Dataset = dataset_lib.Dataset


def _ds(n=10):
    return Dataset.from_tensor_slices({"x": np.arange(n, dtype=np.float32), "y": np.arange(n, dtype=np.int32)})


def _ys(ds):
    return [int(e["y"]) for e in ds]


def test_from_tensor_slices_elements_and_spec():
    ds = _ds(3)
    assert [float(e["x"]) for e in ds] == [0.0, 1.0, 2.0]
    assert str(ds.element_spec) == "<x=float32,y=int32>"
    assert types.to_type(ds) == types.SequenceType(ds.element_spec)
    assert ds.cardinality == 3


def test_from_tensor_slices_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="common leading"):
        Dataset.from_tensor_slices({"x": np.zeros(3), "y": np.zeros(4)})


def test_nested_tuple_structure_round_trips():
    ds = Dataset.from_tensor_slices(((np.zeros((4, 2), np.float32), {"a": np.arange(4)}), np.ones(4)))
    first = next(iter(ds))
    assert isinstance(first, tuple) and first[0][0].shape == (2,)
    assert str(ds.batch(2).element_spec) == "<<float32[?,2],<a=int64[?]>>,float64[?]>"


def test_iteration_is_lazy_and_restartable():
    calls = []

    def gen():
        calls.append(1)
        return iter(range(3))

    ds = Dataset.from_generator_fn(gen, np.int64).map(lambda v: v * 2)
    assert calls == []
    assert list(ds) == [0, 2, 4] and list(ds) == [0, 2, 4]
    assert len(calls) == 2


def test_map_infers_spec_from_first_element_or_uses_given():
    ds = _ds().map(lambda e: {"z": e["x"] * 2})
    assert str(ds.element_spec) == "<z=float32>"
    given = _ds().map(lambda e: e["y"], element_spec=np.int32)
    assert given.element_spec == types.TensorType(np.int32)


def test_filter_take_repeat():
    ds = _ds().filter(lambda e: e["y"] % 2 == 0)
    assert _ys(ds) == [0, 2, 4, 6, 8]
    assert _ys(ds.take(2)) == [0, 2]
    assert _ys(_ds(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert _ys(_ds(2).repeat().take(5)) == [0, 1, 0, 1, 0]
    assert _ds(3).repeat(2).cardinality == 6 and _ds(3).take(0).cardinality == 0


def test_skip_is_takes_complement():
    ds = _ds()
    assert _ys(ds.skip(7)) == [7, 8, 9] and _ys(ds.take(7)) + _ys(ds.skip(7)) == _ys(ds)
    assert ds.skip(7).cardinality == 3 and ds.skip(20).cardinality == 0
    assert _ys(ds.skip(-1)) == _ys(ds) and _ys(_ds(3).repeat().skip(2).take(3)) == [2, 0, 1]
    assert ds.filter(lambda e: e["y"] > 0).skip(1).cardinality is None


def test_repeat_forever_of_empty_dataset_ends():
    assert list(_ds(0).repeat()) == []


def test_shuffle_is_deterministic_and_a_permutation():
    ds = _ds(50).shuffle(8, seed=3)
    assert _ys(ds) == _ys(ds)
    assert sorted(_ys(ds)) == list(range(50))
    assert _ys(ds) != list(range(50))
    assert _ys(_ds(50).shuffle(8, seed=4)) != _ys(ds)


def test_shuffle_reshuffles_each_repeat_pass_deterministically():
    ds = _ds(20).shuffle(100, seed=1).repeat(2)
    ys = _ys(ds)
    assert ys[:20] != ys[20:] and sorted(ys[:20]) == sorted(ys[20:])
    assert ys == _ys(ds)


def test_shuffle_rejects_bad_buffer():
    with pytest.raises(ValueError, match="buffer_size >= 1"):
        _ds().shuffle(0)


def test_batch_stacks_with_leading_dim():
    batches = list(_ds(5).batch(2))
    assert [b["y"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert str(_ds().batch(2).element_spec) == "<x=float32[?],y=int32[?]>"
    assert str(_ds().batch(2, drop_remainder=True).element_spec) == "<x=float32[2],y=int32[2]>"
    assert len(list(_ds(5).batch(2, drop_remainder=True))) == 2
    assert _ds(5).batch(2).cardinality == 3


def test_batch_of_generated_elements_matches_sliced_batch():
    sliced = [b["x"].tolist() for b in _ds(7).batch(3)]
    generic = [b["x"].tolist() for b in _ds(7).map(lambda e: e).batch(3)]
    assert sliced == generic


def test_batch_of_ragged_elements_names_field():
    ds = Dataset.from_iterable([{"t": np.zeros(2)}, {"t": np.zeros(3)}])
    with pytest.raises(ValueError, match="field 't'"):
        list(ds.batch(2))


def test_strings_have_structure_and_a_str_element_type():
    ds = Dataset.from_tensor_slices({"text": ["a b", "c"], "n": np.arange(2)})
    assert str(specs.structure_str(ds.structure)) == "<text=string,n=int64>"
    assert [e["text"] for e in ds] == ["a b", "c"]
    batch = next(iter(ds.map(lambda e: e).batch(2)))
    assert batch["text"].dtype == object and batch["text"].tolist() == ["a b", "c"]
    assert str(ds.element_spec) == "<text=str,n=int64>"
    assert str(ds.batch(2).element_spec) == "<text=str[?],n=int64[?]>"


def test_generator_spec_accepts_string_spec():
    ds = Dataset.from_generator_fn(lambda: iter([b"ab"]), bytes)
    assert ds.structure == specs.StringSpec(())


def test_empty_dataset_spec_needs_explicit_spec():
    with pytest.raises(ValueError, match="empty dataset"):
        _ = Dataset.from_generator_fn(lambda: iter([])).element_spec
    assert Dataset.from_generator_fn(lambda: iter([]), np.float32).element_spec == types.TensorType(np.float32)


def test_from_iterable_rejects_one_shot_iterators():
    with pytest.raises(TypeError, match="re-iterable"):
        Dataset.from_iterable(iter([1, 2]))
    assert list(Dataset.from_iterable([1, 2])) == [1, 2]


def test_reduce():
    assert _ds(5).reduce(0, lambda s, e: s + int(e["y"])) == 10


def test_prefetch_yields_everything_in_order():
    assert _ys(_ds(20).prefetch(3)) == list(range(20))


def test_prefetch_propagates_exceptions():
    def boom(e):
        if e["y"] == 3:
            raise RuntimeError("bad element")
        return e

    with pytest.raises(RuntimeError, match="bad element"):
        list(_ds().map(boom).prefetch(2))


def _wait_threads(baseline):
    for _ in range(100):
        if threading.active_count() <= baseline:
            return True
        time.sleep(0.01)
    return False


def test_prefetch_does_not_leak_threads_on_early_stop():
    baseline = threading.active_count()
    for _ in range(5):
        for e in _ds(1000).prefetch(2):
            if e["y"] == 2:
                break
    assert _wait_threads(baseline)
    it = iter(_ds(1000).prefetch(2))
    next(it)
    del it
    assert _wait_threads(baseline)
    assert _ys(_ds(1000).repeat().prefetch(2).take(3)) == [0, 1, 2]
    assert _wait_threads(baseline)


def test_to_structure_from_fedlang_types():
    t = types.to_type({"a": (np.float32, [2]), "b": np.int32})
    structure = specs.to_structure(t)
    assert list(structure) == ["a", "b"]
    assert specs.element_type(structure) == t
    with pytest.raises(TypeError, match="tensor or struct"):
        specs.to_structure(types.FederatedType(np.float32, types.CLIENTS))


def test_unbatch_splits_elements_along_their_first_axis():
    ds = Dataset.from_tensor_slices({"x": np.arange(12, dtype=np.float32).reshape(6, 2), "t": list("abcdef")})
    back = ds.batch(4).unbatch()
    assert [e["t"] for e in back] == list("abcdef")
    assert [e["x"].tolist() for e in back][-1] == [10.0, 11.0]
    assert str(back.structure["x"]) == "float32[2]"
    assert str(back.structure["t"]) == "string"
    ragged = Dataset.from_iterable([np.array([1, 2, 3]), np.array([4, 5])])
    assert [int(v) for v in ragged.unbatch()] == [1, 2, 3, 4, 5]


def test_unbatch_refuses_scalars_and_mismatched_lengths():
    with pytest.raises(ValueError, match=r"leading dimension to unbatch.*found a scalar in field 'x'"):
        list(_ds(2).unbatch())
    odd = Dataset.from_iterable([{"a": np.zeros(3), "b": np.zeros(2)}])
    with pytest.raises(ValueError, match=r"same leading dimension.*\[3, 2\]"):
        list(odd.unbatch())


def test_flat_map_concatenates_the_datasets_fn_returns():
    ds = Dataset.from_tensor_slices({"n": np.array([2, 0, 3])})
    flat = ds.flat_map(lambda e: Dataset.from_tensor_slices({"i": np.arange(int(e["n"]))}))
    assert [int(e["i"]) for e in flat] == [0, 1, 0, 1, 2]
    assert str(flat.element_spec) == "<i=int64>"
    with pytest.raises(TypeError, match=r"flat_map.*return a Dataset, found list"):
        list(ds.flat_map(lambda e: [e]))


def test_map_after_batch_keeps_the_batch_dimension_unknown():
    # The spec is inferred from the first batch (5 rows), but the last has 2: a fixed [5]
    # would make a computation typed from the spec refuse the client's own data.
    ds = Dataset.from_tensor_slices({"x": np.ones((12, 3), np.float32), "y": np.arange(12, dtype=np.int32)})
    pairs = ds.batch(5).map(lambda e: (e["x"], e["y"], e["x"].sum(0)))
    assert str(pairs.element_spec) == "<float32[?,3],int32[?],float32[3]>"
    assert [len(b[1]) for b in pairs] == [5, 5, 2]
    assert str(ds.batch(5, drop_remainder=True).map(lambda e: (e["x"], e["y"])).element_spec) == (
        "<float32[5,3],int32[5]>")
    assert str(ds.batch(5).shuffle(3, seed=0).map(lambda e: e["y"]).element_spec) == "int32[?]"

    import jax.numpy as jnp

    import fedlang as fl

    @fl.jax_computation(types.SequenceType(pairs.element_spec))
    def count(data):
        return data.reduce(jnp.int32(0), lambda n, batch: n + batch[1].shape[0])

    assert int(count(pairs)) == 12


def test_shakespeare_preprocessing_as_tff_writes_it():
    # TFF's tutorial: map(to_ids).unbatch().batch(SEQ_LENGTH + 1, drop_remainder=True).map(split_input_target)
    snippets = Dataset.from_tensor_slices({"snippets": ["To be, or not", "to be"]})
    to_ids = lambda e: np.frombuffer(e["snippets"].encode(), np.uint8).astype(np.int32)  # noqa: E731
    chunks = snippets.map(to_ids).unbatch().batch(6, drop_remainder=True).map(lambda c: (c[:-1], c[1:]))
    pairs = list(chunks)
    assert len(pairs) == 3 and bytes(pairs[0][0].astype(np.uint8)) == b"To be"
    assert bytes(pairs[1][0].astype(np.uint8)) == b" or n" and bytes(pairs[1][1].astype(np.uint8)) == b"or no"
    assert str(chunks.element_spec) == "<int32[5],int32[5]>"


def test_from_generator_under_tff_name():
    ds = Dataset.from_generator(lambda: ({"v": np.float32(i)} for i in range(3)), element_spec={"v": np.float32})
    assert [float(e["v"]) for e in ds] == [0.0, 1.0, 2.0] and [float(e["v"]) for e in ds][-1] == 2.0
    assert str(ds.element_spec) == "<v=float32>"
    counted = Dataset.from_generator(lambda n: ({"v": np.int32(i)} for i in range(n)), args=(4,))
    assert [int(e["v"]) for e in counted] == [0, 1, 2, 3]
    with pytest.raises(TypeError, match=r"callable that returns a fresh iterator.*lambda: "):
        Dataset.from_generator({"v": i} for i in range(3))
