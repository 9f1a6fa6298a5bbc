"""A run compiles a bounded set of programs, and the vectorized path moves data per chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.core import context
from fedlang.runtime import local_exec, reference
from fedlang.runtime.simulation import SimulationContext

SEQ = fl.SequenceType(fl.to_type({"x": (np.float32, [None, 3]), "y": (np.float32, [None])}))
W = fl.TensorType(np.float32, [3])


def make_round():
    # A fresh computation per test: compiled programs are cached per computation.
    @fl.jax_computation(W, SEQ)
    def client_update(w, ds):
        def step(state, b, mask):
            w, n, loss = state
            err = (b["x"] @ w - b["y"]) * mask
            grad = (b["x"].T @ err) / jnp.maximum(jnp.sum(mask), 1.0)
            return w - 0.1 * grad, n + jnp.sum(mask), loss + jnp.sum(err**2)

        w_new, n, loss = ds.reduce((w, jnp.float32(0), jnp.float32(0)), step, masked=True)
        return {"delta": w_new - w, "n": n, "loss": loss}

    @fl.federated_computation(fl.type_at_server(W), fl.type_at_clients(SEQ))
    def fed_round(w, data):
        out = fl.federated_map(client_update, (fl.federated_broadcast(w), data))
        return (
            fl.federated_mean(out.delta, weight=out.n),
            fl.federated_sum(out.loss),
            fl.federated_sum(out.n),
        )

    return fed_round


def client(rng, examples, batch=4):
    """A client's batches of `batch` examples, the last one partial."""
    x = rng.normal(size=(examples, 3)).astype(np.float32)
    y = rng.normal(size=examples).astype(np.float32)
    return [{"x": x[i : i + batch], "y": y[i : i + batch]} for i in range(0, examples, batch)]


def on(ctx, fn, *args):
    with context.with_context(ctx):
        return fn(*args)


@pytest.mark.parametrize("strategy", ["loop", "scan", "vmap"])
def test_new_client_lengths_and_tail_sizes_compile_nothing(strategy):
    rng = np.random.default_rng(0)
    fed_round = make_round()
    ctx = SimulationContext(strategy=strategy, chunk_size=4, decision_cache=False)
    w = np.zeros(3, np.float32)
    # Warm-up rounds: clients of 1 to 25 batches (every length bucket up to 32).
    for sizes in ([4, 30, 61, 100], [13, 7, 2, 57]):
        on(ctx, fed_round, w, [client(rng, n) for n in sizes])
    assert ctx.last_run.compilations >= 0
    # New lengths, new tail sizes (1, 2 or 3 examples): nothing new to compile.
    for sizes in ([5, 22, 47, 98], [9, 18, 35, 70], [3, 11, 26, 91]):
        on(ctx, fed_round, w, [client(rng, n) for n in sizes])
        assert ctx.last_run.compilations == 0, sizes


@pytest.mark.parametrize("strategy", ["loop", "scan", "vmap", "auto"])
def test_padded_tails_give_the_reference_results(strategy):
    rng = np.random.default_rng(1)
    cohort = [client(rng, n) for n in (1, 3, 6, 17, 40, 9, 2, 33)]
    w = np.array([0.5, -1.0, 2.0], np.float32)
    fed_round = make_round()
    want = on(reference.ReferenceContext(), fed_round, w, cohort)
    got = on(SimulationContext(strategy=strategy, chunk_size=5, decision_cache=False), fed_round, w, cohort)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_first_call_reports_its_compilations_and_a_repeat_none():
    fed_round = make_round()
    rng = np.random.default_rng(2)
    cohort = [client(rng, 20) for _ in range(3)]
    ctx = SimulationContext(strategy="loop", decision_cache=False)
    on(ctx, fed_round, np.zeros(3, np.float32), cohort)
    assert ctx.last_run.compilations > 0
    on(ctx, fed_round, np.zeros(3, np.float32), cohort)
    assert ctx.last_run.compilations == 0


def test_vectorized_path_moves_data_per_group_and_waits_once_per_chunk(monkeypatch):
    fed_round = make_round()
    rng = np.random.default_rng(3)
    cohort = [client(rng, n) for n in rng.integers(1, 60, size=24)]
    ctx = SimulationContext(strategy="vmap", chunk_size=8, vmap_width=4, decision_cache=False)
    on(ctx, fed_round, np.zeros(3, np.float32), cohort)  # compiles
    # Every transfer of client data to the device is explicit: implicit ones are refused.
    original = local_exec.LocalRunner.map_chunk

    def guarded(self, comp, cv, c):
        with jax.transfer_guard_host_to_device("disallow"):
            return original(self, comp, cv, c)

    monkeypatch.setattr(local_exec.LocalRunner, "map_chunk", guarded)
    want = on(reference.ReferenceContext(), fed_round, np.zeros(3, np.float32), cohort)
    got = on(ctx, fed_round, np.zeros(3, np.float32), cohort)
    stats = ctx.last_run
    chunks, groups = 3, 6  # 24 clients: 3 chunks of 8, 2 groups of 4 per chunk
    assert stats.device_to_host == chunks
    assert stats.host_to_device == chunks + groups
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_client_longer_than_any_seen_compiles_nothing_with_scan():
    # The first round's clients have at most 8 batches; the scan programs for 16, 32 and
    # 64 batches are compiled then, so a long client later compiles nothing.
    rng = np.random.default_rng(4)
    fed_round = make_round()
    ctx = SimulationContext(strategy="scan", chunk_size=4, decision_cache=False)
    w = np.zeros(3, np.float32)
    on(ctx, fed_round, w, [client(rng, n) for n in (8, 30, 17, 25)])
    on(ctx, fed_round, w, [client(rng, n) for n in (9, 250, 110, 3)])
    assert ctx.last_run.compilations == 0


def test_learning_api_fedavg_agrees_on_every_strategy():
    import jax
    import optax

    from fedlang.learning import algorithms, models

    def model_fn():
        return models.FunctionalModel(
            init_fn=lambda rng: {"w": jax.random.normal(rng, (3, 2)) * 0.1, "b": jnp.zeros(2)},
            apply_fn=lambda p, x: x @ p["w"] + p["b"],
            loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
                logits, y
            ).mean(),
            input_spec={"x": (np.float32, [None, 3]), "y": (np.int32, [None])},
        )

    rng = np.random.default_rng(5)

    def generator_client(n):  # a user's generator of batch dicts, the last one partial
        x = rng.normal(size=(n, 3)).astype(np.float32)
        y = rng.integers(0, 2, n).astype(np.int32)

        class Client:
            def __iter__(self):
                return ({"x": x[i : i + 4], "y": y[i : i + 4]} for i in range(0, n, 4))

        return Client()

    cohort = [generator_client(n) for n in (1, 6, 13, 30, 9, 4, 22)]
    process = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.5), optax.sgd(1.0))
    state = process.initialize()

    def weights_after_round(ctx):
        with context.with_context(ctx):
            new_state, _ = process.next(state, cohort)
        return process.get_model_weights(new_state).trainable

    want = weights_after_round(reference.ReferenceContext())
    for strategy in ("loop", "scan", "vmap", "auto"):
        ctx = SimulationContext(strategy=strategy, chunk_size=4, decision_cache=False)
        got = weights_after_round(ctx)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=strategy)


def test_wide_vectorized_groups_agree_with_the_reference():
    # 100 clients in one group of 128 rows (the width an accelerator uses): vectorized
    # matrix products sum in another order than one client's, so results agree to float
    # rounding, not bit for bit (bench/strategy_agreement.py measures it over rounds).
    rng = np.random.default_rng(6)
    cohort = [client(rng, n) for n in rng.integers(1, 60, size=100)]
    w = np.array([0.5, -1.0, 2.0], np.float32)
    fed_round = make_round()
    want = on(reference.ReferenceContext(), fed_round, w, cohort)
    ctx = SimulationContext(strategy="vmap", vmap_width=100, chunk_size=100, decision_cache=False)
    got = on(ctx, fed_round, w, cohort)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
