"""Values in chunks (store/values.py): written in a transaction or staged as they arrive,
read whole or in ranges a chunk at a time, checked on reading, on both databases."""

import hashlib
import os

import pytest

from fedlang.deploy.store import values

CHUNK = 1000  # small chunks: a few kB make a value of several


def write(store, data, chunk=CHUNK):
    with store.transaction(write=True) as tx:
        return values.write(tx, [data], chunk)


def rows(store, value_id):
    with store.transaction() as tx:
        return [int(n) for (n,) in tx.all(
            "SELECT idx FROM value_chunks WHERE value = ? ORDER BY idx", (value_id,))]


def read(store, value):
    with store.transaction() as tx:
        return values.read(tx, value)


def test_a_value_is_cut_in_chunks_and_read_back_whole(store):
    data = os.urandom(3500)
    value = write(store, data)
    assert (value.size, value.chunk, value.chunks) == (3500, CHUNK, 4)
    assert value.sha256 == hashlib.sha256(data).hexdigest()
    assert rows(store, value.id) == [0, 1, 2, 3]
    assert read(store, value) == data
    with store.transaction() as tx:
        assert values.head(tx, value.id) == value


def test_parts_of_any_size_make_the_same_chunks(store):
    data = os.urandom(5000)
    parts = [data[:1], data[1:999], data[999:2500], data[2500:2500], data[2500:]]
    with store.transaction(write=True) as tx:
        value = values.write(tx, parts, CHUNK)
        lengths = [len(tx.one_binary("SELECT data FROM value_chunks WHERE value = ? AND idx = ?",
                                     (value.id, i))[0]) for i in range(value.chunks)]
    assert lengths == [1000] * 5
    assert read(store, value) == data


def test_a_small_value_is_one_chunk_and_an_empty_one_none(store):
    small = write(store, b"abc", chunk=values.CHUNK)
    assert rows(store, small.id) == [0] and read(store, small) == b"abc"
    empty = write(store, b"")
    assert (empty.size, empty.chunks, rows(store, empty.id)) == (0, 0, [])
    assert read(store, empty) == b"" and list(values.chunks(store, empty)) == []


def test_every_range_reads_its_bytes_a_chunk_at_a_time(store):
    data = os.urandom(3500)
    value = write(store, data)
    for start in range(0, 3501, 250):
        for stop in range(start, 3501, 250):
            parts = list(values.chunks(store, value, start, stop))
            assert b"".join(parts) == data[start:stop], (start, stop)
            assert all(len(p) <= CHUNK for p in parts)
    assert b"".join(values.chunks(store, value, 999, 1001)) == data[999:1001]  # across chunks
    with pytest.raises(ValueError, match="within 0:3500"):
        list(values.chunks(store, value, 10, 3501))


def test_a_deleted_value_leaves_no_row(store):
    value = write(store, os.urandom(2500))
    with store.transaction(write=True) as tx:
        values.delete(tx, value.id)
        assert values.head(tx, value.id) is None
    assert rows(store, value.id) == []


@pytest.mark.parametrize("damage", [
    ("UPDATE value_chunks SET data = ? WHERE value = ? AND idx = 1", (b"short",)),  # cut
    ("DELETE FROM value_chunks WHERE value = ? AND idx = 1", ()),  # lost
])
def test_a_chunk_of_another_length_is_an_error_never_bytes_passed_on(store, damage):
    data = os.urandom(2500)
    value = write(store, data)
    query, params = damage
    with store.transaction(write=True) as tx:
        tx.run(query, (*params, value.id))
    with pytest.raises(values.DamagedValue, match=r"chunk 1 .* 1000 bytes"):
        read(store, value)
    with pytest.raises(values.DamagedValue):
        b"".join(values.chunks(store, value, 500, 1500))


def test_a_changed_byte_stops_a_whole_read_before_its_last_chunk(store):
    data = os.urandom(2500)
    value = write(store, data)
    with store.transaction(write=True) as tx:  # same length, other bytes
        tx.run("UPDATE value_chunks SET data = ? WHERE value = ? AND idx = 0",
               (bytes(1000), value.id))
    with pytest.raises(values.DamagedValue, match="SHA-256"):
        read(store, value)
    given = []
    with pytest.raises(values.DamagedValue, match="SHA-256"):
        for part in values.chunks(store, value):
            given.append(part)
    assert len(given) == value.chunks - 1  # the last one is never handed out
    # a range is checked for lengths only: its reader checks the whole it assembles
    assert b"".join(values.chunks(store, value, 1000, 2500)) == data[1000:]


def test_a_staged_value_is_invisible_until_finished_with_its_row(store):
    data = os.urandom(3500)
    staging = values.Staging(store, CHUNK)
    for i in range(0, len(data), 700):
        staging.write(data[i : i + 700])
    assert rows(store, staging.id) == [0, 1, 2]  # each full chunk written, in its own transaction
    with store.transaction() as tx:
        assert values.head(tx, staging.id) is None
    with store.transaction(write=True) as tx:
        value = staging.finish(tx)
    assert (value.size, value.sha256) == (3500, hashlib.sha256(data).hexdigest())
    assert rows(store, value.id) == [0, 1, 2, 3] and read(store, value) == data
    staging.discard()  # once finished, nothing of it is discarded
    assert read(store, value) == data


def test_a_staged_value_discarded_or_abandoned_leaves_nothing(store, clock):
    cut = values.Staging(store, CHUNK)
    cut.write(os.urandom(2500))
    cut.discard()
    assert rows(store, cut.id) == []
    # a process killed during an upload: its staged chunks wait for the sweep
    abandoned, live = values.Staging(store, CHUNK), values.Staging(store, CHUNK)
    abandoned.write(os.urandom(2500))
    with pytest.raises(RuntimeError), store.transaction(write=True) as tx:
        abandoned.finish(tx)
        raise RuntimeError("the transaction that would have named it fails")
    clock.now += 100
    live.write(os.urandom(1500))
    assert values.sweep_staged(store, before=clock.now - 50) == 1
    assert rows(store, abandoned.id) == [] and rows(store, live.id) == [0]
    with store.transaction() as tx:
        assert tx.one("SELECT COUNT(*) FROM value_heads WHERE id = ?", (abandoned.id,))[0] == 0


def test_a_staged_value_swept_while_stalled_is_never_finished_half(store, clock):
    staging = values.Staging(store, CHUNK)
    staging.write(os.urandom(1500))  # one chunk written, then nothing for a while
    clock.now += 100
    assert values.sweep_staged(store, before=clock.now - 50) == 1
    with pytest.raises(values.Swept, match="found them swept"):
        staging.write(os.urandom(1000))
    with pytest.raises(values.Swept), store.transaction(write=True) as tx:
        staging.finish(tx)
    assert rows(store, staging.id) == []


@pytest.mark.slow
def test_a_value_larger_than_the_database_s_largest_cell_round_trips(store):
    # SQLite keeps at most 10^9 bytes in a cell, PostgreSQL's bytea 1 GB
    data = os.urandom(1 << 20) * 1000 + os.urandom(12345)  # 1,048,588,345 bytes
    value = write(store, data, chunk=values.CHUNK)
    assert value.size == len(data) > 10**9
    digest = hashlib.sha256()
    for part in values.chunks(store, value):
        digest.update(part)
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest() == value.sha256
    assert b"".join(values.chunks(store, value, len(data) - 5)) == data[-5:]
