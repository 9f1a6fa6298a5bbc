"""The driver's side of the admin endpoints (bearer admin token): populations, blobs,
rounds, the status."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, TypeVar

import httpx

from fedlang.deploy import protocol
from fedlang.deploy.client import connection as connection_lib

BULK_PER_CALL = 100_000  # the server's most clients a bulk enrollment request
R = TypeVar("R", bound=connection_lib.Reader)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def _aggregate_path(round_id: int) -> str:
    return f"{protocol.API}/admin/rounds/{round_id}/aggregate"


def read_credentials(lines: Iterator[bytes] | IO[bytes]) -> Iterator[dict[str, Any]]:
    """The credentials `Admin.enroll_bulk` wrote, one document per client as a
    `Client`'s credential file holds it (client_id, credential, public_key, server,
    population, expires), read line by line (a file of a million is never held whole).

    Raises:
      ValueError: a line that is not such a file's.
    """
    head: dict[str, Any] | None = None
    for number, line in enumerate(lines, 1):
        try:
            doc = json.loads(line)
            if head is None:
                head = {k: doc[k] for k in ("population", "expires", "public_key", "server")}
                continue
            yield {**head, "client_id": doc["client_id"], "credential": doc["credential"]}
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"Expected bulk enrollment credentials (NDJSON from `fedlang enroll-bulk`), "
                f"found line {number} unlike them ({e})."
            ) from e


class Admin:
    """The admin endpoints (bearer admin token)."""

    def __init__(
        self, url: str | connection_lib.Connection, admin_token: str, **connection: Any
    ):
        if not isinstance(url, connection_lib.Connection):
            url = connection_lib.Connection(url, **connection)
        self.connection = url
        self.token = admin_token

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.connection.json(method, protocol.API + path, token=self.token, **kwargs)

    def create_population(self, name: str, max_enrollments: int | None = None) -> str:
        """Creates a population; returns its enrollment token, which enrolls at most
        `max_enrollments` clients (None: any number)."""
        body = {"name": name, "max_enrollments": max_enrollments}
        return self._json("POST", "/admin/populations", json=body)["token"]

    def rotate_token(self, population: str, max_enrollments: int | None = None) -> str:
        """A new enrollment token for `population` (the old one stops enrolling)."""
        return self._json(
            "POST", f"/admin/populations/{population}/token",
            json={"max_enrollments": max_enrollments},
        )["token"]

    def audit_log(self, after: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """The audit log's entries after `after` (each admin request that may change
        something: when, method, path, status, from where)."""
        return self._json("GET", "/admin/audit", params={"after": after, "limit": limit})

    def device_tokens(self, population: str, count: int) -> list[str]:
        """`count` single-use enrollment tokens of `population`, one per device."""
        return self._json(
            "POST", f"/admin/populations/{population}/device-tokens", json={"count": count}
        )["tokens"]

    def enroll_bulk(
        self, population: str, count: int, out: IO[bytes], per_call: int = BULK_PER_CALL
    ) -> int:
        """Enrolls `count` clients of `population`, `per_call` a request, and writes their
        credentials to `out` as NDJSON: a header line (population, count, expires,
        public_key, server), then one `{"client_id", "credential"}` line per client
        (`read_credentials` reads it back). The secrets are shown once: keep `out` as you
        would the admin token. A request is not retried (a retry would enroll other
        clients); one that fails after the server enrolled its clients leaves them
        unknown: revoke them or let their credentials expire. Returns the clients written.
        """
        if count < 1:
            raise ValueError(f"Expected at least 1 client to enroll, found {count}.")
        path = f"{protocol.API}/admin/populations/{population}/clients:bulk"
        done = 0
        while done < count:
            n = min(per_call, count - done)
            body = self.connection.request(
                "POST", path, token=self.token, retry=False, json={"count": n}
            ).content
            head, _, lines = body.partition(b"\n")
            if done == 0:
                doc = {**json.loads(head), "count": count, "server": self.connection.url}
                out.write(json.dumps(doc).encode() + b"\n")
            out.write(lines)
            done += n
        return done

    def revoke_client(self, client_id: str) -> str:
        """Revokes a client's credential; returns its population."""
        return self._json("DELETE", f"/admin/clients/{client_id}")["population"]

    def create_edge(self, name: str, population: str) -> str:
        """An edge aggregator's token for `population` (`fedlang serve --upstream`)."""
        body = {"name": name, "population": population}
        return self._json("POST", "/admin/edges", json=body)["token"]

    def revoke_edge(self, name: str) -> None:
        """Revokes an edge: its token is refused from now on."""
        self._json("DELETE", f"/admin/edges/{name}")

    def edge_shares(self, round_id: int) -> list[dict[str, Any]]:
        """The edges' shares of a round: seats, target, and what each forwarded."""
        return self._json("GET", f"/admin/rounds/{round_id}/edges")

    def populations(self) -> list[dict[str, Any]]:
        return self._json("GET", "/admin/populations")

    def finish_population(self, name: str) -> None:
        """Tells the population's clients to stop at their next check-in."""
        self._json("POST", f"/admin/populations/{name}/finish")

    def put_blob(self, data: bytes) -> str:
        """Uploads a blob; returns its hash."""
        return self._json(
            "POST", "/admin/blobs", content=data, headers={"Content-Type": protocol.BINARY}
        )["hash"]

    def put_blob_parts(self, parts: Iterable[Any], size: int) -> str:
        """Uploads a blob of `size` bytes sent as it is read from `parts` (bytes-like
        pieces; iterated again if the upload is retried): a large value is never joined
        into one buffer. Returns its hash."""
        return self._json(
            "POST", "/admin/blobs", content=parts,
            headers={"Content-Type": protocol.BINARY, "Content-Length": str(size)},
        )["hash"]

    def create_round(self, population: str, plan: str, broadcast: str, **options: Any) -> Any:
        body = {"population": population, "plan": plan, "broadcast": broadcast, **options}
        return self._json("POST", "/admin/rounds", json=body)

    def round(self, round_id: int, wait: float = 0.0, seen: int = -1) -> dict[str, Any]:
        return self._json(
            "GET", f"/admin/rounds/{round_id}", params={"wait": wait, "seen": seen},
            timeout=(self.connection.http.timeout.read or 60.0) + wait,
        )

    def aggregate(self, round_id: int) -> bytes:
        """A closed round's aggregate, streamed (a cut transfer resumes)."""
        return self.connection.download(_aggregate_path(round_id), token=self.token)

    def aggregate_into(self, round_id: int, reader: Callable[[int | None], R]) -> R:
        """A closed round's aggregate handed to `reader(size)` as it arrives, never held
        (`Connection.download_into`: a cut transfer resumes; a value sent again from its
        start goes to a new reader). Returns the reader, fed every byte once."""
        return self.connection.download_into(_aggregate_path(round_id), reader, token=self.token)

    def aggregate_part(self, round_id: int, start: int, stop: int) -> tuple[bytes, int] | None:
        """Bytes `start:stop` of a closed round's aggregate and the aggregate's size, read
        with `Range` (a few bytes of a large value: a mean's count ahead of its totals);
        None when the answer is not that part (a server or proxy that ignores `Range`
        answers the whole value, which is then not read) or is cut: the caller reads the
        whole value instead.

        Raises:
          what `Connection.request` raises (a refusal, an unreachable server).
        """
        resp = self.connection.request(
            "GET", _aggregate_path(round_id), token=self.token,
            headers={"Range": f"bytes={start}-{stop - 1}"}, stream=True)
        try:
            m = _CONTENT_RANGE.fullmatch(resp.headers.get("content-range", ""))
            if resp.status_code != 206 or m is None or int(m[1]) != start or int(m[2]) != stop - 1:
                return None
            body = resp.read()
        except httpx.TransportError:
            return None
        finally:
            resp.close()
        return (body, int(m[3])) if len(body) == stop - start else None

    # -- watching a deployment (server/ops.py)

    def release_metrics(self, population: str, round_num: int, metrics: Any) -> int:
        """Releases round `round_num`'s metrics of `population` (`{kind: {name: number}}`,
        e.g. `{"train": {"loss": 0.3}, "eval": {...}}`; deeper mappings become `a/b`
        names) for the dashboard; returns how many were stored. Releasing a round again
        replaces its values."""
        body = {"round": int(round_num), "metrics": metrics}
        return int(self._json("POST", f"/admin/populations/{population}/metrics", json=body)["stored"])

    def released_metrics(self, population: str, since: float | None = None) -> list[dict[str, Any]]:
        """The released metrics of `population` (`round`, `kind`, `name`, `value`,
        `released`), those released after `since` when given."""
        params = {} if since is None else {"since": since}
        return self._json("GET", f"/admin/populations/{population}/metrics", params=params)["metrics"]

    def overview(self, rounds: int = 20, sessions: int = 10) -> dict[str, Any]:
        """Populations, the latest rounds and sessions with their progress, the totals and
        the rates of the last hour (`GET /v1/admin/overview`)."""
        return self._json("GET", "/admin/overview", params={"rounds": rounds, "sessions": sessions})

    def stop_round(self, round_id: int) -> dict[str, Any]:
        """Ends an open round now, as failed; returns its row."""
        return self._json("POST", f"/admin/rounds/{round_id}/stop")

    def close_session(self, session_id: int) -> dict[str, Any]:
        """Closes a buffered session (no more tasks); returns its row."""
        return self._json("POST", f"/admin/sessions/{session_id}/close")

    def session(self, session_id: int, wait: float = 0.0, seen: int = -1) -> dict[str, Any]:
        return self._json(
            "GET", f"/admin/sessions/{session_id}", params={"wait": wait, "seen": seen},
            timeout=(self.connection.http.timeout.read or 60.0) + wait,
        )

    def status(self) -> dict[str, Any]:
        return self.connection.json("GET", f"{protocol.API}/status")

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

