"""What every mode of the task store shares (populations, clients, blobs, metadata), on
SQLite and on PostgreSQL (`db_url` runs each test on both)."""

import pytest

from fedlang.deploy import protocol
from fedlang.deploy.store import store as store_lib


def test_enrollment_needs_the_population_token_and_credentials_expire(store, token, clock):
    with pytest.raises(protocol.Unauthorized, match="enrollment token of population 'pop'"):
        store.enroll("pop", "wrong", 60.0)
    with pytest.raises(protocol.Unauthorized, match="no population named 'nope'"):
        store.enroll("nope", token, 60.0)
    client_id, credential, _ = store.enroll("pop", token, 60.0)
    assert store.authenticate(credential) == (client_id, "pop")
    with pytest.raises(protocol.Unauthorized, match="unknown one"):
        store.authenticate("not-a-credential")
    clock.now += 61
    with pytest.raises(protocol.Unauthorized, match="expired") as e:
        store.authenticate(credential)
    assert e.value.reason == "expired"
    assert store.populations()[0]["clients"] == 1
    with pytest.raises(protocol.Conflict, match="exists"):
        store.create_population("pop")


def test_blobs_are_content_addressed(store):
    h = store.put_blob(b"abc")
    assert h == protocol.blob_hash(b"abc") and store.put_blob(b"abc") == h
    assert store.get_blob(h) == b"abc" and store.has_blob(h)
    with pytest.raises(protocol.NotFound):
        store.get_blob("0" * 64)


def test_database_urls_are_checked(tmp_path):
    with pytest.raises(ValueError, match="Expected a database URL"):
        store_lib.Store("mysql://x/y")
