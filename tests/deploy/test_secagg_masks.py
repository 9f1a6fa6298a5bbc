import doctest

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedlang.deploy.secagg import Segment, config, masks

SEED = bytes(range(32))


def _keystream_words(seed, index, count, width=8):
    nonce = index.to_bytes(8, "big") + bytes(8)
    raw = Cipher(algorithms.AES(seed), modes.CTR(nonce)).encryptor().update(bytes(width * count))
    return [int.from_bytes(raw[i : i + width], "little") for i in range(0, len(raw), width)]


def test_power_of_two_masks_are_the_low_bits_of_aes_ctr_words():
    for bits, width in [(1, 4), (20, 4), (32, 4), (33, 8), (63, 8), (64, 8)]:
        words = _keystream_words(SEED, 3, 50, width)
        got = masks.expand(SEED, 3, Segment(50, 2**bits))
        assert got.dtype == np.uint64
        assert got.tolist() == [w % 2**bits for w in words]


def test_other_moduli_use_exact_rejection_sampling():
    m = (1 << 63) - 25  # about half of the 64-bit words are rejected
    limit = (2**64 // m) * m
    words = _keystream_words(SEED, 0, 400)
    expected = [w % m for w in words if w < limit][:100]
    assert masks.expand(SEED, 0, Segment(100, m)).tolist() == expected
    assert len(expected) == 100  # the reference drew enough


def test_masks_are_deterministic_and_differ_by_seed_and_segment():
    s = Segment(1000, 1_000_003)
    a = masks.expand(SEED, 0, s)
    assert np.array_equal(a, masks.expand(SEED, 0, s))
    assert not np.array_equal(a, masks.expand(SEED, 1, s))
    assert not np.array_equal(a, masks.expand(bytes(32), 0, s))


def test_masks_are_uniform_modulo_a_small_modulus():
    counts = np.bincount(masks.expand(SEED, 0, Segment(70_000, 7)).astype(np.int64), minlength=7)
    # A fixed seed: deterministic; a biased PRG (e.g. 2**64 mod 7 != 0 without rejection)
    # would not move the counts this far, so check against a chi-square bound (6 dof).
    chi2 = (((counts - 10_000) ** 2) / 10_000).sum()
    assert counts.size == 7 and chi2 < 22.5  # p = 0.001


@pytest.mark.parametrize("modulus", [1, 2**16, 2**32, 2**40, 2**64, 12345, 2**63])
def test_accumulator_equals_adding_and_subtracting_expanded_masks(modulus):
    s = Segment(257, modulus)
    start = masks.reduce(np.arange(-128, 129), s, "x")
    expected = [int(v) for v in start]
    acc = masks.Accumulator(start.copy(), s)
    for i, sign in [(0, 1), (1, -1), (2, -1), (3, 1)]:
        acc.add(bytes([i]) * 32, 0, sign)
        mask = masks.expand(bytes([i]) * 32, 0, s)
        expected = [(e + sign * int(m)) % modulus for e, m in zip(expected, mask)]
    assert acc.result().tolist() == expected


def test_reduce_wraps_signed_and_unsigned_integers():
    x = np.array([-1, 0, 5, -(2**63)], np.int64)
    assert masks.reduce(x, Segment(4, 2**8), "x").tolist() == [255, 0, 5, 0]
    assert masks.reduce(x, Segment(4, 10), "x").tolist() == [9, 0, 5, (-(2**63)) % 10]
    u = np.array([2**64 - 1, 3], np.uint64)
    assert masks.reduce(u, Segment(2, 10), "x").tolist() == [(2**64 - 1) % 10, 3]
    assert masks.reduce(u, Segment(2, 2**64), "x").tolist() == [2**64 - 1, 3]
    assert masks.reduce(np.ones((2, 3), np.int8), Segment(6, 7), "x").shape == (6,)


def test_reduce_refuses_floats_and_wrong_sizes():
    with pytest.raises(TypeError, match="Expected integers for x, found an array of float32"):
        masks.reduce(np.ones(3, np.float32), Segment(3, 8), "x")
    with pytest.raises(ValueError, match="Expected 3 elements for x, found 4"):
        masks.reduce(np.ones(4, np.int32), Segment(3, 8), "x")


def test_segments_check_their_modulus():
    with pytest.raises(ValueError, match="up to 2\\*\\*64"):
        Segment(1, 2**65)
    with pytest.raises(ValueError, match="up to 2\\*\\*63"):
        Segment(1, 2**63 + 1)
    with pytest.raises(ValueError, match="modulus >= 1"):
        Segment(1, 0)
    with pytest.raises(ValueError, match="length >= 0"):
        Segment(-1, 2)
    with pytest.raises(config.SecAggError, match="below the modulus 10"):
        masks.check_residues(np.array([3, 10], np.uint64), Segment(2, 10), "y")


def test_defaults_and_bitwidth_modulus_match_the_documented_values():
    assert [config.default_degree(n) for n in (1, 2, 3, 10, 100, 1000, 10_000)] == [
        0,
        1,
        2,
        9,
        28,
        40,
        54,
    ]
    assert [config.default_threshold(k) for k in (0, 1, 2, 9, 28, 40)] == [1, 2, 2, 6, 15, 21]
    assert config.bitwidth_modulus(8, 1) == 2**8
    assert config.bitwidth_modulus(8, 100) == 2**15  # ceil(log2 100) = 7 extra bits
    assert config.bitwidth_modulus(8, 128) == 2**15


def test_docstring_examples_run():
    for module in (config, masks):
        assert doctest.testmod(module).failed == 0
