"""What only the simulation runtime promises: bounded memory, shared client work, strategies, devices."""

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.core import context

# `fedlang.runtime.simulation` is the context manager; the module is reached by its full name.
from fedlang.runtime import accumulate, local_exec, reference, simulation
from fedlang.runtime.simulation import Options, SimulationContext

SEQ = fl.SequenceType(fl.to_type({"x": (np.float32, [None, 3]), "y": (np.float32, [None])}))
W = fl.TensorType(np.float32, [3])


@fl.jax_computation(W, SEQ)
def client_update(w, ds):
    def step(state, b):
        w, n, loss = state
        pred = b["x"] @ w
        err = pred - b["y"]
        grad = b["x"].T @ err / b["y"].shape[0]
        return w - 0.1 * grad, n + b["y"].shape[0], loss + jnp.sum(err**2)

    w_new, n, loss = ds.reduce((w, jnp.int32(0), jnp.float32(0)), step)
    return {"delta": w_new - w, "n": n.astype(jnp.float32), "loss": loss}


@fl.federated_computation(fl.type_at_server(W), fl.type_at_clients(SEQ))
def fedavg_round(w, data):
    out = fl.federated_map(client_update, (fl.federated_broadcast(w), data))
    delta = fl.federated_mean(out.delta, weight=out.n)
    return delta, fl.federated_sum(out.loss), fl.federated_sum(out.n)


def make_clients(num, seed=0, sizes=(1, 7)):
    rng = np.random.default_rng(seed)
    clients = []
    for _ in range(num):
        n = int(rng.integers(*sizes))
        batches = []
        for _ in range(n):
            bs = int(rng.integers(1, 5))
            batches.append(
                {
                    "x": rng.normal(size=(bs, 3)).astype(np.float32),
                    "y": rng.normal(size=bs).astype(np.float32),
                }
            )
        clients.append(batches)
    return clients


def on(ctx, fn, *args):
    with context.with_context(ctx):
        return fn(*args)


def assert_close(a, b):
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["loop", "scan", "vmap", "auto"])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_fedavg_round_matches_the_reference(strategy, chunk_size):
    clients = make_clients(11)
    w = np.array([0.5, -1.0, 2.0], np.float32)
    expected = on(reference.ReferenceContext(), fedavg_round, w, clients)
    got = on(SimulationContext(chunk_size=chunk_size, strategy=strategy), fedavg_round, w, clients)
    assert_close(got, expected)


def test_client_work_shared_by_several_aggregations_runs_once(monkeypatch):
    calls = []
    original = local_exec.LocalRunner.run_client
    monkeypatch.setattr(
        local_exec.LocalRunner, "run_client", lambda self, *a: calls.append(1) or original(self, *a)
    )
    ctx = SimulationContext(chunk_size=4, strategy="loop")
    on(ctx, fedavg_round, np.zeros(3, np.float32), make_clients(10))
    assert len(calls) == 10  # three aggregations, one pass over the clients
    assert ctx.last_run.waves == 1


def test_memory_is_bounded_by_the_chunk_not_the_cohort(monkeypatch):
    seen = []
    original = accumulate.WeightedMean.add
    monkeypatch.setattr(
        accumulate.WeightedMean, "add", lambda self, cv, c: seen.append(c) or original(self, cv, c)
    )

    @fl.federated_computation(fl.type_at_clients(np.float32), fl.type_at_clients(np.float32))
    def wmean(x, w):
        return fl.federated_mean(x, weight=w)

    x = np.arange(10_000, dtype=np.float32)
    w = np.ones(10_000, np.float32)
    got = on(SimulationContext(chunk_size=100), wmean, list(x), list(w))
    assert max(seen) == 100 and len(seen) == 100
    assert got == pytest.approx(x.mean())


def test_default_chunk_size_comes_from_the_value_sizes():
    small = SimulationContext()
    assert small.options.chunk_size is None
    on(small, fedavg_round, np.zeros(3, np.float32), make_clients(3))
    tight = SimulationContext(memory_budget=1 << 16)

    @fl.federated_computation(fl.type_at_clients(fl.TensorType(np.float32, [4096])))
    def total(x):
        return fl.federated_sum(x)

    seen = []
    original = accumulate.Sum.add
    try:
        accumulate.Sum.add = lambda self, cv, c: seen.append(c) or original(self, cv, c)
        on(tight, total, [np.ones(4096, np.float32)] * 20)
    finally:
        accumulate.Sum.add = original
    assert max(seen) == 8  # 64 KiB budget / (2 x 16 KiB per client) -> the floor of 8


def test_a_client_larger_than_the_budget_is_streamed(monkeypatch):
    pulled, staged = [], []

    def huge():
        for i in range(400):
            pulled.append(i)
            yield {"x": np.ones((256, 3), np.float32), "y": np.ones(256, np.float32)}  # 4 KiB

    original = simulation._StagedStream.__init__

    def record(self, stream, budget):
        original(self, stream, budget)
        staged.append(len(self.batches))

    monkeypatch.setattr(simulation._StagedStream, "__init__", record)
    ctx = SimulationContext(chunk_size=1, memory_budget=1 << 16, strategy="scan")
    _, _, n = on(ctx, fedavg_round, np.zeros(3, np.float32), [huge()])
    assert n == 400 * 256 and len(pulled) == 400
    assert staged == [16]  # 64 KiB of the 1.6 MiB client staged ahead; the rest streamed


def test_auto_records_the_strategy_it_picked():
    ctx = SimulationContext(strategy="auto")
    on(ctx, fedavg_round, np.zeros(3, np.float32), make_clients(4, sizes=(9, 10)))
    rows = local_exec.describe_choices(ctx.runner)
    assert rows and rows[0]["picked"] in ("loop", "scan") and rows[0]["loop"] > 0


def test_options_are_validated():
    with pytest.raises(ValueError, match="chunk_size"):
        Options(chunk_size=0)
    with pytest.raises(ValueError, match="strategy"):
        Options(strategy="fastest")
    with pytest.raises(ValueError, match="memory_budget"):
        Options(memory_budget=10)


def test_simulation_context_manager_and_default():
    assert isinstance(context.get_default_context(), SimulationContext)
    with fl.runtime.simulation_context(chunk_size=2) as ctx:
        assert fedavg_round(np.zeros(3, np.float32), make_clients(5))[2] > 0
    assert ctx.last_run is not None


# -- bad input --------------------------------------------------------------------


def test_inconsistent_element_shapes_name_the_client():
    clients = make_clients(4)
    clients[2] = [{"x": np.ones((2, 4), np.float32), "y": np.ones(2, np.float32)}]
    with pytest.raises(TypeError, match=r"\[client 2\]<element 0>\.x"):
        on(SimulationContext(chunk_size=2), fedavg_round, np.zeros(3, np.float32), clients)


def test_empty_client_contributes_its_initial_state_and_zero_weight():
    clients = make_clients(3)
    with_empty = [*clients, []]
    ref = on(reference.ReferenceContext(), fedavg_round, np.ones(3, np.float32), clients)
    got = on(SimulationContext(chunk_size=2), fedavg_round, np.ones(3, np.float32), with_empty)
    assert_close(got, ref)


def test_nan_in_client_data_is_never_silently_dropped():
    clients = make_clients(3)
    clients[1][0]["y"][0] = np.nan
    delta, loss, _ = on(SimulationContext(), fedavg_round, np.ones(3, np.float32), clients)
    assert np.isnan(loss) and np.isnan(delta).all()


def test_several_devices_split_each_chunk(tmp_path):
    script = textwrap.dedent(
        """
        import numpy as np, jax, jax.numpy as jnp, fedlang as fl
        from fedlang.runtime import reference
        from fedlang.core import context
        assert len(jax.devices()) == 2
        SEQ = fl.SequenceType(fl.TensorType(np.float32, [None]))

        @fl.jax_computation(np.float32, SEQ)
        def total(w, ds):
            return ds.reduce(jnp.float32(0), lambda s, b: s + w * jnp.sum(b))

        @fl.jax_computation(np.float32)
        def square(x):
            return x * x

        @fl.federated_computation(fl.type_at_server(np.float32), fl.type_at_clients(SEQ), fl.type_at_clients(np.float32))
        def fed(w, ds, xs):
            return fl.federated_sum(fl.federated_map(total, (fl.federated_broadcast(w), ds))), fl.federated_sum(fl.federated_map(square, xs))

        data = [[np.ones(3, np.float32) * i] * (i % 4 + 1) for i in range(10)]
        xs = [float(i) for i in range(10)]
        with fl.runtime.simulation_context(chunk_size=8) as ctx:
            got = fed(2.0, data, xs)
        with context.with_context(reference.ReferenceContext()):
            want = fed(2.0, data, xs)
        assert len(ctx.runner.devices) == 2
        np.testing.assert_allclose(got, want)
        print("ok")
        """
    )
    # Two CPU devices, also on a machine with a GPU (which would be JAX's default).
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


XY = fl.SequenceType(fl.to_type({"x": (np.float32, [None, 2]), "y": (np.float32, [None])}))


@fl.jax_computation(XY)
def masked_sum(ds):
    return ds.reduce(jnp.float32(0), lambda s, b, m: s + jnp.sum(b["y"] * m), masked=True)


@fl.jax_computation(XY)
def plain_sum(ds):
    return ds.reduce(jnp.float32(0), lambda s, b: s + jnp.sum(b["y"]))


@pytest.mark.parametrize(("comp", "runs"), [(masked_sum, [3]), (plain_sum, [2, 1])])
def test_masked_reduce_pads_ragged_tails_into_one_scan(monkeypatch, comp, runs):
    seen = []
    original = local_exec.LocalRunner._scan_run
    monkeypatch.setattr(
        local_exec.LocalRunner,
        "_scan_run",
        staticmethod(
            lambda c, lv, s, run, *rest: seen.append(len(run)) or original(c, lv, s, run, *rest)
        ),
    )
    batches = [
        {"x": np.zeros((4, 2), np.float32), "y": np.ones(4, np.float32)},
        {"x": np.zeros((4, 2), np.float32), "y": np.ones(4, np.float32)},
        {"x": np.zeros((3, 2), np.float32), "y": np.ones(3, np.float32) * 2},
    ]

    @fl.federated_computation(fl.type_at_clients(XY))
    def total(data):
        return fl.federated_sum(fl.federated_map(comp, data))

    assert on(SimulationContext(strategy="scan"), total, [batches]) == 14.0
    assert seen == runs


@pytest.mark.parametrize("one_shot", [False, True])
def test_auto_tuning_never_loses_batches(one_shot):
    # 'auto' times strategies on the first clients of a chunk; with one-shot streams it
    # must not read them twice (the clients would lose the batches read while timing).
    clients = make_clients(10, seed=3, sizes=(3, 9))
    expected = sum(len(b["y"]) for c in clients for b in c)
    data = [iter(c) for c in clients] if one_shot else clients
    ctx = SimulationContext(strategy="auto", chunk_size=10, prefetch=False)
    _, _, n = on(ctx, fedavg_round, np.zeros(3, np.float32), data)
    assert n == expected
