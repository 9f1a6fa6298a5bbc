import itertools
import random

import pytest

from fedlang.deploy.secagg import shamir


def _is_probable_prime(n, rounds=40):
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    rng = random.Random(0)
    for _ in range(rounds):
        x = pow(rng.randrange(2, n - 1), d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def test_the_field_is_a_prime_above_every_32_byte_secret():
    assert shamir.PRIME > 2**256
    assert _is_probable_prime(shamir.PRIME)
    assert not any(_is_probable_prime(2**256 + i) for i in range(1, 297, 2))  # the smallest


def test_any_threshold_shares_rebuild_the_secret():
    secret = random.Random(1).getrandbits(256)
    xs = [3, 5, 8, 13, 21]
    ys = shamir.share(secret, xs, threshold=3)
    for subset in itertools.combinations(zip(xs, ys), 3):
        assert shamir.reconstruct(list(subset), threshold=3) == secret
    assert shamir.reconstruct(list(zip(xs, ys)), threshold=3) == secret


def _evaluate(points, x):
    # Lagrange interpolation through `points`, evaluated at x (mod p).
    p, total = shamir.PRIME, 0
    for i, (xi, yi) in enumerate(points):
        term = yi
        for j, (xj, _) in enumerate(points):
            if j != i:
                term = term * (x - xj) * pow(xi - xj, -1, p) % p
        total += term
    return total % p


def test_fewer_than_threshold_shares_fit_every_secret():
    # Two shares of a threshold-3 sharing: for every candidate secret there is a polynomial
    # of degree 2 through them and (0, candidate), so they say nothing about the secret.
    xs = [1, 2, 3]
    ys = shamir.share(42, xs, threshold=3)
    for candidate in (0, 42, 2**255, shamir.PRIME - 1):
        y3 = _evaluate([(0, candidate), (1, ys[0]), (2, ys[1])], 3)
        assert shamir.reconstruct([(1, ys[0]), (2, ys[1]), (3, y3)], threshold=3) == candidate
    assert shamir.share(42, xs, threshold=3) != ys  # fresh randomness each time


def test_a_wrong_share_is_detected_when_a_spare_exists():
    xs = [1, 2, 3, 4]
    ys = shamir.share(7, xs, threshold=3)
    ys[1] = (ys[1] + 1) % shamir.PRIME
    with pytest.raises(ValueError, match="inconsistent shares"):
        shamir.reconstruct(list(zip(xs, ys)), threshold=3)


def test_bad_arguments_are_refused_with_clear_messages():
    with pytest.raises(ValueError, match="at least 3 shares"):
        shamir.reconstruct([(1, 1), (2, 2)], threshold=3)
    with pytest.raises(ValueError, match="distinct holder indices"):
        shamir.share(1, [1, 1, 2], threshold=2)
    with pytest.raises(ValueError, match="distinct holder indices"):
        shamir.share(1, [0, 1], threshold=2)
    with pytest.raises(ValueError, match="threshold between 1 and the 2 holders"):
        shamir.share(1, [1, 2], threshold=3)
    with pytest.raises(ValueError, match="secret in"):
        shamir.share(shamir.PRIME, [1], threshold=1)
    with pytest.raises(ValueError, match="33-byte share"):
        shamir.decode(b"\x00" * 32)
    with pytest.raises(ValueError, match="above the prime"):
        shamir.decode(b"\xff" * 33)
    assert shamir.decode(shamir.encode(shamir.PRIME - 1)) == shamir.PRIME - 1
