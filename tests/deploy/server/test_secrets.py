"""No secret is kept in the clear in the task store (issue 23, item 3): the database
holds the admin token, enrollment tokens, credentials (one by one or in bulk) and edges' tokens as SHA-256 hashes only, and the
plan-signing key lives in a key file (mode 0600) outside it. What someone with a copy of
the database can read is checked byte by byte, on a real `fedlang serve` process; a
database an older fedlang wrote (token and key in the clear) is cleaned when it opens."""

import base64
import contextlib
import json
import os
import sqlite3
import stat
import subprocess
import sys

import httpx
import pytest

from fedlang.core import signing
from fedlang.deploy.server import serve
from fedlang.deploy.store import store as store_lib

from ...cli._run import ENV
from .conftest import bearer

API = "/v1"


def _database_bytes(db):
    """Everything a backup of an SQLite database holds: the file and its write-ahead log."""
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*")
                    if not p.name.endswith((".key", ".lock")))


def test_a_copy_of_the_database_holds_no_secret(tmp_path, server_process):
    db = tmp_path / "server.db"
    server = server_process(db, admin_token="the-admin-token-0123456789").start()
    http = httpx.Client(base_url=server.url, timeout=30)
    admin = bearer(server.admin_token)
    token = http.post(f"{API}/admin/populations", json={"name": "pop"}, headers=admin).json()["token"]
    enrolled = http.post(f"{API}/populations/pop/enroll", headers=bearer(token)).json()
    rotated = http.post(f"{API}/admin/populations/pop/token", json={}, headers=admin).json()["token"]
    edge = http.post(f"{API}/admin/edges", json={"name": "east", "population": "pop"},
                     headers=admin).json()["token"]
    bulk = http.post(f"{API}/admin/populations/pop/clients:bulk", json={"count": 3},
                     headers=admin)
    assert bulk.status_code == 201, bulk.text
    many = [json.loads(line)["credential"] for line in bulk.text.splitlines()
            if "credential" in line]
    assert len(many) == 3
    http.close()
    key_file = server.key_file
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    private = key_file.read_bytes()
    assert base64.b64decode(enrolled["public_key"]) == signing.public_key_bytes(
        signing.load_private_key(private))
    server.kill()  # what is on disk now is what a backup holds
    data = _database_bytes(db)
    for secret in (server.admin_token, token, rotated, enrolled["credential"], edge, *many):
        assert secret.encode() not in data
    assert private not in data
    assert store_lib.secret_hash(enrolled["credential"]).encode() in data  # as a hash


def test_a_new_database_shows_its_admin_token_once(tmp_path, server_factory):
    first = server_factory(db=tmp_path / "s.db", key=None)  # the default key file: DB.key
    token = first.admin_token
    assert token and (tmp_path / "s.db.key").exists()
    assert stat.S_IMODE(os.stat(tmp_path / "s.db.key").st_mode) == 0o600
    first.stop()
    again = server_factory(db=tmp_path / "s.db", key=None)
    assert again.admin_token is None and again.public_key == first.public_key
    assert httpx.get(f"{again.url}{API}/admin/populations", headers=bearer(token)).status_code == 200
    again.stop()
    # --admin-token sets another: the old one stops working
    third = server_factory(db=tmp_path / "s.db", key=None, admin_token="a-new-admin-token")
    assert httpx.get(f"{third.url}{API}/admin/populations", headers=bearer(token)).status_code == 401
    assert httpx.get(f"{third.url}{API}/admin/populations",
                     headers=bearer("a-new-admin-token")).status_code == 200


def test_an_older_database_is_cleaned_of_its_clear_secrets(tmp_path, server_factory):
    db = tmp_path / "old.db"
    store_lib.Store(db).close()
    key = signing.private_key_bytes(signing.generate_key())
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:  # as fedlang before kept them
        conn.execute("INSERT INTO meta (key, value) VALUES ('admin_token', ?)", (b"old-token",))
        conn.execute("INSERT INTO meta (key, value) VALUES ('signing_key', ?)", (key,))
    server = server_factory(db=db, key=None)
    assert server.admin_token is None  # the old token stands, as a hash
    assert httpx.get(f"{server.url}{API}/admin/populations", headers=bearer("old-token")).status_code == 200
    assert server.public_key == signing.public_key_bytes(signing.load_private_key(key))
    assert (tmp_path / "old.db.key").read_bytes() == key
    server.stop()
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert sorted(r[0] for r in conn.execute("SELECT key FROM meta")) == [
            "admin_token_sha256", "schema"]
    assert key not in _database_bytes(db) and b"old-token" not in _database_bytes(db)


def test_a_key_file_that_disagrees_with_an_older_databases_key_is_refused(tmp_path):
    db = tmp_path / "old.db"
    store = store_lib.Store(db)
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("INSERT INTO meta (key, value) VALUES ('signing_key', ?)",
                     (signing.private_key_bytes(signing.generate_key()),))
    other = tmp_path / "other.key"
    other.write_bytes(signing.private_key_bytes(signing.generate_key()))
    with pytest.raises(ValueError, match="another key"):
        serve.load_key(other, store, db)
    assert store.get_meta("signing_key") is not None  # nothing lost
    store.close()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_postgresql_needs_a_key_file(db_url):
    out = subprocess.run(
        [sys.executable, "-m", "fedlang", "serve", "--db", db_url, "--port", "0"],
        capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 1 and "--key-file" in out.stderr, out.stderr
