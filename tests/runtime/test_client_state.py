"""Client state on every runtime: bindings read and written by chunk equal plain lists."""

import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.simulation import ClientStateError, ClientStateStore

pytestmark = pytest.mark.usefixtures("runtime")

STATE = {"sum": (np.float32, [3]), "count": np.int32}
BATCHES = fl.SequenceType((np.float32, [None, 3]))


@fl.jax_computation()
def initial_state():
    return {"sum": np.full(3, 0.5, np.float32), "count": np.int32(0)}


@fl.jax_computation(STATE, np.float32, BATCHES)
def client_step(state, scale, data):
    total = data.reduce(jnp.zeros(3, jnp.float32), lambda acc, batch: acc + batch.sum(0))
    return {"sum": state["sum"] + scale * total, "count": state["count"] + 1}


@fl.jax_computation(STATE)
def state_sum(state):
    return state["sum"]


@fl.federated_computation(fl.type_at_server(np.float32), fl.type_at_clients(BATCHES),
                          fl.type_at_clients(STATE))
def round_fn(scale, data, states):
    new = fl.federated_map(client_step, (states, fl.federated_broadcast(scale), data))
    return {"total": fl.federated_sum(fl.federated_map(state_sum, new)), "states": new}


NEXT = fl.with_client_state(round_fn, initial_state, parameter="states", result="states")


def client_batches(cid, round_num):
    r = np.random.default_rng(1000 * round_num + int(cid[1:]))
    return [r.normal(size=(int(r.integers(1, 4)), 3)).astype(np.float32)
            for _ in range(int(r.integers(0, 3)))]


def oracle(rounds):
    """The same rounds on plain dicts of NumPy states."""
    states, totals = {}, []
    for round_num, (scale, cohort) in enumerate(rounds):
        total = np.zeros(3, np.float32)
        for cid in cohort:
            s = states.get(cid, {"sum": np.full(3, 0.5, np.float32), "count": 0})
            data = client_batches(cid, round_num)
            step = sum((b.sum(0) for b in data), np.zeros(3, np.float32))
            s = {"sum": s["sum"] + np.float32(scale) * step, "count": s["count"] + 1}
            states[cid] = s
            total += s["sum"]
        totals.append(total)
    return states, totals


ROUNDS = [(1.0, ["c0", "c1", "c2", "c3", "c4"]), (0.5, ["c3", "c5", "c0"]),
          (2.0, ["c6", "c1", "c3", "c7", "c2", "c8", "c9"])]


def test_a_store_binding_equals_plain_lists_round_after_round(tmp_path):
    store = ClientStateStore(tmp_path / "states", NEXT.client_state)
    want_states, want_totals = oracle(ROUNDS)
    for round_num, (scale, cohort) in enumerate(ROUNDS):
        out = NEXT(scale, [client_batches(c, round_num) for c in cohort], store.cohort(cohort))
        np.testing.assert_allclose(out["total"], want_totals[round_num], rtol=1e-5)
        assert out["states"].client_ids == tuple(cohort)  # the binding comes back
        assert store.version == round_num + 1
    for cid, want in want_states.items():
        got = store.get(cid)
        np.testing.assert_allclose(got["sum"], want["sum"], rtol=1e-5)
        assert int(got["count"]) == want["count"], cid
    # a client never sampled reads the initial state
    assert not store.has_state("c42")
    np.testing.assert_array_equal(store.get("c42")["sum"], np.full(3, 0.5, np.float32))


def test_plain_lists_go_in_and_come_back():
    states = [NEXT.client_state.initial_state(), {"sum": np.ones(3, np.float32), "count": 4}]
    data = [[np.ones((2, 3), np.float32)], []]
    out = NEXT(2.0, data, states)
    np.testing.assert_allclose(out["states"][0]["sum"], 4.5)
    np.testing.assert_allclose(out["states"][1]["sum"], 1.0)
    assert [int(s["count"]) for s in out["states"]] == [1, 5]
    np.testing.assert_allclose(out["total"], 5.5)


def _failing(after):
    """A client dataset that raises after `after` batches (a client failing mid-round)."""
    def batches():
        for i in range(10):
            if i == after:
                raise ValueError("the disk under this client's data failed")
            yield np.ones((1, 3), np.float32)
    return batches()


def test_a_round_that_fails_midway_changes_no_state(tmp_path):
    store = ClientStateStore(tmp_path / "states", NEXT.client_state)
    cohort = ["c0", "c1", "c2", "c3", "c4"]
    NEXT(1.0, [client_batches(c, 0) for c in cohort], store.cohort(cohort))
    before = {c: store.get(c) for c in cohort}
    # clients before the failing one may already be written (in their chunk, on a worker)
    data = [[np.ones((1, 3), np.float32)]] * 4 + [_failing(1)]
    with pytest.raises(ValueError, match="disk under this client"):
        NEXT(1.0, data, store.cohort(cohort))
    assert store.version == 1
    for c in cohort:
        np.testing.assert_array_equal(store.get(c)["sum"], before[c]["sum"])
    # the next round commits its own clients only: the failed round's files stay unseen
    NEXT(1.0, [[np.ones((1, 3), np.float32)]], store.cohort(["c4"]))
    assert store.version > 1  # (the failed round's version number is never reused)
    for c in cohort[:4]:
        np.testing.assert_array_equal(store.get(c)["sum"], before[c]["sum"])
        assert int(store.get(c)["count"]) == 1
    assert int(store.get("c4")["count"]) == 2


@fl.federated_computation(fl.type_at_clients(STATE))
def read_only(states):
    return fl.federated_sum(fl.federated_map(state_sum, states))


def test_any_client_state_argument_may_be_a_binding_read_only(tmp_path):
    store = ClientStateStore(tmp_path / "states", NEXT.client_state)
    cohort = ["c0", "c1", "c2"]
    NEXT(1.0, [client_batches(c, 0) for c in cohort], store.cohort(cohort))
    want = sum(store.get(c)["sum"] for c in [*cohort, "new"])
    np.testing.assert_allclose(read_only(store.cohort([*cohort, "new"])), want, rtol=1e-6)
    assert store.version == 1  # nothing written


def test_a_binding_of_another_state_type_is_refused(tmp_path):
    @fl.jax_computation()
    def other():
        return np.zeros(2, np.float32)

    @fl.federated_computation(fl.type_at_clients((np.float32, [2])))
    def keep(states):
        return fl.federated_sum(states), states

    keep = fl.with_client_state(keep, other, parameter=0, result=1)
    store = ClientStateStore(tmp_path / "other", keep.client_state)
    with pytest.raises(TypeError, match=r"found client states of type \{float32\[2\]\}@CLIENTS"):
        NEXT(1.0, [[]], store.cohort(["c0"]))
    assert store.version == 0


def test_a_cohort_made_before_another_round_committed_is_refused(tmp_path):
    store = ClientStateStore(tmp_path / "states", NEXT.client_state)
    stale = store.cohort(["c0"])
    NEXT(1.0, [[]], store.cohort(["c0"]))
    with pytest.raises(ClientStateError, match="changed since this cohort was made"):
        NEXT(1.0, [[]], stale)
    assert store.version == 1 and int(store.get("c0")["count"]) == 1
