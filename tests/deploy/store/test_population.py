"""A population at scale in the task store, on SQLite and PostgreSQL: selection is uniform
over many rounds, pace steering keeps check-ins at the rate it promises (no herd at a
round's deadline), and every query of a check-in is served by an index.

The fleet here is simulated on the real store with the test's clock: devices that do
what `Client.run` does (check in; wait what they are told; run a task, report, check in
again at once) at the times a random draw and the server's answers give them."""

import collections
import contextlib
import heapq
import random

import pytest

from fedlang.deploy import protocol
from fedlang.deploy.plans import folding
from fedlang.deploy.store import bulk, sessions, shards, sql
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import store as store_lib

from .conftest import Clock
from .test_rounds import report


class Reports:
    """Devices' reports taken as the server takes them (`shards.ReportShards`), each the
    same small report of `sum_round`."""

    def __init__(self, store, sum_round):
        self.folder = folding.Folder(sum_round[0])
        self.rounds = rounds_lib.Rounds(store, lambda plan: self.folder)
        self.shards = shards.ReportShards(self.rounds)
        self.body = report(sum_round, [1, 2, 3])
        self.checked = self.folder.check(self.body)

    def open(self, options):
        return self.rounds.create("pop", "plan", "broadcast", options, self.folder.empty())

    def take(self, round_id, client):
        return self.shards.accept(round_id, client, protocol.blob_hash(self.body),
                                  len(self.body), self.checked)

    def close(self):
        self.shards.close()


class Fleet:
    """`n` bulk-enrolled devices of population "pop" and a driver that opens a round of
    `options` whenever none is open (after `driver_delay` s), until `rounds` closed."""

    def __init__(self, url, sum_round, n, pace, options, seed=0, train=(5.0, 15.0),
                 driver_delay=0.1):
        self.clock = Clock()
        self.rng = random.Random(seed)
        self.store = store_lib.Store(url, clock=self.clock, pace=pace,
                                     rng=random.Random(seed + 1))
        self.reports = Reports(self.store, sum_round)
        self.rounds = self.reports.rounds
        self.store.create_population("pop")
        self.ids = []
        bulk.enroll_bulk(self.store, "pop", n, 1e9, lambda made: self.ids.extend(i for i, _ in made))
        self.options, self.train, self.driver_delay = options, train, driver_delay
        self.selected = collections.Counter()  # device -> rounds it was assigned
        self.checkins = []  # times
        self._events, self._seq = [], 0
        first = pace.base(n)  # devices start at random phases
        for device in range(n):
            self._at(self.clock.now + self.rng.uniform(0, first), "checkin", device)
        self._at(self.clock.now, "open", None)

    def _at(self, t, kind, what):
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, what))

    def run(self, rounds):
        closed, current = 0, None
        while closed < rounds:
            t, _, kind, what = heapq.heappop(self._events)
            self.clock.now = t
            if kind == "open":
                current = self.reports.open(self.options).id
            elif kind == "checkin":
                self.checkins.append(t)
                got = self.rounds.checkin(self.ids[what], "pop")
                if isinstance(got, rounds_lib.Task):
                    self.selected[what] += 1
                    self._at(t + self.rng.uniform(*self.train), "report", (what, got.round))
                else:
                    self._at(t + got, "checkin", what)
            else:
                device, round_id = what
                with contextlib.suppress(protocol.Gone):  # over-selected: came too late
                    self.reports.take(round_id, self.ids[device])
                if round_id == current and self.rounds.round(round_id).state != "open":
                    closed, current = closed + 1, None
                    self._at(t + self.driver_delay, "open", None)
                self._at(t, "checkin", device)  # as Client.run: at once after a task
        return closed

    def close(self):
        self.reports.close()
        self.store.close()


@pytest.fixture
def fleet(db_url, sum_round):
    made = []

    def make(*args, **kwargs):
        made.append(Fleet(db_url, sum_round, *args, **kwargs))
        return made[-1]

    yield make
    for f in made:
        f.close()


def test_selection_is_uniform_over_the_population(fleet):
    # 200 devices, rounds of 10 (13 with over-selection), 60 rounds: each device is
    # expected in 3.9 rounds. Uniform selection gives counts of binomial dispersion
    # (variance / binomial variance = 1, +-0.1 at this size); a server that favoured
    # the devices it had just selected (or any fixed subset) would give far more.
    f = fleet(200, store_lib.Pace(checkins_per_second=10.0), rounds_lib.CohortOptions(
        target=10, over_selection=0.3, deadline=60.0), seed=7)
    rounds = f.run(60)
    counts = [f.selected[d] for d in range(200)]
    p = sum(counts) / (200 * rounds)  # the fraction of the population a round selects
    mean = sum(counts) / 200
    dispersion = sum((c - mean) ** 2 for c in counts) / 200 / (rounds * p * (1 - p))
    assert 0.6 < dispersion < 1.5, (dispersion, collections.Counter(counts))
    assert counts.count(0) < 10  # P(never) = (1 - p)^60 ~ 2%: about 4 devices


def test_a_selected_client_waits_as_if_it_had_not_been(store, token, clock, sum_round):
    """A client checks in again at once after its task (`Client.run` does): were the
    next round open, it would be first in line, round after round, while the others
    wait the pace's draw. It waits out its own draw from its assignment instead."""
    pace = store.pace  # 0.5 s to 5 s; a population of 3: base 0.5 s, waits 0.25-0.75 s
    ids = []
    bulk.enroll_bulk(store, "pop", 3, 3600.0, lambda made: ids.extend(i for i, _ in made))
    a, b, _ = ids
    reports = Reports(store, sum_round)
    rounds = reports.rounds
    one = rounds_lib.CohortOptions(target=1)
    first = reports.open(one)
    assert rounds.checkin(a, "pop").round == first.id
    clock.now += 0.1
    assert reports.take(first.id, a)  # closes the round
    reports.close()
    second = rounds.create("pop", "plan", "broadcast", one, b"")
    wait = rounds.checkin(a, "pop")
    rest = pace.rest(3, f"{a}/{first.id}")
    assert isinstance(wait, float) and wait == pytest.approx(rest - 0.1, abs=1e-3)
    assert rounds.checkin(a, "pop") == wait  # asking again changes nothing
    assert rounds.checkin(b, "pop").round == second.id
    clock.now += wait + 0.001  # (the wait is rounded to ms)
    third = rounds.create("pop", "plan", "broadcast", one, b"")
    assert rounds.checkin(a, "pop").round == third.id


def test_check_ins_keep_their_pace_when_a_deadline_is_shorter_than_the_wait(fleet):
    # 1,000 devices asked to check in 10 times a second wait 100 s (+-50%); rounds fill in
    # about a second and last up to 30 s. Asking the devices that find a round full back
    # at its deadline made them return together (all 1,000 within one second, before
    # pace steering ignored deadlines); the pace keeps them at about 10 a second.
    f = fleet(1000, store_lib.Pace(checkins_per_second=10.0), rounds_lib.CohortOptions(
        target=10, deadline=30.0), seed=3)
    f.run(20)
    times = f.checkins
    per_second = collections.Counter(int(t) for t in times)
    rate = len(times) / (max(times) - min(times))
    assert rate < 15, rate  # 10 asked for, plus the participants' check-ins after a task
    assert max(per_second.values()) < 60, per_second.most_common(3)


def test_the_pace_promises_its_rate_and_refuses_nonsense():
    pace = store_lib.Pace(checkins_per_second=100.0, min_retry=1.0, max_retry=3600.0)
    assert [pace.base(n) for n in (10, 10_000, 10**6)] == [1.0, 100.0, 3600.0]
    rng = random.Random(0)
    waits = [pace.retry_after(10_000, rng) for _ in range(10_000)]
    assert min(waits) >= 50.0 and max(waits) <= 150.0
    assert abs(sum(waits) / len(waits) - 100.0) < 1.0
    for bad in ({"checkins_per_second": 0.0}, {"min_retry": 0.0},
                {"min_retry": 5.0, "max_retry": 1.0}, {"max_retry": float("inf")}):
        with pytest.raises(ValueError, match="Expected a positive check-in rate"):
            store_lib.Pace(**bad)


def _recorded(monkeypatch):
    """The statements `sql.Tx` runs from now on, with their parameters."""
    seen = []
    for name in ("run", "one", "all"):
        original = getattr(sql.Tx, name)

        def record(self, query, params=(), _original=original):
            seen.append((query, params))
            return _original(self, query, params)

        monkeypatch.setattr(sql.Tx, name, record)
    return seen


def test_every_query_of_a_check_in_uses_an_index(store, token, monkeypatch):
    ids = []
    bulk.enroll_bulk(store, "pop", 2000, 3600.0, lambda made: ids.extend(made))
    rounds = rounds_lib.Rounds(store)
    rounds.create("pop", "plan", "broadcast", rounds_lib.CohortOptions(target=1), b"")
    seen = _recorded(monkeypatch)
    (first, credential), (second, _) = ids[:2]
    store.authenticate(credential)
    assert isinstance(rounds.checkin(first, "pop"), rounds_lib.Task)  # assigned
    assert isinstance(rounds.checkin(first, "pop"), rounds_lib.Task)  # held: again
    assert isinstance(rounds.checkin(second, "pop"), float)  # the round is full
    sessions.Sessions(store).checkin(second, "pop")  # no round: a buffered session's?
    monkeypatch.undo()
    queries = {q: p for q, p in seen if not q.lstrip().upper().startswith("INSERT")}
    assert len(queries) >= 8
    postgres = store.dialect.name == "postgresql"
    with store.transaction(write=True) as tx:  # SET LOCAL needs a transaction
        if postgres:  # a table this small is read whole when allowed: is an index there?
            tx.run("SET LOCAL enable_seqscan = off")
        for query, params in queries.items():
            if postgres:
                plan = " ".join(r[0] for r in tx.all("EXPLAIN " + query, params))
                assert "Seq Scan" not in plan, (query, plan)
            else:
                plan = [r[3] for r in tx.all("EXPLAIN QUERY PLAN " + query, params)]
                assert not any(step.startswith("SCAN") for step in plan), (query, plan)
