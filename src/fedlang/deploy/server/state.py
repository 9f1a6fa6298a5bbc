"""What every route of the server reads: the store and its three modes, the keys, and
the verified plans (`ServerState`); `app.create_app` puts it where routes find it
(`routing.State`)."""

from __future__ import annotations

from typing import Any

from fedlang.core import signing
from fedlang.deploy.plans import cache
from fedlang.deploy.plans import round as plan_lib
from fedlang.deploy.server import ratelimit
from fedlang.deploy.server import telemetry as telemetry_lib
from fedlang.deploy.store import edges as edges_lib
from fedlang.deploy.store import metrics as metrics_lib
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import secure as secure_lib
from fedlang.deploy.store import sessions as sessions_lib
from fedlang.deploy.store import shards as shards_lib
from fedlang.deploy.store import store as store_lib

VERSION = "0.1.0"


class ServerState:
    """The server's state: a store, the modes over it, and the server's keys.

    Args:
      store: the task store.
      key: the Ed25519 key that signs plans.
      admin_token_hash: the SHA-256 (hex) of the admin endpoints' bearer token.
      credential_ttl: seconds a client credential stays valid.
      max_blob_bytes: the largest blob the admin may upload (`--max-blob-bytes`).
      client_rate: each enrolled client's rate limit (`ratelimit`; None: none).
      enroll_rate: each address's limit on failed enrollments (None: none).
      admin_rate: each address's limit on requests with a wrong admin token (None: none).
      max_report_bytes: the largest upload of any kind (`--max-report-bytes`).
      stream_report_bytes: reports of a plan that lets them hold more are taken as they
        arrive and stored (`--stream-report-bytes`; `intake`).
    """

    def __init__(
        self,
        store: store_lib.Store,
        key: Any,
        admin_token_hash: str,
        credential_ttl: float = 30 * 86400,
        max_blob_bytes: int = 1 << 30,
        client_rate: ratelimit.Rate | None = None,
        enroll_rate: ratelimit.Rate | None = None,
        max_report_bytes: int = 1 << 30,
        stream_report_bytes: int = 64 << 20,
        admin_rate: ratelimit.Rate | None = None,
    ):
        self.store = store
        self.key = key
        self.public_key = signing.public_key_bytes(key)
        self.admin_token_hash = admin_token_hash
        self.credential_ttl = credential_ttl
        self.max_blob_bytes = max_blob_bytes
        self.max_report_bytes = max_report_bytes
        self.stream_report_bytes = stream_report_bytes
        # Each plan is read, verified and parsed once for every upload checked against it.
        self.verified = cache.VerifiedPlans(store.get_blob, self.public_key)
        self.rounds = rounds_lib.Rounds(store, self.verified.folder)
        self.shards = shards_lib.ReportShards(self.rounds)  # plain rounds' reports
        self.secure = secure_lib.SecureRounds(self.rounds, self.verified.folder)
        self.sessions = sessions_lib.Sessions(store)  # buffered (FedBuff) sessions
        self.telemetry = telemetry_lib.Telemetry(store)  # /metrics, rates, request logs
        self.edges = edges_lib.Edges(self.rounds)  # edge aggregators: credentials, seats
        self.client_buckets = None if client_rate is None else ratelimit.Buckets(
            client_rate, "client")
        self.enroll_buckets = None if enroll_rate is None else ratelimit.Buckets(
            enroll_rate, "address")
        self.admin_buckets = None if admin_rate is None else ratelimit.Buckets(
            admin_rate, "address sending wrong admin tokens")

    def close(self) -> None:
        """Commits the reports waiting for the writer, and stops it."""
        self.shards.close()

    def close_due(self) -> None:
        """Closes the rounds, and the secure rounds' stages, whose time is up."""
        self.rounds.close_due()
        self.secure.close_due()

    def status(self, hashes: bool = True) -> dict[str, Any]:
        """What `GET /v1/status` shows: counters, populations, the latest rounds and
        sessions; without `hashes` (a caller without the admin token), the rounds'
        plan and broadcast hashes are left out (null)."""
        return {
            "server": {"version": VERSION, "public_key": plan_lib.b64(self.public_key)},
            "populations": self.store.populations(),
            "rounds": [
                r.to_json() if hashes else {**r.to_json(), "plan": None, "broadcast": None}
                for r in self.rounds.rounds()
            ],
            **totals(self.store.counters()),
            "sessions": [self.sessions.status(s) for s in self.sessions.sessions()],
        }


def totals(counters: dict[str, int]) -> dict[str, Any]:
    """The store's counters as `GET /v1/status` (and the overview) show them."""
    refused, admin_refused = metrics_lib.refusal_counts(counters)
    return {
        "enrollments": counters.get("enrollments", 0),
        "checkins": counters.get("checkins", 0),
        "assignments": counters.get("assignments", 0),
        "reports": {
            "accepted": counters.get("reports:accepted", 0),
            "refused": refused,
            "late": refused.get("late", 0),
        },
        "dropouts": counters.get("dropouts", 0),
        "rounds_closed": counters.get("rounds:closed", 0),
        "rounds_failed": counters.get("rounds:failed", 0),
        "admin_refused": admin_refused,
        "connections_refused": metrics_lib.connection_refusals(counters),
    }
