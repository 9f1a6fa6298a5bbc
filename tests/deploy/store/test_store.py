"""What every mode of the task store shares (populations, clients, blobs, metadata), on
SQLite and on PostgreSQL (`db_url` runs each test on both)."""

import os

import pytest

from fedlang.deploy import protocol
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import sessions as sessions_lib
from fedlang.deploy.store import store as store_lib
from fedlang.deploy.store import values


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


def chunk_rows(store):
    with store.transaction() as tx:
        return tx.one("SELECT COUNT(*) FROM value_chunks")[0], tx.one(
            "SELECT COUNT(*) FROM value_heads")[0]


def test_a_blob_of_several_chunks_is_stored_as_it_arrives_and_read_in_ranges(store):
    data = os.urandom(2 * values.CHUNK + 12345)
    parts = (data[i : i + 100_000] for i in range(0, len(data), 100_000))
    h, size = store.put_blob_stream(parts, size=len(data))
    assert (h, size) == (protocol.blob_hash(data), len(data))
    assert store.get_blob(h) == data and chunk_rows(store) == (3, 1)
    value = store.open_blob(h)
    assert (value.size, value.sha256) == (len(data), h)
    start = values.CHUNK - 10
    assert b"".join(values.chunks(store, value, start)) == data[start:]
    assert store.put_blob_stream([data]) == (h, len(data))  # stored again: nothing new
    assert chunk_rows(store) == (3, 1)
    with pytest.raises(protocol.NotFound, match="stored blob"):
        store.open_blob("0" * 64)


def test_a_blob_is_invisible_until_it_arrived_whole_and_a_cut_one_leaves_nothing(store):
    data = os.urandom(values.CHUNK + 10)
    h = protocol.blob_hash(data)
    writer = store.blob_writer(len(data))
    writer.write(data[:-7])
    assert chunk_rows(store) == (1, 1)  # its first chunk, staged ...
    assert not store.has_blob(h)  # ... and no blob yet
    writer.write(data[-7:])
    assert writer.commit() == h and store.get_blob(h) == data

    def cut():
        yield data[:values.CHUNK]
        yield data[values.CHUNK:]
        raise ConnectionError("the upload was cut off")

    other = os.urandom(2 * values.CHUNK)
    with pytest.raises(ConnectionError):
        store.put_blob_stream(cut())
    with pytest.raises(protocol.BadRequest, match=f"blob of {len(other) + 1} bytes, found"):
        store.put_blob_stream([other], size=len(other) + 1)
    with pytest.raises(protocol.BadRequest, match=f"blob of {len(other) - 1} bytes, found more"):
        store.put_blob_stream([other], size=len(other) - 1)
    assert chunk_rows(store) == (2, 1)  # the first blob's only


def test_an_upload_stalled_past_the_sweep_is_refused_never_stored_half(store, clock):
    writer = store.blob_writer()
    writer.write(os.urandom(values.CHUNK + 5))
    clock.now += store.staged_grace + 1
    assert store.sweep_values() == 1
    with pytest.raises(protocol.Timeout, match="send it again"):
        writer.commit()
    assert chunk_rows(store) == (0, 0)


def test_blobs_no_task_needs_are_swept_once_their_grace_ended(store, clock):
    # arrange: a round's plan and broadcast, a session's plan and weights, a blob nothing names
    rounds = rounds_lib.Rounds(store)
    store.create_population("pop")
    plan, broadcast, loose = (store.put_blob(b) for b in (b"plan", b"broadcast", b"loose"))
    r = rounds.create("pop", plan, broadcast, rounds_lib.CohortOptions(1), b"")
    weights = store.put_blob(b"weights")
    sessions = sessions_lib.Sessions(store)
    s = sessions.create("pop", plan, weights, version=0, buffer_size=2, max_staleness=1)
    # act, assert: kept for the grace after their last upload, and while a task names them
    clock.now += store.blob_grace - 1
    store.put_blob(b"loose")  # uploaded again: refreshed
    clock.now += 2
    assert store.sweep_values() == 0  # the tasks are open; the loose blob refreshed
    clock.now += store.blob_grace
    assert store.sweep_values() == 1 and not store.has_blob(loose)
    rounds.stop(r.id, "stopped by the test")
    assert store.sweep_values() == 1 and not store.has_blob(broadcast)  # the plan: the session's
    sessions.close(s.id)
    assert store.sweep_values() == 2
    assert not any(store.has_blob(h) for h in (plan, broadcast, weights))
    assert chunk_rows(store) == (0, 1)  # the round's aggregate only (empty: no chunk)


def test_database_urls_are_checked(tmp_path):
    with pytest.raises(ValueError, match="Expected a database URL"):
        store_lib.Store("mysql://x/y")


def test_an_enrollment_token_is_capped_rotated_and_refusals_are_counted(store):
    token = store.create_population("capped", max_enrollments=2)
    store.enroll("capped", token, 60.0)
    store.enroll("capped", token, 60.0)
    with pytest.raises(protocol.Forbidden, match="enrolled its 2 clients") as e:
        store.enroll("capped", token, 60.0)
    assert e.value.reason == "enrollment_cap"
    with pytest.raises(protocol.Unauthorized):
        store.enroll("capped", "wrong", 60.0)
    # refusals are counted even though the transaction that counts them refuses
    assert store.counters()["refused:enrollment_cap"] == 1
    assert store.counters()["refused:enrollment"] == 1
    (pop,) = store.populations()
    assert (pop["clients"], pop["token_enrollments"], pop["max_enrollments"]) == (2, 2, 2)
    new = store.rotate_token("capped", max_enrollments=1)
    with pytest.raises(protocol.Unauthorized, match="found a wrong or used one"):
        store.enroll("capped", token, 60.0)  # the old token enrolls no more
    store.enroll("capped", new, 60.0)
    with pytest.raises(protocol.Forbidden):
        store.enroll("capped", new, 60.0)
    assert store.populations()[0]["clients"] == 3
    with pytest.raises(protocol.NotFound):
        store.rotate_token("nope")


def test_a_revoked_client_is_refused_at_once(store, token):
    client_id, credential, _ = store.enroll("pop", token, 60.0)
    other, other_credential, _ = store.enroll("pop", token, 60.0)
    assert store.revoke_client(client_id) == "pop"
    with pytest.raises(protocol.Unauthorized, match="unknown one"):
        store.authenticate(credential)
    assert store.authenticate(other_credential) == (other, "pop")
    assert store.populations()[0]["clients"] == 1
    with pytest.raises(protocol.NotFound, match="enrolled client"):
        store.revoke_client(client_id)


def test_a_device_token_enrolls_one_client_of_its_population_once(store, token):
    store.create_population("other")
    first, second = store.device_tokens("pop", 2)
    client_id, credential, _ = store.enroll("pop", first, 60.0)
    assert store.authenticate(credential) == (client_id, "pop")
    with pytest.raises(protocol.Unauthorized, match="wrong or used one"):
        store.enroll("pop", first, 60.0)  # spent
    with pytest.raises(protocol.Unauthorized):
        store.enroll("other", second, 60.0)  # another population's
    store.enroll("pop", second, 60.0)
    (pop,) = [p for p in store.populations() if p["name"] == "pop"]
    assert (pop["clients"], pop["token_enrollments"]) == (2, 0)  # not the shared token's
    assert store.counters()["refused:enrollment"] == 2
    with pytest.raises(protocol.NotFound):
        store.device_tokens("nope", 1)
    with pytest.raises(ValueError, match="1 to 1000"):
        store.device_tokens("pop", 0)


def test_reads_in_a_reading_block_share_one_transaction_until_the_thread_writes(store, token):
    client_id, credential, _ = store.enroll("pop", token, 60.0)
    seen: list[bool] = []
    store.on_transaction = lambda write, seconds: seen.append(write)
    with store.reading():
        with store.transaction() as first, store.transaction() as second:
            assert first is second
        assert store.authenticate(credential) == (client_id, "pop")
        assert seen == []  # nothing ended yet: one transaction holds the reads so far
        store.revoke_client(client_id)  # a write is its own transaction ...
        with pytest.raises(protocol.Unauthorized, match="unknown one"):
            store.authenticate(credential)  # ... and the reads after it see it
    assert seen == [True, False, False]  # the write, the later read, the block's reads


def test_a_read_on_postgresql_is_statements_without_a_transaction_and_cannot_write(store):
    store.put_blob(b"abc")
    with store.transaction() as tx:
        assert tx.one("SELECT COUNT(*) FROM blobs")[0] == 1
        if store.dialect.name == "postgresql":  # READ COMMITTED: no BEGIN/COMMIT needed
            assert tx.read_only and tx.conn.info.transaction_status.name == "IDLE"
            with pytest.raises(RuntimeError, match="found a write"):
                tx.run("DELETE FROM blobs")
    assert store.has_blob(protocol.blob_hash(b"abc"))
