"""The JAX string encoding: fixed-width bytes, decoding, hashing, and the refusal."""

import numpy as np
import pytest

import fedlang as fl
from fedlang.backends.jax import strings


def test_encode_decode_round_trip_any_shape():
    values = np.array([["ab", "héllo"], ["", "日本"]])
    enc = strings.encode(values, max_len=6)
    assert enc.bytes.shape == (2, 2, 6) and enc.bytes.dtype == np.uint8
    assert enc.lengths.tolist() == [[2, 6], [0, 6]] and enc.truncated == 0
    assert strings.decode(enc.bytes, enc.lengths).tolist() == values.tolist()


def test_truncation_is_counted_and_keeps_whole_characters():
    enc = strings.encode(["ab", "héllo", "日本語"], max_len=4)
    assert enc.truncated == 2
    # 'é' is 2 bytes: 'hé' is 3 bytes, and 'l' fits; '日' is 3 bytes: only one fits.
    assert strings.decode(enc.bytes, enc.lengths).tolist() == ["ab", "hél", "日"]


def test_numbers_and_bad_widths_are_refused():
    with pytest.raises(TypeError, match="Expected strings"):
        strings.encode([1, 2], 4)
    with pytest.raises(ValueError, match="max_len"):
        strings.encode(["a"], 0)
    with pytest.raises(ValueError, match="UTF-8"):
        strings.decode(np.array([[0xFF, 0]], np.uint8), np.array([1]))


def test_hash_is_the_same_in_numpy_and_in_a_jax_computation():
    enc = strings.encode(["a", "b", "ab", "ba", "", "a"], max_len=4)

    @fl.jax_computation((np.uint8, [6, 4]), (np.int32, [6]))
    def hashed(b, n):
        return strings.hash_bytes(b, n, 7)

    with fl.runtime.reference_context():
        in_jax = np.asarray(hashed(enc.bytes, enc.lengths))
    in_numpy = strings.hash_bytes(enc.bytes, enc.lengths, 7)
    assert in_jax.tolist() == in_numpy.tolist()
    assert len(set(in_numpy[:5].tolist())) == 5 and in_numpy[0] == in_numpy[5]
    # Padding bytes past the length do not matter; the seed does.
    padded = enc.bytes.copy()
    padded[0, 3] = 9
    assert strings.hash_bytes(padded, enc.lengths, 7)[0] == in_numpy[0]
    assert strings.hash_bytes(enc.bytes, enc.lengths, 8)[0] != in_numpy[0]


def test_hash_bits_are_balanced():
    words = [f"word{i}" for i in range(4000)]
    enc = strings.encode(words, max_len=12)
    h = strings.hash_bytes(enc.bytes, enc.lengths, 0)
    bits = (h[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    assert np.all(np.abs(bits.mean(0) - 0.5) < 0.05)


def test_jax_computation_refuses_strings_with_how_to_encode():
    with pytest.raises(TypeError, match=r"strings.encode\(values, max_len\)"):

        @fl.jax_computation({"text": str, "n": np.int32})
        def f(x):
            return x["n"]

    @fl.jax_computation
    def poly(x):
        return x

    with pytest.raises(TypeError, match="JAX holds numbers only"):

        @fl.federated_computation(fl.type_at_clients(fl.SequenceType(str)))
        def g(ds):
            return fl.federated_map(poly, ds)
