"""The two documented ways to release a learning process's metrics chart them under the
same kinds, `train` and `eval` (docs/deploy.md, "Released metrics"; issue 37, item 10):
the experiment driver with `ServerMetricsWriter` (`fedlang train --metrics-server`) and
a round loop's `ServerRounds.release_metrics`."""

import httpx

from fedlang import deploy
from fedlang import simulation as sim
from fedlang.deploy.driver import metrics as driver_metrics

from .conftest import bearer

# What a learning process's `next` returns: each part's measurements under its name.
PROCESS_METRICS = {
    "distributor": (),
    "client_work": {"train": {"loss": 0.5, "num_examples": 12}},
    "aggregator": {"mean_value": ()},
    "finalizer": {"update_non_finite": 0},
    "traffic": {"num_clients": 2, "broadcast_bits": 800.0, "aggregated_bits": 900.0},
}
EVALUATION = {"loss": 0.75, "sparse_categorical_accuracy": 0.5}


class _Process:
    def initialize(self):
        return 0

    def next(self, state, data):
        return state + 1, PROCESS_METRICS


class _Sampler:
    def sample(self):
        return ["a", "b"]


def _released(url, admin, population):
    got = httpx.get(f"{url}/v1/admin/populations/{population}/metrics", headers=admin,
                    timeout=30).json()["metrics"]
    return {(m["kind"], m["name"]) for m in got}


def test_the_experiment_driver_and_a_round_loop_release_the_same_kinds(server_factory):
    server = server_factory()
    admin = bearer(server.admin_token)
    with deploy.Admin(server.url, server.admin_token) as a:
        a.create_population("by-writer")
        a.create_population("by-loop")

    writer = driver_metrics.ServerMetricsWriter(server.url, server.admin_token, "by-writer")
    sim.run_training(_Process(), lambda round_num, ids: ids, _Sampler(), 1,
                     evaluation=lambda state: EVALUATION, metrics=[writer], progress=False)
    writer.close()
    runner = deploy.ServerRounds(server.url, server.admin_token, "by-loop", target=1)
    runner.release_metrics(1, PROCESS_METRICS, evaluation=EVALUATION)
    runner.close()

    by_writer = _released(server.url, admin, "by-writer")
    by_loop = _released(server.url, admin, "by-loop")
    assert {k for k, _ in by_loop} == {"train", "eval"}
    assert {k for k, _ in by_writer} == {"train", "eval", "round"}  # and round_time_s
    assert by_loop == {(k, n) for k, n in by_writer if k != "round"}
    assert ("train", "client_work/train/loss") in by_loop and ("eval", "loss") in by_loop
