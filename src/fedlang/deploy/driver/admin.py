"""The driver's side of the admin endpoints (bearer admin token): populations, blobs,
rounds, the status."""

from __future__ import annotations

from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.client import connection as connection_lib


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

    def create_round(self, population: str, plan: str, broadcast: str, **options: Any) -> Any:
        body = {"population": population, "plan": plan, "broadcast": broadcast, **options}
        return self._json("POST", "/admin/rounds", json=body)

    def round(self, round_id: int, wait: float = 0.0, seen: int = -1) -> dict[str, Any]:
        return self._json(
            "GET", f"/admin/rounds/{round_id}", params={"wait": wait, "seen": seen},
            timeout=(self.connection.http.timeout.read or 60.0) + wait,
        )

    def aggregate(self, round_id: int) -> bytes:
        return self.connection.request(
            "GET", f"{protocol.API}/admin/rounds/{round_id}/aggregate", token=self.token
        ).content

    def status(self) -> dict[str, Any]:
        return self.connection.json("GET", f"{protocol.API}/status")

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

