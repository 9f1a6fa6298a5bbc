"""The Ray runtime: client data read by the workers, programs cached on the actors,
partials merged before the driver, dead actors' tasks re-run, unreadable data named.

The conformance suite runs on Ray through the `runtime` fixture (tests/conftest.py);
these tests cover what only Ray does. They share the session's local Ray instance.
"""

import functools
import os
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

ray = pytest.importorskip("ray")

import fedlang as fl  # noqa: E402
from fedlang import simulation as sim  # noqa: E402
from fedlang.core import context  # noqa: E402
from fedlang.runtime import RayContext  # noqa: E402

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

DIM = 16
W = fl.TensorType(np.float32, [DIM])
BATCH = {"x": fl.TensorType(np.float32, [None, DIM]), "y": fl.TensorType(np.float32, [None])}
SEQ = fl.SequenceType(BATCH)


@fl.jax_computation(W, SEQ)
def client_update(w, ds):
    """One pass of least-squares SGD; returns (delta, examples)."""

    def step(state, batch):
        v, n = state
        grad = batch["x"].T @ (batch["x"] @ v - batch["y"]) / batch["y"].shape[0]
        return v - 0.05 * grad, n + jnp.float32(batch["y"].shape[0])

    v, n = ds.reduce((w, jnp.float32(0)), step)
    return v - w, n


@fl.federated_computation(fl.type_at_server(W), fl.type_at_clients(SEQ))
def fed_round(w, data):
    delta, n = fl.federated_map(client_update, fl.federated_zip(
        (fl.federated_broadcast(w), data)))
    return fl.federated_mean(delta, weight=n), fl.federated_sum(n), fl.federated_max(n)


def _write_store(path: pathlib.Path, num_clients: int, rows: int = 200, seed: int = 0):
    rng = np.random.default_rng(seed)
    clients = {}
    for c in range(num_clients):
        k = rows + c % 7
        x = rng.normal(size=(k, DIM)).astype(np.float32)
        y = (x @ np.linspace(-1, 1, DIM, dtype=np.float32)).astype(np.float32)
        clients[f"c{c}"] = [{"x": x[i], "y": y[i]} for i in range(k)]
    return sim.store.write(path, clients)


def _datasets(path: pathlib.Path) -> list:
    cd = sim.ClientData.from_store(path)
    return [cd.create_dataset_for_client(cid).batch(10) for cid in cd.client_ids]


def _reference(w, data):
    with fl.runtime.reference_context():
        return fed_round(w, data)


def _assert_close(got, want):
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=1e-6)


W0 = np.zeros(DIM, np.float32)


def test_a_round_on_store_data_equals_the_reference_and_ships_recipes_not_data(tmp_path):
    path = _write_store(tmp_path / "store", num_clients=12)
    data = _datasets(path)
    ctx = RayContext(num_workers=2, strategy="loop")

    with context.with_context(ctx):
        got = fed_round(W0, data)

    _assert_close(got, _reference(W0, data))
    t = ctx.last_transfers
    assert t.waves == 1 and t.tasks == 4 and t.retries == 0
    data_bytes = sum(4 * (DIM + 1) * int(sim.ClientData.from_store(path).num_examples(c))
                     for c in sim.ClientData.from_store(path).client_ids)
    # the per-client values sent are the datasets' recipes (path and client id)
    assert t.to_workers - _fn_bytes(ctx) < data_bytes / 4


def _fn_bytes(ctx: RayContext) -> int:
    return sum(entry[3] for entry in ctx.registry.by_id.values())


def test_programs_stay_compiled_on_the_actors_across_rounds(tmp_path):
    data = _datasets(_write_store(tmp_path / "store", num_clients=8))
    ctx = RayContext(num_workers=2, strategy="loop")
    with context.with_context(ctx):
        w, *_ = fed_round(W0, data)
        first = ctx.last_transfers
        fed_round(w, data)
        second = ctx.last_transfers

    assert second.worker_compilations == 0
    # the local computation is sent once per context, not per round
    assert second.to_workers < first.to_workers


def test_the_driver_receives_one_partial_whatever_the_cohort():
    @fl.federated_computation(fl.type_at_clients(W))
    def total(x):
        return fl.federated_sum(x)

    ctx = RayContext(num_workers=2, chunk_size=4)
    received = {}
    for n in (8, 200):
        values = [np.full(DIM, i, np.float32) for i in range(n)]
        with context.with_context(ctx):
            np.testing.assert_allclose(total(values), np.full(DIM, n * (n - 1) / 2))
        received[n] = ctx.last_transfers.from_workers
        assert ctx.last_transfers.tasks == 4

    assert received[8] == received[200]


def _exit_once(marker: str, task: int) -> None:
    """A task hook: the actor running task 1 dies, once (the marker says it did)."""
    if task == 1 and not os.path.exists(marker):
        pathlib.Path(marker).touch()
        os._exit(1)


def test_an_actor_that_dies_mid_round_has_its_task_rerun(tmp_path):
    data = _datasets(_write_store(tmp_path / "store", num_clients=10))
    marker = tmp_path / "died"
    ctx = RayContext(num_workers=2, strategy="loop",
                     task_hook=functools.partial(_exit_once, str(marker)))

    with context.with_context(ctx):
        got = fed_round(W0, data)
        first = ctx.last_transfers
        again = fed_round(W0, data)  # on the replacement actor

    assert marker.exists() and first.retries >= 1
    _assert_close(got, _reference(W0, data))
    _assert_close(again, got)


def test_an_actor_that_dies_while_merging_leaves_the_merge_to_the_driver(tmp_path):
    data = _datasets(_write_store(tmp_path / "store", num_clients=10))
    marker = tmp_path / "died"
    normal = RayContext(num_workers=2, strategy="loop")
    dying = RayContext(num_workers=2, strategy="loop",
                       task_hook=functools.partial(_exit_once_merging, str(marker)))

    with context.with_context(normal):
        fed_round(W0, data)
    with context.with_context(dying):
        got = fed_round(W0, data)
    with context.with_context(normal):
        again = fed_round(W0, data)  # the dead actor was replaced

    assert marker.exists()
    # the driver received the 4 task partials instead of the merge tree's root
    assert dying.last_transfers.from_workers > 3 * normal.last_transfers.from_workers
    _assert_close(got, _reference(W0, data))
    _assert_close(again, got)


def _exit_once_merging(marker: str, task: int) -> None:
    if task == -1 and not os.path.exists(marker):
        pathlib.Path(marker).touch()
        os._exit(1)


def _exit_on_first_task(task: int) -> None:
    if task == 0:
        os._exit(1)


@pytest.mark.slow  # starts three actors (processes importing JAX) after the deaths
def test_a_task_that_keeps_killing_its_actor_fails_the_round_and_the_next_call_works():
    @fl.federated_computation(fl.type_at_clients(np.float32))
    def total(x):
        return fl.federated_sum(x)

    dying = RayContext(num_workers=2, max_retries=1, task_hook=_exit_on_first_task)
    with context.with_context(dying), pytest.raises(RuntimeError, match="died 2 times"):
        total([1.0, 2.0, 3.0, 4.0])

    with context.with_context(RayContext(num_workers=2)):
        assert total([1.0, 2.0, 3.0, 4.0]) == 10.0


def test_unreadable_client_data_names_the_client_and_path_and_the_next_call_works(tmp_path):
    broken = _write_store(tmp_path / "broken", num_clients=6)
    data = _datasets(broken)
    (broken / sim.store.DATA_FILE).unlink()  # after the driver opened the store
    ctx = RayContext(num_workers=2, strategy="loop")

    with context.with_context(ctx):
        with pytest.raises(sim.store.StoreError) as raised:
            fed_round(W0, data)
        good = _datasets(_write_store(tmp_path / "good", num_clients=6))
        got = fed_round(W0, good)

    message = str(raised.value)
    assert "client 'c" in message and str(broken / sim.store.DATA_FILE) in message
    assert any("Ray worker" in note for note in getattr(raised.value, "__notes__", []))
    _assert_close(got, _reference(W0, good))


def test_one_shot_generators_are_read_by_the_driver():
    def gen(k):
        for _ in range(k):
            yield {"x": np.ones((2, DIM), np.float32), "y": np.ones(2, np.float32)}

    ctx = RayContext(num_workers=2)
    with context.with_context(ctx):
        got = fed_round(W0, [gen(1), gen(3), gen(2)])

    _assert_close(got, _reference(W0, [list(gen(1)), list(gen(3)), list(gen(2))]))


def test_ray_context_uses_a_running_instance_and_leaves_it_running():
    @fl.federated_computation(fl.type_at_clients(np.float32))
    def mean(x):
        return fl.federated_mean(x)

    with fl.runtime.ray_context(num_workers=2) as ctx:
        assert mean([1.0, 2.0, 4.0]) == pytest.approx(7 / 3)

    assert isinstance(ctx, RayContext) and ray.is_initialized()


def test_contexts_with_other_numbers_of_workers_take_turns_with_the_cpus():
    @fl.federated_computation(fl.type_at_clients(np.float32))
    def total(x):
        return fl.federated_sum(x)

    # the session has 2 CPUs: a pool of 1 actor and one of 2 cannot both hold them
    for workers in (1, 2):
        with context.with_context(RayContext(num_workers=workers)):
            assert total([1.0, 2.0, 3.0]) == 6.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="num_workers"):
        RayContext(num_workers=0)
    with pytest.raises(ValueError, match="tasks_per_worker"):
        RayContext(tasks_per_worker=0)
    with pytest.raises(ValueError, match="start_timeout"):
        RayContext(start_timeout=0)


def test_more_workers_than_the_cluster_can_place_fail_at_once_and_the_next_call_works():
    @fl.federated_computation(fl.type_at_clients(np.float32))
    def total(x):
        return fl.federated_sum(x)

    # the session has 2 CPUs: a third worker would wait for one forever
    with (context.with_context(RayContext(num_workers=3)),
          pytest.raises(ValueError, match=r"num_workers=3 .* has 2: .*num_workers <= 2")):
        total([1.0, 2.0])
    # workers that cannot start in time: the call fails naming the resources, no pool is kept
    with (context.with_context(RayContext(num_workers=1, start_timeout=1e-4)),
          pytest.raises(RuntimeError, match=r"did not all start within .*start_timeout=")):
        total([1.0, 2.0])
    with context.with_context(RayContext(num_workers=2)):
        assert total([1.0, 2.0]) == 3.0
