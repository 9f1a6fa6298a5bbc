"""A deployment client: a stateless executor that pulls tasks and pushes reports.

It only ever connects out: enroll once with the population's token (the credential and
the server's public key can be kept in a file), then loop: check in; if given a task,
download its signed plan and broadcast value by hash (the plan cached; the broadcast
read into the model's own tensors as it arrives, `execution.BroadcastScan`, and let go
after the round), verify the plan against the pinned key, run it on the client's own
data (`execution.run_plan`, the simulation runtime's local execution) and upload the
report (in pieces: a model-sized report is never copied on its way out); otherwise wait as long as the server
says (pace steering). Every request retries with exponential backoff and jitter, so a
client rides out a server restart; a rejected credential makes it enroll again.

A task of a secure round (its plan has secure aggregations) runs the plan once
(`execution.run_plan_parts`) and then takes part in the four stages of SecAgg+: the
client fetches each stage's request, answers it with its `secagg.SecAggClient`, and
waits as the server says for the next stage. Its inputs to the secure aggregations only
ever leave it masked; its plain report travels with its masked input. The protocol's
keys live in memory only: a client that restarts mid-round has left that round (a
dropout, which the protocol handles) and waits for the next one.

A task of a buffered (asynchronous, FedBuff) session (`kind` "buffered") names a model
version: the client verifies the session's plan (`plans.buffered.BufferedPlan`), trains it
on its data from that version's weights and uploads the raw report for that version; a
refusal as stale is logged, and the client checks in for the current version.

A task with client state (its plan's `state`, e.g. SCAFFOLD's control variate) runs
on the client's stored state (`state_dir`, `client.state.DeviceStates`: one file per
population and state name; a client without one starts from the plan's initial
state). The new state stays on the device and is committed, by an atomic replace of
its file, only once the server has acknowledged the report computed with it (in a
secure round: its masked input): a report refused, a task that fails, or a crash
before the acknowledgement leave the stored state as it was. A crash between the
acknowledgement and the replace, or a round that fails after acknowledging the
report, leave the device one step apart from the server (docs/deploy.md).

A client's data are given by name (`data={"train": ...}`), each as a dataset (any
iterable of batches of the type the task expects, e.g. a `fedlang.simulation` dataset)
or as the path of an `.npz` file: its arrays (e.g. `x` and `y`, in the file's order)
are the fields of each element, cut into batches of `batch_size` rows. Each file is
checked when the client is made, before it enrolls (it exists and holds numeric arrays
with as many rows each: their headers are read, not their data); its rows are read when a
task runs.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import pathlib
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from fedlang.core import signing
from fedlang.deploy import protocol, secagg
from fedlang.deploy.client import connection as connection_lib
from fedlang.deploy.client import data as data_lib
from fedlang.deploy.client import state as state_lib
from fedlang.deploy.plans import cache, execution
from fedlang.deploy.plans import round as plan_lib

log = logging.getLogger("fedlang.deploy.client")
T = TypeVar("T")
# The blobs a client keeps: a plan and a broadcast per round, a few rounds of small ones.
_KEPT_BLOBS, _KEPT_BLOB_BYTES = 8, 64 << 20


class CredentialFileError(ValueError):
    """A credential file that holds no credential (not JSON, or without its fields)."""


def _dataset(value: Any, batch_size: int) -> Any:
    if isinstance(value, str | os.PathLike):
        path = pathlib.Path(value)
        if path.suffix != ".npz":
            raise ValueError(
                f"Expected client data as an .npz file of arrays (e.g. x and y), found {path}."
            )
        return data_lib.NpzDataset(path, batch_size)
    return value


class Client:
    """A deployment client (see the module docstring).

    Args:
      server: the server's URL.
      population: the population to enroll in.
      token: the population's enrollment token (not needed once `credential_file` holds
        a credential).
      data: the client's datasets by name (datasets or `.npz` paths).
      batch_size: rows per batch of `.npz` data.
      credential_file: where to keep the credential and the pinned key between runs.
      public_key: the server's Ed25519 public key (32 bytes), pinned in advance; default:
        the one the server gives at enrollment (trust on first use).
      max_tasks: stop after this many reports (default: run until the population is
        finished or `stop()` is called).
      state_dir: where this device keeps its client states (needed for tasks with
        client state; see the module docstring).
      patience: seconds to keep retrying an unreachable server.
      connection: more options of `connection.Connection` (`timeout`, `verify`, `backoff`).
    """

    def __init__(
        self,
        server: str,
        population: str,
        token: str | None = None,
        data: Mapping[str, Any] | None = None,
        *,
        batch_size: int = 20,
        credential_file: str | os.PathLike[str] | None = None,
        public_key: bytes | None = None,
        max_tasks: int | None = None,
        patience: float = 300.0,
        state_dir: str | os.PathLike[str] | None = None,
        **connection: Any,
    ):
        # said in its log: a server that stops answering, and answers again
        connection.setdefault("say", log.warning)
        self.connection = connection_lib.Connection(server, patience=patience, **connection)
        self.population = population
        self.token = token
        self.data = {k: _dataset(v, batch_size) for k, v in (data or {}).items()}
        self.credential_file = pathlib.Path(credential_file) if credential_file else None
        self.pinned = public_key
        self.max_tasks = max_tasks
        self.client_id: str | None = None
        self.credential: str | None = None
        self.tasks_done = 0
        self.states = state_lib.DeviceStates(state_dir) if state_dir is not None else None
        self._blobs: dict[str, bytes] = {}
        self._plans: cache.VerifiedPlans | None = None
        self._left: set[int] = set()  # secure rounds this client can no longer take part in
        self._stop = threading.Event()
        self._rejoining = False  # a credential from `credential_file`, not yet used
        if self.credential_file and self.credential_file.exists():
            self._load_credential()

    # -- enrollment

    def _load_credential(self) -> None:
        """The credential and pinned key kept in `credential_file` by `enroll`.

        Raises:
          CredentialFileError: the file is not such a credential (not JSON, or without
            its fields): it says to delete it, so the client enrolls again.
        """
        path = self.credential_file
        assert path is not None
        fix = "; delete it to enroll again as a new client (with the population's token)."
        expected = f"Expected the credential file {path} to hold this client's credential"
        try:
            doc = json.loads(path.read_bytes())
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            raise CredentialFileError(f"{expected} (JSON), found invalid JSON ({e}){fix}") from e
        fields = ("client_id", "credential", "public_key")
        missing = [k for k in fields if not isinstance(doc, dict) or not isinstance(doc.get(k), str)]
        if missing:
            found = (f"JSON without {', '.join(missing)}" if isinstance(doc, dict) else
                     f"a JSON {type(doc).__name__}")
            raise CredentialFileError(
                f"{expected} (JSON with {', '.join(fields)}), found {found}{fix}")
        try:
            key = base64.b64decode(doc["public_key"], validate=True)
        except binascii.Error as e:
            raise CredentialFileError(
                f"{expected}, found a public_key that is not base64 ({e}){fix}") from e
        self.client_id, self.credential = doc["client_id"], doc["credential"]
        self._pin(key)
        self._rejoining = True

    def _pin(self, key: bytes) -> None:
        if self.pinned is not None and key != self.pinned:
            raise signing.SignatureError(
                f"Expected the server's public key {base64.b64encode(self.pinned).decode()} "
                f"(pinned), found {base64.b64encode(key).decode()}; this is not the server this "
                "client enrolled with."
            )
        self.pinned = key

    def enroll(self) -> str:
        """Enrolls with the population's token; returns the client id."""
        if self.token is None:
            raise protocol.Unauthorized(
                f"Expected an enrollment token for population {self.population!r} (this client "
                "has no valid credential), found none; pass token=... (--token)."
            )
        doc = self.connection.json(
            "POST", f"{protocol.API}/populations/{self.population}/enroll", token=self.token
        )
        self._pin(base64.b64decode(doc["public_key"]))
        self.client_id, self.credential = doc["client_id"], doc["credential"]
        self._rejoining = False
        if self.credential_file is not None:
            fd = os.open(self.credential_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({**doc, "server": self.connection.url, "population": self.population}, f)
        log.info("enrolled as %s", self.client_id)
        return doc["client_id"]

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """A request with the credential (`_authorized`)."""
        return self._authorized(lambda credential: self.connection.request(
            method, path, token=credential, **kwargs))

    def _authorized(self, send: Callable[[str | None], T]) -> T:
        """`send(credential)`; enrolls (again) when the credential is missing or refused."""
        if self.credential is None:
            self.enroll()
        try:
            answer = send(self.credential)
        except protocol.Unauthorized:
            if self.token is None:
                raise
            self.enroll()
            return send(self.credential)
        if self._rejoining:  # the server took the kept credential
            self._rejoining = False
            log.info("rejoined as %s (credential %s)", self.client_id, self.credential_file)
        return answer

    # -- the loop

    def stop(self) -> None:
        """Stops `run` after the current step."""
        self._stop.set()

    def run(self) -> int:
        """Checks in and runs tasks until a stop condition; returns the tasks done."""
        while not self._stop.is_set():
            if self.max_tasks is not None and self.tasks_done >= self.max_tasks:
                break
            answer = self._request("POST", f"{protocol.API}/checkin").json()
            if answer.get("finished"):
                log.info("the population is finished")
                break
            task = answer.get("task")
            if task is None:
                self._stop.wait(float(answer.get("retry_after") or 1.0))
                continue
            buffered = task.get("kind") == protocol.TaskKind.BUFFERED
            if not buffered and task["round"] in self._left:  # assigned until its stage closes
                self._stop.wait(1.0)
                continue
            self.run_task(task)
        return self.tasks_done

    def run_task(self, task: Mapping[str, Any]) -> bool:
        """Runs one task and uploads the report (or, in a secure round, takes part in its
        stages); returns whether the report (the masked input) was accepted.

        Raises:
          SignatureError: the task's ticket is missing or not the pinned key's signature
            over this task (its plan, broadcast, round and version): nothing is run.
        """
        self._check_ticket(task)
        if task.get("kind") == protocol.TaskKind.BUFFERED:
            return self._run_buffered(task)
        round_plan = self._plan(task["plan"])
        broadcast = self._broadcast(round_plan, task["broadcast"])
        if task.get("kind") == protocol.TaskKind.SECURE or round_plan.secure:
            return self._run_secure(task["round"], round_plan, broadcast)
        parts = self._run_parts(round_plan, broadcast)
        del broadcast  # the model: not held while the report is sent
        try:
            self._put(f"{protocol.API}/rounds/{task['round']}/report", parts.report, task)
        except (protocol.Gone, protocol.Conflict, protocol.Forbidden) as e:
            log.warning("report for round %s refused: %s", task["round"], e)
            return False
        self._commit_state(round_plan, parts)
        self.tasks_done += 1
        log.info("reported for round %s", task["round"])
        return True

    def _run_buffered(self, task: Mapping[str, Any]) -> bool:
        """Trains the task's model version of a buffered session and uploads the report
        for that version; returns whether it was accepted (a stale one is refused)."""
        plan = self._verified().buffered(task["plan"])
        report = plan.run(self._blob(task["broadcast"]), self.data)
        session, version = task["session"], task["version"]
        try:
            self._put(f"{protocol.API}/sessions/{session}/reports/{version}", report, task)
        except (protocol.Gone, protocol.Conflict, protocol.Forbidden) as e:
            log.warning("report for version %s of session %s refused: %s", version, session, e)
            return False
        self.tasks_done += 1
        log.info("reported for version %s of session %s", version, session)
        return True

    def _put(self, path: str, body: bytes, task: Mapping[str, Any]) -> None:
        """PUTs binary `body` (a report), in pieces (`connection.Body`): not copied whole;
        with the task it was computed for (`protocol.task_header`: the server refuses it
        for any other, 409 `stale`)."""
        pieces = connection_lib.Body(body)
        self._request("PUT", path, content=pieces,
                      headers={**pieces.headers, "Content-Type": protocol.BINARY,
                               **protocol.task_header(task)})

    def _run_secure(self, round_id: int, round_plan: plan_lib.RoundPlan, broadcast: Any) -> bool:
        """Takes part in a secure round's stages until it has nothing more to do there."""
        path = f"{protocol.API}/rounds/{round_id}/secagg"
        sa: secagg.SecAggClient | None = None
        parts: execution.ClientReport | None = None
        counted = False
        while not self._stop.is_set():
            try:
                step = self._request("GET", path).json()
            except (protocol.Gone, protocol.Conflict, protocol.Forbidden, protocol.NotFound) as e:
                log.warning("round %s: leaving: %s", round_id, e)
                break
            if step.get("finished"):
                log.info("round %s: nothing more to do (the round is %s)", round_id,
                         step.get("state"))
                break
            if step.get("request") is None:
                self._stop.wait(float(step.get("retry_after") or 1.0))
                continue
            stage, request = int(step["stage"]), base64.b64decode(step["request"])
            try:
                if stage == secagg.Stage.ADVERTISE_KEYS:
                    parts = self._run_parts(round_plan, broadcast)
                    assert self.client_id is not None  # set at enrollment
                    sa = secagg.SecAggClient(self.client_id, request)
                    message = sa.advertise_keys()
                elif sa is None or parts is None:
                    log.warning("round %s: this client lost its keys for the round (it "
                                "restarted); leaving it", round_id)
                    break
                elif stage == secagg.Stage.SHARE_KEYS:
                    message = sa.share_keys(request)
                elif stage == secagg.Stage.MASKED_INPUT:
                    masked = sa.masked_input(request, parts.secure)
                    message = protocol.pack_masked_input(parts.report, masked)
                else:
                    message = sa.unmask(request)
            except secagg.SecAggError as e:
                log.warning("round %s: refusing the server's stage %s request: %s",
                            round_id, stage, e)
                break
            try:
                self._put(f"{path}/{stage}", message, {"round": round_id})
            except (protocol.Gone, protocol.Conflict, protocol.Forbidden,
                    protocol.BadRequest) as e:
                log.warning("round %s: stage %s answer refused: %s", round_id, stage, e)
                break
            if stage == secagg.Stage.MASKED_INPUT and parts is not None:
                self._commit_state(round_plan, parts)  # its input is in the round now
            counted = counted or stage == secagg.Stage.MASKED_INPUT
            log.info("round %s: answered stage %s", round_id, stage)
        if not counted:
            self._left.add(round_id)
            return False
        self.tasks_done += 1
        return True

    # -- client state (kept on this device)

    def _run_parts(self, round_plan: plan_lib.RoundPlan, broadcast: Any) -> execution.ClientReport:
        """Runs the task on this client's data (and stored state, if the plan has one)."""
        if round_plan.state is None:
            return execution.run_plan_parts(round_plan, broadcast, self.data)
        if self.states is None:
            raise state_lib.StateFileError(
                f"This task keeps client state {round_plan.state.name!r} on the device, but "
                "the client has no state directory; start it with state_dir=... (--state-dir DIR)."
            )
        sp = round_plan.state
        stored = self.states.read(self.population, sp.name, sp.state_type)
        return execution.run_plan_parts(round_plan, broadcast, self.data, state=stored)

    def _commit_state(self, round_plan: plan_lib.RoundPlan, parts: execution.ClientReport) -> None:
        """Keeps the task's new state, once the server holds the report made with it."""
        sp = round_plan.state
        if sp is not None and sp.writes and self.states is not None:
            self.states.commit(self.population, sp.name, sp.state_type, parts.state)

    def _check_ticket(self, task: Mapping[str, Any]) -> None:
        """The task is the one the server signed (so the broadcast it names, the model's
        weights, is covered by the pinned key as the plan is)."""
        assert self.pinned is not None  # set at enrollment, before any check-in
        try:
            ticket = base64.b64decode(task.get("ticket") or "", validate=True)
        except binascii.Error as e:
            raise signing.SignatureError(f"Expected a task ticket, found bad base64: {e}") from e
        signed = signing.verify(ticket, self.pinned)
        if signed != protocol.ticket_payload(task):
            raise signing.SignatureError(
                f"Expected the task the server signed, found another: the check-in's answer "
                f"{protocol.ticket_payload(task)!r} differs from the signed "
                f"{signed[:300]!r}; someone between this client and the server changed it."
            )

    def _blob(self, h: str) -> bytes:
        """Blob `h` (a plan, a broadcast), streamed and checked against its hash. A few
        small ones are kept (a plan is read again each round); a large one (a model's
        broadcast, read once a round) pushes out all but itself, so a client holds at
        most one model-sized blob."""
        if h not in self._blobs:
            self._blobs[h] = self._authorized(lambda credential: self.connection.download(
                f"{protocol.API}/blobs/{h}", token=credential, expected_hash=h))
            while len(self._blobs) > 1 and (len(self._blobs) > _KEPT_BLOBS or sum(
                    len(b) for b in self._blobs.values()) > _KEPT_BLOB_BYTES):
                self._blobs.pop(next(iter(self._blobs)))
        return self._blobs[h]

    def _broadcast(self, round_plan: plan_lib.RoundPlan, h: str) -> Any:
        """The round's broadcast in blob `h` (checked against its hash): read into the
        model's own tensors as it arrives (`execution.BroadcastScan`), never held as
        bytes nor kept after the round; its bytes (`_blob`) when its type has leaves of
        no fixed size."""
        layout = execution.broadcast_layout(round_plan)
        if layout is None:
            return self._blob(h)
        return self._authorized(lambda credential: self.connection.download_into(
            f"{protocol.API}/blobs/{h}", lambda size: execution.BroadcastScan(layout),
            token=credential, expected_hash=h))

    def _plan(self, h: str) -> plan_lib.RoundPlan:
        """The verified round plan in blob `h`."""
        return self._verified().round(h)

    def _verified(self) -> cache.VerifiedPlans:
        """The plans this client verified against the pinned key (kept: rounds of one
        computation share a plan, and its compiled programs)."""
        assert self.pinned is not None  # set at enrollment
        if self._plans is None or self._plans.public_key != self.pinned:
            self._plans = cache.VerifiedPlans(self._blob, self.pinned, size=2)
        return self._plans

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
