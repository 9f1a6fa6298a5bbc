"""The verified-plan cache the server and the clients share: a plan is read, verified and
parsed once, and only a plan signed with the pinned key is ever returned."""

import pytest

from fedlang.core import signing
from fedlang.deploy.plans import cache, folding


@pytest.fixture
def signed(sum_round):
    """(key, the bytes of the round plan signed with it, by a name)."""
    key = signing.generate_key()
    plan = sum_round[0].to_bytes()
    return key, {"a": signing.sign(plan, key), "b": signing.sign(plan + b" ", key)}


class Reads:
    def __init__(self, blobs):
        self.blobs, self.count = blobs, 0

    def __call__(self, h):
        self.count += 1
        return self.blobs[h]


def test_a_plan_is_read_and_verified_once(signed, sum_round):
    key, blobs = signed
    reads = Reads(blobs)
    plans = cache.VerifiedPlans(reads, signing.public_key_bytes(key))
    first = plans.folder("a")
    assert isinstance(first, folding.Folder)
    assert first.report_type == sum_round[0].report_type
    assert plans.folder("a") is first and reads.count == 1
    assert plans.round("a").report_type == sum_round[0].report_type  # another view: read again
    assert reads.count == 2


def test_the_least_recently_used_plan_goes_first(signed):
    key, blobs = signed
    reads = Reads(blobs)
    plans = cache.VerifiedPlans(reads, key.public_key(), size=1)
    plans.round("a")
    plans.round("a")
    plans.round("b")
    plans.round("a")
    assert reads.count == 3


def test_a_plan_signed_with_another_key_is_refused_and_not_kept(signed):
    _, blobs = signed
    reads = Reads(blobs)
    plans = cache.VerifiedPlans(reads, signing.generate_key().public_key())
    for _ in range(2):
        with pytest.raises(signing.SignatureError):
            plans.round("a")
    assert reads.count == 2
