"""Secure rounds over HTTP on 127.0.0.1: results equal the simulation runtime's exactly,
dropouts at each stage, failure below the threshold or the quorum, bad stage messages,
a server restarted on the same database, and what the server receives, stores and logs.

Most tests drive each client by hand (`Cohort`): real `SecAggClient`s and the real client
computation (`execution.run_plan_parts`), over HTTP, so a test decides who answers what;
stage timeouts pass on the server's clock, which the test moves."""

import base64
import logging
import sqlite3
import time

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

import fedlang as fl
from fedlang import cli, deploy
from fedlang.core import context
from fedlang.deploy import protocol, secagg
from fedlang.deploy.plans import execution
from fedlang.deploy.secagg import Stage, messages, wire

from .. import secagg_privacy
from ..conftest import bounds_of, capture, secure_and_plain
from .conftest import Clock, bearer

API = "/v1"
TIMEOUT = 30.0  # the rounds' stage timeout, on the test's clock


@pytest.fixture(scope="module")
def secure_round():
    """(plan, broadcast) of `secure_and_plain`'s round."""
    return capture(secure_and_plain, deploy.client_data("d"))


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        [{"a": np.float32(0), "n": np.int32(v)} for v in rng.integers(-40, 90, size=4)]
        for _ in range(n)
    ]


class Member:
    def __init__(self, credential, batches, parts):
        self.credential, self.batches, self.parts = credential, batches, parts
        self.sa = None


class Cohort:
    """A secure round on a server, each client driven by hand over HTTP."""

    def __init__(self, server, clock, plan, broadcast, data, **options):
        self.clock, self.plan = clock, plan
        self.connect(server)
        self.token = self.ok(self.http.post(f"{API}/admin/populations", json={"name": "pop"},
                                            headers=self.admin))["token"]
        created = self.ok(self.http.post(f"{API}/admin/rounds", headers=self.admin, json={
            "population": "pop", "plan": self.upload(plan.to_bytes()),
            "broadcast": self.upload(broadcast), "target": len(data),
            "stage_timeout": TIMEOUT, "deadline": 4 * TIMEOUT, **options,
        }))
        self.round = created["id"]
        assert created["kind"] == "secure" and created["stage"] == 1
        self.clients = {}
        self.refusals = {}  # client -> why its own SecAgg+ client refused a request
        for batches in data:
            enrolled = self.enroll()
            task = self.ok(self.http.post(f"{API}/checkin",
                                          headers=bearer(enrolled["credential"])))["task"]
            assert (task["round"], task["kind"]) == (self.round, "secure")
            parts = execution.run_plan_parts(plan, broadcast, {"d": batches})
            self.clients[enrolled["client_id"]] = Member(enrolled["credential"], batches, parts)

    def connect(self, server):
        self.server = server
        self.http = httpx.Client(base_url=server.url, timeout=30)
        self.admin = bearer(server.admin_token)

    @staticmethod
    def ok(response, status=(200, 201)):
        assert response.status_code in status, response.text
        return response.json()

    def upload(self, data):
        return self.ok(self.http.post(f"{API}/admin/blobs", content=data, headers=self.admin))["hash"]

    def enroll(self):
        return self.ok(self.http.post(f"{API}/populations/pop/enroll", headers=bearer(self.token)))

    def get(self, cid, round_id=None):
        return self.http.get(f"{API}/rounds/{round_id or self.round}/secagg",
                             headers=bearer(self.clients[cid].credential))

    def put(self, cid, stage, body, round_id=None):
        rid = round_id or self.round
        return self.http.put(f"{API}/rounds/{rid}/secagg/{stage}", content=body,
                             headers={**bearer(self.clients[cid].credential),
                                      **protocol.task_header({"round": rid})})

    def message(self, cid):
        """(stage, the client's answer to its current request)."""
        step = self.ok(self.get(cid))
        stage, request = step["stage"], base64.b64decode(step["request"])
        m = self.clients[cid]
        if stage == Stage.ADVERTISE_KEYS:
            m.sa = secagg.SecAggClient(cid, request)
            return stage, m.sa.advertise_keys()
        if stage == Stage.SHARE_KEYS:
            return stage, m.sa.share_keys(request)
        if stage == Stage.MASKED_INPUT:
            masked = m.sa.masked_input(request, m.parts.secure)
            return stage, protocol.pack_masked_input(m.parts.report, masked)
        return stage, m.sa.unmask(request)

    def answer(self, cid, alter=None):
        stage, body = self.message(cid)
        body = alter(stage, body) if alter is not None else body
        self.last_body = body
        answer = self.ok(self.put(cid, stage, body))
        assert answer == {"round": self.round, "stage": stage, "accepted": True, "replay": False}

    def status(self):
        return self.ok(self.http.get(f"{API}/admin/rounds/{self.round}", headers=self.admin))

    def expire(self):
        """Moves the server's clock past the stage timeout and waits for the stage to close."""
        before = self.status()
        self.clock.now += TIMEOUT + 1
        end = time.monotonic() + 30
        while time.monotonic() < end:
            r = self.status()
            if r["stage"] != before["stage"] or r["state"] != "open":
                return r
            time.sleep(0.02)
        raise AssertionError("the stage did not close at its timeout")

    def play(self, drop=None, alter=None):
        """Runs the four stages: every client answers unless it vanished (`drop`: stage ->
        clients that vanish before sending that stage's message); a stage still open when
        everyone who could has answered is closed at its timeout."""
        gone = set()
        for stage in (1, 2, 3, 4):
            gone |= set((drop or {}).get(stage, ()))
            for cid in self.clients:
                if cid not in gone and self.status()["state"] == "open":
                    if self.get(cid).status_code == 410:  # the protocol left it out
                        continue
                    try:
                        self.answer(cid, alter)
                    except secagg.SecAggError as e:  # the client drops out, as Client does
                        self.refusals[cid] = str(e)
                        gone.add(cid)
            r = self.status()
            if r["state"] == "open" and r["stage"] == stage:
                r = self.expire()
            if r["state"] != "open":
                return r
        return self.status()

    def aggregate(self):
        r = self.http.get(f"{API}/admin/rounds/{self.round}/aggregate", headers=self.admin)
        assert r.status_code == 200, r.text
        return r.content

    def snapshot(self):
        """What a refused message must not change: the round (less its refusal counter),
        the protocol state, the aggregate, the accepted messages and the assignments."""
        r = {k: v for k, v in self.status().items() if k != "refused"}
        with self.server.store.transaction() as tx:
            rows = [tx.all(q, (self.round,)) for q in (
                "SELECT stage, answered, state FROM secure_rounds WHERE round = ?",
                "SELECT c.data FROM aggregates a JOIN value_chunks c ON c.value = a.value"
                " WHERE a.round = ? ORDER BY c.idx",
                "SELECT client, stage, digest FROM reports WHERE round = ? ORDER BY client, stage",
                "SELECT client, state FROM assignments WHERE round = ? ORDER BY client",
                "SELECT client, stage FROM secure_requests WHERE round = ? ORDER BY client, stage",
            )]
        return r, [[tuple(bytes(v) if isinstance(v, bytes | memoryview) else v for v in row)
                    for row in table] for table in rows]


class HttpRounds:
    """A round runner that plays each round by hand over HTTP (see `Cohort.play`)."""

    def __init__(self, server, clock, data, **play):
        self.server, self.clock, self.data, self.play = server, clock, data, play
        self.options = play.pop("options", {})
        self.cohorts = []

    def run_round(self, plan, broadcast):
        cohort = Cohort(self.server, self.clock, plan, broadcast, self.data, **self.options)
        self.cohorts.append(cohort)
        ids = list(cohort.clients)
        drop = {stage: [ids[i] for i in who] for stage, who in self.play.get("drop", {}).items()}
        r = cohort.play(drop, self.play.get("alter"))
        if r["state"] != "closed":
            raise deploy.RoundFailedError(r["failure"])
        return deploy.RoundResult(cohort.aggregate(), r["reports"], 0.0, r)


@pytest.fixture
def cohorts(server_factory):
    """Makes `Cohort`s on new servers (each with its own clock); closes them at the end."""
    made = []

    def make(plan, broadcast, data, **options):
        clock = Clock()
        made.append(Cohort(server_factory(clock=clock), clock, plan, broadcast, data, **options))
        return made[-1]

    def run(data, **play):
        """`secure_and_plain` of the clients' data, its round played by `HttpRounds`."""
        clock = Clock()
        runner = HttpRounds(server_factory(clock=clock), clock, data, **play)
        try:
            bounds = bounds_of(secure_and_plain)
            with context.with_context(deploy.DeploymentContext(runner, bounds=bounds)):
                got = secure_and_plain(deploy.client_data("d"))
        finally:
            made.extend(runner.cohorts)
        return got, runner.cohorts[0]

    make.run = run
    yield make
    for c in made:
        c.http.close()


def _assert_equal(got, want):
    for k in ("bits", "mod", "plain"):
        for name in ("q", "r"):
            np.testing.assert_array_equal(got[k][name], want[k][name])


# ----------------------------------------------------------------------------


def test_a_secure_round_with_client_threads_equals_the_simulation_exactly(
    server_factory, client_threads
):
    data = _data(5, seed=1)
    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    errors = [client_threads(deploy.Client(server.url, "pop", token, {"d": b},
                                           backoff=(0.02, 0.2))) for b in data]
    ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=5,
                                    progress=True, bounds=bounds_of(secure_and_plain))
    with context.with_context(ctx):
        got = secure_and_plain(deploy.client_data("d"))
    ctx.runner.finish()
    ctx.runner.close()
    _assert_equal(got, secure_and_plain(data))
    (r,) = ctx.rounds
    assert r.reports == 5
    assert (r.details["kind"], r.details["state"], r.details["stage"]) == ("secure", "closed", 5)
    assert not any(errors)
    shown = CliRunner().invoke(cli.app, ["status", server.url], env={"COLUMNS": "200"})
    assert "closed (secure, stage 5)" in shown.output, shown.output


@pytest.mark.parametrize(
    "stage", [Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING],
    ids=["after-keys", "after-shares", "after-masked-input"],
)
def test_dropouts_at_each_stage_leave_the_survivors_sum(cohorts, stage):
    # 5 clients: 4 neighbours each, threshold 3; two vanish before sending `stage`'s message.
    data = _data(5, seed=int(stage))
    got, cohort = cohorts.run(data, drop={stage: [0, 1]}, options={"quorum": 3})
    in_sum = data if stage == Stage.UNMASKING else data[2:]  # a masked input that arrived counts
    _assert_equal(got, secure_and_plain(in_sum))
    r = cohort.status()
    # the two dropped out at whichever stage, even when their inputs are in the sum
    assert (r["reports"], r["dropped"]) == (len(in_sum), 2)


@pytest.mark.parametrize(
    ("vanish", "quorum", "why"),
    [(3, 2, "Expected at least 3 clients to share their keys"),
     (2, 4, "Expected at least 4 clients \\(the round's quorum\\)")],
    ids=["below-threshold", "below-quorum"],
)
def test_too_few_clients_fail_the_round_with_a_clear_message(cohorts, vanish, quorum, why):
    data = _data(5)
    drop = {Stage.SHARE_KEYS: list(range(vanish))}
    with pytest.raises(deploy.RoundFailedError, match=f"failed when stage 2 .* closed: {why}"):
        cohorts.run(data, drop=drop, options={"quorum": quorum})


def test_after_a_failure_nothing_more_is_asked_or_kept(cohorts, secure_round):
    c = cohorts(*secure_round, _data(5), quorum=2)
    ids = list(c.clients)
    r = c.play({Stage.SHARE_KEYS: ids[:3]})
    assert (r["state"], r["stage"], r["reports"], r["dropped"]) == ("failed", 6, 0, 5)
    with c.server.store.transaction() as tx:
        assert tx.all("SELECT * FROM secure_requests") == []
        assert bytes(tx.one("SELECT state FROM secure_rounds")[0]) == b""
        assert tx.one("SELECT MAX(stage) FROM reports")[0] == 2  # no masked input, no share
    assert c.ok(c.get(ids[4])) == {"round": c.round, "state": "failed", "stage": 6,
                                    "request": None, "retry_after": None, "finished": True}
    assert c.put(ids[4], 3, b"late").status_code == 410
    assert c.http.get(f"{API}/admin/rounds/{c.round}/aggregate",
                      headers=c.admin).status_code == 409


def test_a_tampered_share_drops_its_receiver_and_the_round_goes_on(cohorts):
    # The server cannot read shares; the client a tampered one is for refuses its
    # masked-input request and drops out, and the round finishes without it.
    data = _data(5, seed=7)
    victim = []

    def tamper(stage, body):
        if stage == Stage.SHARE_KEYS and not victim:
            m = wire.decode(body, wire.SHARES)
            victim.append(m.header["to"][0])
            blob = bytearray(m.blobs[0])
            blob[20] ^= 1  # inside the ciphertext of the first receiver's shares
            header = {k: v for k, v in m.header.items() if k != "blobs"}
            return wire.encode(wire.SHARES, header, [bytes(blob)])
        return body

    got, c = cohorts.run(data, alter=tamper, options={"quorum": 3})
    assert list(c.refusals) == victim and "share" in c.refusals[victim[0]]
    survivors = [m.batches for cid, m in c.clients.items() if cid not in victim]
    _assert_equal(got, secure_and_plain(survivors))
    r = c.status()
    assert (r["reports"], r["dropped"]) == (4, 1)


def _refused(c, cid, stage, body, status, text, reason=None):
    before = c.snapshot()
    r = c.put(cid, stage, body)
    assert r.status_code == status, r.text
    assert text in r.json()["detail"], r.text
    if reason is not None:
        assert r.json()["reason"] == reason
    assert c.snapshot() == before


def test_bad_stage_messages_get_4xx_and_change_nothing(cohorts, secure_round):
    c = cohorts(*secure_round, _data(4, seed=5))
    a, b, d, e = c.clients  # 4 clients: each the neighbour of all others, threshold 3
    config = base64.b64decode(c.ok(c.get(a))["request"])
    round_id, _ = messages.read_config(config)

    # Stage 1: advertise keys.
    _stage, first = c.message(a)
    assert c.ok(c.put(a, 1, first))["replay"] is False
    assert c.ok(c.put(a, 1, first))["replay"] is True  # the same bytes: nothing changes
    enc, mask = messages.read_advertise(first, round_id, a)
    _refused(c, a, 1, messages.advertise(round_id, a, mask, enc), 409, "the first one stands")
    _refused(c, b, 1, messages.advertise(round_id, b, enc, mask), 400, "reused key", "secagg")
    _refused(c, b, 1, messages.advertise(round_id, a, enc, mask), 400, "Expected", "secagg")
    _refused(c, b, 1, b"FLSA garbage", 400, "Expected a valid advertise keys message", "secagg")
    _refused(c, b, 2, b"too early", 409, "has not opened")
    assert c.put(b, 5, b"no such stage").status_code == 422  # FastAPI's validation
    before = c.snapshot()  # a plain report, as to an aggregate round
    r = c.http.put(f"{API}/rounds/{c.round}/report", content=c.clients[b].parts.report,
                   headers={**bearer(c.clients[b].credential),
                            **protocol.task_header({"round": c.round})})
    assert r.status_code == 409 and "take part in its stages" in r.json()["detail"]
    assert c.snapshot() == before
    outsider = c.enroll()  # the round is full: it is not assigned
    c.clients["outsider"] = Member(outsider["credential"], None, None)
    assert c.ok(c.http.post(f"{API}/checkin", headers=bearer(outsider["credential"])))["task"] is None
    assert c.get("outsider").status_code == 403
    _refused(c, "outsider", 1, first, 403, "not assigned")
    del c.clients["outsider"]
    for cid in (b, d, e):
        c.answer(cid)
    assert c.status()["stage"] == 2

    # Stage 2: share keys. A retried answer to a closed stage is still a replay.
    assert c.ok(c.put(a, 1, first))["replay"] is True
    _stage, shares = c.message(a)
    m = wire.decode(shares, wire.SHARES)
    to = list(m.header["to"])
    wrong = messages.shares(round_id, a, [*to[:-1], "c-nobody"],
                            wire.split(m.blobs[0], messages.CIPHERTEXT_BYTES, 3, "shares"))
    _refused(c, a, 2, wrong, 400, "non-neighbours ['c-nobody']", "secagg")
    _refused(c, a, 2, shares[:-10], 400, "Expected", "secagg")
    c.ok(c.put(a, 2, shares))
    _refused(c, a, 2, shares[:-1] + bytes([shares[-1] ^ 1]), 409, "the first one stands")
    for cid in (b, d, e):
        c.answer(cid)
    assert c.status()["stage"] == 3

    # Stage 3: the plain report with the masked input.
    _stage, body = c.message(a)
    plain, masked = protocol.unpack_masked_input(body)
    _refused(c, a, 3, b"\xff" * 8 + body, 400, "Expected a plain report of at most")
    _refused(c, a, 3, protocol.pack_masked_input(b"not a report", masked), 400,
             "Expected a report of type")
    _refused(c, a, 3, protocol.pack_masked_input(plain, first), 400, "Expected", "secagg")
    _refused(c, a, 3, protocol.pack_masked_input(plain, masked[:-4]), 400, "Expected", "secagg")
    c.ok(c.put(a, 3, body))
    for cid in (b, d, e):
        c.answer(cid)
    assert c.status()["stage"] == 4

    # Stage 4: unmasking, then the sum.
    _stage, unmask = c.message(a)
    _refused(c, b, 3, body, 409, "the first one stands")
    _refused(c, a, 4, messages.unmask(round_id, a, [], [], [], []), 400, "Expected", "secagg")
    for cid in (a, b, d, e):
        if cid == a:
            c.ok(c.put(a, 4, unmask))
        else:
            c.answer(cid)
    r = c.status()
    assert (r["state"], r["stage"], r["reports"]) == ("closed", 5, 4)
    assert r["refused"] == 16
    refused = c.ok(c.http.get(f"{API}/status"))["reports"]["refused"]
    assert refused == {"secagg": 8, "conflict": 5, "not_assigned": 1, "bad_request": 1,
                       "malformed": 1}
    _assert_results_are_local_rounds(c, secure_round[1])


def _assert_results_are_local_rounds(c, broadcast):
    """The round's results are those of the same plan run in process (`LocalRounds`, which
    test_context.py checks against the simulation runtime)."""
    local = deploy.LocalRounds({cid: {"d": m.batches} for cid, m in c.clients.items()})
    want = deploy.Folder(c.plan).results(local.run_round(c.plan, broadcast).aggregate)
    got = deploy.Folder(c.plan).results(c.aggregate())
    for got_leaf, want_leaf in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_array_equal(got_leaf, want_leaf)


def _leaves(x):
    if isinstance(x, tuple | list):
        return [leaf for item in x for leaf in _leaves(item)]
    return [np.asarray(x)]


def test_a_restarted_server_continues_the_round_from_its_database(
    db_url, server_factory, secure_round
):
    clock = Clock()
    c = Cohort(server_factory(db=db_url, clock=clock), clock, *secure_round, _data(5, seed=11))
    ids = list(c.clients)

    def restart():
        c.server.stop()
        c.http.close()
        c.connect(server_factory(db=db_url, clock=clock, admin_token=c.server.admin_token))

    try:
        for cid in ids:
            c.answer(cid)
        assert c.status()["stage"] == 2
        restart()  # between stages
        for cid in ids:
            c.answer(cid)
        for cid in ids[:2]:
            c.answer(cid)
        restart()  # in the middle of the masked inputs
        assert (c.status()["stage"], c.status()["reports"]) == (3, 2)
        assert c.ok(c.put(ids[1], 3, c.last_body))["replay"] is True  # a retried upload
        for cid in ids[2:]:
            c.answer(cid)
        for cid in ids:
            c.answer(cid)
        assert (c.status()["state"], c.status()["reports"]) == ("closed", 5)
        _assert_results_are_local_rounds(c, secure_round[1])
    finally:
        c.http.close()


# ----------------------------------------------------------------------------
# What the server receives, stores and logs


VECTOR = fl.TensorType(np.int32, [64])
TOTALS = fl.to_type({"v": VECTOR, "k": np.int32})


@fl.jax_computation(fl.SequenceType(VECTOR))
def _vector_total(ds):
    return ds.reduce({"v": np.zeros(64, np.int32), "k": np.int32(0)},
                     lambda st, x: {"v": st["v"] + x, "k": st["k"] + 1})


@fl.jax_computation(TOTALS)
def _values(st):
    return st["v"]


@fl.jax_computation(TOTALS)
def _count(st):
    return st["k"]


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(VECTOR)))
def secure_vector(data):
    totals = fl.federated_map(_vector_total, data)
    return {
        "sum": fl.federated_secure_sum_bitwidth(fl.federated_map(_values, totals), 20),
        "examples": fl.federated_sum(fl.federated_map(_count, totals)),
    }


class Recording:
    """ASGI middleware: records every request the server receives (method, path, query,
    headers and body)."""

    def __init__(self, app, log):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        try:
            await self.app(scope, recording_receive, send)
        finally:
            self.log.append({
                "method": scope["method"], "path": scope["path"], "query": scope["query_string"],
                "headers": dict(scope["headers"]), "body": b"".join(body),
            })


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.name} {record.levelname} {record.getMessage()}")


_AUDIT = [
    "CREATE TABLE audit (data BLOB)",
    *(f"CREATE TRIGGER audit_{table}_{event} AFTER {event} ON {table} BEGIN INSERT INTO audit"
      f" VALUES (NEW.{column}); END"
      for table, column in [("secure_rounds", "state"), ("secure_requests", "data"),
                            ("value_chunks", "data"), ("reports", "digest")]
      for event in ("INSERT", "UPDATE")),
]


def test_the_server_receives_stores_and_logs_no_clients_input(tmp_path):
    # Six clients sum vectors of 64 integers (20 bits each); one vanishes after sharing its
    # keys (its mask key is rebuilt), one after sending its masked input (its self-mask
    # seed is rebuilt from the others').
    rng = np.random.default_rng(0)
    data = [[rng.integers(0, 2**18, 64).astype(np.int32) for _ in range(3)] for _ in range(6)]
    db = tmp_path / "privacy.db"
    clock = Clock()
    received, lines = [], Lines()
    server = deploy.Server(db=db, port=0, clock=clock, tick=0.05, log_level="debug",
                           access_log=True, pace=deploy.Pace(min_retry=0.05))
    server.app.add_middleware(Recording, log=received)
    with sqlite3.connect(db) as audit:  # every value the server writes, as it writes it
        for statement in _AUDIT:
            audit.execute(statement)
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "uvicorn.access",
                                                "fedlang")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(lines)
    logging.getLogger("fedlang").setLevel(logging.DEBUG)
    server.start()
    try:
        examples = deploy.ReportBounds(ranges={"[1]": (0, 10**6)})  # a client's count of rows
        plan, broadcast = capture(secure_vector, deploy.client_data("d"), bounds=examples)
        c = Cohort(server, clock, plan, broadcast, data, quorum=4)
        ids = list(c.clients)
        r = c.play({Stage.MASKED_INPUT: ids[:1], Stage.UNMASKING: ids[1:2]})
        # one vanished before its masked input, one before unmasking (its input is in)
        assert (r["state"], r["reports"], r["dropped"]) == ("closed", 5, 2)
        c.http.close()
    finally:
        server.stop()
        for lg, level in zip(loggers, levels):
            lg.removeHandler(lines)
            lg.setLevel(level)
    with sqlite3.connect(db) as conn:
        written = [bytes(row[0]) if isinstance(row[0], bytes) else str(row[0]).encode()
                   for row in conn.execute("SELECT data FROM audit")]
        stored = []
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            for row in conn.execute(f"SELECT * FROM {table}"):
                stored += [v if isinstance(v, bytes) else str(v).encode() for v in row]
        final = bytes(conn.execute("SELECT state FROM secure_rounds").fetchone()[0])
    server_state = secagg.SecAggServer.from_bytes(final)
    segment = server_state.segments[0]
    plain = {cid: secagg_privacy.masks_lib.reduce(m.parts.secure[0], segment, cid)
             for cid, m in c.clients.items()}

    # 1. No byte the server received, wrote or keeps holds a client's input.
    requests = [b"".join([rec["path"].encode(), rec["query"], *rec["headers"].values(),
                          rec["body"]]) for rec in received]
    assert any(b"/secagg/3" in p for p in requests) and written and stored
    secagg_privacy.assert_no_payload_holds_an_input([*requests, *written, *stored], plain)

    # 2. Removing every mask the server could compute leaves each masked input masked.
    by_credential = {m.credential.encode(): cid for cid, m in c.clients.items()}
    log = []
    for rec in received:
        parts = rec["path"].split("/")
        if rec["method"] == "PUT" and "secagg" in parts:
            stage = Stage(int(parts[-1]))
            cid = by_credential[rec["headers"][b"authorization"].split()[-1]]
            body = rec["body"]
            if stage == Stage.MASKED_INPUT:
                body = protocol.unpack_masked_input(body)[1]
            log.append((stage, cid, body))
    survivors = [cid for cid in ids if cid != ids[0]]
    rebuilt = secagg_privacy.assert_masks_hide_every_input(log, plain, segment, server_state,
                                                           survivors)
    assert rebuilt == {ids[0]}

    # 3. The logs (uvicorn's access log included) name requests, never their payloads.
    text = "\n".join(lines.lines)
    assert "PUT /v1/rounds/1/secagg/3" in text
    for rec in received:
        body = rec["body"]
        if len(body) >= 16:
            for shown in (body[:16].decode("latin-1"), body.hex()[:32],
                          base64.b64encode(body).decode()[:24]):
                assert shown not in text
    for vector in plain.values():
        for raw in secagg_privacy.encodings(vector):
            assert raw.decode("latin-1") not in text

