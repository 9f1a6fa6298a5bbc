"""At an edge: the rounds that mirror the root's, and the root's pinned key."""

from fedlang.deploy.plans import folding
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import upstream as upstream_lib


def test_a_mirrored_round_is_opened_once_and_forwarded_once(store, token, sum_round):
    upstream = upstream_lib.Upstream(rounds_lib.Rounds(store))
    empty = folding.Folder(sum_round[0]).empty()
    plan, broadcast = store.put_blob(b"edge-signed plan"), store.put_blob(b"broadcast")
    options = rounds_lib.CohortOptions(3, over_selection=1 / 3, quorum=1, deadline=60)
    first = upstream.open(7, "pop", plan, broadcast, options, empty)
    again = upstream.open(7, "pop", plan, broadcast, options, empty)  # a restarted edge
    assert first == again and (first.target, first.capacity) == (3, 4)
    assert [(m.upstream, m.round, m.forwarded) for m in upstream.mirrors()] == [(7, first.id, None)]
    upstream.forwarded(7, "accepted")
    assert upstream.mirrors(pending=True) == []
    assert upstream.mirrors()[0].outcome == "accepted"
    assert store.counters()["partials:accepted"] == 1


def test_the_root_s_key_is_pinned_on_first_contact(store):
    upstream = upstream_lib.Upstream(rounds_lib.Rounds(store))
    assert upstream.pinned_key(b"k" * 32) == b"k" * 32
    assert upstream.pinned_key(b"x" * 32) == b"k" * 32  # the first one stays
