"""The client-state store: first-seen clients, versions, rollback, pruning, damage, crashes."""

import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fedlang as fl
from fedlang.simulation import ClientStateError, ClientStateStore, state_store

STATE = {"w": (np.float32, [2, 2]), "n": np.int32}


@fl.jax_computation()
def initial():
    return {"w": np.eye(2, dtype=np.float32), "n": np.int32(0)}


@fl.jax_computation(STATE)
def step(s):
    return {"w": s["w"] * 2, "n": s["n"] + 1}


@fl.federated_computation(fl.type_at_clients(STATE))
def bump(states):
    return fl.federated_sum(fl.federated_map(step, states)), fl.federated_map(step, states)


BUMP = fl.with_client_state(bump, initial, parameter=0, result=1)
SPEC = BUMP.client_state


def write_round(store, ids, n_values):
    """One round through the binding's own API: client i gets n = n_values[i]."""
    cohort = store.cohort(ids)
    cohort.begin()
    w = np.stack([np.full((2, 2), v, np.float32) for v in n_values])
    cohort.write(0, len(ids), [w, np.asarray(n_values, np.int32)])
    cohort.commit()


def test_first_seen_clients_read_the_initial_state_and_written_ones_resume(tmp_path):
    store = ClientStateStore(tmp_path / "s", SPEC)
    assert store.version == 0 and not store.has_state("a")
    np.testing.assert_array_equal(store.get("a")["w"], np.eye(2))
    write_round(store, ["a", "b"], [3, 4])
    write_round(store, ["b", "c"], [5, 6])
    assert [int(store.get(c)["n"]) for c in "abcd"] == [3, 5, 6, 0]
    cohort = store.cohort(["d", "a", "c"])
    w, n = cohort.read(0, 3)
    assert n.tolist() == [0, 3, 6] and w.shape == (3, 2, 2)
    assert cohort.slice(1, 3).read(0, 2)[1].tolist() == [3, 6]


def test_reopening_checks_the_process_it_was_made_for(tmp_path):
    write_round(ClientStateStore(tmp_path / "s", SPEC), ["a"], [7])
    assert int(ClientStateStore(tmp_path / "s").get("a")["n"]) == 7  # no spec needed
    assert int(ClientStateStore(tmp_path / "s", SPEC).get("a")["n"]) == 7

    @fl.jax_computation()
    def other_initial():
        return {"w": np.zeros((2, 2), np.float32), "n": np.int32(0)}

    other = fl.with_client_state(bump, other_initial, parameter=0, result=1).client_state
    with pytest.raises(ClientStateError, match="another initial state"):
        ClientStateStore(tmp_path / "s", other)

    @fl.jax_computation()
    def scalar():
        return np.float32(0)

    @fl.federated_computation(fl.type_at_clients(np.float32))
    def keep(states):
        return fl.federated_sum(states), states

    scalar_spec = fl.with_client_state(keep, scalar, parameter=0, result=1).client_state
    with pytest.raises(ClientStateError, match="hold states of type float32"):
        ClientStateStore(tmp_path / "s", scalar_spec)
    with pytest.raises(FileNotFoundError, match="pass the process's spec"):
        ClientStateStore(tmp_path / "missing")
    (tmp_path / "not_a_store").mkdir()
    (tmp_path / "not_a_store" / "notes.txt").write_text("mine")
    with pytest.raises(ClientStateError, match="cannot be read"):
        ClientStateStore(tmp_path / "not_a_store", SPEC)
    assert (tmp_path / "not_a_store" / "notes.txt").read_text() == "mine"  # left alone


def test_a_state_type_without_fixed_shapes_is_refused():
    @fl.jax_computation()
    def ragged_init():
        return np.zeros([3], np.float32)

    @fl.federated_computation(fl.type_at_clients((np.float32, [None])))
    def keep(states):
        return fl.federated_sum(states), states

    with pytest.raises(TypeError, match="fully defined shapes"):
        fl.with_client_state(keep, ragged_init, parameter=0, result=1)


def test_rollback_returns_to_a_kept_version_and_the_undone_rounds_stay_unseen(tmp_path):
    store = ClientStateStore(tmp_path / "s", SPEC)
    store.retain_from(0)
    write_round(store, ["a", "b"], [1, 1])
    kept = store.version
    write_round(store, ["a", "c"], [2, 2])
    write_round(store, ["a"], [3])
    store.rollback(kept)
    assert store.version == kept
    assert [int(store.get(c)["n"]) for c in "abc"] == [1, 1, 0]
    write_round(store, ["b"], [9])  # after the rollback: "a" and "c" keep version `kept`'s
    assert [int(store.get(c)["n"]) for c in "abc"] == [1, 9, 0]
    with pytest.raises(ClientStateError, match="newer than the client-state store"):
        store.rollback(store.version + 1)


def test_without_retention_only_the_newest_version_is_kept(tmp_path):
    store = ClientStateStore(tmp_path / "s", SPEC)
    for n in range(1, 5):
        write_round(store, ["a"], [n])
    # the newest, and the one it superseded (readers of the last round needed it; it goes
    # when the client is next written)
    files = sorted(p.name for p in (tmp_path / "s" / "clients").rglob("*.st"))
    assert files == ["000000000003.st", "000000000004.st"] and int(store.get("a")["n"]) == 4
    with pytest.raises(ClientStateError, match="were not kept"):
        store.rollback(1)
    store.retain_from(store.version)
    for n in range(5, 8):
        write_round(store, ["a"], [n])
    assert len(list((tmp_path / "s" / "clients").rglob("*.st"))) == 4  # 4 (kept), 5, 6, 7


def test_a_repeated_client_and_a_non_string_id_are_refused(tmp_path):
    store = ClientStateStore(tmp_path / "s", SPEC)
    with pytest.raises(ValueError, match="found 'a' twice"):
        store.cohort(["a", "b", "a"])
    with pytest.raises(TypeError, match="client ids as strings"):
        store.cohort([1, 2])


def test_a_damaged_file_is_reported_with_the_client_and_what_to_do(tmp_path):
    store = ClientStateStore(tmp_path / "s", SPEC)
    write_round(store, ["a", "b"], [1, 2])
    (path,) = state_store._client_dir(store.root, "b").glob("*.st")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert int(store.get("a")["n"]) == 1
    with pytest.raises(ClientStateError, match=r"client 'b'.*fails its checksum.*earlier checkpoint"):
        store.get("b")
    path.write_bytes(bytes(data[:10]))
    with pytest.raises(ClientStateError, match="client 'b'"):
        store.cohort(["a", "b"]).read(0, 2)


CRASH = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_state_store import BUMP
    from fedlang.simulation import ClientStateStore
    from fedlang.runtime import SimulationContext
    from fedlang.core import context

    store = ClientStateStore({path!r})
    cohort = store.cohort([f"c{{i}}" for i in range(40)])
    write = type(cohort).write
    def write_then_die(self, start, stop, leaves):
        write(self, start, stop, leaves)
        if start >= 16:  # some chunks of this round are on disk: die like a kill -9
            os.kill(os.getpid(), signal.SIGKILL)
    type(cohort).write = write_then_die
    context.set_default_context(SimulationContext(chunk_size=8))
    BUMP(cohort)
""")


def test_a_process_killed_mid_round_leaves_the_store_as_it_was(tmp_path):
    store = ClientStateStore(tmp_path / "s", SPEC)
    ids = [f"c{i}" for i in range(40)]
    BUMP(store.cohort(ids[:20]))
    before = store.version
    script = CRASH.format(tests=str(pathlib.Path(__file__).parent), path=str(tmp_path / "s"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    # the killed round's files are on disk, but not its commit
    assert len(list((tmp_path / "s" / "clients").rglob("*.st"))) > 20
    store = ClientStateStore(tmp_path / "s", SPEC)
    assert store.version == before
    assert [int(store.get(c)["n"]) for c in ids] == [1] * 20 + [0] * 20
    BUMP(store.cohort(ids[30:]))  # the next round commits; the killed one stays unseen
    assert [int(store.get(c)["n"]) for c in ids] == [1] * 20 + [0] * 10 + [1] * 10


def test_the_memory_bench_runs_and_reports_both_ways_of_keeping_states(load_script, capsys):
    rows = load_script("bench/client_state.py").main(["--sizes", "40", "--floats", "8"])
    assert [r["mode"] for r in rows] == ["store", "lists"]
    assert all(r["second"]["seconds"] > 0 for r in rows)
    assert "| ClientStateStore | 40 |" in capsys.readouterr().out
