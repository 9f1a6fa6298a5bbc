"""An edge's HTTP to the root: its rounds, its shares, their blobs, and the partial
aggregates it forwards (`server/edges.py` answers); its buffered sessions and the batches
of reports it forwards (`server/edge_sessions.py`); each with the edge's token."""

from __future__ import annotations

from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.client import connection


class Link:
    """HTTP to the root as edge (see the module docstring).

    Args:
      url: the root's URL.
      token: the edge's token (`POST /v1/admin/edges` on the root).
      patience: seconds one call retries an unreachable root before it raises
        `ServerUnavailable` (the edge then tries again on its next pass).
      verify: TLS verification (True, False, or a CA bundle path).
    """

    def __init__(self, url: str, token: str, *, patience: float = 10.0, verify: Any = True,
                 backoff: tuple[float, float] = (0.1, 2.0)):
        self.token = token
        self.conn = connection.Connection(url, patience=patience, verify=verify, backoff=backoff)
        self.url = self.conn.url

    def rounds(self, wait: float = 0.0) -> dict[str, Any]:
        """The edge's population, whether it is finished, the root's public key, and its
        open plain rounds and secure rounds run by edges (`wait`: long poll until one is new
        to the edge)."""
        result: dict[str, Any] = self.conn.json(
            "GET", "/v1/edge/rounds", token=self.token, params={"wait": wait},
            timeout=60 + wait,
        )
        return result

    def join(self, round_id: int) -> dict[str, Any]:
        """The edge's share of a root round (made on the first call)."""
        result: dict[str, Any] = self.conn.json(
            "POST", f"/v1/edge/rounds/{round_id}/join", token=self.token
        )
        return result

    def blob(self, h: str) -> bytes:
        """A blob of a root round, checked against its hash."""
        data = self.conn.request("GET", f"/v1/edge/blobs/{h}", token=self.token).content
        if protocol.blob_hash(data) != h:
            raise protocol.BadRequest(
                f"Expected the root's blob {h}, found bytes of another hash; the root or the "
                "path to it changed them."
            )
        return data

    def forward(self, round_id: int, body: bytes) -> dict[str, Any]:
        """Uploads the edge's partial aggregate of a root round (idempotent)."""
        result: dict[str, Any] = self.conn.json(
            "PUT", f"/v1/edge/rounds/{round_id}/partial", token=self.token, content=body,
            headers={"Content-Type": protocol.BINARY},
        )
        return result

    def sessions(self) -> dict[str, Any]:
        """The edge's population, the root's public key, and its open buffered sessions."""
        result: dict[str, Any] = self.conn.json("GET", "/v1/edge/sessions", token=self.token)
        return result

    def join_session(self, session_id: int) -> dict[str, Any]:
        """A root session as the edge mirrors it (its plan, version, weights, buffer)."""
        result: dict[str, Any] = self.conn.json(
            "POST", f"/v1/edge/sessions/{session_id}/join", token=self.token
        )
        return result

    def forward_batch(self, session_id: int, number: int, body: bytes) -> dict[str, Any]:
        """Uploads batch `number` of reports of a root session, once (no retry: the edge
        sends the same bytes again on its next pass)."""
        result: dict[str, Any] = self.conn.json(
            "PUT", f"/v1/edge/sessions/{session_id}/batches/{number}", token=self.token,
            content=body, headers={"Content-Type": protocol.BINARY}, retry=False,
        )
        return result

    def close(self) -> None:
        self.conn.close()
