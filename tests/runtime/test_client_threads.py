"""Clients side by side on one CPU device: the same results, and used where they pay."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fedlang as fl
from fedlang.runtime import local_exec, reference
from fedlang.runtime.simulation import Options, SimulationContext

from .test_bounded_programs import client, make_round, on


@pytest.mark.parametrize("strategy", ["loop", "scan", "auto"])
def test_threads_give_the_one_thread_results_bit_for_bit(strategy):
    rng = np.random.default_rng(0)
    cohort = [client(rng, n) for n in rng.integers(1, 80, size=13)]
    w = np.array([0.5, -1.0, 2.0], np.float32)
    fed_round = make_round()
    one = on(SimulationContext(strategy=strategy, client_threads=1, chunk_size=5, decision_cache=False), fed_round, w, cohort)
    three = on(SimulationContext(strategy=strategy, client_threads=3, chunk_size=5, decision_cache=False), fed_round, w, cohort)
    want = on(reference.ReferenceContext(), fed_round, w, cohort)
    for a, b, c in zip(three, one, want):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="client threads are for CPU devices")
def test_clients_really_run_side_by_side(monkeypatch):
    # The first two clients wait for each other: one thread at a time would never pass.
    barrier = threading.Barrier(2, timeout=20)
    seen = []
    original = local_exec.LocalRunner.run_client

    def meeting(self, comp, leaves, stream):
        if len(seen) < 2:
            seen.append(threading.current_thread().name)
            barrier.wait()
        return original(self, comp, leaves, stream)

    monkeypatch.setattr(local_exec.LocalRunner, "run_client", meeting)
    rng = np.random.default_rng(1)
    cohort = [client(rng, 9) for _ in range(6)]
    ctx = SimulationContext(strategy="loop", client_threads=2, decision_cache=False)
    on(ctx, make_round(), np.zeros(3, np.float32), cohort)
    assert len(seen) == 2 and all(name.startswith("fedlang-client") for name in seen)


def test_one_shot_generator_clients_and_errors_with_threads():
    rng = np.random.default_rng(2)
    batches = [client(rng, n) for n in (5, 17, 30, 2)]
    fed_round = make_round()
    w = np.zeros(3, np.float32)
    want = on(reference.ReferenceContext(), fed_round, w, batches)
    got = on(SimulationContext(strategy="loop", client_threads=2, decision_cache=False),
             fed_round, w, [iter(b) for b in batches])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    def broken():
        yield batches[0][0]
        raise OSError("client 3's file is unreadable")

    with pytest.raises(OSError, match="unreadable"):
        on(SimulationContext(strategy="loop", client_threads=2, decision_cache=False),
           fed_round, w, [iter(batches[0]), iter(batches[1]), broken()])


def test_a_convolution_step_gets_one_client_per_core(monkeypatch):
    monkeypatch.setattr(local_exec, "usable_cores", lambda: 4)
    batch = fl.SequenceType(fl.to_type({"x": (np.float32, [None, 6, 6, 1])}))

    @fl.jax_computation(fl.TensorType(np.float32, [3, 3, 1, 2]), batch)
    def conv_sum(k, ds):
        def step(total, b):
            y = lax.conv_general_dilated(b["x"], k, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return total + jnp.sum(y)

        return ds.reduce(jnp.float32(0), step)

    @fl.jax_computation(fl.TensorType(np.float32, [3]), batch)
    def dense_sum(w, ds):
        return ds.reduce(jnp.float32(0), lambda t, b: t + jnp.sum(b["x"]) * w[0])

    cpu = jax.devices("cpu")
    assert local_exec.client_threads_for(conv_sum, cpu[:1]) == 4
    assert local_exec.client_threads_for(dense_sum, cpu[:1]) == 1
    monkeypatch.setattr(local_exec, "usable_cores", lambda: 1)
    assert local_exec.client_threads_for(conv_sum, cpu[:1]) == 1


def test_client_threads_must_be_positive():
    with pytest.raises(ValueError, match="client_threads"):
        Options(client_threads=0)


def test_staged_clients_start_longest_first(monkeypatch):
    started = []
    original = local_exec.LocalRunner.run_client

    def record(self, comp, leaves, stream):
        started.append(len(list(stream)))  # staged clients replay their batches
        return original(self, comp, leaves, stream)

    monkeypatch.setattr(local_exec.LocalRunner, "run_client", record)
    rng = np.random.default_rng(3)
    sizes = [8, 40, 4, 100, 20]  # batches of 4: 2, 10, 1, 25, 5
    ctx = SimulationContext(strategy="loop", client_threads=1, decision_cache=False)
    on(ctx, make_round(), np.zeros(3, np.float32), [client(rng, n) for n in sizes])
    assert started == [2, 10, 1, 25, 5]  # one thread: the clients' order
    started.clear()
    ctx = SimulationContext(strategy="loop", client_threads=2, decision_cache=False)
    on(ctx, make_round(), np.zeros(3, np.float32), [client(rng, n) for n in sizes])
    assert sorted(started[:2]) == [10, 25] and sorted(started) == [1, 2, 5, 10, 25]
