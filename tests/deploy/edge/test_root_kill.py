"""kill -9 of the root mid-round, with edges: the root restarts on the same database,
port and key, the edges retry their forwards, and the round closes with every report
an edge acknowledged, equal to the sum one server computes (SQLite and PostgreSQL roots)."""

import threading

import numpy as np
import pytest

from fedlang import deploy

from ..conftest import Gated, ServerProcess, wait_for
from .test_edge import _drive, _edge_process, _local_round, _population_token, _status


@pytest.mark.slow
def test_the_root_killed_mid_round_restarts_and_takes_every_edge_s_partial(
    db_url, tmp_path, client_threads
):
    root = ServerProcess(db_url, tmp_path).start()  # the root on SQLite, then PostgreSQL
    edges = []
    gates = [Gated(np.full((2, 3), i + 1)) for i in range(6)]
    driver = None
    try:
        with deploy.Admin(root.url, root.admin_token) as admin:
            admin.create_population("pop")
            edges = [_edge_process(tmp_path, name, root, admin.create_edge(name, "pop"))
                     for name in ("east", "west")]
        east, west = edges
        errors = [client_threads(deploy.Client(
            (east if i < 3 else west).url, "pop", _population_token(east if i < 3 else west),
            {"train": g}, max_tasks=1, patience=120, backoff=(0.05, 0.5)))
            for i, g in enumerate(gates)]
        result = {}
        driver = threading.Thread(target=_drive, args=(root.url, root.admin_token, result),
                                  kwargs={"target": 6, "deadline": 120})
        driver.start()
        for edge in edges:
            wait_for(lambda e=edge: (r := _local_round(e.url)) and r["assigned"] == 3,
                     "each edge's clients")
        for g in gates[:3]:  # east's clients report; east forwards its partial to the root
            g.release.set()
        wait_for(lambda: (r := _local_round(root.url)) and r["reports"] == 3,
                 "east's partial at the root")
        root.kill()  # mid-round: east's partial acknowledged, west's not yet sent
        for g in gates[3:]:  # west's clients report to west, which forwards to a dead root
            g.release.set()
        wait_for(lambda: _local_round(west.url)["state"] == "closed", "west's round closed")
        root.start()  # the same command: same database, port and key
        driver.join(timeout=180)
        assert not driver.is_alive() and "error" not in result, result
        want = sum(np.full((2, 3), i + 1, np.float32).sum(axis=0) for i in range(6))
        np.testing.assert_allclose(result["value"], want)
        assert result["rounds"][0].reports == 6
        assert _status(root.url)["reports"]["accepted"] == 6  # each partial taken once
        for edge in edges:  # each client's report acknowledged once, at its edge
            local = _local_round(edge.url)
            assert (local["state"], local["reports"]) == ("closed", 3)
        with deploy.Admin(root.url, root.admin_token) as admin:
            shares = admin.edge_shares(_local_round(root.url)["id"])
        assert [(s["edge"], s["state"], s["reports"]) for s in shares] == [
            ("east", "reported", 3), ("west", "reported", 3)]
        assert not any(errors), errors
    finally:
        for g in gates:
            g.release.set()
        if driver is not None:
            driver.join(timeout=60)
        for p in [*edges, root]:
            p.kill()
