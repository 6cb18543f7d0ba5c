"""Secure aggregation (Bonawitz et al. 2017) as phases for the generic driver.

Honest-but-curious sites and aggregator; robust to up to ``S - t`` dropouts.

Run-level setup (:func:`setup_phases`, once per run)
    ``keys``        every site makes two X25519 key pairs -- ``c`` (encrypts
                    shares) and ``s`` (pairwise masks) -- and advertises the
                    public halves; the aggregator broadcasts them (set U0).
    ``share-keys``  every site Shamir-shares its ``s`` private key, one share
                    encrypted to each other site; the aggregator relays the
                    table (set U1, the first *key set*).

Optional group secret (:func:`group_secret_phase`, once, directly after the setup)
    ``<topic>``     the leader (lowest site id in the key set) draws a fresh
                    32-byte secret and sends it AES-GCM-encrypted under the
                    pairwise share-encryption key to every other site of the
                    key set; the others send nothing; the aggregator relays
                    the ciphertexts, which it cannot read. Each site gets the
                    secret with :func:`group_secret`. It is a secret of the
                    *sites* (e.g. PD-SVD's blinding key): the aggregator never
                    holds it, but any one site that colludes with the
                    aggregator hands it over.

Per secure sum (:func:`sum_phases`)
    ``<topic>-masked``  site u sends ``y_u = x_u + PRG(b_u) + sum_v +-PRG(k_uv)``
                        (uint64 ring), ``SHA-256(b_u)`` and encrypted Shamir
                        shares of the fresh self-mask seed ``b_u``; the
                        aggregator relays the shares and announces U2, the
                        sites whose inputs are in the sum.
    ``<topic>-unmask``  surviving sites reveal their shares of ``b_u`` for u in
                        U2 and of ``s_v`` for v in (key set minus U2); never
                        both for one site. The aggregator reconstructs, strips
                        all masks and passes the float sum to ``on_sum``.

Forward secrecy of the pairwise keys
    Revealing a dropped site's ``s`` key lets the aggregator recompute *every*
    pairwise mask made with that key. With one ``s`` key for the whole run this
    would unmask all the site's *earlier* inputs (whose ``b`` seeds were
    revealed when they were summed) -- for CAPE, its noise draws. So the keys
    ratchet: each masked message also carries a fresh ``s`` public key and
    shares of its private key, which mask the *next* sum only. A revealed
    ``s`` key therefore only ever covers the one sum the site missed, and the
    next key set is U2 of the previous sum.

Site state lives in ``state["secagg"]`` and needs ``state["site"]`` (the
site's id); aggregator state lives in ``agg_state["secagg"]``. Everything
stored is JSON-able, bytes, or numpy arrays. Sums must not interleave: a
sum's ``-unmask`` phase must come before the next sum's ``-masked`` phase,
and the first sum's ``-masked`` phase must directly follow the setup phases
(it receives their last broadcast) or the group-secret phase that follows them.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from dpneuro.protocol.driver import Phase
from dpneuro.protocol.exchange.base import Payload
from dpneuro.protocol.secagg import prg, shamir
from dpneuro.protocol.secagg.config import SecAggConfig
from dpneuro.protocol.secagg.errors import SecAggDropped, SecAggError, SecAggWarning

State = dict[str, Any]
OnSum = Callable[[State, int, np.ndarray], Payload]
#: what a party holds for a sum (its state -> a string bound into every pairwise mask; see sum_phases)
Context = Callable[[State], str]

SECRET_BYTES = 32
_ONE_SHARE = prg.ciphertext_bytes(shamir.SHARE_BYTES)  # setup: the s key share
_TWO_SHARES = prg.ciphertext_bytes(2 * shamir.SHARE_BYTES)  # masked: b share || next s share
_GROUP_CT = prg.ciphertext_bytes(SECRET_BYTES)  # group secret: one 32-byte secret per recipient
LABEL_GROUP_AAD = "dpneuro-secagg/v1/group-secret"

__all__ = ["group_secret", "group_secret_phase", "setup_phases", "sum_phases"]


# -- small helpers -------------------------------------------------------------------

def _u8(data: bytes) -> np.ndarray:
    return np.frombuffer(bytes(data), dtype=np.uint8).copy()


def _site_id(state: State) -> int:
    if "site" not in state:
        raise KeyError("secure aggregation needs the site's id in state['site'] (set it in site_init)")
    return int(state["site"])


def _site_state(state: State) -> State:
    if "secagg" not in state:
        raise SecAggError("secure aggregation setup has not run at this site: put setup_phases(config) "
                          "before any sum_phases(...) in the protocol")
    return state["secagg"]


def _agg_state(agg_state: State) -> State:
    if "secagg" not in agg_state:
        raise SecAggError("secure aggregation setup has not run at the aggregator: put "
                          "setup_phases(config) before any sum_phases(...) in the protocol")
    return agg_state["secagg"]


def _sites(names: list[int]) -> str:
    return ", ".join(str(s) for s in names) if names else "none"


def _need(payload: Payload, name: str, shape: tuple[int, ...], who: str) -> np.ndarray:
    """A uint8 array of a fixed shape from ``payload``, or a :class:`SecAggError`."""
    arr = payload.arrays.get(name)
    if arr is None:
        raise SecAggError(f"{who}: array {name!r} missing")
    arr = np.asarray(arr)
    if arr.dtype != np.uint8 or arr.shape != shape:
        raise SecAggError(f"{who}: array {name!r} has dtype {arr.dtype} and shape {arr.shape}, "
                          f"expected uint8 {shape}")
    return arr


def _rows(rows: list[bytes]) -> np.ndarray:
    """Shares as a ``(len(rows), SHARE_BYTES)`` uint8 array."""
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), shamir.SHARE_BYTES).copy()


def _run_tag(config: SecAggConfig, u0: list[int], c_pk: dict[str, str], s_pk: dict[str, str]) -> str:
    """Hash of the run's parameters and every advertised key: binds all derived keys to this run."""
    blob = json.dumps(["dpneuro-secagg/v1/run", config.run_id, config.n_sites, config.threshold,
                       [[v, c_pk[str(v)], s_pk[str(v)]] for v in u0]], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _commit(seed: bytes) -> bytes:
    return hashlib.sha256(seed).digest()


def _secret_bytes(value: int) -> bytes | None:
    """A reconstructed field element as the 32-byte secret, or None if it cannot be one."""
    return value.to_bytes(SECRET_BYTES, "big") if 0 <= value < 2 ** (8 * SECRET_BYTES) else None


# -- setup: advertise keys -------------------------------------------------------------

def _keys_site(config: SecAggConfig) -> Callable[[State, int, Payload | None], Payload]:
    def step(state: State, round: int, incoming: Payload | None) -> Payload:
        u = _site_id(state)
        if not 0 <= u < config.n_sites:
            raise SecAggError(f"site id {u} is outside 0..{config.n_sites - 1} (SecAggConfig.n_sites)")
        c_sk, s_sk = prg.new_private_key(), prg.new_private_key()
        state["secagg"] = {"site": u, "c_sk": c_sk, "s_sk": s_sk, "epoch": 0, "keyset": None,
                           "open": None, "last": None}
        return Payload(arrays={"c_pk": _u8(prg.public_key(c_sk)), "s_pk": _u8(prg.public_key(s_sk))},
                       meta={"secagg": "keys"}, carries={"c_pk": "public", "s_pk": "public"})
    return step


def _keys_aggregator(config: SecAggConfig) -> Callable[[State, int, dict[int, Payload]], Payload]:
    def step(agg_state: State, round: int, msgs: dict[int, Payload]) -> Payload:
        u0 = sorted(msgs)
        if len(u0) < config.threshold:
            raise SecAggError(
                f"secure aggregation setup: only {len(u0)} of {config.n_sites} sites advertised keys "
                f"(sites {_sites(u0)}), fewer than the threshold t={config.threshold}")
        c_pk, s_pk = {}, {}
        for v in u0:
            who = f"keys from site {v}"
            c_pk[str(v)] = _need(msgs[v], "c_pk", (32,), who).tobytes().hex()
            s_pk[str(v)] = _need(msgs[v], "s_pk", (32,), who).tobytes().hex()
        agg_state["secagg"] = {"tag": _run_tag(config, u0, c_pk, s_pk), "u0": u0, "epoch": 0,
                               "keyset": None, "s_pk": s_pk, "open": None, "last": None, "log": []}
        return Payload(
            arrays={"c_pk": np.stack([_u8(bytes.fromhex(c_pk[str(v)])) for v in u0]),
                    "s_pk": np.stack([_u8(bytes.fromhex(s_pk[str(v)])) for v in u0])},
            meta={"secagg": "keys", "u0": u0}, carries={"c_pk": "public", "s_pk": "public"})
    return step


# -- setup: share the s keys -----------------------------------------------------------

def _share_keys_site(config: SecAggConfig, topic: str) -> Callable[[State, int, Payload | None], Payload]:
    def step(state: State, round: int, incoming: Payload | None) -> Payload:
        sa = _site_state(state)
        u = sa["site"]
        if incoming is None or incoming.meta.get("secagg") != "keys":
            raise SecAggError("the share-keys phase must directly follow the keys phase")
        u0 = [int(v) for v in incoming.meta["u0"]]
        if len(u0) < config.threshold:
            raise SecAggError(
                f"site {u} refuses to continue: only {len(u0)} sites advertised keys, "
                f"fewer than the threshold t={config.threshold}")
        if u not in u0:
            raise SecAggDropped(f"site {u} was dropped from secure aggregation setup (its keys arrived late)")
        n = len(u0)
        c_rows = _need(incoming, "c_pk", (n, 32), "keys broadcast")
        s_rows = _need(incoming, "s_pk", (n, 32), "keys broadcast")
        c_pk = {str(v): c_rows[i].tobytes().hex() for i, v in enumerate(u0)}
        s_pk = {str(v): s_rows[i].tobytes().hex() for i, v in enumerate(u0)}
        if (c_pk[str(u)] != prg.public_key(sa["c_sk"]).hex()
                or s_pk[str(u)] != prg.public_key(sa["s_sk"]).hex()):
            raise SecAggError(f"site {u}: the keys broadcast does not carry this site's own public keys")
        tag = _run_tag(config, u0, c_pk, s_pk)
        # the share-encryption keys are fixed for the run: derive them once
        c_sk = prg.load_private(sa["c_sk"])
        enc_keys = {str(v): prg.encryption_key(c_sk, bytes.fromhex(c_pk[str(v)]), tag, u, v) for v in u0 if v != u}
        shares = shamir.split(int.from_bytes(sa["s_sk"], "big"), config.n_sites, config.threshold)
        enc = np.zeros((config.n_sites, _ONE_SHARE), dtype=np.uint8)
        for v in u0:
            if v != u:
                aad = prg.share_aad(tag, round, topic, u, v)
                enc[v] = _u8(prg.encrypt(enc_keys[str(v)], shamir.to_bytes(shares[v]), aad))
        sa.update(tag=tag, c_pk=c_pk, s_pk=s_pk, enc_keys=enc_keys, own_s_share=hex(shares[u]),
                  setup={"round": int(round), "topic": topic})
        del sa["c_sk"]  # only the derived pair keys are needed from now on
        return Payload(arrays={"enc": enc}, meta={"secagg": "share-keys"}, carries={"enc": "encrypted-share"})
    return step


def _share_keys_aggregator(config: SecAggConfig) -> Callable[[State, int, dict[int, Payload]], Payload]:
    def step(agg_state: State, round: int, msgs: dict[int, Payload]) -> Payload:
        sa = _agg_state(agg_state)
        u1 = sorted(v for v in msgs if v in sa["u0"])
        if len(u1) < config.threshold:
            raise SecAggError(
                f"secure aggregation setup: only {len(u1)} sites shared their keys (sites {_sites(u1)}), "
                f"fewer than the threshold t={config.threshold}")
        table = np.stack([_need(msgs[v], "enc", (config.n_sites, _ONE_SHARE), f"key shares from site {v}")
                          for v in u1])
        sa["keyset"] = u1
        sa["s_pk"] = {str(v): sa["s_pk"][str(v)] for v in u1}
        return Payload(arrays={"enc": table}, meta={"secagg": "share-keys", "u1": u1},
                       carries={"enc": "encrypted-share"})
    return step


def _absorb_setup(config: SecAggConfig, sa: State, incoming: Payload) -> None:
    """Site side: take the share-keys broadcast; the key set and s-key shares of epoch 0."""
    u = sa["site"]
    u1 = [int(v) for v in incoming.meta["u1"]]
    if len(u1) < config.threshold:
        raise SecAggError(f"site {u} refuses to continue: only {len(u1)} sites shared keys, "
                          f"fewer than the threshold t={config.threshold}")
    if u not in u1:
        raise SecAggDropped(f"site {u} was dropped from secure aggregation setup (its key shares arrived late)")
    table = _need(incoming, "enc", (len(u1), config.n_sites, _ONE_SHARE), "share-keys broadcast")
    setup = sa["setup"]
    shares = {str(u): sa.pop("own_s_share")}
    for i, v in enumerate(u1):
        if v == u:
            continue
        try:
            aad = prg.share_aad(sa["tag"], setup["round"], setup["topic"], v, u)
            plain = prg.decrypt(sa["enc_keys"][str(v)], table[i, u].tobytes(), aad)
        except SecAggError as exc:
            raise SecAggError(f"site {u}: the encrypted key share from site {v} failed authentication "
                              "(altered, misrouted, or encrypted under another key)") from exc
        shares[str(v)] = hex(shamir.from_bytes(plain))
    sa.update(keyset=u1, epoch=0, s_shares=shares, s_pk={str(v): sa["s_pk"][str(v)] for v in u1})


def setup_phases(config: SecAggConfig, *, topic_prefix: str = "secagg") -> list[Phase]:
    """The two run-level setup phases: advertise keys, then share the mask keys.

    Parameters
    ----------
    config : SecAggConfig
        Shared by all parties.
    topic_prefix : str
        Topics are ``f"{topic_prefix}-keys"`` and ``f"{topic_prefix}-share-keys"``.

    Returns
    -------
    list of Phase
        Both allow dropouts; the aggregator raises :class:`SecAggError` if
        fewer than ``config.threshold`` sites take part. Put them once, before
        the first :func:`sum_phases`, which must follow them directly.
    """
    share_topic = f"{topic_prefix}-share-keys"
    return [
        Phase(topic=f"{topic_prefix}-keys", site=_keys_site(config), aggregator=_keys_aggregator(config),
              allow_dropout=True),
        Phase(topic=share_topic, site=_share_keys_site(config, share_topic),
              aggregator=_share_keys_aggregator(config), allow_dropout=True),
    ]


# -- optional: a secret shared by the sites only ------------------------------------------

def _group_aad(tag: str, round: int, topic: str, sender: int, recipient: int) -> bytes:
    """Associated data of an encrypted group secret: run tag, round, topic, sender, recipient."""
    return json.dumps([LABEL_GROUP_AAD, tag, int(round), topic, int(sender), int(recipient)],
                      separators=(",", ":")).encode()


def _group_site(config: SecAggConfig, topic: str) -> Callable[[State, int, Payload | None], Payload]:
    def step(state: State, round: int, incoming: Payload | None) -> Payload:
        sa = _site_state(state)
        u = sa["site"]
        if incoming is not None and incoming.meta.get("secagg") == "share-keys":
            _absorb_setup(config, sa, incoming)  # the next sum's masked step then finds the key set
        if sa.get("keyset") is None:
            raise SecAggError(f"site {u}: the group-secret phase {topic!r} must directly follow setup_phases "
                              "(the key shares have not been received)")
        if sa.get("open"):
            raise SecAggError(f"site {u}: secure sum {sa['open']['topic']!r} is still open; the group-secret "
                              f"phase {topic!r} may not interleave with it")
        keyset = [int(v) for v in sa["keyset"]]
        if u not in keyset:
            raise SecAggDropped(f"site {u} is no longer in the secure-aggregation key set; it must not rejoin")
        leader = min(keyset)
        group = {"topic": topic, "round": int(round), "leader": leader, "members": keyset,
                 "n_sites": config.n_sites, "secret": None}
        if u != leader:
            sa["group"] = group
            return Payload(meta={"secagg": "group-secret", "topic": topic})
        secret = os.urandom(SECRET_BYTES)
        enc = np.zeros((config.n_sites, _GROUP_CT), dtype=np.uint8)
        for v in keyset:
            if v != u:
                enc[v] = _u8(prg.encrypt(sa["enc_keys"][str(v)], secret,
                                         _group_aad(sa["tag"], round, topic, u, v)))
        group["secret"] = secret  # the leader keeps its own; the others decrypt the relayed table
        sa["group"] = group
        return Payload(arrays={"enc": enc}, meta={"secagg": "group-secret", "topic": topic},
                       carries={"enc": "encrypted-share"})
    return step


def _group_aggregator(config: SecAggConfig, topic: str) -> Callable[[State, int, dict[int, Payload]], Payload]:
    def step(agg_state: State, round: int, msgs: dict[int, Payload]) -> Payload:
        sa = _agg_state(agg_state)
        if sa.get("keyset") is None:
            raise SecAggError(f"the group-secret phase {topic!r} ran before the secure-aggregation setup finished")
        keyset = [int(v) for v in sa["keyset"]]
        leader = min(keyset)
        if leader not in msgs:
            raise SecAggError(f"group secret {topic!r}: the leader, site {leader} (lowest id in the key set), "
                              "did not send the encrypted secret; the sites cannot agree on it")
        enc = _need(msgs[leader], "enc", (config.n_sites, _GROUP_CT), f"group secret from site {leader}")
        for v in keyset:
            if v != leader and v in msgs and msgs[v].arrays:
                raise SecAggError(f"group secret {topic!r}: site {v} sent arrays, but only the leader "
                                  f"(site {leader}) sends the secret")
        # what the aggregator keeps: who took part, never the secret (it only relays ciphertexts)
        sa["group"] = {"topic": topic, "round": int(round), "leader": leader, "members": keyset}
        return Payload(arrays={"enc": np.asarray(enc, dtype=np.uint8).copy()},
                       meta={"secagg": "group-secret", "topic": topic, "leader": leader, "members": keyset},
                       carries={"enc": "encrypted-share"})
    return step


def group_secret_phase(config: SecAggConfig, topic: str = "secagg-group-secret") -> Phase:
    """A phase in which the sites agree on a fresh 32-byte secret the aggregator cannot read.

    Put it directly after :func:`setup_phases` and before the first
    :func:`sum_phases` (its site step takes over absorbing the key shares).
    The leader -- the lowest site id in the key set -- draws the secret with
    ``os.urandom`` and encrypts it (AES-256-GCM, the pairwise share-encryption
    key of the setup, associated data binding run tag, round, ``topic``,
    sender and recipient) to every other site of the key set; the other sites
    send an empty message; the aggregator relays the ciphertext table. Each
    site then calls :func:`group_secret` with the broadcast.

    Parameters
    ----------
    config : SecAggConfig
        The configuration given to :func:`setup_phases`.
    topic : str
        The phase's topic (unique within the round).

    Returns
    -------
    Phase
        Allowing dropouts like the other secure-aggregation phases (a site
        that misses it is then handled as dropped by the next sum), but the
        aggregator raises :class:`SecAggError` if the leader's message is
        missing or malformed.

    Notes
    -----
    The secret is protected against the aggregator alone (it never holds it,
    and altering a ciphertext makes the recipient raise
    :class:`SecAggError`), not against a coalition of the aggregator with
    any one site, which holds the secret. A site's state keeps it (in
    ``state["secagg"]["group"]``), so a site checkpoint contains it.
    """
    return Phase(topic=topic, site=_group_site(config, topic), aggregator=_group_aggregator(config, topic),
                 allow_dropout=True)


def group_secret(state: State, incoming: Payload | None = None) -> bytes:
    """The group secret at a site: decrypt it from the group-secret broadcast once, then from the cache.

    Parameters
    ----------
    state : dict
        The site's state (holds ``state["secagg"]``).
    incoming : Payload, optional
        The broadcast of :func:`group_secret_phase`; needed the first time
        at every site but the leader.

    Raises
    ------
    SecAggError
        If no group-secret phase ran at this site, the broadcast is missing
        or belongs to another phase, or the ciphertext fails authentication
        (altered, misrouted or encrypted under another key).
    """
    sa = _site_state(state)
    u, group = sa["site"], sa.get("group")
    if group is None:
        raise SecAggError(f"site {u}: no group secret was agreed; put group_secret_phase(config) directly "
                          "after setup_phases(config)")
    if group.get("secret") is not None:
        return bytes(group["secret"])
    topic = group["topic"]
    meta = incoming.meta if incoming is not None else {}
    if meta.get("secagg") != "group-secret" or meta.get("topic") != topic:
        raise SecAggError(f"site {u}: the group secret {topic!r} has not been decrypted yet and needs its "
                          "broadcast (the message that follows the group-secret phase)")
    leader = int(meta.get("leader", -1))
    if leader != group["leader"]:
        raise SecAggError(f"site {u}: the group-secret broadcast names site {leader} as the leader, but the "
                          f"lowest id in this site's key set is {group['leader']}")
    enc = _need(incoming, "enc", (int(group["n_sites"]), _GROUP_CT), "group-secret broadcast")
    try:
        secret = prg.decrypt(sa["enc_keys"][str(leader)], enc[u].tobytes(),
                             _group_aad(sa["tag"], group["round"], topic, leader, u))
    except SecAggError as exc:
        raise SecAggError(f"site {u}: the encrypted group secret from site {leader} ({topic!r}) failed "
                          "authentication (altered, misrouted, or encrypted under another key)") from exc
    if len(secret) != SECRET_BYTES:
        raise SecAggError(f"site {u}: the group secret from site {leader} has {len(secret)} bytes, "
                          f"expected {SECRET_BYTES}")
    group["secret"] = secret
    return secret


# -- one secure sum: masked input collection -------------------------------------------

def _mask_topic(topic: str, context: Context | None, state: State) -> str:
    """What a pairwise mask is derived for: the sum's topic and, with a ``context``, what the party holds for it
    (e.g. CAPE's noise plan): parties holding different contexts get masks that do not cancel."""
    return topic if context is None else f"{topic}#{context(state)}"


def _masked_site(config: SecAggConfig, topic: str, input_key: str, context: Context | None = None
                 ) -> Callable[[State, int, Payload | None], Payload]:
    phase_topic = f"{topic}-masked"

    def step(state: State, round: int, incoming: Payload | None) -> Payload:
        sa = _site_state(state)
        u = sa["site"]
        if incoming is not None and incoming.meta.get("secagg") == "share-keys":
            _absorb_setup(config, sa, incoming)
        if sa.get("keyset") is None:
            raise SecAggError(
                f"site {u}: secure sum {topic!r} started before the key shares were received; the first "
                "sum_phases must directly follow setup_phases (or the group_secret_phase after them)")
        if sa.get("open"):
            raise SecAggError(f"site {u}: secure sum {sa['open']['topic']!r} is still open; "
                              f"sums may not interleave (starting {topic!r})")
        keyset, epoch, tag = sa["keyset"], int(sa["epoch"]), sa["tag"]
        if u not in keyset:
            raise SecAggDropped(f"site {u} is no longer in the secure-aggregation key set; it must not rejoin")

        rng = state.get("rounding_rng")
        rng = rng if isinstance(rng, np.random.Generator) else None
        if input_key not in state:
            raise SecAggError(f"site {u}: secure sum {topic!r} has no input: the protocol's step before it must "
                              f"put the array to add in state[{input_key!r}]")
        x = np.asarray(state.pop(input_key))  # taken, so a later sum can never send it again
        y = config.encode(x, rng=rng).reshape(-1)  # a fresh array: masks are added in place

        seed = os.urandom(SECRET_BYTES)
        prg.add_mask(y, seed, +1)
        s_sk = prg.load_private(sa["s_sk"])
        mask_topic = _mask_topic(topic, context, state)
        for v in keyset:
            if v != u:
                key = prg.mask_key(s_sk, bytes.fromhex(sa["s_pk"][str(v)]), tag, u, v, epoch, round, mask_topic)
                prg.add_mask(y, key, +1 if u < v else -1)  # lower index adds, higher subtracts

        next_sk = prg.new_private_key()
        b_sh = shamir.split(int.from_bytes(seed, "big"), config.n_sites, config.threshold)
        s_sh = shamir.split(int.from_bytes(next_sk, "big"), config.n_sites, config.threshold)
        enc = np.zeros((config.n_sites, _TWO_SHARES), dtype=np.uint8)
        for v in keyset:
            if v != u:
                plain = shamir.to_bytes(b_sh[v]) + shamir.to_bytes(s_sh[v])
                aad = prg.share_aad(tag, round, phase_topic, u, v)
                enc[v] = _u8(prg.encrypt(sa["enc_keys"][str(v)], plain, aad))
        sa["open"] = {"topic": topic, "round": int(round), "b_share": hex(b_sh[u]),
                      "next_s_sk": next_sk, "next_s_share": hex(s_sh[u])}
        return Payload(
            arrays={"y": y.reshape(x.shape), "enc": enc, "commit": _u8(_commit(seed)),
                    "next_s_pk": _u8(prg.public_key(next_sk))},
            meta={"secagg": "masked", "topic": topic, "epoch": epoch},
            carries={"y": "secagg-mask", "enc": "encrypted-share", "commit": "public", "next_s_pk": "public"})
    return step


def _masked_aggregator(config: SecAggConfig, topic: str) -> Callable[[State, int, dict[int, Payload]], Payload]:
    def step(agg_state: State, round: int, msgs: dict[int, Payload]) -> Payload:
        sa = _agg_state(agg_state)
        if sa.get("keyset") is None:
            raise SecAggError("secure sum started before the secure-aggregation setup finished")
        if sa.get("open"):
            raise SecAggError(f"secure sum {sa['open']['topic']!r} is still open; sums may not interleave "
                              f"(starting {topic!r})")
        keyset, epoch = sa["keyset"], int(sa["epoch"])
        u2 = sorted(v for v in msgs if v in keyset)
        if len(u2) < config.threshold:
            raise SecAggError(
                f"secure sum {topic!r}, round {round}: only {len(u2)} of the {len(keyset)} sites sent masked "
                f"inputs (sites {_sites(u2)}); at least the threshold t={config.threshold} are needed")
        shape = None
        total = None
        for v in u2:
            p, who = msgs[v], f"secure sum {topic!r}, round {round}, site {v}"
            if p.meta.get("epoch") != epoch:
                raise SecAggError(f"{who}: key epoch {p.meta.get('epoch')} differs from the aggregator's {epoch}")
            y = np.asarray(p.arrays.get("y"))
            if y.dtype != np.uint64:
                raise SecAggError(f"{who}: masked input has dtype {y.dtype}, expected uint64")
            if shape is None:
                shape, total = y.shape, np.zeros(y.size, dtype=np.uint64)
            elif y.shape != shape:
                raise SecAggError(f"{who}: masked input has shape {y.shape}, others sent {shape}")
            np.add(total, y.reshape(-1), out=total)
            _need(p, "enc", (config.n_sites, _TWO_SHARES), who)
            _need(p, "commit", (32,), who)
            _need(p, "next_s_pk", (32,), who)
        s_request = sorted(set(keyset) - set(u2))
        sa["open"] = {
            "topic": topic, "round": int(round), "u2": u2, "s_request": s_request, "ysum": total,
            "shape": list(shape),
            "commit": {str(v): msgs[v].arrays["commit"].tobytes().hex() for v in u2},
            "next_s_pk": {str(v): msgs[v].arrays["next_s_pk"].tobytes().hex() for v in u2},
        }
        return Payload(
            arrays={"enc": np.stack([np.asarray(msgs[v].arrays["enc"]) for v in u2]),
                    "next_s_pk": np.stack([np.asarray(msgs[v].arrays["next_s_pk"]) for v in u2])},
            meta={"secagg": "masked", "topic": topic, "epoch": epoch, "u2": u2,
                  "b_request": u2, "s_request": s_request},
            carries={"enc": "encrypted-share", "next_s_pk": "public"})
    return step


# -- one secure sum: unmasking -----------------------------------------------------------

def _check_request(config: SecAggConfig, u: int, keyset: list[int], u2: list[int],
                   b_req: list[int], s_req: list[int], topic: str, round: int) -> None:
    """Refuse any unmasking request that could expose an individual input."""
    where = f"site {u} refuses to unmask secure sum {topic!r}, round {round}"
    both = sorted(set(b_req) & set(s_req))
    if both:
        raise SecAggError(f"{where}: it was asked for shares of both the self-mask seed and the mask key "
                          f"of sites {_sites(both)}, which would reveal their inputs")
    sent = sorted(set(s_req) & set(u2))
    if sent:
        raise SecAggError(f"{where}: it was asked for the mask keys of sites {_sites(sent)}, whose masked "
                          "inputs are in the sum")
    if set(b_req) - set(u2) or set(s_req) - set(keyset) or set(u2) - set(keyset):
        raise SecAggError(f"{where}: the request names sites outside the key set")
    if len(u2) < config.threshold:
        raise SecAggError(f"{where}: only {len(u2)} inputs are in the sum, fewer than the threshold "
                          f"t={config.threshold}")


def _unmask_site(config: SecAggConfig, topic: str) -> Callable[[State, int, Payload | None], Payload]:
    masked_topic = f"{topic}-masked"

    def step(state: State, round: int, incoming: Payload | None) -> Payload:
        sa = _site_state(state)
        u, op = sa["site"], sa.get("open")
        meta = incoming.meta if incoming is not None else {}
        if (op is None or op["topic"] != topic or op["round"] != round or meta.get("secagg") != "masked"
                or meta.get("topic") != topic):
            raise SecAggError(f"site {u}: the {topic!r}-unmask phase must directly follow its -masked phase")
        u2 = [int(v) for v in meta["u2"]]
        b_req = [int(v) for v in meta["b_request"]]
        s_req = [int(v) for v in meta["s_request"]]
        keyset, tag = sa["keyset"], sa["tag"]
        _check_request(config, u, keyset, u2, b_req, s_req, topic, round)
        if u not in u2:
            sa["open"] = None
            raise SecAggDropped(
                f"site {u}: its masked input for secure sum {topic!r}, round {round} is not in the sum (it "
                "arrived after the aggregator's timeout); the site has been dropped and must not rejoin")

        enc = _need(incoming, "enc", (len(u2), config.n_sites, _TWO_SHARES), "masked broadcast")
        pks = _need(incoming, "next_s_pk", (len(u2), 32), "masked broadcast")
        b_shares = {u: int(op["b_share"], 16)}
        next_shares = {u: int(op["next_s_share"], 16)}
        for i, w in enumerate(u2):
            if w == u:
                continue
            try:
                aad = prg.share_aad(tag, round, masked_topic, w, u)
                plain = prg.decrypt(sa["enc_keys"][str(w)], enc[i, u].tobytes(), aad)
            except SecAggError as exc:
                raise SecAggError(f"site {u}: the encrypted shares from site {w} for secure sum {topic!r}, "
                                  f"round {round} failed authentication (altered, misrouted, or encrypted "
                                  "under another key)") from exc
            b_shares[w] = shamir.from_bytes(plain[:shamir.SHARE_BYTES])
            next_shares[w] = shamir.from_bytes(plain[shamir.SHARE_BYTES:])

        s_for = [v for v in s_req if str(v) in sa["s_shares"]]
        b_rows = [shamir.to_bytes(b_shares[w]) for w in b_req]
        s_rows = [shamir.to_bytes(int(sa["s_shares"][str(v)], 16)) for v in s_for]

        # ratchet: the key pair announced with this sum masks the next one
        sa.update(
            epoch=int(sa["epoch"]) + 1, s_sk=op["next_s_sk"], keyset=u2,
            s_pk={str(w): pks[i].tobytes().hex() for i, w in enumerate(u2)},
            s_shares={str(w): hex(next_shares[w]) for w in u2},
            open=None, last={"topic": topic, "round": int(round), "included": u2})
        return Payload(
            arrays={"b_shares": _rows(b_rows), "s_shares": _rows(s_rows)},
            meta={"secagg": "unmask", "topic": topic, "b_for": b_req, "s_for": s_for},
            carries={"b_shares": "secagg-share", "s_shares": "secagg-share"})
    return step


def _recover(config: SecAggConfig, points: dict[int, int], check: Callable[[int], bool],
             what: str, bad_log: list[dict[str, Any]], topic: str, round: int) -> bytes:
    """Reconstruct one 32-byte secret from ``{site: share}``; name wrong shares; raise if impossible."""
    try:
        rec = shamir.reconstruct_verified({v + 1: s for v, s in points.items()}, config.threshold, check)
    except shamir.ShamirError as exc:
        raise SecAggError(
            f"secure sum {topic!r}, round {round}: could not reconstruct {what} from the shares of sites "
            f"{_sites(sorted(points))}: {exc}") from exc
    bad = [x - 1 for x in rec.bad]
    if bad:
        bad_log.append({"topic": topic, "round": int(round), "secret": what, "sites": bad})
        warnings.warn(
            f"secure sum {topic!r}, round {round}: the shares of {what} sent by sites {_sites(bad)} are "
            f"inconsistent (wrong); reconstructed it from sites {_sites([x - 1 for x in rec.used])} instead",
            SecAggWarning, stacklevel=2)
    out = _secret_bytes(rec.secret)
    assert out is not None  # the check already required a 32-byte value
    return out


def _unmask_aggregator(config: SecAggConfig, topic: str, on_sum: OnSum, context: Context | None = None
                       ) -> Callable[[State, int, dict[int, Payload]], Payload]:
    def step(agg_state: State, round: int, msgs: dict[int, Payload]) -> Payload:
        sa = _agg_state(agg_state)
        op = sa.get("open")
        if op is None or op["topic"] != topic or op["round"] != round:
            raise SecAggError(f"the {topic!r}-unmask phase must directly follow its -masked phase")
        u2, s_req = op["u2"], op["s_request"]
        u3 = sorted(v for v in msgs if v in u2)
        if len(u3) < config.threshold:
            raise SecAggError(
                f"secure sum {topic!r}, round {round}: only {len(u3)} sites responded to unmasking "
                f"(sites {_sites(u3)}), fewer than the threshold t={config.threshold}; the sum cannot be "
                "recovered")
        b_pts: dict[int, dict[int, int]] = {v: {} for v in u2}
        s_pts: dict[int, dict[int, int]] = {v: {} for v in s_req}
        for w in u3:
            p, who = msgs[w], f"unmasking shares from site {w}"
            b_for, s_for = [int(v) for v in p.meta.get("b_for", [])], [int(v) for v in p.meta.get("s_for", [])]
            if set(b_for) - set(u2) or set(s_for) - set(s_req):
                raise SecAggError(f"{who}: shares for sites that were not requested")
            rows_b = _need(p, "b_shares", (len(b_for), shamir.SHARE_BYTES), who)
            rows_s = _need(p, "s_shares", (len(s_for), shamir.SHARE_BYTES), who)
            for i, v in enumerate(b_for):
                b_pts[v][w] = int.from_bytes(rows_b[i].tobytes(), "big")
            for i, v in enumerate(s_for):
                s_pts[v][w] = int.from_bytes(rows_s[i].tobytes(), "big")

        bad_log = sa.setdefault("bad_shares", [])
        total = op["ysum"].copy()
        for v in u2:
            commit = bytes.fromhex(op["commit"][str(v)])

            def check_b(value: int, commit: bytes = commit) -> bool:
                seed = _secret_bytes(value)
                return seed is not None and _commit(seed) == commit

            seed = _recover(config, b_pts[v], check_b, f"the self-mask seed of site {v}", bad_log, topic, round)
            prg.add_mask(total, seed, -1)
        for v in s_req:
            pk = sa["s_pk"][str(v)]

            def check_s(value: int, pk: str = pk) -> bool:
                sk = _secret_bytes(value)
                return sk is not None and prg.public_key(sk).hex() == pk

            s_sk = prg.load_private(
                _recover(config, s_pts[v], check_s, f"the mask key of dropped site {v}", bad_log, topic, round))
            for u in u2:
                key = prg.mask_key(s_sk, bytes.fromhex(sa["s_pk"][str(u)]), sa["tag"], u, v,
                                   int(sa["epoch"]), round, _mask_topic(topic, context, agg_state))
                prg.add_mask(total, key, -1 if u < v else +1)  # undo what site u added
        values = config.decode(total).reshape(tuple(op["shape"]))

        sa["log"].append({"topic": topic, "round": int(round), "epoch": int(sa["epoch"]), "included": u2,
                          "responded": u3, "dropped_before_input": s_req})
        sa.update(epoch=int(sa["epoch"]) + 1, keyset=u2, s_pk=op["next_s_pk"], open=None,
                  last={"topic": topic, "round": int(round), "included": u2, "responded": u3})
        out = on_sum(agg_state, round, values)
        if not isinstance(out, Payload):
            raise TypeError(f"on_sum for secure sum {topic!r} must return a Payload, got {type(out).__name__}")
        return Payload(arrays=out.arrays, meta={**out.meta, "secagg_included": u2}, carries=out.carries)
    return step


def sum_phases(config: SecAggConfig, topic: str, input_key: str, on_sum: OnSum, context: Context | None = None
               ) -> list[Phase]:
    """The two phases of one secure sum of a float array over the sites.

    Parameters
    ----------
    config : SecAggConfig
        Shared by all parties; must match the one given to :func:`setup_phases`.
    topic : str
        Names the sum; the phases' topics are ``f"{topic}-masked"`` and
        ``f"{topic}-unmask"``. Must be unique within a round.
    input_key : str
        The key of a site's state that holds the float array it adds (the
        same shape at every site, ``|x| <= config.value_range``), put there
        by the protocol's own code before the masked phase's site step runs
        (a wrapper of that step, as CAPE's zero-sum noise does); the step
        takes it out of the state. Transient: it starts with ``_``, so no
        checkpoint keeps it.
    on_sum : callable
        ``on_sum(agg_state, round, total) -> Payload`` at the aggregator with
        the float sum over the sites whose inputs were included; its return
        value is broadcast, with ``meta["secagg_included"]`` (those sites)
        added. ``agg_state["secagg"]["last"]`` holds the same information.
    context : callable, optional
        ``context(state) -> str``, called with a site's state and with the
        aggregator's: what each party holds for this sum (CAPE: the digest of
        the noise plan it drew under, or broadcast). It enters every pairwise
        mask, so the masks cancel only if every party holds the same: an
        aggregator that told two honest sites different things learns a sum
        hidden by the masks that did not cancel, nothing of the inputs.

    Returns
    -------
    list of Phase
        ``[masked, unmask]``, both allowing dropouts.

    Notes
    -----
    The sum is exact up to fixed-point quantisation: each input is rounded
    stochastically (unbiased) to a multiple of ``config.quantum``, so
    ``|error| < n_included * config.quantum`` per entry. The aggregator
    raises :class:`SecAggError` if fewer than ``config.threshold`` sites
    send masked inputs or answer the unmasking request.
    """
    if not input_key.startswith("_"):
        raise ValueError(f"input_key must start with '_' (a transient state key, never checkpointed), got "
                         f"{input_key!r}")
    return [
        Phase(topic=f"{topic}-masked", site=_masked_site(config, topic, input_key, context),
              aggregator=_masked_aggregator(config, topic), allow_dropout=True),
        Phase(topic=f"{topic}-unmask", site=_unmask_site(config, topic),
              aggregator=_unmask_aggregator(config, topic, on_sum, context), allow_dropout=True),
    ]
