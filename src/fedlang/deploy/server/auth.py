"""Who is asking: the admin token, client credentials and edge tokens, from a bearer
header.

Every route that needs a caller names it here (`admin`, `client`, `edge`; an upload's
`Uploader`), so a change to how callers prove who they are (issue 23: before any body
is read) is made once.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from typing import Annotated, TypeVar

import fastapi
from fastapi import security
from starlette.types import Scope

from fedlang.deploy import protocol
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.store import edges as edges_lib
from fedlang.deploy.store import store as store_lib

T = TypeVar("T")


class Credentials(security.HTTPAuthorizationCredentials):
    """A request's bearer token, and the address it came from (the admin token's
    per-address limit counts wrong tokens by it)."""

    address: str = ""


class _Bearer(security.HTTPBearer):
    """FastAPI's bearer scheme (in the OpenAPI schema as such), keeping the address."""

    async def __call__(self, request: fastapi.Request) -> Credentials | None:  # type: ignore[override]
        found = await super().__call__(request)
        if found is None:
            return None
        return Credentials(scheme=found.scheme, credentials=found.credentials,
                           address=address(request.scope))


_bearer = _Bearer(auto_error=False, description="A bearer token.")
Bearer = Annotated[Credentials | None, fastapi.Depends(_bearer)]


def address(scope: Scope) -> str:
    """The address a request came from (behind a trusted proxy, the one the proxy
    names: uvicorn's `--forwarded-allow-ips`); "" when unknown."""
    client = scope.get("client")
    return str(client[0]) if client else ""


def token(auth: security.HTTPAuthorizationCredentials | None, what: str) -> str:
    """The bearer token of a request.

    Raises:
      Unauthorized: there is none (`what` says what was expected).
    """
    if auth is None or not auth.credentials:
        raise protocol.Unauthorized(
            f"Expected an 'Authorization: Bearer ...' header with {what}, found none."
        )
    return auth.credentials


def admin(server: state_lib.ServerState, auth: security.HTTPAuthorizationCredentials | None) -> None:
    """Checks the server's admin token.

    Raises:
      Unauthorized: no token, or another one.
      RateLimited: the request's address sent wrong admin tokens too often.
    """
    _check_admin(server, token(auth, "the server's admin token"),
                 auth.address if isinstance(auth, Credentials) else "")


def is_admin(
    server: state_lib.ServerState, auth: security.HTTPAuthorizationCredentials | None
) -> bool:
    """Whether the request carries the admin token (routes that answer others too)."""
    try:
        admin(server, auth)
    except protocol.Unauthorized:
        return False
    return True


def admin_header(server: state_lib.ServerState, authorization: str | None, remote: str) -> None:
    """`admin` for a raw `Authorization` header from address `remote`, read before the
    request's body (`guard.Guard`).

    Raises:
      Unauthorized: no bearer token, or another one.
      RateLimited: `remote` sent wrong admin tokens too often.
    """
    scheme, _, credentials = (authorization or "").partition(" ")
    given = credentials.strip() if scheme.lower() == "bearer" else ""
    if not given:
        raise protocol.Unauthorized(
            "Expected an 'Authorization: Bearer ...' header with the server's admin token, "
            "found none."
        )
    _check_admin(server, given, remote)


def _check_admin(server: state_lib.ServerState, given: str, remote: str) -> None:
    """The one comparison with the admin token, for every route that takes it: an
    address out of wrong guesses (`ServerState.admin_buckets`) is refused before its
    token is looked at, and a wrong token takes one guess."""
    buckets = server.admin_buckets
    if buckets is not None:
        seconds = buckets.wait(remote)
        if seconds > 0:
            raise buckets.refuse(remote, seconds)
    if not secrets.compare_digest(store_lib.secret_hash(given), server.admin_token_hash):
        if buckets is not None:
            buckets.take(remote)
        raise protocol.Unauthorized(
            "Expected the server's admin token, found another token; it is printed when "
            "the server starts (or set with --admin-token)."
        )


def client(
    server: state_lib.ServerState, auth: security.HTTPAuthorizationCredentials | None
) -> tuple[str, str]:
    """(client id, population) of the client credential of a request, within the
    client's rate limit (`ratelimit`); a refusal is counted (`refused:unauthorized`,
    `refused:expired`, `refused:rate_limited`).

    Raises:
      Unauthorized: no credential, or an unknown or expired one.
      RateLimited: the client made more requests than its rate limit allows.
    """
    try:
        client_id, population = server.store.authenticate(token(auth, "a client credential"))
        if server.client_buckets is not None:
            server.client_buckets.check(client_id)
    except (protocol.Unauthorized, protocol.RateLimited) as e:
        server.store.count_refusal(e.reason)
        raise
    return client_id, population


@dataclasses.dataclass(frozen=True)
class Uploader:
    """Who uploads: a client, which holds one seat of a task, or an edge aggregator,
    which holds seats for its own clients (`holds_seats`): its upload stands for their
    reports (a round's partial aggregate, a session's batch).

    Attributes:
      id: the holder of the seats: a client's id, or `edge:NAME` (`store.edges.holder`).
      population: the population it belongs to.
      holds_seats: whether it is an edge.
    """

    id: str
    population: str
    holds_seats: bool = False


def uploader(
    server: state_lib.ServerState, auth: security.HTTPAuthorizationCredentials | None
) -> Uploader:
    """The client of a request, as an uploader (`client`)."""
    return Uploader(*client(server, auth))


def edge(
    server: state_lib.ServerState, auth: security.HTTPAuthorizationCredentials | None
) -> Uploader:
    """The edge aggregator of the edge token of a request; a refusal is counted
    (`refused:unauthorized`), as a client's.

    Raises:
      Unauthorized: no token, or an unknown or revoked one.
    """
    try:
        name, population = server.edges.authenticate(token(auth, "an edge token"))
    except protocol.Unauthorized as e:
        server.store.count_refusal(e.reason)
        raise
    return Uploader(edges_lib.holder(name), population, holds_seats=True)


def edge_name(who: Uploader) -> str:
    """The name of the edge `who` is."""
    return who.id.removeprefix(edges_lib.HOLDER)


def enrollment(server: state_lib.ServerState, address: str, attempt: Callable[[], T]) -> T:
    """`attempt()` (an enrollment) from `address`, within the address's limit on failed
    attempts: refused at once (429, counted) when the address has none left; a failure
    takes one.

    Raises:
      RateLimited: `address` failed to enroll too often.
      Unauthorized, NotFound: what `attempt` raises for a wrong token or an unknown
        population (taking one attempt).
    """
    buckets = server.enroll_buckets
    if buckets is None:
        return attempt()
    seconds = buckets.wait(address)
    if seconds > 0:
        server.store.count_refusal(protocol.RateLimited.reason)
        raise buckets.refuse(address, seconds)
    try:
        return attempt()
    except (protocol.Unauthorized, protocol.NotFound):  # a wrong token, or population
        buckets.take(address)
        raise
