"""PD-SVD as a deployable reduction stage: the sites' secret agreed in the run, eigenvalues, unit scaling.

Tolerances. Two errors reach the eigenvalues:

* fixed point: secure aggregation sums numbers rounded (stochastically) to
  2^-32 ~ 2.3e-10, so the unblinded eigenvalue sum of 4 sites is off by less
  than 4 * 2.3e-10 ~ 1e-9 per entry -- a relative 1e-8 for eigenvalues of
  0.08-0.34 (unit-scaled data; their sum over all D is 1). The iterations'
  blinded inputs are scaled up by >= 2^8 and round even less.
* convergence: the subspace converges as (lambda_6 / lambda_5)^t ~ 0.04^40,
  to machine precision, but the eigenvalues are Rayleigh quotients of the
  individual final columns, and column i turns towards its own eigenvector
  only as (lambda_{i+1} / lambda_i)^t; its Rayleigh quotient is off by about
  that squared times the eigen-gap. With neighbouring ratios up to 0.83
  (seed 2) that is 0.83^80 * 0.05 ~ 2e-8, a relative ~1e-7 (observed: 1.3e-7).

So rtol 1e-6 on the eigenvalues (and 1e-6 on principal angles of the
subspace) holds with an order of magnitude to spare for these spectra, while a
wrong formula (a missing 1/n, c or norm_bound factor, unscaled columns, wrong
order) misses it by orders of magnitude.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from dpneuro.algorithms.pca import as_source
from dpneuro.algorithms.pdsvd import PDSVD, SiteInput, pd_pca, pd_svd
from dpneuro.data.matrix import column_norms, scale_factors
from dpneuro.protocol.driver import RunOptions, run_aggregator, run_site
from dpneuro.protocol.exchange import DirectoryCheckpoint, DirectoryExchange, InProcessExchange, Payload
from dpneuro.protocol.secagg import SecAggError, group_secret, group_secret_phase
from dpneuro.protocol.simulation import simulate

CLEAR = {"public", "secagg-mask", "secagg-share", "encrypted-share"}
D, K, S, N_ITER = 30, 5, 4, 40


def low_rank_sites(seed=0):
    """Rank-5 signal plus noise; every column then multiplied by a random factor (raw norms ~1 to ~400)."""
    rng = np.random.default_rng(seed)
    maps = np.linalg.qr(rng.standard_normal((D, K)))[0]
    Xs, lengths = [], []
    for _ in range(S):
        lens = [int(n) for n in rng.integers(15, 40, size=3)]  # three subjects of different lengths
        n = sum(lens)
        X = maps @ (np.array([6.0, 5.0, 4.0, 3.0, 2.5])[:, None] * rng.standard_normal((K, n)))
        X += 0.3 * rng.standard_normal((D, n))
        X *= 20.0 * np.exp(rng.normal(0.0, 1.0, n))[None, :]
        Xs.append(X)
        lengths.append(lens)
    return Xs, lengths


def unit_reference(Xs):
    """Eigen-decomposition of (1/n) sum_s Z_s Z_s^T, Z_s the unit-scaled columns, decreasing."""
    Z = np.hstack([X * scale_factors(column_norms(X), "unit") for X in Xs])
    w, U = np.linalg.eigh(Z @ Z.T / Z.shape[1])
    return w[::-1], U[:, ::-1]


def sin_max_angle(V, U):
    return float(np.linalg.norm(V - U @ (U.T @ V), 2))


def secret_in(obj, secret: bytes, path="") -> list[str]:
    """Where ``secret`` (raw or hex) occurs in a nested state/payload; [] if nowhere."""
    hits = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            hits += secret_in(k, secret, f"{path}/key") + secret_in(v, secret, f"{path}/{k}")
    elif isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(obj):
            hits += secret_in(v, secret, f"{path}[{i}]")
    elif isinstance(obj, Payload):
        hits += secret_in(dict(obj.arrays), secret, f"{path}.arrays")
        hits += secret_in(json.dumps(obj.meta, default=str), secret, f"{path}.meta")
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        if secret in b or secret.hex().encode() in b:
            hits.append(path)
    elif isinstance(obj, np.ndarray):
        if obj.dtype == object:
            hits += secret_in(list(obj.ravel()), secret, path)
        elif secret in obj.tobytes():
            hits.append(path)
    elif isinstance(obj, str):
        if secret.hex() in obj or secret.hex().upper() in obj:
            hits.append(path)
    return hits


class RecordingExchange(InProcessExchange):
    """Keeps every payload that passes (both directions); ``tamper`` may alter a broadcast."""

    def __init__(self, *a, tamper=None, **kw):
        super().__init__(*a, **kw)
        self.traffic: list[tuple[str, int, str, Payload]] = []
        self.tamper = tamper
        self._rec = threading.Lock()

    def send(self, site, round, topic, payload):
        with self._rec:
            self.traffic.append((f"site {site}", round, topic, payload))
        super().send(site, round, topic, payload)

    def broadcast(self, round, topic, payload):
        if self.tamper is not None:
            payload = self.tamper(round, topic, payload)
        with self._rec:
            self.traffic.append(("aggregator", round, topic, payload))
        super().broadcast(round, topic, payload)

    def raw_blobs(self) -> list[bytes]:
        """The encoded messages as stored by the exchange (what would cross the network)."""
        with self._cond:
            return list(self._sent.values()) + list(self._broadcasts.values())


def deploy_protocol(**kw) -> PDSVD:
    opts = dict(n_sites=S, random_state=3, norm_bound=1.0, group_secret=True, eigenvalues=True, scale="unit")
    opts.update(kw)
    return PDSVD(K, N_ITER, **opts)


@pytest.fixture(scope="module")
def deployed():
    Xs, lengths = low_rank_sites()
    ex = RecordingExchange(n_sites=S)
    sources = [as_source(X, lens) for X, lens in zip(Xs, lengths, strict=True)]  # plain sources: no SiteInput
    res = simulate(deploy_protocol(), sources, exchange=ex, options=RunOptions(timeout=60))
    return Xs, res, ex


def test_group_secret_eigenvalues_and_unit_scaling_give_the_pooled_eigensystem(deployed):
    Xs, res, ex = deployed
    lam_ref, U_ref = unit_reference(Xs)
    assert lam_ref[K] / lam_ref[K - 1] < 0.1  # a well-separated spectrum: the test data are as intended
    agg = res.aggregator
    V, lam = agg["basis"], agg["eigenvalues"]
    assert V.shape == (D, K) and lam.shape == (K,)
    assert np.allclose(V.T @ V, np.eye(K), atol=1e-12)
    assert sin_max_angle(V, U_ref[:, :K]) < 1e-6
    np.testing.assert_allclose(lam, lam_ref[:K], rtol=1e-6)
    assert np.all(np.diff(lam) < 0)
    # each column is its eigenvector (not only the span), in the order of the eigenvalues
    assert np.allclose(np.abs(np.sum(V * U_ref[:, :K], axis=0)), 1.0, atol=1e-6)
    # the scaling matters: the raw data's top-5 subspace is a different one
    X = np.hstack(Xs)
    U_raw = np.linalg.eigh(X @ X.T)[1][:, ::-1][:, :K]
    assert sin_max_angle(V, U_raw) > 1e-2
    # one extra round: the eigenvalue sum, after the 40 iterations
    assert agg["rounds"] == N_ITER + 1
    assert [t["topic"] for t in agg["transcript"]].count("it") == N_ITER
    # every site ends with the aggregator's basis and eigenvalues
    for s, st in enumerate(res.sites):
        final = st["final"]
        assert final.meta.get("stop") is True
        np.testing.assert_array_equal(final.arrays["V"], V, err_msg=f"site {s}")
        np.testing.assert_array_equal(final.arrays["eigenvalues"], lam, err_msg=f"site {s}")
        assert any("unit norm" in n for n in st["ledger"].notes)
        assert any("eigenvalues" in n for n in st["ledger"].notes)
    final_bcast = [p for who, _, topic, p in ex.traffic if who == "aggregator" and topic == "pdsvd-eig-unmask"]
    assert len(final_bcast) == 1 and dict(final_bcast[0].carries) == {"V": "public", "eigenvalues": "public"}
    for s in range(S):
        for rec in ex.egress_log(s):
            assert {a["carries"] for a in rec["arrays"].values()} <= CLEAR, rec


def test_the_aggregator_relays_but_never_holds_the_group_secret(deployed):
    Xs, res, ex = deployed
    secrets_ = [st["secagg"]["group"]["secret"] for st in res.sites]
    assert all(isinstance(k, bytes) and len(k) == 32 for k in secrets_)
    assert len(set(secrets_)) == 1  # every site derived the same K
    K_ = secrets_[0]
    assert all(st["secagg"]["group"]["leader"] == 0 for st in res.sites)
    # the aggregator's state, every message in both directions, and the encoded bytes on the wire
    assert secret_in(res.aggregator, K_) == []
    assert res.aggregator["secagg"]["group"] == {"topic": "pdsvd-group-secret", "round": 0, "leader": 0,
                                                 "members": [0, 1, 2, 3]}
    assert [where for who, rnd, topic, p in ex.traffic for where in secret_in(p, K_, f"{who} {topic}")] == []
    assert all(K_ not in blob and K_.hex().encode() not in blob for blob in ex.raw_blobs())
    # ... while the leader did send it (encrypted) and only the leader sent arrays in that phase
    sent = {who: p for who, _, topic, p in ex.traffic if topic == "pdsvd-group-secret"}
    assert set(sent) == {"site 0", "site 1", "site 2", "site 3", "aggregator"}
    assert dict(sent["site 0"].carries) == {"enc": "encrypted-share"}
    assert all(not sent[f"site {s}"].arrays for s in (1, 2, 3))
    # the count sum decoded (sites raise otherwise): all four blinded it with the same K
    t = next(t for t in res.aggregator["transcript"] if t["topic"] == "n")
    assert round(t["value"] / t["check"] * S) == sum(X.shape[1] for X in Xs)


def test_a_tampered_ciphertext_is_refused_by_its_recipient():
    Xs, lengths = low_rank_sites(seed=1)

    def flip(round, topic, payload):
        if topic != "pdsvd-group-secret":
            return payload
        enc = np.array(payload.arrays["enc"], copy=True)
        enc[2, 20] ^= 0x01  # one bit of site 2's ciphertext
        return Payload({"enc": enc}, payload.meta, payload.carries)

    ex = RecordingExchange(n_sites=S, tamper=flip)
    with pytest.raises(SecAggError, match="site 2: the encrypted group secret from site 0 .*failed authentication"):
        simulate(PDSVD(K, 2, n_sites=S, random_state=0, group_secret=True, scale="unit"),
                 [as_source(X) for X in Xs], exchange=ex, options=RunOptions(timeout=20))


def test_group_secret_helper_on_its_own():
    """Direct use of the phase functions: decrypt once, cache, refuse a wrong or missing broadcast."""
    from dpneuro.protocol.secagg import SecAggConfig, setup_phases

    cfg = SecAggConfig(n_sites=3)
    phases = setup_phases(cfg) + [group_secret_phase(cfg, "gs")]
    sites = [{"site": s} for s in range(3)]
    agg: dict = {}
    incoming = [None] * 3
    for ph in phases:
        msgs = {s: ph.site(sites[s], 0, incoming[s]) for s in range(3)}
        out = ph.aggregator(agg, 0, msgs)
        incoming = [out] * 3
    bcast = incoming[0]
    with pytest.raises(SecAggError, match="needs its broadcast"):
        group_secret(sites[1])
    enc = np.array(bcast.arrays["enc"], copy=True)
    enc[1, -1] ^= 0x80  # the authentication tag of site 1's ciphertext
    with pytest.raises(SecAggError, match="failed authentication"):
        group_secret(sites[1], Payload({"enc": enc}, bcast.meta, bcast.carries))
    keys = [group_secret(st, bcast) for st in sites]
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    assert group_secret(sites[2]) == keys[0]  # cached: no broadcast needed any more
    assert secret_in(agg, keys[0]) == [] and secret_in(bcast, keys[0]) == []
    with pytest.raises(SecAggError, match="no group secret"):
        group_secret({"site": 0, "secagg": {"site": 0}})


def test_over_the_directory_exchange_one_exchange_per_party(tmp_path):
    """Aggregator and sites as separate parties (threads) sharing only a folder; checkpoints at two of them."""
    Xs, lengths = low_rank_sites(seed=2)
    key, root, run_id = bytes(range(32)), tmp_path / "shared", "pdsvd-deploy"
    proto = deploy_protocol()
    out: dict = {}

    def party(name, fn):
        try:
            out[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[name] = exc

    def site(s):
        ex = DirectoryExchange(root, S, run_id=run_id, key=key, poll_interval=0.005)
        try:
            # checkpoints (write-ahead, fsynced every phase) only where the test reads them: they triple the time
            ckpt = DirectoryCheckpoint(tmp_path / f"site-{s}.npz") if s == 1 else None
            return run_site(proto, s, as_source(Xs[s], lengths[s]), ex, timeout=60, checkpoint=ckpt)
        finally:
            ex.close()

    def aggregator():
        ex = DirectoryExchange(root, S, run_id=run_id, key=key, poll_interval=0.005)
        try:
            return run_aggregator(proto, ex, checkpoint=DirectoryCheckpoint(tmp_path / "agg.npz"),
                                  options=RunOptions(timeout=60))
        finally:
            ex.close()

    threads = [threading.Thread(target=party, args=("agg", aggregator), daemon=True)]
    threads += [threading.Thread(target=party, args=(s, lambda s=s: site(s)), daemon=True) for s in range(S)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    errors = {k: v for k, v in out.items() if isinstance(v, BaseException)}
    assert not errors and len(out) == S + 1, errors
    agg = out["agg"]
    lam_ref, U_ref = unit_reference(Xs)
    assert sin_max_angle(agg["basis"], U_ref[:, :K]) < 1e-6
    np.testing.assert_allclose(agg["eigenvalues"], lam_ref[:K], rtol=1e-6)
    for s in range(S):
        np.testing.assert_array_equal(out[s]["final"].arrays["V"], agg["basis"])
        np.testing.assert_array_equal(out[s]["final"].arrays["eigenvalues"], agg["eigenvalues"])
    K_ = out[0]["secagg"]["group"]["secret"]
    assert all(out[s]["secagg"]["group"]["secret"] == K_ for s in range(S))
    # a site's checkpoint keeps K (a restarted site needs it); nothing the aggregator has or saw does
    assert DirectoryCheckpoint(tmp_path / "site-1.npz").load()["state"]["secagg"]["group"]["secret"] == K_
    assert secret_in(DirectoryCheckpoint(tmp_path / "agg.npz").load(), K_) == []
    assert secret_in(agg, K_) == []
    files = [p for p in (root / run_id).rglob("*") if p.is_file()]
    assert any(p.suffix == ".msg" for p in files)
    assert [p for p in files if K_ in p.read_bytes() or K_.hex().encode() in p.read_bytes()] == []
    for s in range(S):  # every array that left a site is masked, encrypted or public
        for line in (root / run_id / "egress" / f"site-{s:03d}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            assert {a["carries"] for a in rec["arrays"].values()} <= CLEAR, rec


# -- the options on their own, and through pd_svd / pd_pca --------------------------------------

def test_eigenvalues_are_scaled_back_by_the_norm_bound_and_centred_for_pd_pca():
    """pd_svd: raw data over their largest column norm; pd_pca: unit-scaled columns, centred (c = 4)."""
    rng = np.random.default_rng(4)
    maps = np.linalg.qr(rng.standard_normal((12, 3)))[0]
    Xs = [maps @ (np.array([5.0, 3.0, 1.5])[:, None] * rng.standard_normal((3, 60)))
          + 0.2 * rng.standard_normal((12, 60)) + 2.0 * (s + 1) * maps[:, :1] for s in range(3)]
    X = np.hstack(Xs)
    n = X.shape[1]
    res = pd_svd(Xs, 3, 40, random_state=1, eigenvalues=True)  # norm_bound: the largest raw column norm (>> 1)
    assert res.norm_bound > 5
    w, U = np.linalg.eigh(X @ X.T / n)
    np.testing.assert_allclose(res.eigenvalues, w[::-1][:3], rtol=1e-6)
    assert sin_max_angle(res.basis, U[:, ::-1][:, :3]) < 1e-6
    # PD-PCA of unit-scaled columns: the secure mean and the centring use the scaled columns too
    pca = pd_pca(Xs, 3, 40, random_state=1, eigenvalues=True, group_secret=True, scale="unit")
    assert pca.norm_bound == 1.0
    Z = X * scale_factors(column_norms(X), "unit")
    Xc = Z - Z.mean(axis=1, keepdims=True)
    wc, Uc = np.linalg.eigh(Xc @ Xc.T / n)
    assert wc[-4] / wc[-3] < 0.5  # separated (the test data are as intended)
    np.testing.assert_allclose(pca.eigenvalues, wc[::-1][:3], rtol=1e-6)
    assert sin_max_angle(pca.basis, Uc[:, ::-1][:, :3]) < 1e-6


def test_group_secret_alone_gives_the_same_basis_as_an_out_of_band_secret():
    Xs, _ = low_rank_sites(seed=5)
    Zs = [X * scale_factors(column_norms(X), "unit") for X in Xs]
    agreed = pd_svd(Xs, K, 10, random_state=2, scale="unit", group_secret=True)
    given = pd_svd(Zs, K, 10, random_state=2, norm_bound=1.0, site_secret=b"s" * 32)
    assert agreed.eigenvalues is None and given.eigenvalues is None
    assert sin_max_angle(agreed.basis, given.basis) < 1e-7  # 10 rounds: not converged, the same iterate


def test_the_final_broadcast_sorts_the_basis_by_eigenvalue():
    """The aggregator's last step on its own: columns follow the eigenvalues, both public, the run stops."""
    proto = PDSVD(3, 2, n_sites=3, secure=False, eigenvalues=True, norm_bound=2.0, center=True)
    V = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 3)))[0]
    state = {"V": V, "sites": [0, 1, 2], "transcript": []}
    out = proto._on_eig(state, 2, np.diag([0.01, 0.03, 0.02]).ravel())
    lam = np.array([0.03, 0.02, 0.01]) * 4 * 2.0**2  # times c and norm_bound^2
    np.testing.assert_allclose(out.arrays["eigenvalues"], lam, rtol=1e-15)
    np.testing.assert_array_equal(out.arrays["V"], V[:, [1, 2, 0]])
    # Rayleigh-Ritz: a non-diagonal projected matrix rotates the basis onto its eigenvectors, within the span
    H = np.array([[0.03, 0.01, 0.0], [0.01, 0.02, 0.005], [0.0, 0.005, 0.01]])
    rot = proto._on_eig({"V": V, "sites": [0, 1, 2], "transcript": []}, 2, H.ravel())
    U = V.T @ rot.arrays["V"]  # the rotation applied
    np.testing.assert_allclose(U.T @ U, np.eye(3), atol=1e-12)
    np.testing.assert_allclose(U.T @ H @ U * 16, np.diag(rot.arrays["eigenvalues"]), atol=1e-12)
    assert np.all(np.diff(rot.arrays["eigenvalues"]) < 0)
    assert out.meta == {"stop": True} and dict(out.carries) == {"V": "public", "eigenvalues": "public"}
    np.testing.assert_array_equal(state["basis"], out.arrays["V"])
    np.testing.assert_array_equal(state["eigenvalues"], out.arrays["eigenvalues"])
    assert proto.max_rounds == 3 and [p.topic for p in proto.phases(2)] == ["pdsvd-eig"]
    assert PDSVD(3, 2, n_sites=3).max_rounds == 2  # without the option: no extra round


@pytest.mark.parametrize("kw, match", [
    ({"group_secret": True, "secure": False}, "group_secret=True .* needs secure=True"),
    ({"scale": "clip"}, "scale must be None .* or 'unit'"),
    ({"scale": 2.0}, "scale must be None .* or 'unit'"),
    ({"scale": "Unit"}, "scale must be None .* or 'unit'"),
])
def test_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        PDSVD(2, 3, n_sites=3, **kw)


def test_raw_data_need_the_unit_scaling_and_a_bound_of_at_least_one():
    Xs, lengths = low_rank_sites(seed=6)
    ex = InProcessExchange(n_sites=S)
    with pytest.raises(ValueError, match=r"norm \d.* above the public norm bound"):
        simulate(deploy_protocol(scale=None), [as_source(X, lens) for X, lens in zip(Xs, lengths)], exchange=ex)
    ex2 = InProcessExchange(n_sites=S)
    with pytest.raises(ValueError, match=r"norm 1 \(after unit scaling\) above the public norm bound 0.5"):
        simulate(deploy_protocol(norm_bound=0.5), [as_source(X, lens) for X, lens in zip(Xs, lengths)],
                 exchange=ex2)
    with pytest.raises(ValueError, match="do not also give one in SiteInput"):
        deploy_protocol().site_init(0, SiteInput(Xs[0], b"s" * 32))
    assert all(e.egress_log(s) == [] for e in (ex, ex2) for s in range(S))  # refused before anything was sent
