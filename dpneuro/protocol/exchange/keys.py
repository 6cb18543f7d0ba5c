"""Per-party signing keys: no party of a run can write as another.

Every party (the aggregator and each site) holds its own Ed25519 private key
(:func:`generate_key` writes one, 0600; :func:`load_private_key` refuses one
that group or others may read or write, as ssh does) and signs every message it
sends. Every party holds the public keys of all the others, pinned out of band:
the consortium collects each party's public key (``dpneuro keygen`` prints it)
into one keys file that every party is given (:func:`read_public_keys`), like
SSH's known hosts; no two parties may share a key. A message is accepted only with a valid signature of the party
whose address it was written to, so a site cannot forge the aggregator's
broadcast or another site's release, and nothing secret lies in the shared
folder.

:class:`PartyKeys` is what the exchanges' codec signs and verifies with
(:func:`dpneuro.protocol.exchange.codec.encode_payload`); a plain ``bytes`` key still
selects an HMAC shared by every party, which is only for parties inside one
process (the in-process exchange, simulations).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from dpneuro._utils.errors import DpneuroError
from dpneuro.protocol.exchange.base import AGGREGATOR
from dpneuro.protocol.exchange.codec import SIGNED_VERSION

__all__ = ["AGGREGATOR_NAME", "KeyFileError", "PartyKeys", "generate_key", "load_private_key", "public_hex",
           "read_public_keys", "write_public_keys"]

AGGREGATOR_NAME = "aggregator"
SIGNATURE_BYTES = 64


class KeyFileError(DpneuroError, ValueError):
    """A key file is missing, malformed or does not match the key the consortium pinned (the message says which)."""


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def public_hex(private: Ed25519PrivateKey) -> str:
    """The public key of ``private`` as 64 hex digits: what the consortium pins for this party."""
    return _raw_public(private.public_key()).hex()


def generate_key(path: str | os.PathLike[str]) -> str:
    """Create a private key at ``path`` (0600, 64 hex digits; never overwritten) and return its public key."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()).hex()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{path} already exists: a party keeps its key for good (its public key is pinned by the "
                        "consortium); remove it only to start a new consortium") from None
    with os.fdopen(fd, "w") as f:
        f.write(seed + "\n")
        f.flush()
        os.fsync(f.fileno())
    return public_hex(key)


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The private key written by :func:`generate_key`.

    On POSIX a key file that its group or others may read or write is refused, as ssh refuses one: whoever can
    read it can sign as this party, whoever can write it can swap the party's key.
    """
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if os.name == "posix" and mode & 0o077:
                raise KeyFileError(f"key file {path}: its permissions {stat.S_IMODE(mode):04o} let its group or "
                                   f"others read or write it, so another user could sign as this party; run "
                                   f"`chmod 600 {path}` (only its owner may read it)")
            text = f.read().decode("ascii", "replace").strip()
    except OSError as exc:
        raise KeyFileError(f"key file {path}: {exc.strerror or exc}") from None
    try:
        seed = bytes.fromhex(text)
    except ValueError:
        seed = b""
    if len(seed) != 32:
        raise KeyFileError(f"key file {path}: expected 64 hex digits (a private key from `dpneuro keygen`)")
    return Ed25519PrivateKey.from_private_bytes(seed)


def _parse_public(party: str, value: object, where: str) -> Ed25519PublicKey:
    try:
        raw = bytes.fromhex(str(value).strip())
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise KeyFileError(f"{where}: the public key of {party!r} must be 64 hex digits, got {value!r}")
    return Ed25519PublicKey.from_public_bytes(raw)


def read_public_keys(path: str | os.PathLike[str]) -> dict[str, str]:
    """The consortium's keys file: one line ``<party> = "<64 hex digits>"`` per party (TOML)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise KeyFileError(f"keys file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise KeyFileError(f"keys file {path}: not TOML ({exc})") from None
    data = data.get("public_keys", data)
    for party, value in data.items():
        _parse_public(party, value, f"keys file {path}")
    keys = {str(k): str(v).strip().lower() for k, v in data.items()}
    _check_distinct(keys, f"keys file {path}")
    return keys


def _check_distinct(keys: Mapping[str, str], where: str) -> None:
    """Refuse two parties with one public key: whoever holds it could write as both."""
    seen: dict[str, str] = {}
    for party, value in keys.items():
        if value in seen:
            raise KeyFileError(f"{where}: {seen[value]!r} and {party!r} have the same public key ({value[:16]}...); "
                               "every party needs its own key (`dpneuro keygen`), or one could write as the other")
        seen[value] = party


def write_public_keys(path: str | os.PathLike[str], keys: Mapping[str, str]) -> Path:
    """Write a keys file that :func:`read_public_keys` reads."""
    path = Path(path)
    path.write_text("".join(f'"{party}" = "{value}"\n' for party, value in keys.items()))
    return path


class PartyKeys:
    """This party's private key and every party's pinned public key, for one run.

    Parameters
    ----------
    me : str
        This party's name: ``"aggregator"`` or a site's name.
    private : Ed25519PrivateKey
        This party's key; it must match ``public[me]``.
    public : mapping of str to str
        Every party's public key (64 hex digits): the aggregator and each of ``sites``.
    sites : sequence of str
        The run's sites in order: sender ``i`` of the exchange is ``sites[i]``.
    """

    tag_bytes = SIGNATURE_BYTES
    version = SIGNED_VERSION  # the codec's format for signed messages

    def __init__(self, me: str, private: Ed25519PrivateKey, public: Mapping[str, str], sites: Sequence[str]):
        self.me, self.sites = me, list(sites)
        missing = [p for p in [AGGREGATOR_NAME, *self.sites] if p not in public]
        if missing:
            raise KeyFileError(f"the consortium's public keys have no entry for {missing}: every party of the run "
                            "(the aggregator and each site) needs one")
        self._public = {p: _parse_public(p, public[p], "public keys") for p in [AGGREGATOR_NAME, *self.sites]}
        self._hex = {p: str(public[p]).strip().lower() for p in self._public}
        _check_distinct(self._hex, "the consortium's public keys")
        if me not in self._public:
            raise KeyFileError(f"{me!r} is not a party of this run (sites: {self.sites})")
        if public_hex(private) != self._hex[me]:
            raise KeyFileError(f"{me}'s key file does not match the public key the consortium pinned for {me!r} "
                            f"({self._hex[me][:16]}...): use the key whose public key you handed out")
        self._private = private

    def party(self, sender: int) -> str:
        """The name of exchange sender ``sender`` (a site index or ``AGGREGATOR``)."""
        return AGGREGATOR_NAME if sender == AGGREGATOR else self.sites[sender]

    def sign(self, sender: int, body: bytes) -> bytes:
        """Sign ``body`` as ``sender``: only this party's own messages can be signed here."""
        who = self.party(sender)
        if who != self.me:
            raise PermissionError(f"{self.me} holds only its own key and cannot write as {who}")
        return self.sign_named(body)

    def verify(self, sender: int, body: bytes, signature: bytes) -> bool:
        return self.verify_named(self.party(sender), body, signature)

    def sign_named(self, body: bytes) -> bytes:
        """Sign ``body`` as this party (failure notices and other files outside the exchange's messages)."""
        return self._private.sign(body)

    def verify_named(self, party: str, body: bytes, signature: bytes) -> bool:
        """Whether ``signature`` is ``party``'s over ``body``; False for a party of another run."""
        if party not in self._public:
            return False
        try:
            self._public[party].verify(signature, body)
        except InvalidSignature:
            return False
        return True

    def digest(self) -> str:
        """SHA-256 of the pinned public keys: parties with different keys files disagree on it."""
        text = ";".join(f"{p}={self._hex[p]}" for p in sorted(self._hex))
        return hashlib.sha256(text.encode()).hexdigest()
