"""The cryptographic primitives of the protocol, all from the `cryptography` package.

- Key agreement: X25519. Each client has two key pairs per round: `c` (its shares are
  encrypted under keys agreed with it) and `s` (its pairwise masks are seeded by keys
  agreed with it).
- Key derivation: HKDF-SHA256 of the X25519 shared secret, with an `info` naming the
  purpose and the round, so a share key never equals a mask seed and no key is reused
  across rounds.
- Share encryption: AES-256-GCM with a random 96-bit nonce; the associated data binds
  the round, the sender, the receiver and the receiver's Shamir index, so a share that
  is replayed, or forwarded to the wrong client, fails authentication.
"""

from __future__ import annotations

import functools
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedlang.deploy.secagg import config

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
SHARE_KEY_INFO = b"fedlang-secagg/1/share-key"
PAIR_SEED_INFO = b"fedlang-secagg/1/pairwise-mask-seed"
_SHARE_AD = b"fedlang-secagg/1/share"


def generate_private_key() -> x25519.X25519PrivateKey:
    return x25519.X25519PrivateKey.generate()


def public_bytes(key: x25519.X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def private_bytes(key: x25519.X25519PrivateKey) -> bytes:
    return key.private_bytes_raw()


def private_from_bytes(data: bytes) -> x25519.X25519PrivateKey:
    return x25519.X25519PrivateKey.from_private_bytes(data)


def check_public_key(data: bytes, what: str) -> None:
    """Rejects a public key that is not 32 bytes or that X25519 refuses (a low-order point).

    Raises:
      SecAggError: naming `what`.
    """
    if len(data) != KEY_BYTES:
        raise config.SecAggError(
            f"Expected a {KEY_BYTES}-byte X25519 key for {what}, found {len(data)} bytes."
        )
    try:
        _probe().exchange(x25519.X25519PublicKey.from_public_bytes(data))
    except ValueError as e:
        raise config.SecAggError(
            f"Expected a valid X25519 public key for {what}, found a low-order point ({e})."
        ) from None


def agree(
    private: x25519.X25519PrivateKey, peer_public: bytes, info: bytes, round_id: bytes
) -> bytes:
    """A 32-byte key: HKDF-SHA256(X25519(private, peer_public), info=info || round_id).

    Both ends derive the same key; `info` separates share keys from mask seeds.

    Raises:
      SecAggError: if the peer's key is invalid.
    """
    try:
        shared = private.exchange(x25519.X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as e:
        raise config.SecAggError(
            f"Expected a valid X25519 public key, found one X25519 refuses ({e})."
        ) from None
    return HKDF(hashes.SHA256(), KEY_BYTES, salt=None, info=info + round_id).derive(shared)


def share_associated_data(
    round_id: bytes, sender: str, receiver: str, receiver_index: int
) -> bytes:
    parts = [_SHARE_AD, round_id, sender.encode(), receiver.encode()]
    out = b"".join(struct.pack("<I", len(p)) + p for p in parts)
    return out + struct.pack("<Q", receiver_index)


def encrypt(key: bytes, plaintext: bytes, associated_data: bytes) -> bytes:
    """nonce || AES-256-GCM(key, nonce, plaintext, associated_data) (ciphertext and tag)."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated_data)


def decrypt(key: bytes, sealed: bytes, associated_data: bytes, what: str) -> bytes:
    """Opens what `encrypt` wrote.

    Raises:
      SecAggError: if the ciphertext was altered, or was sealed for another sender,
        receiver or round.
    """
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated_data)
    except InvalidTag:
        raise config.SecAggError(
            f"Expected {what} encrypted for this client, sender and round, found a ciphertext "
            "that fails authentication (altered, replayed or meant for another client)."
        ) from None


@functools.cache
def _probe() -> x25519.X25519PrivateKey:
    # Any fixed key: exchanging with it is how X25519 reports a low-order public key.
    return x25519.X25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
