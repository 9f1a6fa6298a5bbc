"""Enrolling clients in bulk (`store.bulk`), on SQLite and PostgreSQL."""

import pytest

from fedlang.deploy import protocol
from fedlang.deploy.store import bulk
from fedlang.deploy.store import store as store_lib


def test_each_credential_authenticates_and_only_its_hash_is_kept(store, token, monkeypatch):
    monkeypatch.setattr(bulk, "CHUNK", 7)  # several statements for 20 clients
    chunks = []
    expires = bulk.enroll_bulk(store, "pop", 20, 3600.0, chunks.append)
    made = [pair for chunk in chunks for pair in chunk]
    assert [len(c) for c in chunks] == [7, 7, 6]
    assert expires == store.clock() + 3600.0
    assert len({i for i, _ in made}) == len({c for _, c in made}) == 20
    for client_id, credential in made:
        assert store.authenticate(credential) == (client_id, "pop")
    with store.transaction() as tx:
        rows = tx.all("SELECT id, population, credential_hash, expires FROM clients")
    assert sorted(rows) == sorted(
        (i, "pop", store_lib.secret_hash(c), expires) for i, c in made
    )
    stored = repr(rows)
    assert not any(c in stored for _, c in made)  # no secret in the clear
    (pop,) = store.populations()
    assert (pop["clients"], pop["token_enrollments"]) == (20, 0)  # the token's cap is its own
    counters = store.counters()
    assert (counters["enrollments"], counters["enrollments:bulk"]) == (20, 20)


@pytest.mark.parametrize("count", [0, -1, bulk.MAX_BULK + 1, 2.0])
def test_a_count_outside_the_cap_is_refused_and_enrolls_nobody(store, token, count):
    with pytest.raises(ValueError, match=f"Expected 1 to {bulk.MAX_BULK} clients a call"):
        bulk.enroll_bulk(store, "pop", count, 3600.0, lambda made: None)
    assert store.populations()[0]["clients"] == 0


def test_an_unknown_population_is_refused(store):
    with pytest.raises(protocol.NotFound, match="create it first"):
        bulk.enroll_bulk(store, "nope", 3, 3600.0, lambda made: None)


def test_a_failed_call_enrolls_nobody(store, token):
    """All or none: a failure after some chunks were written rolls them all back."""

    seen = []

    def fail_on_second(made):
        seen.append(made)
        if len(seen) == 2:
            raise RuntimeError("the caller failed")

    with pytest.raises(RuntimeError):
        bulk.enroll_bulk(store, "pop", bulk.CHUNK + 1, 3600.0, fail_on_second)
    with store.transaction() as tx:
        assert tx.one("SELECT COUNT(*) FROM clients")[0] == 0
    assert store.populations()[0]["clients"] == 0
