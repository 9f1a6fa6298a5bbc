"""Every intrinsic's type rule and reference semantics."""

import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.core import context, intrinsics

pytestmark = pytest.mark.usefixtures("runtime")

F32 = np.float32
C_F32 = fl.type_at_clients(np.float32)
S_F32 = fl.type_at_server(np.float32)
C_I32 = fl.type_at_clients(np.int32)


@fl.jax_computation(np.float32)
def add_one(x):
    return x + 1.0


def test_table_has_every_intrinsic_with_a_signature():
    expected = {
        "federated_value_at_server",
        "federated_value_at_clients",
        "federated_eval_at_server",
        "federated_eval_at_clients",
        "federated_broadcast",
        "federated_map",
        "federated_zip",
        "federated_sum",
        "federated_mean",
        "federated_weighted_mean",
        "federated_aggregate",
        "federated_min",
        "federated_max",
        "federated_select",
        "federated_secure_sum_bitwidth",
        "federated_secure_modular_sum",
        "sequence_map",
        "sequence_reduce",
        "sequence_sum",
    }
    assert expected <= set(intrinsics.TABLE)
    for d in intrinsics.TABLE.values():
        assert d.signature.startswith("(") and "->" in d.signature


def test_federated_value():
    @fl.federated_computation()
    def at_server():
        return fl.federated_value(2.0, fl.SERVER)

    @fl.federated_computation(C_F32)
    def at_clients(x):
        return fl.federated_zip((x, fl.federated_value(np.int32(3), fl.CLIENTS)))

    assert str(at_server.type_signature) == "( -> float32@SERVER)"
    assert at_server() == 2.0
    assert str(at_clients.type_signature) == "({float32}@CLIENTS -> {<float32,int32>}@CLIENTS)"
    assert at_clients([1.0, 2.0]) == [(1.0, 3), (2.0, 3)]


def test_federated_eval():
    @fl.jax_computation()
    def seven():
        return jnp.float32(7.0)

    @fl.federated_computation()
    def ev():
        return fl.federated_eval(seven, fl.SERVER)

    assert str(seven.type_signature) == "( -> float32)"
    assert str(ev.type_signature) == "( -> float32@SERVER)"
    assert ev() == 7.0

    @fl.federated_computation(C_F32)
    def ev_clients(x):
        return fl.federated_zip((x, fl.federated_eval(seven, fl.CLIENTS)))

    assert str(ev_clients.type_signature) == "({float32}@CLIENTS -> {<float32,float32>}@CLIENTS)"
    assert ev_clients([0.0, 1.0]) == [(0.0, 7.0), (1.0, 7.0)]


def test_federated_broadcast_and_map_all_equal(runtime):
    @fl.federated_computation(S_F32)
    def bcast(x):
        return fl.federated_map(add_one, fl.federated_broadcast(x))

    assert str(bcast.type_signature) == "(float32@SERVER -> float32@CLIENTS)"
    with context.with_context(runtime(num_clients=3)):
        assert bcast(1.0) == 2.0


def test_federated_map_at_clients_and_server():
    @fl.federated_computation(C_F32)
    def at_clients(x):
        return fl.federated_map(add_one, x)

    @fl.federated_computation(S_F32)
    def at_server(x):
        return fl.federated_map(add_one, x)

    assert str(at_clients.type_signature) == "({float32}@CLIENTS -> {float32}@CLIENTS)"
    assert at_clients([1.0, 2.0]) == [2.0, 3.0]
    assert str(at_server.type_signature) == "(float32@SERVER -> float32@SERVER)"
    assert at_server(1.0) == 2.0

    @fl.federated_computation(S_F32)
    def applied(x):
        return fl.federated_apply(add_one, x)

    assert applied(4.0) == 5.0


def test_federated_map_zips_a_tuple_implicitly():
    @fl.jax_computation(np.float32, np.float32)
    def mul(a, b):
        return a * b

    @fl.federated_computation(C_F32, C_F32)
    def prod(a, b):
        return fl.federated_map(mul, (a, b))

    assert (
        str(prod.type_signature)
        == "(<a={float32}@CLIENTS,b={float32}@CLIENTS> -> {float32}@CLIENTS)"
    )
    assert prod([1.0, 2.0], [3.0, 4.0]) == [3.0, 8.0]


def test_federated_map_with_a_polymorphic_computation():
    @fl.jax_computation
    def double(x):
        return x * 2

    @fl.federated_computation(C_I32)
    def f(x):
        return fl.federated_map(double, x)

    assert str(f.type_signature) == "({int32}@CLIENTS -> {int32}@CLIENTS)"
    assert f([1, 2]) == [2, 4]


def test_federated_zip_keeps_names():
    @fl.federated_computation(C_F32, C_I32)
    def z(a, b):
        return fl.federated_zip({"a": a, "b": b})

    assert (
        str(z.type_signature)
        == "(<a={float32}@CLIENTS,b={int32}@CLIENTS> -> {<a=float32,b=int32>}@CLIENTS)"
    )
    assert z([1.0, 2.0], [3, 4]) == [{"a": 1.0, "b": 3}, {"a": 2.0, "b": 4}]

    @fl.federated_computation(S_F32, fl.type_at_server(np.int32))
    def zs(a, b):
        return fl.federated_zip((a, b))

    assert str(zs.type_signature) == "(<a=float32@SERVER,b=int32@SERVER> -> <float32,int32>@SERVER)"


def test_federated_sum_and_struct_zip():
    @fl.federated_computation(C_F32, C_I32)
    def s(a, b):
        return fl.federated_sum((a, b))

    assert (
        str(s.type_signature)
        == "(<a={float32}@CLIENTS,b={int32}@CLIENTS> -> <float32,int32>@SERVER)"
    )
    assert s([1.0, 2.5], [3, 4]) == (3.5, 7)


def test_federated_sum_of_no_clients_is_zero():
    @fl.federated_computation(fl.type_at_clients(fl.TensorType(np.float32, [2])))
    def s(a):
        return fl.federated_sum(a)

    np.testing.assert_array_equal(s([]), np.zeros(2, np.float32))


def test_federated_mean_unweighted_and_weighted():
    @fl.federated_computation(C_F32)
    def mean(x):
        return fl.federated_mean(x)

    @fl.federated_computation(C_F32, C_F32)
    def wmean(x, w):
        return fl.federated_mean(x, weight=w)

    assert mean([68.5, 70.3, 69.8]) == pytest.approx(69.5333, abs=1e-4)
    assert (
        str(wmean.type_signature) == "(<x={float32}@CLIENTS,w={float32}@CLIENTS> -> float32@SERVER)"
    )
    assert wmean([1.0, 3.0], [3.0, 1.0]) == pytest.approx(1.5)
    assert np.isnan(wmean([1.0, 3.0], [0.0, 0.0]))


def test_federated_mean_rejects_integers_and_server_values():
    with pytest.raises(TypeError, match="floating-point"):
        fl.federated_computation(C_I32)(lambda x: fl.federated_mean(x))
    with pytest.raises(TypeError, match=r"placed at CLIENTS, found float32@SERVER"):
        fl.federated_computation(S_F32)(lambda x: fl.federated_mean(x))


def test_federated_min_max():
    t = fl.type_at_clients(fl.TensorType(np.int32, [2]))

    @fl.federated_computation(t)
    def mm(x):
        return fl.federated_min(x), fl.federated_max(x)

    assert str(mm.type_signature) == "({int32[2]}@CLIENTS -> <int32[2]@SERVER,int32[2]@SERVER>)"
    lo, hi = mm([[1, 5], [3, 2]])
    assert lo.tolist() == [1, 2] and hi.tolist() == [3, 5]


def test_federated_aggregate_uses_zero_accumulate_merge_report():
    @fl.jax_computation(np.float32, np.float32)
    def accumulate(acc, x):
        return acc + x

    @fl.jax_computation(np.float32, np.float32)
    def merge(a, b):
        return a + b

    @fl.jax_computation(np.float32)
    def report(a):
        return a * 10.0

    @fl.federated_computation(C_F32)
    def agg(x):
        return fl.federated_aggregate(x, np.float32(0.0), accumulate, merge, report)

    assert str(agg.type_signature) == "({float32}@CLIENTS -> float32@SERVER)"
    assert agg([1.0, 2.0, 3.0]) == pytest.approx(60.0)


def test_federated_aggregate_checks_its_functions():
    @fl.jax_computation(np.float32, np.int32)
    def bad_accumulate(acc, x):
        return acc

    @fl.jax_computation(np.float32, np.float32)
    def merge(a, b):
        return a + b

    with pytest.raises(TypeError, match="accumulate"):
        fl.federated_computation(C_F32)(
            lambda x: fl.federated_aggregate(x, np.float32(0), bad_accumulate, merge, merge)
        )


def test_federated_select():
    @fl.jax_computation(fl.TensorType(np.float32, [4, 2]), np.int32)
    def row(table, k):
        return table[k]

    keys_t = fl.type_at_clients(fl.TensorType(np.int32, [None]))
    table_t = fl.type_at_server(fl.TensorType(np.float32, [4, 2]))

    @fl.federated_computation(keys_t, table_t)
    def sel(keys, table):
        return fl.federated_select(keys, fl.federated_value(np.int32(4), fl.SERVER), table, row)

    assert str(sel.type_signature) == (
        "(<keys={int32[?]}@CLIENTS,table=float32[4,2]@SERVER> -> {sequence<float32[2]>}@CLIENTS)"
    )
    table = np.arange(8, dtype=np.float32).reshape(4, 2)
    out = sel([np.array([0, 3], np.int32), np.array([], np.int32)], table)
    assert [r.tolist() for r in out[0]] == [[0, 1], [6, 7]] and out[1] == []
    with pytest.raises(ValueError, match="outside"):
        sel([np.array([5], np.int32)], table)


def test_secure_sum_bitwidth_wraps_inputs_like_the_protocol():
    @fl.federated_computation(C_I32)
    def ss(x):
        return fl.federated_secure_sum_bitwidth(x, 3)

    assert str(ss.type_signature) == "({int32}@CLIENTS -> int32@SERVER)"
    assert ss([1, 2, 7]) == 10  # in range: exact
    assert ss([9, 1]) == 2  # 9 does not fit in 3 bits: it wraps to 1


def test_secure_modular_sum_is_exact_modular_arithmetic():
    @fl.federated_computation(C_I32)
    def ms(x):
        return fl.federated_secure_modular_sum(x, 4)

    assert ms([1, 3, 6]) == 2
    assert ms([-1, 2]) == 1  # -1 is 3 modulo 4

    @fl.federated_computation(fl.type_at_clients(fl.TensorType(np.int32, [2])))
    def ms_big(x):
        return fl.federated_secure_modular_sum(x, 2**31 - 1)

    big = np.array([2**31 - 2, 5], np.int32)
    assert ms_big([big, big]).tolist() == [(2 * (2**31 - 2)) % (2**31 - 1), 10]


def test_secure_sums_reject_floats_and_bad_bounds():
    with pytest.raises(TypeError, match="integers"):
        fl.federated_computation(C_F32)(lambda x: fl.federated_secure_modular_sum(x, 4))
    with pytest.raises(TypeError, match="positive integer"):
        fl.federated_computation(C_I32)(lambda x: fl.federated_secure_sum_bitwidth(x, 0))


SEQ_F32 = fl.SequenceType(fl.TensorType(np.float32, [None]))


def test_sequence_map_reduce_sum_local_and_federated():
    @fl.jax_computation(fl.TensorType(np.float32, [None]))
    def square(b):
        return b * b

    @fl.jax_computation(np.float32, fl.TensorType(np.float32, [None]))
    def add_batch(acc, b):
        return acc + jnp.sum(b)

    @fl.federated_computation(SEQ_F32)
    def local(ds):
        return fl.sequence_sum(fl.sequence_map(square, ds)), fl.sequence_reduce(
            ds, np.float32(0), add_batch
        )

    assert str(local.type_signature) == "(sequence<float32[?]> -> <float32[?],float32>)"
    total, reduced = local([np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)])
    assert total.tolist() == [10.0, 20.0] and reduced == 10.0

    @fl.federated_computation(fl.type_at_clients(SEQ_F32))
    def fed(ds):
        return fl.federated_sum(fl.sequence_reduce(ds, np.float32(0), add_batch))

    assert str(fed.type_signature) == "({sequence<float32[?]>}@CLIENTS -> float32@SERVER)"
    gen = (np.ones(2, np.float32) for _ in range(5))
    assert fed([[np.array([1.0], np.float32)], gen]) == 11.0


SPARSE_C = fl.type_at_clients(fl.SparseTensorType(np.float32, [5, 2]))


@fl.federated_computation(SPARSE_C)
def sparse_family(x):
    return (
        fl.federated_sparse_sum(x),
        fl.federated_sparse_sum(x, keep_sparse=True),
        fl.federated_sparse_mean(x),
    )


def test_sparse_family_has_explicit_semantics():
    assert str(sparse_family.type_signature) == (
        "({sparse<float32[5,2]>}@CLIENTS -> "
        "<float32[5,2]@SERVER,sparse<float32[5,2]>@SERVER,sparse<float32[5,2]>@SERVER>)"
    )
    a = fl.SparseTensor([[0, 1], [3, 0]], [1.0, 2.0], (5, 2))
    b = fl.SparseTensor([[3, 0], [4, 1], [3, 0]], [4.0, 1.0, 2.0], (5, 2))  # [3,0] twice: summed
    c = fl.SparseTensor(
        np.zeros((0, 2), np.int64), np.zeros(0, np.float32), (5, 2)
    )  # touches nothing
    dense, union, mean = sparse_family([a, b, c])
    expected = np.zeros((5, 2), np.float32)
    expected[0, 1], expected[3, 0], expected[4, 1] = 1.0, 8.0, 1.0
    np.testing.assert_array_equal(dense, expected)
    assert union.indices.tolist() == [[0, 1], [3, 0], [4, 1]] and union.values.tolist() == [
        1.0,
        8.0,
        1.0,
    ]
    # [3,0]: (2 + 6) / 2 clients that sent it; c sent nothing and does not dilute the mean.
    assert mean.indices.tolist() == [[0, 1], [3, 0], [4, 1]] and mean.values.tolist() == [
        1.0,
        4.0,
        1.0,
    ]


def test_sparse_family_rejects_dense_values():
    with pytest.raises(TypeError, match="expects sparse tensors"):
        fl.federated_computation(C_F32)(lambda x: fl.federated_sparse_sum(x))
