"""Key agreement, key derivation, mask expansion and share encryption.

All primitives come from the ``cryptography`` package:

* X25519 for pairwise Diffie-Hellman secrets,
* HKDF-SHA256 to turn a secret into a key for one purpose; ``info`` is a
  JSON list (label, run tag, ...) so fields can never run into each other,
* ChaCha20 keystreams as the PRG expanding a 32-byte key into uint64 masks,
* AES-256-GCM for Shamir shares in transit, with the full address
  (run, round, topic, sender, recipient) as associated data.
"""

from __future__ import annotations

import json
import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dpneuro.protocol.secagg.errors import SecAggError

KEY_BYTES = 32
NONCE_BYTES = 12  # AES-GCM
TAG_BYTES = 16  # AES-GCM authentication tag

LABEL_ENC = "dpneuro-secagg/v1/share-encryption"
LABEL_MASK = "dpneuro-secagg/v1/pairwise-mask"
LABEL_SHARE_AAD = "dpneuro-secagg/v1/share"


def _info(*fields: object) -> bytes:
    return json.dumps(list(fields), separators=(",", ":")).encode()


def new_private_key() -> bytes:
    """Fresh X25519 private key (32 raw bytes) from OS entropy."""
    return X25519PrivateKey.generate().private_bytes_raw()


def public_key(private: bytes) -> bytes:
    """Raw 32-byte X25519 public key of a raw private key."""
    return X25519PrivateKey.from_private_bytes(bytes(private)).public_key().public_bytes_raw()


def dh(private: bytes | X25519PrivateKey, peer_public: bytes) -> bytes:
    """X25519 shared secret of our private key (raw bytes or loaded) and a peer's public key."""
    key = private if isinstance(private, X25519PrivateKey) else X25519PrivateKey.from_private_bytes(bytes(private))
    try:
        return key.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
    except ValueError as exc:  # e.g. a low-order public key
        raise SecAggError(f"key agreement failed: {exc}") from exc


def load_private(private: bytes) -> X25519PrivateKey:
    """Parse a raw private key once, for many :func:`dh` calls."""
    return X25519PrivateKey.from_private_bytes(bytes(private))


def hkdf(secret: bytes, *info: object) -> bytes:
    """32-byte key derived from ``secret`` for the purpose described by ``info``."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_info(*info)).derive(secret)


def encryption_key(c_private: bytes | X25519PrivateKey, c_peer_public: bytes, tag: str, a: int, b: int) -> bytes:
    """Symmetric key for shares exchanged between sites ``a`` and ``b`` (either order)."""
    lo, hi = sorted((int(a), int(b)))
    return hkdf(dh(c_private, c_peer_public), LABEL_ENC, tag, lo, hi)


def mask_key(s_private: bytes | X25519PrivateKey, s_peer_public: bytes, tag: str, a: int, b: int,
             epoch: int, round: int, topic: str) -> bytes:
    """ChaCha20 key of the pairwise mask between sites ``a`` and ``b`` for one secure sum."""
    lo, hi = sorted((int(a), int(b)))
    return hkdf(dh(s_private, s_peer_public), LABEL_MASK, tag, lo, hi, int(epoch), int(round), topic)


def keystream_u64(key: bytes, n: int) -> np.ndarray:
    """``n`` pseudorandom uint64 words: the ChaCha20 keystream of ``key``.

    Every key is used for exactly one stream, so a fixed all-zero nonce
    (which also holds ChaCha20's initial block counter) is safe.
    """
    if len(key) != KEY_BYTES:
        raise ValueError(f"a PRG key is {KEY_BYTES} bytes, got {len(key)}")
    enc = Cipher(algorithms.ChaCha20(bytes(key), bytes(16)), mode=None).encryptor()
    # encrypting zeros yields the raw keystream
    return np.frombuffer(enc.update(bytes(8 * int(n))), dtype="<u8")


def add_mask(y: np.ndarray, key: bytes, sign: int = 1) -> None:
    """In place: ``y += sign * PRG(key)`` in Z_{2^64} (``y`` flat uint64)."""
    ks = keystream_u64(key, y.size)
    if sign >= 0:
        np.add(y, ks, out=y)
    else:
        np.subtract(y, ks, out=y)


def share_aad(tag: str, round: int, topic: str, sender: int, recipient: int) -> bytes:
    """Associated data binding an encrypted share to its place in the protocol."""
    return _info(LABEL_SHARE_AAD, tag, int(round), topic, int(sender), int(recipient))


def encrypt(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """AES-256-GCM with a random nonce; returns ``nonce || ciphertext || tag``."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def decrypt(key: bytes, blob: bytes, aad: bytes) -> bytes:
    """Inverse of :func:`encrypt`; raises :class:`SecAggError` if the blob was altered or misplaced."""
    try:
        return AESGCM(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
    except InvalidTag as exc:
        raise SecAggError("an encrypted share failed authentication (altered, misrouted, or wrong key)") from exc


def ciphertext_bytes(plaintext_bytes: int) -> int:
    """Length of :func:`encrypt`'s output for a plaintext of the given length."""
    return NONCE_BYTES + plaintext_bytes + TAG_BYTES
