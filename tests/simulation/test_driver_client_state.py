"""run_training with client state: the store is checkpointed and resumed with the run."""

import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.simulation import ClientStateError, ClientStateStore, UniformSampler, run_training

STATE = (np.float32, [3])
BATCHES = fl.SequenceType((np.float32, [None, 3]))
IDS = [f"client-{i}" for i in range(12)]


@fl.jax_computation()
def zeros():
    return np.zeros(3, np.float32)


@fl.federated_computation()
def initialize():
    return fl.federated_eval(zeros, fl.SERVER)


@fl.jax_computation(STATE, STATE, BATCHES)
def client_step(state, server, data):
    total = data.reduce(jnp.zeros(3, jnp.float32), lambda acc, b: acc + b.sum(0))
    return 0.5 * state + total - 0.1 * server


@fl.jax_computation(STATE, STATE)
def server_step(server, mean):
    return 0.9 * server + mean


@fl.federated_computation(fl.type_at_server(STATE), fl.type_at_clients(BATCHES),
                          fl.type_at_clients(STATE))
def next_fn(server, data, states):
    new = fl.federated_map(client_step, (states, fl.federated_broadcast(server), data))
    new_server = fl.federated_map(server_step, (server, fl.federated_mean(new)))
    return new_server, {"mean": fl.federated_mean(new)}, new


PROCESS = fl.templates.IterativeProcess(
    initialize, fl.with_client_state(next_fn, zeros, parameter="states", result=2))


def data(round_num, ids):
    return [[np.full((2, 3), round_num + int(c.split("-")[1]) / 10, np.float32)] for c in ids]


def train(tmp_path, rounds, name="run", **kw):
    store = ClientStateStore(tmp_path / f"{name}-states", PROCESS.client_state)
    result = run_training(PROCESS, data, UniformSampler(IDS, 4, seed=3), rounds,
                          checkpoint_dir=tmp_path / f"{name}-ckpt", progress=False,
                          client_state_store=store, **kw)
    return result, store


def test_the_process_gets_each_cohort_s_states_and_they_persist(tmp_path):
    result, store = train(tmp_path, 4)
    assert result.round_num == 4 and store.version == 4
    seen = {c for c in IDS if store.has_state(c)}
    assert 4 <= len(seen) <= 12
    assert all(np.any(store.get(c) != 0) for c in seen)


def test_a_run_stopped_after_the_store_committed_resumes_exactly(tmp_path):
    want, want_store = train(tmp_path, 5, name="whole", checkpoint_every=2)

    def fail_at_round_3(state):
        if fail_at_round_3.calls == 2:  # evaluations run after rounds 2 and 3
            raise KeyboardInterrupt
        fail_at_round_3.calls += 1
        return {}

    fail_at_round_3.calls = 0
    with pytest.raises(KeyboardInterrupt):
        # checkpoints after rounds 0 and 2; round 3's states are committed, its
        # checkpoint is not: resuming must redo round 3 from round 2's states
        train(tmp_path, 5, name="cut", checkpoint_every=2, evaluation=fail_at_round_3,
              evaluate_every=1)
    store = ClientStateStore(tmp_path / "cut-states")
    assert store.version == 3
    got, store = train(tmp_path, 5, name="cut", checkpoint_every=2)
    assert got.resumed_from == 2
    np.testing.assert_array_equal(got.state, want.state)
    for c in IDS:
        np.testing.assert_array_equal(store.get(c), want_store.get(c), err_msg=c)


def test_a_run_killed_before_its_first_checkpoint_resumes_from_round_zero(tmp_path):
    want, want_store = train(tmp_path, 3, name="whole", checkpoint_every=10)

    def stop(state):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, 3, name="cut", checkpoint_every=10, evaluation=stop, evaluate_every=2)
    got, store = train(tmp_path, 3, name="cut", checkpoint_every=10)
    assert got.resumed_from == 0
    np.testing.assert_array_equal(got.state, want.state)
    for c in IDS:
        np.testing.assert_array_equal(store.get(c), want_store.get(c))


def test_misuse_is_refused_with_the_fix(tmp_path):
    sampler = UniformSampler(IDS, 4, seed=0)
    with pytest.raises(TypeError, match=r"client_state_store=fedlang\.simulation\.ClientStateStore"):
        run_training(PROCESS, data, sampler, 1, progress=False)
    store = ClientStateStore(tmp_path / "s", PROCESS.client_state)
    run_training(PROCESS, data, sampler, 1, progress=False, client_state_store=store)
    with pytest.raises(ClientStateError, match="unused client-state store for a fresh run"):
        run_training(PROCESS, data, sampler, 1, progress=False, client_state_store=store)

    class Stateless:
        def initialize(self):
            return 0

        def next(self, state, data):
            return state, {}

    with pytest.raises(TypeError, match="keeps no client state"):
        run_training(Stateless(), data, sampler, 1, progress=False, client_state_store=store)
