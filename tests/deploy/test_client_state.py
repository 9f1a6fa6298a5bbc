"""Client state in a deployment over HTTP: SCAFFOLD and Ditto driven round by round
against a server on 127.0.0.1 with clients on threads, each keeping its state in its
own directory. Results equal the reference runtime's on the same cohorts (read from
the server's reports), and nothing the server stores holds a client's state."""

import sqlite3
import threading

import jax
import numpy as np
import optax
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import context, serialization, structure
from fedlang.learning import algorithms

from ..learning.test_client_state_algorithms import W0, client_batches, linear_model

FAST = {"backoff": (0.02, 0.2)}
NUM_CLIENTS, PER_ROUND, ROUNDS = 3, 2, 3  # 6 places for 3 clients: someone comes back


def _leaves_bytes(value, t):
    """The bytes of each tensor of a state as stored (little-endian, its dtype)."""
    leaves = structure.flatten(structure.to_internal(value, t), t)
    return [np.ascontiguousarray(np.asarray(x, lt.dtype)).astype(lt.dtype.newbyteorder("<")).tobytes()
            for x, lt in zip(leaves, structure.leaf_types(t))]


def _everything_stored(db_path):
    """Every cell of every table of the server's SQLite database, and the files' bytes."""
    cells = []
    with sqlite3.connect(db_path) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        assert {"blobs", "rounds", "reports", "aggregates"} <= set(tables)
        for table in tables:
            for row in conn.execute(f'SELECT * FROM "{table}"'):
                for cell in row:
                    if isinstance(cell, bytes | str):
                        cells.append(cell.encode() if isinstance(cell, str) else cell)
    files = [p.read_bytes() for p in db_path.parent.glob(db_path.name + "*")]
    return cells, files


def _run(process, state_name, server, tmp_path):
    """Runs `ROUNDS` rounds of `process` on clients over HTTP; returns the initial and
    final server states, the cohorts (from the server's reports) and the clients."""
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    clients, threads, errors = {}, [], []

    def run(c):
        try:
            c.run()
        except Exception as e:  # shown by the assertion below
            errors.append(e)

    ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=PER_ROUND)
    try:
        for i in range(NUM_CLIENTS):
            c = deploy.Client(server.url, "pop", token, {"train": client_batches(f"c{i}", i)},
                              state_dir=tmp_path / f"device{i}", **FAST)
            c.enroll()
            clients[c.client_id] = c
            threads.append(threading.Thread(target=run, args=(c,), daemon=True))
            threads[-1].start()
        state = initial = process.initialize()
        with context.with_context(ctx):
            for _ in range(ROUNDS):
                state, metrics, bound = process.next(
                    state, deploy.client_data("train"), deploy.client_state(state_name))
                assert bound == deploy.client_state(state_name)  # named, not held
                assert int(metrics["client_work"]["diagnostics"]["num_clients"]) == PER_ROUND
        ctx.runner.finish()  # each client stops at its next check-in, its states committed
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads) and not errors, errors
    finally:
        ctx.runner.close()
        for c in clients.values():
            c.stop()
        for t in threads:
            t.join(timeout=60)
        for c in clients.values():
            c.close()
    with sqlite3.connect(server.db_path) as conn:
        rows = conn.execute("SELECT round, client FROM reports ORDER BY round, accepted").fetchall()
    cohorts = {}
    for r, cid in rows:
        cohorts.setdefault(r, []).append(cid)
    assert len(cohorts) == ROUNDS and all(len(c) == PER_ROUND for c in cohorts.values())
    return initial, state, [cohorts[r] for r in sorted(cohorts)], clients


def _reference(process, initial, cohorts, clients):
    """The reference runtime on the same cohorts, with the states in a dict."""
    states = {}
    with fl.runtime.reference_context():
        state = initial
        for cohort in cohorts:
            own = [states.get(cid, process.client_state.initial_state()) for cid in cohort]
            state, _, new = process.next(
                state, [clients[cid].data["train"] for cid in cohort], own)
            states.update(zip(cohort, new))
    return state, states


def _check(process, state_name, server, tmp_path):
    initial, state, cohorts, clients = _run(process, state_name, server, tmp_path)
    want, want_states = _reference(process, initial, cohorts, clients)
    for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
    state_t = process.client_state.state_type
    stored = {}
    for cid, c in clients.items():
        on_device = c.states.read("pop", state_name, state_t)
        if cid not in want_states:
            assert on_device is None  # never sampled: no state yet
            continue
        for got, ref in zip(jax.tree.leaves(on_device), jax.tree.leaves(want_states[cid])):
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
        stored[cid] = on_device
    assert len(stored) >= 2
    # Nothing the server stores holds a client's state: no table cell, no blob, no byte
    # of the database's files holds a state's vector or its serialized form.
    cells, files = _everything_stored(server.db_path)
    for cid, value in stored.items():
        patterns = [b for b in _leaves_bytes(value, state_t) if len(b) >= 8]
        patterns.append(serialization.serialize_value(value, state_t))
        assert len(patterns) >= 2
        for pattern in patterns:
            assert not any(pattern in cell for cell in cells), f"{cid}'s state is in a table"
            assert not any(pattern in f for f in files), f"{cid}'s state is in the database"
    # ... while the same search finds what the server does hold: the first round's
    # broadcast of the initial model.
    assert any(W0.tobytes() in cell for cell in cells)
    assert any(W0.tobytes() in f for f in files)


@pytest.fixture
def sqlite_server(server_factory, tmp_path):
    server = server_factory(db=tmp_path / "server.db")
    server.db_path = tmp_path / "server.db"
    return server


def test_scaffold_over_http_keeps_each_control_variate_on_its_device(
    sqlite_server, tmp_path
):
    process = algorithms.build_scaffold(linear_model, 0.05, 0.7, total_clients=NUM_CLIENTS)
    _check(process, "scaffold", sqlite_server, tmp_path)


def test_ditto_over_http_keeps_each_personal_model_on_its_device(
    sqlite_server, tmp_path
):
    process = algorithms.build_ditto(linear_model, optax.sgd(0.1), lam=0.5,
                                     personal_optimizer=optax.sgd(0.05))
    _check(process, "ditto", sqlite_server, tmp_path)
