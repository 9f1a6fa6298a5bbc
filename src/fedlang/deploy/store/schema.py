"""Every table of the task store, and how a database of an older schema is brought up to
date.

`TABLES` is the whole schema, in both dialects (`{blob}`, `{int}`, `{real}` are the
dialect's column types), at version `VERSION`; the version is kept in `meta` under
`schema`. Opening a database (`install`) creates what is missing, and first runs the
`MIGRATIONS` from the version it finds, all in the transaction that opens the store: a
database is at one version or the other, never between.

A new table or column is a new version: add its statement to `TABLES` (for new
databases) and to `MIGRATIONS[old version]` (for existing ones: a statement, or a
function of the transaction where SQL alone cannot say it), and test that a database of
the old version opens (tests/deploy/store/test_schema.py).
"""

from __future__ import annotations

from collections.abc import Callable

from fedlang.deploy.store import sql, values

VERSION = 14

BUFFERED_BATCHES = (
    "CREATE TABLE IF NOT EXISTS buffered_batches (session {int} NOT NULL, client TEXT NOT NULL,"
    " batch {int} NOT NULL, digest TEXT NOT NULL, size {int} NOT NULL,"
    " reports {int} NOT NULL, stale {int} NOT NULL, accepted {real} NOT NULL,"
    " PRIMARY KEY (session, client, batch))"
)
MIRRORS = (
    "CREATE TABLE IF NOT EXISTS mirrors (kind TEXT NOT NULL, upstream {int} NOT NULL,"
    " local {int} NOT NULL, uploads {int} NOT NULL DEFAULT 0,"
    " forwarded_through {int} NOT NULL DEFAULT 0, sending_through {int},"
    " outcome TEXT NOT NULL DEFAULT '', updated {real} NOT NULL, PRIMARY KEY (kind, upstream))"
)
BLOBS = (
    "CREATE TABLE IF NOT EXISTS blobs (hash TEXT PRIMARY KEY, size {int} NOT NULL,"
    " value TEXT NOT NULL, created {real} NOT NULL)"
)
AGGREGATES = (
    "CREATE TABLE IF NOT EXISTS aggregates (round {int} PRIMARY KEY, value TEXT NOT NULL,"
    " reports {int} NOT NULL)"
)
SHARDS = (
    "CREATE TABLE IF NOT EXISTS aggregate_shards (round {int} NOT NULL, shard TEXT NOT NULL,"
    " value TEXT NOT NULL, reports {int} NOT NULL, PRIMARY KEY (round, shard))"
)

STORED_REPORTS = (
    "CREATE TABLE IF NOT EXISTS stored_reports (round {int} NOT NULL, client TEXT NOT NULL,"
    " value TEXT NOT NULL, max_abs {real} NOT NULL, PRIMARY KEY (round, client))"
)

TABLES = [
    # What every mode shares (store.py).
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value {blob} NOT NULL)",
    # `token_enrollments`: clients enrolled with the current token; `max_enrollments`:
    # how many it may enroll (NULL: no cap).
    "CREATE TABLE IF NOT EXISTS populations (name TEXT PRIMARY KEY, token_hash TEXT NOT NULL,"
    " clients {int} NOT NULL DEFAULT 0, finished {int} NOT NULL DEFAULT 0, created {real} NOT NULL,"
    " token_enrollments {int} NOT NULL DEFAULT 0, max_enrollments {int})",
    "CREATE TABLE IF NOT EXISTS clients (id TEXT PRIMARY KEY, population TEXT NOT NULL,"
    " credential_hash TEXT NOT NULL UNIQUE, created {real} NOT NULL, expires {real} NOT NULL,"
    " last_seen {real} NOT NULL)",
    # Content-addressed blobs (store.py): their bytes are a value (`values`); `created`
    # is when one was last uploaded (uploading it again refreshes it).
    BLOBS,
    # Values of any size, in chunks (values.py): a blob's bytes, a round's aggregate.
    values.HEADS,
    values.CHUNKS,
    "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value {int} NOT NULL)",
    # Single-use enrollment tokens, one per device (store.py): hashes; `used` once spent.
    "CREATE TABLE IF NOT EXISTS device_tokens (hash TEXT PRIMARY KEY, population TEXT NOT NULL,"
    " created {real} NOT NULL, used {real})",
    # Every request made with the admin token that changes something (store.py, written
    # by server/guard.py): when, what, the answer's status, from where.
    "CREATE TABLE IF NOT EXISTS admin_audit (seq {int} PRIMARY KEY, at {real} NOT NULL,"
    " method TEXT NOT NULL, path TEXT NOT NULL, status {int} NOT NULL, remote TEXT NOT NULL)",
    # Rounds, plain and secure (rounds.py): one row each, the clients assigned, the
    # digests of accepted reports (a secure round's: one per client and stage), the
    # running aggregate.
    "CREATE TABLE IF NOT EXISTS rounds (id {int} PRIMARY KEY, population TEXT NOT NULL,"
    " kind TEXT NOT NULL, state TEXT NOT NULL, request_id TEXT UNIQUE, plan TEXT NOT NULL,"
    " broadcast TEXT NOT NULL, target {int} NOT NULL, capacity {int} NOT NULL,"
    " quorum {int} NOT NULL, deadline {real} NOT NULL, created {real} NOT NULL, closed {real},"
    " assigned {int} NOT NULL DEFAULT 0, reports {int} NOT NULL DEFAULT 0,"
    " late {int} NOT NULL DEFAULT 0, dropped {int} NOT NULL DEFAULT 0,"
    " refused {int} NOT NULL DEFAULT 0, failure TEXT NOT NULL DEFAULT '')",
    "CREATE INDEX IF NOT EXISTS rounds_by_state ON rounds (population, state)",
    # A client holds one seat of a round; an edge aggregator holds several (`seats`), for
    # its own clients, and gathers `target` of the round's reports (edges.py: how a
    # round's seats are split among its edges).
    "CREATE TABLE IF NOT EXISTS assignments (round {int} NOT NULL, client TEXT NOT NULL,"
    " state TEXT NOT NULL, assigned {real} NOT NULL, updated {real} NOT NULL,"
    " seats {int} NOT NULL DEFAULT 1, target {int} NOT NULL DEFAULT 1,"
    " PRIMARY KEY (round, client))",
    "CREATE INDEX IF NOT EXISTS assignments_by_client ON assignments (client, state)",
    # An upload stands for `count` reports (an edge's partial aggregate: its clients'),
    # and says how many of its holder's seats dropped out (`dropped`, counted at the close).
    "CREATE TABLE IF NOT EXISTS reports (round {int} NOT NULL, client TEXT NOT NULL,"
    " stage {int} NOT NULL DEFAULT 0, digest TEXT NOT NULL, size {int} NOT NULL,"
    " accepted {real} NOT NULL, count {int} NOT NULL DEFAULT 1,"
    " dropped {int} NOT NULL DEFAULT 0, PRIMARY KEY (round, client, stage))",
    # A round's aggregate (rounds.py): a value (`values`).
    AGGREGATES,
    # A plain round's reports folded in memory by each server process (shards.py): one
    # row per round and process (`shard`), its partial aggregate (a value: `values`)
    # and report count as of its last commit; merged into `aggregates` when the round
    # closes.
    SHARDS,
    # A large model's report (`folding.Folder.streamable`), stored as it arrived (a value)
    # until its round closes and folds it a slice at a time (shards.py, rounds.py); its
    # largest magnitude bounds the round's sum (`max_abs`). Counted in its shard's
    # `reports`, whose `value` is '' while it folded none in memory.
    STORED_REPORTS,
    # A round's count (`rounds._ROUND_FIELDS`) sums its shards' `reports` from this index.
    "CREATE INDEX IF NOT EXISTS aggregate_shards_reports ON aggregate_shards (round, reports)",
    # Secure rounds (secure.py): the SecAgg+ server state and each stage's requests.
    "CREATE TABLE IF NOT EXISTS secure_rounds (round {int} PRIMARY KEY, stage {int} NOT NULL,"
    " stage_timeout {real} NOT NULL, stage_deadline {real} NOT NULL,"
    " answered {int} NOT NULL DEFAULT 0, state {blob} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS secure_requests (round {int} NOT NULL, client TEXT NOT NULL,"
    " stage {int} NOT NULL, data {blob} NOT NULL, PRIMARY KEY (round, client, stage))",
    # Buffered (FedBuff) sessions (sessions.py): the sessions, their published versions,
    # the versions given to clients, and the accepted reports themselves.
    "CREATE TABLE IF NOT EXISTS buffered_sessions (id {int} PRIMARY KEY,"
    " population TEXT NOT NULL, state TEXT NOT NULL, request_id TEXT UNIQUE,"
    " plan TEXT NOT NULL, version {int} NOT NULL, weights TEXT NOT NULL,"
    " server_state TEXT NOT NULL DEFAULT '', buffer_size {int} NOT NULL,"
    " max_staleness {int} NOT NULL, applied_through {int} NOT NULL DEFAULT 0,"
    " reports {int} NOT NULL DEFAULT 0, refused_stale {int} NOT NULL DEFAULT 0,"
    " created {real} NOT NULL, updated {real} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS buffered_sessions_by_state ON buffered_sessions"
    " (population, state)",
    "CREATE TABLE IF NOT EXISTS buffered_versions (session {int} NOT NULL,"
    " version {int} NOT NULL, weights TEXT NOT NULL, server_state TEXT NOT NULL,"
    " through {int} NOT NULL, published {real} NOT NULL, PRIMARY KEY (session, version))",
    "CREATE TABLE IF NOT EXISTS buffered_tasks (session {int} NOT NULL, client TEXT NOT NULL,"
    " version {int} NOT NULL, state TEXT NOT NULL, assigned {real} NOT NULL,"
    " PRIMARY KEY (session, client, version))",
    # What an operator watches (metrics.py): the metrics the driver released per round
    # (or buffered session version), and each task's refused uploads by reason.
    "CREATE TABLE IF NOT EXISTS released_metrics (population TEXT NOT NULL, round {int} NOT NULL,"
    " kind TEXT NOT NULL, name TEXT NOT NULL, value {real} NOT NULL, released {real} NOT NULL,"
    " PRIMARY KEY (population, round, kind, name))",
    "CREATE INDEX IF NOT EXISTS released_metrics_by_time ON released_metrics"
    " (population, released)",
    "CREATE TABLE IF NOT EXISTS task_refusals (task TEXT NOT NULL, reason TEXT NOT NULL,"
    " count {int} NOT NULL, PRIMARY KEY (task, reason))",
    # Edge aggregators, at the root (edges.py): each edge's credential (a hash; revoked:
    # when). An edge's seats in a round are an assignment, its partial aggregate a report.
    "CREATE TABLE IF NOT EXISTS edges (name TEXT PRIMARY KEY, population TEXT NOT NULL,"
    " token_hash TEXT NOT NULL UNIQUE, created {real} NOT NULL, revoked {real})",
    # Uploads of several session reports at once (sessions.py, `accept_many`: an edge's
    # batches), numbered by their uploader: a replay is recognized by its digest.
    BUFFERED_BATCHES,
    # At an edge aggregator (mirrors.py): which local task mirrors which task of the root
    # (`kind`, `upstream`), the uploads the root took of it, the last report forwarded and
    # the last of the upload being sent, and how it ended ('' while it is mirrored).
    MIRRORS,
    "CREATE TABLE IF NOT EXISTS buffered_reports (session {int} NOT NULL, seq {int} NOT NULL,"
    " client TEXT NOT NULL, version {int} NOT NULL, staleness {int} NOT NULL,"
    " digest TEXT NOT NULL, size {int} NOT NULL, data {blob} NOT NULL, accepted {real} NOT NULL,"
    " applied {int}, PRIMARY KEY (session, seq), UNIQUE (session, client, version))",
]



def _values_in_chunks(tx: sql.Tx) -> None:
    """12 -> 13: the bytes of blobs (`blobs.data`), of rounds' aggregates
    (`aggregates.data`) and of their shards (`aggregate_shards.data`) become values in
    chunks (`values`), and their tables name them instead; one row at a time, so the
    largest is held once."""
    types = tx.dialect.types
    tx.run(values.HEADS.format(**types))
    tx.run(values.CHUNKS.format(**types))
    for table, made, key, columns in [("blobs", BLOBS, "hash", "size, created"),
                                      ("aggregates", AGGREGATES, "round", "reports")]:
        tx.run(f"ALTER TABLE {table} RENAME TO old_{table}")
        tx.run(made.format(**types))
        for (k,) in tx.all(f"SELECT {key} FROM old_{table}"):
            data = tx.one_binary(f"SELECT data FROM old_{table} WHERE {key} = ?", (k,))[0]
            value = values.write(tx, [data])
            tx.run(f"INSERT INTO {table} ({key}, {columns}, value) SELECT {key}, {columns}, ?"
                   f" FROM old_{table} WHERE {key} = ?", (value.id, k))
        tx.run(f"DROP TABLE old_{table}")
    # each process's shard of an open round (the index on it is remade afterwards; a
    # database from before version 7 has none: the table is made with the missing ones)
    if not tx.has_table("aggregate_shards"):
        return
    tx.run("DROP INDEX IF EXISTS aggregate_shards_reports")
    tx.run("ALTER TABLE aggregate_shards RENAME TO old_aggregate_shards")
    tx.run(SHARDS.format(**types))
    for round_id, shard in tx.all("SELECT round, shard FROM old_aggregate_shards"):
        data, reports = tx.one_binary("SELECT data, reports FROM old_aggregate_shards"
                                      " WHERE round = ? AND shard = ?", (round_id, shard))
        value = values.write(tx, [data])
        tx.run("INSERT INTO aggregate_shards (round, shard, value, reports) VALUES (?, ?, ?, ?)",
               (round_id, shard, value.id, reports))
    tx.run("DROP TABLE old_aggregate_shards")


# From each version to the next: the statements that bring a database of that version
# to the next one (both dialects), or a function that does (given the transaction). The
# tables `TABLES` adds are created afterwards.
MIGRATIONS: dict[int, list[str | Callable[[sql.Tx], None]]] = {
    # 1 -> 2: the buffered sessions' tables were named `async_*`.
    1: [
        "ALTER TABLE async_sessions RENAME TO buffered_sessions",
        "ALTER TABLE async_versions RENAME TO buffered_versions",
        "ALTER TABLE async_tasks RENAME TO buffered_tasks",
        "ALTER TABLE async_reports RENAME TO buffered_reports",
        "DROP INDEX IF EXISTS async_sessions_by_state",  # remade as buffered_sessions_by_state
    ],
    # 2 -> 3: enrollment tokens count their enrollments and may be capped.
    2: [
        "ALTER TABLE populations ADD COLUMN token_enrollments {int} NOT NULL DEFAULT 0",
        "ALTER TABLE populations ADD COLUMN max_enrollments {int}",
    ],
    # 3 -> 4: the admin_audit table, which `install` creates as it creates any missing table.
    3: [],
    # 4 -> 5: single-use device tokens (`device_tokens`, created as any missing table).
    4: [],
    # 5 -> 6: released metrics and refusals by task (`released_metrics`, `task_refusals`).
    5: [],
    # 6 -> 7: each server process's partial aggregates (`aggregate_shards`, created as
    # any missing table).
    6: [],
    # 7 -> 8: edge aggregators (`edges`, `edge_shares`, `upstream_rounds`, created as any
    # missing table).
    7: [],
    # 8 -> 9: (another branch's tables; the lead renumbers at merge).
    8: [],
    # 9 -> 10: buffered sessions through edges (`edge_batches`, `upstream_sessions`,
    # created as any missing table).
    9: [],
    # 10 -> 11: the index of the shards' report counts (`aggregate_shards_reports`,
    # created as any missing index).
    10: [],
    # 11 -> 12: an edge holds seats (issue 34). Its share of a round becomes an assignment
    # of `seats` and a `target` (`edge:NAME`), its forwarded partial a report standing for `count`
    # reports (its `dropped`, already added to an open round's row, is taken back out:
    # the close adds it); its batches become the sessions' `buffered_batches`; an edge's
    # `upstream_rounds` and `upstream_sessions` become `mirrors`. (The old tables are
    # made first when missing: a database older than version 8 never had them.)
    11: [
        "ALTER TABLE assignments ADD COLUMN seats {int} NOT NULL DEFAULT 1",
        "ALTER TABLE assignments ADD COLUMN target {int} NOT NULL DEFAULT 1",
        "ALTER TABLE reports ADD COLUMN count {int} NOT NULL DEFAULT 1",
        "ALTER TABLE reports ADD COLUMN dropped {int} NOT NULL DEFAULT 0",
        "CREATE TABLE IF NOT EXISTS edge_shares (round {int} NOT NULL, edge TEXT NOT NULL,"
        " state TEXT NOT NULL, target {int} NOT NULL, capacity {int} NOT NULL,"
        " joined {real} NOT NULL, digest TEXT, size {int}, reports {int} NOT NULL DEFAULT 0,"
        " dropped {int} NOT NULL DEFAULT 0, accepted {real}, PRIMARY KEY (round, edge))",
        "INSERT INTO assignments (round, client, state, assigned, updated, seats, target)"
        " SELECT round, 'edge:' || edge, state, joined, COALESCE(accepted, joined), capacity,"
        " target FROM edge_shares",
        "INSERT INTO reports (round, client, stage, digest, size, accepted, count, dropped)"
        " SELECT round, 'edge:' || edge, 0, digest, size, accepted, reports, dropped"
        " FROM edge_shares WHERE digest IS NOT NULL",
        "UPDATE rounds SET dropped = dropped - (SELECT COALESCE(SUM(e.dropped), 0)"
        " FROM edge_shares e WHERE e.round = rounds.id AND e.digest IS NOT NULL)"
        " WHERE state = 'open'",
        "DROP TABLE edge_shares",
        "CREATE TABLE IF NOT EXISTS edge_batches (session {int} NOT NULL, edge TEXT NOT NULL,"
        " batch {int} NOT NULL, digest TEXT NOT NULL, size {int} NOT NULL,"
        " reports {int} NOT NULL, stale {int} NOT NULL, accepted {real} NOT NULL,"
        " PRIMARY KEY (session, edge, batch))",
        BUFFERED_BATCHES,
        "INSERT INTO buffered_batches (session, client, batch, digest, size, reports, stale,"
        " accepted) SELECT session, 'edge:' || edge, batch, digest, size, reports, stale,"
        " accepted FROM edge_batches",
        "DROP TABLE edge_batches",
        "CREATE TABLE IF NOT EXISTS upstream_rounds (upstream {int} PRIMARY KEY,"
        " round {int} NOT NULL UNIQUE, forwarded {real}, outcome TEXT NOT NULL DEFAULT '')",
        "CREATE TABLE IF NOT EXISTS upstream_sessions (upstream {int} PRIMARY KEY,"
        " session {int} NOT NULL UNIQUE, batches {int} NOT NULL DEFAULT 0,"
        " forwarded_through {int} NOT NULL DEFAULT 0, sending_through {int},"
        " outcome TEXT NOT NULL DEFAULT '')",
        MIRRORS,
        "INSERT INTO mirrors (kind, upstream, local, uploads, outcome, updated)"
        " SELECT r.kind, u.upstream, u.round, CASE WHEN u.outcome = 'accepted' THEN 1 ELSE 0"
        " END, u.outcome, COALESCE(u.forwarded, r.created) FROM upstream_rounds u"
        " JOIN rounds r ON r.id = u.round",
        "INSERT INTO mirrors (kind, upstream, local, uploads, forwarded_through,"
        " sending_through, outcome, updated) SELECT 'buffered', u.upstream, u.session,"
        " u.batches, u.forwarded_through, u.sending_through, u.outcome, s.updated"
        " FROM upstream_sessions u JOIN buffered_sessions s ON s.id = u.session",
        "DROP TABLE upstream_rounds",
        "DROP TABLE upstream_sessions",
    ],
    # 12 -> 13: values in chunks (issue 40): no value is bound by a database's largest
    # cell. A SQLite database made before keeps its auto_vacuum mode (none): the pages
    # its old rows held are reused by later writes, the file does not shrink.
    12: [_values_in_chunks],
    # 13 -> 14: large models' reports stored until their round closes (`stored_reports`,
    # created as any missing table).
    13: [],
}


def install(tx: sql.Tx) -> int:
    """Brings the database of `tx` to the schema `VERSION`: creates a new database's
    tables, or migrates an older one; returns the version it found (`VERSION` for a new
    database).

    Raises:
      ValueError: the database is of a newer (or unknown) schema version.
    """
    types = tx.dialect.types
    tx.run(TABLES[0].format(**types))  # meta, which holds the version
    tx.run(
        "INSERT INTO meta (key, value) VALUES ('schema', ?) ON CONFLICT (key) DO NOTHING",
        (str(VERSION).encode(),),
    )
    stored = bytes(tx.one("SELECT value FROM meta WHERE key = 'schema'" + tx.dialect.lock_row)[0])
    found = int(stored) if stored.isdigit() else None
    if found is None or not 1 <= found <= VERSION:
        raise ValueError(
            f"Expected a task store of schema version {VERSION} (or older), found version "
            f"{stored.decode(errors='replace')}; use a fedlang of that version or a new database."
        )
    for version in range(found, VERSION):
        for step in MIGRATIONS[version]:
            if callable(step):
                step(tx)
            else:
                tx.run(step.format(**types))
    if found != VERSION:
        tx.run("UPDATE meta SET value = ? WHERE key = 'schema'", (str(VERSION).encode(),))
    for statement in TABLES[1:]:
        tx.run(statement.format(**types))
    return found
