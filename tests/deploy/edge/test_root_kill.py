"""kill -9 of the root mid-round, with edges: the root restarts on the same database,
port and key, the edges retry their forwards, and the round closes with every report
an edge acknowledged, equal to the sum one server computes (SQLite and PostgreSQL roots)."""

import numpy as np
import pytest

from fedlang import deploy

from ..conftest import Gated, batch_sum, wait_for
from .harness import RootAndEdges, local_round, status


@pytest.mark.slow
def test_the_root_killed_mid_round_restarts_and_takes_every_edge_s_partial(
    db_url, tmp_path, client_threads
):
    gates = [Gated(np.full((2, 3), i + 1)) for i in range(6)]
    with RootAndEdges(db_url, tmp_path) as d:  # the root on SQLite, then PostgreSQL
        try:
            root, west = d.root, d.west
            errors = d.clients(client_threads, gates)
            d.drive(batch_sum, target=6, deadline=120)
            for edge in d.edges:
                wait_for(lambda e=edge: (r := local_round(e.url)) and r["assigned"] == 3,
                         "each edge's clients")
            for g in gates[:3]:  # east's clients report; east forwards its partial to the root
                g.release.set()
            wait_for(lambda: (r := local_round(root.url)) and r["reports"] == 3,
                     "east's partial at the root")
            root.kill()  # mid-round: east's partial acknowledged, west's not yet sent
            for g in gates[3:]:  # west's clients report to west, which forwards to a dead root
                g.release.set()
            wait_for(lambda: local_round(west.url)["state"] == "closed", "west's round closed")
            root.start()  # the same command: same database, port and key
            result = d.join()
            want = sum(np.full((2, 3), i + 1, np.float32).sum(axis=0) for i in range(6))
            np.testing.assert_allclose(result["value"], want)
            assert result["rounds"][0].reports == 6
            assert status(root.url)["reports"]["accepted"] == 6  # each partial taken once
            for edge in d.edges:  # each client's report acknowledged once, at its edge
                local = local_round(edge.url)
                assert (local["state"], local["reports"]) == ("closed", 3)
            with deploy.Admin(root.url, root.admin_token) as admin:
                shares = admin.edge_shares(local_round(root.url)["id"])
            assert [(s["edge"], s["state"], s["reports"]) for s in shares] == [
                ("east", "reported", 3), ("west", "reported", 3)]
            assert not any(errors), errors
        finally:
            for g in gates:
                g.release.set()
