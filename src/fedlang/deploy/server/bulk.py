"""Enrolling clients in bulk (admin): `POST /v1/admin/populations/{name}/clients:bulk`.

The answer is NDJSON (`protocol.NDJSON`), shown once: a first line
`{"population", "count", "expires", "public_key"}`, then one line
`{"client_id", "credential"}` per client. The store keeps only the credentials' hashes
(`store.bulk`). The clients are made in one transaction before the first byte is sent, so
a call either enrolled them all or none; an answer lost on the way is not sent again
(nothing can: the secrets are gone), and its clients, which never check in, can be
revoked. The answer is built from compact per-chunk byte strings (about 75 bytes a
client), never from one Python object per client.

Why each credential is random and sent, not derived from one seed sent instead (32
bytes for any count): the seed would be a secret worth every credential at once, to be
handed to each device (so any one device could act as all of them) or split by the
operator into per-device secrets anyway, which is this answer; and a server keeping it
would hold every credential in the clear.
"""

from __future__ import annotations

import json

import fastapi
from fastapi import responses

from fedlang.deploy import protocol
from fedlang.deploy.plans import round as plan_lib
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import routing, schemas
from fedlang.deploy.server.routing import State
from fedlang.deploy.store import bulk as bulk_lib

router = fastapi.APIRouter(prefix=protocol.API)


@router.post(
    "/admin/populations/{name}/clients:bulk", status_code=201, tags=["admin"],
    response_class=responses.Response,
    responses={201: {"content": {protocol.NDJSON: {"schema": {"type": "string"}}},
                     "description": "A header line, then one line per client (shown once)."}},
)
def enroll_bulk(
    name: routing.Population, body: schemas.BulkIn, auth: auth_lib.Bearer, server: State
) -> responses.Response:
    """Enrolls `count` clients of the population at once (at most 100,000 a call); the
    answer holds their credentials, shown only here."""
    auth_lib.admin(server, auth)
    lines: list[bytes] = []

    def emit(made: list[tuple[str, str]]) -> None:
        lines.append(b"".join(
            b'{"client_id":"%s","credential":"%s"}\n' % (i.encode(), c.encode()) for i, c in made
        ))

    expires = bulk_lib.enroll_bulk(server.store, name, body.count, server.credential_ttl, emit)
    head = {"population": name, "count": body.count, "expires": expires,
            "public_key": plan_lib.b64(server.public_key)}
    lines.insert(0, json.dumps(head).encode() + b"\n")
    return responses.Response(
        b"".join(lines), status_code=201, media_type=protocol.NDJSON,
        headers={"Cache-Control": "no-store"},
    )
