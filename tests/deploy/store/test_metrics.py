"""What an operator watches, in the task store (store/metrics.py): released metrics,
refusals by task, who was seen, round durations; on SQLite and PostgreSQL."""

import pytest

from fedlang.deploy import protocol
from fedlang.deploy.store import metrics
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import store as store_lib


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def store(db_url):
    s = store_lib.Store(db_url, clock=Clock())
    s.create_population("pop")
    yield s
    s.close()


def test_flatten_names_nested_metrics_and_refuses_what_is_not_a_number():
    assert metrics.flatten({"train": {"loss": 1, "client": {"n": 2.5}}, "eval": {}}) == [
        ("train", "loss", 1.0), ("train", "client/n", 2.5)]
    deep = {"x": 1.0}
    for _ in range(metrics.MAX_DEPTH):
        deep = {"d": deep}
    with pytest.raises(ValueError, match="nested at most 8 deep"):
        metrics.flatten({"train": deep})
    with pytest.raises(ValueError, match="at most 200 characters"):
        metrics.flatten({"train": {"n" * 201: 1.0}})
    with pytest.raises(ValueError, match=r"Expected metrics as \{kind"):
        metrics.flatten([1, 2])


def test_released_metrics_replace_by_round_kind_and_name(store):
    assert metrics.release(store, "pop", 2, {"train": {"loss": 0.5}}) == 1
    store.clock.now = 1010.0
    assert metrics.release(store, "pop", 1, {"train": {"loss": 0.9}, "eval": {"acc": 0.1}}) == 2
    store.clock.now = 1020.0
    metrics.release(store, "pop", 2, {"train": {"loss": 0.4}})
    assert [(m["round"], m["kind"], m["name"], m["value"], m["released"])
            for m in metrics.released(store, "pop")] == [
        (1, "eval", "acc", 0.1, 1010.0), (1, "train", "loss", 0.9, 1010.0),
        (2, "train", "loss", 0.4, 1020.0)]
    assert [m["round"] for m in metrics.released(store, "pop", since=1010.0)] == [2]
    with pytest.raises(protocol.NotFound, match="'nobody'"):
        metrics.release(store, "nobody", 1, {"train": {"loss": 1.0}})
    with pytest.raises(protocol.NotFound):
        metrics.released(store, "nobody")


def test_refusals_are_counted_by_task_and_reason(store):
    store.count_refusal("late", task="round:1")
    store.count_refusal("late", task="round:1")
    store.count_refusal("stale", task="session:1")
    store.count_refusal("unauthorized")  # no task: only the global counter
    assert metrics.refusals(store, ["round:1", "session:1", "round:2"]) == {
        "round:1": {"late": 2}, "session:1": {"stale": 1}, "round:2": {}}
    assert metrics.refusals(store, []) == {}
    assert store.counters()["refused:late"] == 2


def test_who_was_seen_and_how_long_rounds_took(store):
    store.enroll("pop", _token(store), 1e6)
    store.clock.now = 5000.0
    store.enroll("pop", _token(store), 1e6)
    assert metrics.seen_since(store, 4000.0) == {"pop": 1}
    assert metrics.round_durations(store) == []
    rounds = rounds_lib.Rounds(store)
    for _ in range(2):
        rounds.create("pop", "p", "b", rounds_lib.CohortOptions(target=1), b"")
    store.clock.now = 5030.0
    rounds.stop(1, "stopped by the test")  # round 2 is still open: no duration yet
    assert metrics.round_durations(store) == [30.0]


def _token(store):
    return store.rotate_token("pop")
