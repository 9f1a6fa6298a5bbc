"""Partial aggregates: folding clients in several places and merging equals folding once."""

import numpy as np
import pytest

from fedlang.core import intrinsic_defs as defs
from fedlang.core import serialization, sparse, structure, types
from fedlang.runtime import accumulate, chunks

F32x3 = types.TensorType(np.float32, [3])
POINT = types.StructType([("a", F32x3), ("n", types.TensorType(np.int32))])


def _clients(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=3).astype(np.float32), np.int32(rng.integers(-5, 5))) for _ in range(n)]


def _chunk(values, t):
    return chunks.stack(values, t)


def _fold_in_parts(make, values, t, groups, through_bytes=True):
    """One accumulator per group of clients; partials merged into a fresh one."""
    final = make()
    for group in groups:
        acc = make()
        part = [values[i] for i in group]
        if part:
            acc.add(_chunk(part, t), len(part))
        partial = acc.partial()
        if through_bytes:  # partials cross processes as values of their type
            data = serialization.serialize_value(
                structure.to_python(partial, acc.partial_type), acc.partial_type
            )
            partial = structure.to_internal(serialization.deserialize_value(data), acc.partial_type)
        final.merge(partial)
    return final.result()


def _fold_once(make, values, t):
    acc = make()
    if values:
        acc.add(_chunk(values, t), len(values))
    return acc.result()


def _assert_same(a, b, t):
    for x, y in zip(structure.flatten(a, t), structure.flatten(b, t)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-6)


GROUPINGS = [[[0, 1, 2], [3], [], [4, 5, 6]], [[6, 5], [4, 3, 2, 1, 0]], [[], []]]


@pytest.mark.parametrize("groups", GROUPINGS)
@pytest.mark.parametrize(
    "make",
    [
        lambda: accumulate.Sum(POINT, defs.FEDERATED_SUM.empty),
        lambda: accumulate.Mean(types.StructType([F32x3]), defs.FEDERATED_MEAN.empty),
        lambda: accumulate.Extremum(POINT, True, defs.FEDERATED_MIN.empty),
        lambda: accumulate.Extremum(POINT, False, defs.FEDERATED_MAX.empty),
    ],
    ids=["sum", "mean", "min", "max"],
)
def test_partials_merge_to_the_single_fold(make, groups):
    n = sum(len(g) for g in groups)
    t = make().member
    values = [v if t is POINT else (v[0],) for v in _clients(n)]
    _assert_same(_fold_in_parts(make, values, t, groups), _fold_once(make, values, t), t)


def test_weighted_mean_partials():
    member, weight = F32x3, types.TensorType(np.float32)
    t = types.StructType([member, weight])
    rng = np.random.default_rng(1)
    values = [(rng.normal(size=3).astype(np.float32), np.float32(rng.uniform(0, 3))) for _ in range(7)]

    def make():
        return accumulate.WeightedMean(member, weight, defs.FEDERATED_WEIGHTED_MEAN.empty)

    for groups in GROUPINGS[:2]:
        _assert_same(_fold_in_parts(make, values, t, groups), _fold_once(make, values, t), member)


def test_modular_partials_stay_exact_beyond_64_bits():
    member = types.TensorType(np.int32, [2])
    widths = [20]

    def make():
        return accumulate.ModularSum(member, [2**20], accumulate.bitwidth_moduli(widths))

    values = [np.array([2**20 - 1, 7 * i], np.int32) for i in range(9)]
    groups = [[0, 1, 2, 3], [4], [5, 6, 7, 8]]
    assert np.array_equal(_fold_in_parts(make, values, member, groups), _fold_once(make, values, member))

    def make_mod():
        return accumulate.ModularSum(member, [1000003], lambda n: [1000003], [1000003])

    big = [np.array([1000002, 999999], np.int32) for _ in range(9)]
    assert np.array_equal(_fold_in_parts(make_mod, big, member, groups), _fold_once(make_mod, big, member))


def test_aggregate_partials_use_the_merge_function():
    calls = []

    def call(fn, arg):
        calls.append(fn)
        return fn(arg)

    member = types.TensorType(np.float32)

    def make():
        return accumulate.Aggregate(
            member,
            np.float32(0),
            lambda a: np.float32(a[0] + a[1] * a[1]),  # sum of squares
            lambda a: np.float32(a[0] + a[1]),
            lambda a: np.float32(a),
            call,
            zero_type=member,
        )

    values = [np.float32(x) for x in range(7)]
    got = _fold_in_parts(make, values, member, [[0, 1], [2, 3, 4], [], [5, 6]])
    assert float(got) == sum(x * x for x in range(7))


@pytest.mark.parametrize("mode", ["dense", "sum", "mean"])
def test_sparse_partials(mode):
    member = types.SparseTensorType(np.float32, (4, 3))
    values = [
        sparse.SparseTensor([[0, 1], [2, 2]], [1.0, 2.0], (4, 3)),
        sparse.SparseTensor([[0, 1]], [5.0], (4, 3)),
        sparse.SparseTensor([[3, 0], [2, 2]], [1.5, -1.0], (4, 3)),
    ]

    def make():
        return accumulate.SparseSum(member, mode, defs.SPARSE_SUM.empty)

    got = _fold_in_parts(make, values, member, [[0], [], [1, 2]])
    want = _fold_once(make, values, member)
    dense = lambda v: v if isinstance(v, np.ndarray) else v.to_dense()  # noqa: E731
    np.testing.assert_allclose(dense(got), dense(want))


def test_collecting_cannot_be_done_in_parts():
    with pytest.raises(TypeError, match="cannot be aggregated in parts"):
        accumulate.Collect(F32x3).partial()


@pytest.mark.parametrize(
    ("dtype", "wrap", "partial", "final"),
    [
        (np.int32, 2**16, 2**64, lambda n: 2**20),  # a bit width: uint64 fast path
        (np.int64, 2**64, 2**64, lambda n: 2**62),  # the whole int64 range wraps
        (np.int32, 11, 11, lambda n: 11),  # a small modulus: uint64, reduced per chunk
        (np.uint32, 2**32, 2**32, lambda n: 2**32),  # the IBLT's modular cells
        (np.uint32, 1000003, 1000003, lambda n: 1000003),  # unsigned, not a power of two
        (np.int64, 2**40 + 1, 2**40 + 1, lambda n: 2**40 + 1),  # too large: Python integers
    ],
)
def test_modular_sum_fast_leaves_equal_exact_integers(dtype, wrap, partial, final):
    """Whatever path a leaf takes (uint64 or Python integers), the sum is the exact one:
    the inputs wrapped modulo `wrap`, summed, reduced modulo the final modulus; also when
    folded in parts and merged, and for a replicated (server-side) chunk."""
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    member = types.TensorType(dtype, [5])
    values = [rng.integers(info.min, info.max, 5, dtype=dtype, endpoint=True) for _ in range(9)]

    def make():
        return accumulate.ModularSum(member, [wrap], lambda n: [final(n)], [partial])

    exact = sum(np.mod(np.asarray(v).astype(object), wrap) for v in values) % final(9)
    once = _fold_once(make, values, member)
    assert [int(v) for v in once] == [int(v) for v in np.asarray(exact).astype(dtype)]
    parts = _fold_in_parts(make, values, member, [[0, 1, 2, 3], [4], [5, 6, 7, 8]])
    assert np.array_equal(parts, once)
    acc = make()
    acc.add(chunks.Rep(values[0]), 9)  # one value for nine clients
    expected = np.mod(np.asarray(values[0]).astype(object), wrap) * 9 % final(9)
    assert [int(v) for v in acc.result()] == [int(v) for v in np.asarray(expected).astype(dtype)]


def test_large_chunks_are_stacked_aligned_and_used_in_place_on_a_cpu():
    import jax

    t = types.TensorType(np.float32, [64, 1024])
    values = [np.full((64, 1024), i, np.float32) for i in range(5)]
    cv = chunks.stack(values, t)
    assert cv.ctypes.data % chunks.ALIGNMENT == 0
    np.testing.assert_array_equal(cv, np.stack(values))
    on_cpu = jax.device_put(cv, jax.devices("cpu")[0])
    assert np.shares_memory(np.asarray(on_cpu), cv)  # no copy into the device buffer
    assert chunks.aligned_zeros((3, 2), np.int32).tolist() == [[0, 0], [0, 0], [0, 0]]
    assert chunks.aligned_empty((2,), np.dtypes.StringDType()).dtype == np.dtypes.StringDType()


@pytest.mark.parametrize("as_jax", [False, True])
def test_float_sums_of_host_and_cpu_device_chunks_match_exact_sums(as_jax):
    import jax.numpy as jnp

    rng = np.random.default_rng(7)
    values = [rng.normal(size=(4, 5)).astype(np.float32) for _ in range(9)]
    weights = rng.random(9).astype(np.float32)
    t = types.TensorType(np.float32, [4, 5])
    cv = chunks.stack(values, t)
    cv = jnp.asarray(cv) if as_jax else cv
    total = accumulate.Sum(t, defs.FEDERATED_SUM.empty)
    total.add(cv, 9)
    np.testing.assert_allclose(total.result(), np.sum(np.float64(values), axis=0), rtol=1e-5, atol=1e-6)
    mean = accumulate.WeightedMean(t, types.TensorType(np.float32), defs.FEDERATED_MEAN.empty)
    mean.add((cv, weights), 9)
    want = np.tensordot(np.float64(weights), np.float64(values), 1) / np.float64(weights).sum()
    np.testing.assert_allclose(mean.result(), want, rtol=1e-5, atol=1e-6)


# One contribution's partial in its values' dtype (`report`): what a deployment client
# sends; merged, it gives the same bits as the wide `partial()`.

def _sum_family(member):
    weight = types.TensorType(np.float32)
    return {
        "sum": lambda: accumulate.Sum(member, defs.FEDERATED_SUM.empty),
        "mean": lambda: accumulate.Mean(member, defs.FEDERATED_MEAN.empty),
        "weighted": lambda: accumulate.WeightedMean(member, weight, defs.FEDERATED_WEIGHTED_MEAN.empty),
    }


def _one(kind, member, rng):
    leaves = []
    for lt in structure.leaf_types(member):
        shape = [d or 0 for d in lt.shape]
        draw = rng.integers(-9, 9, shape) if np.dtype(lt.dtype).kind == "i" else rng.normal(size=shape) * 1e3
        leaves.append(np.asarray(draw, lt.dtype))
    value = structure.unflatten(leaves, member)
    return (value, np.float32(rng.uniform(0, 7))) if kind == "weighted" else value


@pytest.mark.parametrize("kind", ["sum", "mean", "weighted"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_a_report_is_narrow_and_merges_to_the_bits_of_the_wide_partial(kind, dtype):
    member = types.StructType([("w", types.TensorType(dtype, [4, 3])), ("b", types.TensorType(dtype))])
    make = _sum_family(member)[kind]
    client_t = types.StructType([member, types.TensorType(np.float32)]) if kind == "weighted" else member
    rng = np.random.default_rng(3)
    narrow, wide = make(), make()
    for _ in range(6):
        acc = make()
        acc.add(_chunk([_one(kind, member, rng)], client_t), 1)
        assert {np.dtype(lt.dtype) for lt in structure.leaf_types(acc.report_type)} <= {
            np.dtype(dtype), np.dtype(np.int64), np.dtype(np.float64)}
        data = serialization.serialize_value(  # as a client sends it
            structure.to_python(acc.report(), acc.report_type), acc.report_type)
        narrow.merge(structure.to_internal(
            serialization.deserialize_value(data, expected_type=acc.report_type), acc.report_type))
        wide.merge(acc.partial())
    for a, b in zip(structure.flatten(narrow.partial(), narrow.partial_type),
                    structure.flatten(wide.partial(), wide.partial_type)):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)
    assert (narrow.report_type == narrow.partial_type) == (dtype == np.float64)  # else wider


def test_a_report_is_the_partial_where_nothing_is_widened():
    acc = accumulate.Extremum(POINT, False, defs.FEDERATED_MAX.empty)
    acc.add(_chunk(_clients(1), POINT), 1)
    assert acc.report_type == acc.partial_type
    np.testing.assert_array_equal(acc.report()[0][0], acc.partial()[0][0])
    total = accumulate.Sum(POINT, defs.FEDERATED_SUM.empty)
    assert (str(total.report_type), str(total.partial_type)) == (
        "<a=float32[3],n=int32>", "<a=float64[3],n=int64>")


def test_a_report_of_several_contributions_that_would_round_is_refused():
    acc = accumulate.Sum(F32x3, defs.FEDERATED_SUM.empty)
    acc.add(_chunk([np.full(3, 1.0, np.float32)], F32x3), 1)
    acc.add(_chunk([np.full(3, 2.0**-30, np.float32)], F32x3), 1)  # 1 + 2^-30: not a float32
    with pytest.raises(ValueError, match="one contribution's total"):
        acc.report()
    acc = accumulate.Mean(F32x3, defs.FEDERATED_MEAN.empty)
    acc.merge((np.full(3, 1e39), np.int64(2)))  # beyond float32's range
    with pytest.raises(ValueError, match=r"tensor 0 of the total \(float32\[3\]\)"):
        acc.report()
