"""Tests of fedlang.backends.jax.export: JAX computations as exported StableHLO."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.backends.jax import export
from fedlang.core import serialization, wire


def _round_trip(comp):
    back = fl.Computation.from_bytes(comp.to_bytes())
    assert isinstance(back, export.ExportedJaxComputation)
    assert back.type_signature == comp.type_signature
    assert back.name == comp.name and back.parameter_names == comp.parameter_names
    return back


def _assert_tree_equal(actual, expected):
    assert type(actual) is type(expected)
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            _assert_tree_equal(actual[k], expected[k])
    elif isinstance(expected, tuple | list):
        for a, e in zip(actual, expected, strict=True):
            _assert_tree_equal(a, e)
    else:
        np.testing.assert_array_equal(actual, expected, strict=True)


def test_computation_without_a_dataset_and_unknown_dims():
    @fl.jax_computation({"w": (np.float32, [None, 3]), "b": np.float32}, (np.float32, [None, 3]))
    def affine(params, x):
        return {"y": x @ params["w"].T + params["b"], "rows": jnp.sum(x, axis=1)}

    back = _round_trip(affine)
    assert set(back.programs) == {"fn"}
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float32(1)}
    for n in (1, 2):  # one symbolic leading dim 'a' shared by w and x
        x = np.ones((2, 3), np.float32) * n
        _assert_tree_equal(back(params, x), affine(params, x))


def test_unknown_inner_dims_and_the_shared_leading_dim():
    @fl.jax_computation((np.float32, [2, None]), (np.float32, [None]), (np.float32, [None]))
    def sums(m, x, y):
        return jnp.sum(m, axis=1), jnp.sum(x) + jnp.sum(y)

    back = _round_trip(sums)
    m = np.arange(8, dtype=np.float32).reshape(2, 4)
    x = np.ones(3, np.float32)
    _assert_tree_equal(back(m, x, x), sums(m, x, x))
    with pytest.raises(ValueError, match="leading dimensions of its non-dataset arguments share"):
        back(m, x, np.ones(4, np.float32))


def test_computation_with_no_parameters():
    @fl.jax_computation()
    def zeros():
        return jnp.zeros(2, jnp.int32), jnp.float32(1)

    _assert_tree_equal(_round_trip(zeros)(), zeros())


def test_dataset_reduce_with_map_and_other_arguments():
    element = {"x": (np.float32, [None, 2]), "y": (np.int32, [None])}

    @fl.jax_computation(np.float32, fl.SequenceType(element))
    def fit(scale, ds):
        def step(state, batch):
            return state[0] + jnp.sum(batch["x"]) * scale, state[1] + batch["y"].shape[0]

        total, count = ds.map(lambda b: {"x": b["x"] + 1, "y": b["y"]}).reduce(
            (jnp.float32(0), jnp.int32(0)), step
        )
        return {"mean": total / count.astype(jnp.float32), "count": count}

    back = _round_trip(fit)
    assert set(back.programs) == {"prologue", "step", "epilogue"}
    batches = [
        {"x": np.ones((3, 2), np.float32), "y": np.arange(3, dtype=np.int32)},
        {"x": np.zeros((1, 2), np.float32), "y": np.zeros(1, np.int32)},
    ]
    _assert_tree_equal(back(2.0, batches), fit(2.0, batches))
    _assert_tree_equal(back(2.0, []), fit(2.0, []))


def test_dataset_that_is_never_reduced():
    @fl.jax_computation(fl.SequenceType(np.float32), np.int32)
    def ignore(ds, k):
        return k * 2

    back = _round_trip(ignore)
    assert set(back.programs) == {"epilogue"} and not back.uses_reduce
    assert back([1.0, 2.0], 4) == ignore([1.0, 2.0], 4) == 8


def test_sparse_argument():
    @fl.jax_computation(fl.SparseTensorType(np.float32, [4, 3]))
    def column_sums(st):
        return st.to_dense().sum(axis=0)

    x = fl.SparseTensor([[0, 1], [2, 2], [3, 2]], [1.0, 2.0, 3.0], (4, 3))
    _assert_tree_equal(_round_trip(column_sums)(x), column_sums(x))


def test_exported_computation_serializes_again_and_runs_in_federated_code():
    @fl.jax_computation(np.float32)
    def double(x):
        return x * 2

    back = fl.Computation.from_bytes(_round_trip(double).to_bytes())

    @fl.federated_computation(fl.type_at_clients(np.float32))
    def fed(values):
        return fl.federated_sum(fl.federated_map(back, values))

    assert fed([1.0, 2.5]) == np.float32(7.0)
    assert fl.Computation.from_bytes(fed.to_bytes())([1.0, 2.5]) == np.float32(7.0)


@pytest.mark.parametrize("use_reference", [False, True])
def test_deserialized_dataset_computation_in_every_runtime(use_reference):
    @fl.jax_computation(fl.SequenceType((np.float32, [None, 2])))
    def count_and_sum(ds):
        return ds.reduce(
            (jnp.int32(0), jnp.zeros(2, jnp.float32)),
            lambda s, b: (s[0] + b.shape[0], s[1] + jnp.sum(b, axis=0)),
        )

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType((np.float32, [None, 2]))))
    def fed(data):
        return fl.federated_sum(fl.federated_map(count_and_sum, data))

    back = fl.Computation.from_bytes(fed.to_bytes())
    rng = np.random.default_rng(0)
    data = [[rng.normal(size=(4, 2)).astype(np.float32) for _ in range(n)] for n in (0, 3, 12)]
    if use_reference:
        with fl.runtime.reference_context():
            expected, actual = fed(data), back(data)
    else:
        expected, actual = fed(data), back(data)
    assert actual[0] == expected[0] == 60
    np.testing.assert_allclose(actual[1], expected[1], rtol=1e-5)


def test_programs_are_exported_for_cpu_and_cuda():
    @fl.jax_computation(np.float32)
    def inc(x):
        return x + 1

    programs = export.export_programs(inc)
    assert programs["fn"].platforms == export.PLATFORMS


def test_corrupted_program_bytes_raise_a_serialization_error():
    @fl.jax_computation(np.float32)
    def inc(x):
        return x + 1

    header, blobs = wire.unpack(inc.to_bytes(), wire.KIND_COMPUTATION)
    blobs = [b"\x00" * 64 for _ in blobs]
    data = wire.pack(wire.KIND_COMPUTATION, header, blobs)
    # Untrusted (the default): the checking process refuses them; this process never parses them.
    with pytest.raises(serialization.SerializationError, match="checking process refused"):
        fl.Computation.from_bytes(data)
    # Trusted by the caller: parsed here, and refused as unreadable.
    with pytest.raises(serialization.SerializationError, match="exported StableHLO"):
        fl.Computation.from_bytes(data, trusted=True)


def test_missing_program_is_rejected():
    @fl.jax_computation(np.float32)
    def inc(x):
        return x + 1

    header, blobs = wire.unpack(inc.to_bytes(), wire.KIND_COMPUTATION)
    header["locals"][0]["meta"]["programs"] = {"step": 0}
    data = wire.pack(wire.KIND_COMPUTATION, header, blobs)
    with pytest.raises(serialization.SerializationError, match=r"the programs \['fn'\]"):
        fl.Computation.from_bytes(data)


# ----------------------------------------------------------------------------
# A computation runs in a fresh process that never imports the code defining it.

_DEFINING_MODULE = """
import jax.numpy as jnp
import numpy as np
import fedlang as fl

BATCH = fl.TensorType(np.float32, [None, 2])


@fl.jax_computation(fl.TensorType(np.float32, [2]), fl.SequenceType(BATCH))
def client_update(weights, ds):
    def step(state, batch):
        return state[0] + jnp.sum(batch * weights, axis=0), state[1] + batch.shape[0]

    total, n = ds.reduce((jnp.zeros(2, jnp.float32), jnp.int32(0)), step)
    return total / jnp.maximum(n, 1).astype(jnp.float32)


@fl.federated_computation(fl.type_at_server(fl.TensorType(np.float32, [2])), fl.type_at_clients(fl.SequenceType(BATCH)))
def round_(weights, data):
    update = fl.federated_map(client_update, (fl.federated_broadcast(weights), data))
    return fl.federated_mean(update)
"""

_WRITER = """
import sys
import secret_model_def
with open(sys.argv[1], "wb") as f:
    f.write(secret_model_def.round_.to_bytes())
"""

_READER = """
import json
import sys
import numpy as np
import fedlang as fl
comp = fl.Computation.from_bytes(open(sys.argv[1], "rb").read())
assert "secret_model_def" not in sys.modules
try:
    import secret_model_def  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("the defining module should not be importable here")
weights = np.array([1.0, -2.0], np.float32)
data = [[np.ones((3, 2), np.float32), np.full((1, 2), 2.0, np.float32)], [np.zeros((2, 2), np.float32)]]
print(str(comp.type_signature))
print(json.dumps(comp(weights, data).tolist()))
"""


def _python(args, env_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if env_path:
        env["PYTHONPATH"] = env_path
    done = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_serialized_computation_runs_in_a_fresh_process_without_its_source(tmp_path):
    module_dir, work_dir = tmp_path / "src", tmp_path / "work"
    module_dir.mkdir()
    work_dir.mkdir()
    (module_dir / "secret_model_def.py").write_text(_DEFINING_MODULE)
    (work_dir / "writer.py").write_text(_WRITER)
    (work_dir / "reader.py").write_text(textwrap.dedent(_READER))
    blob = work_dir / "round.fedl"

    _python([str(work_dir / "writer.py"), str(blob)], str(module_dir))
    out = _python([str(work_dir / "reader.py"), str(blob)], None).splitlines()

    spec = importlib.util.spec_from_file_location(
        "secret_model_def", module_dir / "secret_model_def.py"
    )
    defining = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(defining)
    weights = np.array([1.0, -2.0], np.float32)
    data = [
        [np.ones((3, 2), np.float32), np.full((1, 2), 2.0, np.float32)],
        [np.zeros((2, 2), np.float32)],
    ]
    expected = defining.round_(weights, data)
    assert out[0] == str(defining.round_.type_signature)
    np.testing.assert_allclose(np.array(json.loads(out[1]), np.float32), expected, rtol=1e-6)
