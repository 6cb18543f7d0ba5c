"""PD-SVD and PD-PCA ([PD-ML-Lite] Sec. 3, Alg. 3, 4, 6, 7) and the KS distributional privacy measurement (Alg. 5).

No differential-privacy noise is added here. PD-SVD computes the *exact*
top-k subspace of the pooled data (up to the iteration's convergence and the
fixed-point resolution of secure aggregation); its privacy is *measured* with
:func:`ks_privacy`, never stated as (eps, delta). Every site's ledger records
no Gaussian release and is marked not private, so its ``epsilon()`` is
infinite: PD-SVD gives no differential-privacy guarantee.

Orientation
-----------
[PD-ML-Lite] stores samples as rows (X^(m) is n_m x d) and computes the right singular
vectors of the stacked rows, the top-k eigenvectors of sum_m X^(m)T X^(m).
Here a site's data are D x N_s (columns are samples), so the same basis is the
top-k eigenvectors of ``S = sum_s X_s X_s^T`` (D x D), the left singular
vectors of ``[X_1 ... X_S]``.

Protocol (block power iteration, [PD-ML-Lite] Alg. 3-4, on the generic driver)
-----------------------------------------------------------------------------
``pdsvd-setup``  sites announce D (public); the aggregator broadcasts
                 V_0 = orth(N(0, 1/D)^{D x k}) drawn from the agreed public
                 seed, and a public run nonce.
``pdsvd-group-secret``  ``group_secret=True`` only, after secure aggregation's
                 setup: the sites agree the blinding key K
                 (:func:`dpneuro.protocol.secagg.group_secret_phase`, see below).
secure sums      (secure aggregation, dpneuro.protocol.secagg; SECSUM of [PD-ML-Lite] App. C)
  ``pdsvd-n``     the total count n (the aggregator learns it, see below);
  ``pdsvd-mean``  PD-PCA only ([PD-ML-Lite] App. D, Alg. 6): the global mean
                  mu = sum_s X_s 1 / n; each site then works with
                  X_s - mu 1^T (secure centring);
  ``pdsvd-it``    every round t: sum_s S_s V_t, one column per normalised sum
                  (NORMEDSECSUM, [PD-ML-Lite] Alg. 7); the aggregator orthonormalises
                  (QR, diag R >= 0) and broadcasts V_{t+1}.
  ``pdsvd-eig``   ``eigenvalues=True`` only, one extra round after the
                  ``n_iter`` iterations: sum_s V^T S_s V / (c n) for the
                  final V (k x k), *not* blinded; the aggregator
                  eigendecomposes it (Rayleigh-Ritz), rotates V by its
                  eigenvectors within the span, sorts by decreasing eigenvalue
                  (times c: the eigenvalues of the pooled second-moment matrix
                  (1/n) sum_s X_s X_s^T, or of the covariance for PD-PCA,
                  restricted to the final subspace) and broadcasts ``V`` and
                  ``eigenvalues`` with the stop signal, so every site ends
                  with the aggregator's basis and eigenvalues (what whitening
                  and the maps need). The rotation is published as the new
                  basis anyway, so the k x k matrix reveals nothing beyond the
                  eigenvalues; whitening with them is exact within the
                  subspace, whose accuracy is (lambda_{k+1}/lambda_k)^t.
``scale="unit"`` first brings every column (time point) to unit L2 norm at
its site, block by block as the data are streamed (the per-column scaling of
:func:`dpneuro.data.matrix.scale_columns` and capePCA's ``scale="unit"``, in float64);
everything above, the norm check included, then concerns the scaled columns
and the eigenvalues are those of the scaled data.
Data are divided by a public ``norm_bound`` (every column norm <= it; for a
simulation the largest column norm, treated as public) so that every value
a site feeds to the fixed-point secure sum is bounded ([PD-ML-Lite] App. E scales by a
secure sum of local Frobenius norms for the same purpose; the bound here needs
no extra sum). The subspace is unchanged; revealed singular values and eigenvalues are scaled back.

Normalised secure sum: construction and threat model
----------------------------------------------------
[PD-ML-Lite] computes s / ||s|| inside SPDZ so that nobody sees ||s|| (the singular
values). dpneuro has no general MPC; instead the *sites* share a secret key K,
fresh per run and never given to the aggregator, in one of two ways:

* ``group_secret=False`` (default): ``site_secret``, distributed to every site
  out of band. Whoever distributes it must keep it from the aggregator -- a
  configuration the aggregator also reads (e.g. a consortium's shared site
  configuration) does not.
* ``group_secret=True`` (needs ``secure=True``): K is agreed in the run
  (phase ``pdsvd-group-secret``) with secure aggregation's keys: the site with
  the lowest id draws K from ``os.urandom`` and sends it to every other site
  encrypted (AES-256-GCM under the pairwise X25519-derived key of the secagg
  setup, the associated data binding run, round, topic, sender and
  recipient). The aggregator relays the ciphertexts but cannot read them; an
  altered ciphertext makes its recipient stop (SecAggError). No secret has to
  be configured anywhere.

From K and the public run nonce each site derives, with a keyed
hash (BLAKE2b as a PRF), the same positive factor r_{t,i} for column i of round
t and feeds ``r_{t,i} * (S_s V_t)[:, i] / (c n)`` to the secure sum. Positive
column scaling changes neither s / ||s|| nor the QR factor Q, so the
aggregator still computes the exact next iterate.
r_{t,i} = 2^(lo + a u_i + b u_{t,i}), u uniform from the PRF: a factor
rho_i fixed for the run (``a`` = 6 bits by default) times a fresh factor
(``b`` = 5 bits), lo = 8 (for fixed-point resolution).

Who learns what (honest-but-curious parties):

* The aggregator sees, per round, the blinded column sums: their directions
  (exactly what the sites learn from V_{t+1} anyway) and each column norm
  ||S v_{t,i}|| only times the unknown r_{t,i}: the scale of every singular
  value stays hidden within a factor 2^a (not reduced by repetition: rho_i is
  fixed for the run), iteration-to-iteration changes within a factor 2^b per
  observation, and ratios between columns are blinded by independent factors.
  It learns the total number of time points n *exactly*: the count sum is
  [n r_n, S r_n] (the second entry lets every site check that all S sites
  joined with the same secret), and S is public, so n = S x first / second.
  That is no leak in dpneuro's model, where every site's numbers of subjects
  and time points are public anyway. The global mean (PD-PCA) is blinded by
  one factor (its direction is visible). It never sees one site's
  contribution: secure aggregation masks each input.
  This is *statistical* hiding of the singular values, weaker than the
  MPC normalisation of [PD-ML-Lite] (which reveals nothing but s / ||s||); the KS
  measurement below is how to check what it leaks for a given data set.
* Every site learns V_t for every t, the final V, n and (PD-PCA) mu --
  never the norms: the broadcast is orthonormalised.
* With ``eigenvalues=True`` the aggregator (and every site) also learns the
  final k eigenvalues of (1/n) sum_s X_s X_s^T (i.e., with n, the top-k
  singular values at the end of the run): that is what whitening and the
  maps need. It does not learn the iterates' norms ||S V_t|| directly, but
  it is not blind to them either: the final eigenvalues against the last
  round's blinded norms give away that round's factors r_{T,i}, hence rho_i
  up to the fresh part, so earlier rounds' norms stay hidden only within
  the fresh factors (about 2^b either way) instead of 2^(a+b).
* Collusion that breaks it: the aggregator together with ANY ONE site learns
  K (with ``group_secret=True`` as with an out-of-band secret: every site
  holds K), hence every r_{t,i}: it then sees S V_t exactly, i.e. the singular values
  and the convergence profile (the Sigma-revealing SECSUM variant of [PD-ML-Lite]).
  The individual sites' inputs stay protected by secure aggregation unless
  the aggregator also gathers the Shamir threshold's worth of sites
  (dpneuro.protocol.secagg). Coalitions of sites without the aggregator see only
  the outputs above. A malicious aggregator could send sites a V of its
  choosing; only honest-but-curious behaviour is covered.

``reveal_singular_values=True`` runs the plain-SECSUM variant (no blinding):
the aggregator learns S V_t and the result carries ``singular_values``.
``secure=False`` replaces secure aggregation by a plain sum (tests and the KS
simulations only: individual blinded inputs are then visible to the aggregator).

PD-PCA centring ([PD-ML-Lite] Alg. 6 as printed subtracts ``(n_m / n) * sum_i x_i`` from
party m's rows, which is not the global mean; the text before it and App. D
mean the global mean, which is what is implemented).
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpneuro.algorithms.pca import SiteSource, as_source, check_k, check_sources, orthonormalize, scale_note
from dpneuro.data.matrix import column_norms, scale_factors
from dpneuro.privacy import PrivacyLedger, resolve_random_state
from dpneuro.protocol import secagg
from dpneuro.protocol.driver import Phase, RunOptions, State
from dpneuro.protocol.exchange import Payload
from dpneuro.protocol.simulation import simulate

__all__ = [
    "KSPrivacyResult",
    "PDSVD",
    "PDSVDResult",
    "SiteInput",
    "covariance_statistics",
    "ks_privacy",
    "pd_pca",
    "pd_svd",
]

#: where a site's input waits for the secure sum (transient: never checkpointed)
_SUM_INPUT = "_pdsvd_sum"
_COUNT_UNIT = 2.0**-20  # counts enter the secure sum as n_m * r_n * 2^-20 (exact after rounding)
_COUNT_BITS = 6.0
_NOTE = ("PD-SVD adds no differential-privacy noise: its privacy is measured (KS distributional privacy, "
         "[PD-ML-Lite] Alg. 5), not an (eps, delta) guarantee, so its epsilon() is infinite. The aggregator learns "
         "the total number of time points n (public in dpneuro's model). What the aggregator "
         "and the sites learn: dpneuro.algorithms.pdsvd module docstring")


@dataclass(frozen=True)
class SiteInput:
    """What a site brings to PD-SVD: its data and the sites' shared secret (never sent anywhere)."""

    data: Any
    secret: bytes | None = None


def _prf_uniform(key: bytes, label: str) -> float:
    """A uniform number in (0, 1) from a keyed BLAKE2b (a PRF keyed by the sites' secret)."""
    h = hashlib.blake2b(label.encode(), key=key, digest_size=8).digest()
    return (int.from_bytes(h, "big") + 0.5) / 2.0**64


def _max_scaled_norm(src: SiteSource, scale: str | None) -> float:
    """The largest column norm of a validated source's data as PD-SVD uses them (after ``scale``)."""
    if scale != "unit":
        return float(src.max_norm)
    # unit scaling (dpneuro.data.matrix.scale_factors) brings every nonzero column to norm 1 and keeps zero
    # columns at 0: the scaled data's largest column norm is 1 unless every column is zero
    return 1.0 if src.max_norm > 0 else 0.0


@dataclass(frozen=True)
class Blinding:
    """Exponents of the blinding factors (bits): r = 2^(lo + fixed * u + fresh * u')."""

    lo: float = 8.0
    fixed: float = 6.0
    fresh: float = 5.0

    @property
    def hi(self) -> float:
        return self.lo + self.fixed + self.fresh


class PDSVD:
    """PD-SVD / PD-PCA as a protocol for :mod:`dpneuro.protocol.driver` (see the module docstring).

    Parameters
    ----------
    k, n_iter : int
        Subspace dimension and number of power iterations (rounds).
    n_sites : int
    center : bool
        PD-PCA: centre on the securely summed global mean first.
    reveal_singular_values : bool
        Plain SECSUM variant: the aggregator learns S V_t; the result has singular values.
    random_state : None, int or numpy Generator
        The agreed public seed of V_0 (a Generator gives it by one draw; None: the aggregator draws one).
    norm_bound : float
        Public bound on every column's L2 norm (data are divided by it).
    secure : bool
        Secure aggregation (default) or a plain sum (tests, simulations).
    secagg_config : SecAggConfig, optional
    blinding : Blinding, optional
    group_secret : bool
        Agree the sites' blinding secret K inside the run (the phase
        ``pdsvd-group-secret``, :func:`dpneuro.protocol.secagg.group_secret_phase`)
        instead of taking it from ``SiteInput(data, secret)``; needs
        ``secure=True``. Sites then take plain data (no secret).
    eigenvalues : bool
        One extra round after the ``n_iter`` iterations: a secure sum of the
        sites' V^T S_s V for the final basis, then Rayleigh-Ritz (the basis
        rotated to the eigenvectors within its span). The aggregator's state
        gets ``basis`` (D x k, columns by decreasing eigenvalue) and
        ``eigenvalues`` (k,), and the final broadcast carries both (arrays
        ``"V"`` and ``"eigenvalues"``), so every site ends with the same.
    scale : None or "unit"
        ``"unit"``: every column (time point) is scaled to unit L2 norm at its
        site, block by block, before anything is computed from it (the
        scaling of :func:`dpneuro.data.matrix.scale_columns` and of capePCA's
        ``scale="unit"``; zero columns stay zero). The norm check then applies
        to the scaled columns, so ``norm_bound=1.0`` admits raw data.
    privacy_note : str, optional
        Why every site's ledger is not private, in the caller's terms (default:
        this module's statement); a product states its own threat model here.
    """

    name = "pdsvd"

    def __init__(self, k: int, n_iter: int, *, n_sites: int, center: bool = False,
                 reveal_singular_values: bool = False, random_state=None, norm_bound: float = 1.0,
                 secure: bool = True, secagg_config=None, blinding: Blinding | None = None, nonce: str | None = None,
                 group_secret: bool = False, eigenvalues: bool = False, scale: str | None = None,
                 privacy_note: str | None = None):
        self.k = check_k(k)
        if isinstance(n_iter, bool) or not isinstance(n_iter, (int, np.integer)) or n_iter < 1:
            raise ValueError(f"n_iter must be a positive integer, got {n_iter!r}")
        if not (float(norm_bound) > 0 and math.isfinite(float(norm_bound))):
            raise ValueError(f"norm_bound must be positive and finite, got {norm_bound!r}")
        if scale is not None and not (isinstance(scale, str) and scale == "unit"):
            raise ValueError(f"scale must be None (data already within the norm bound) or 'unit' (every column "
                             f"scaled to unit norm at its site), got {scale!r}")
        if group_secret and not secure:
            raise ValueError("group_secret=True agrees the sites' secret through secure aggregation's keys and "
                             "needs secure=True; with secure=False give every site SiteInput(data, secret)")
        self.n_iter = int(n_iter)
        self.eigenvalues, self.group_secret, self.scale = bool(eigenvalues), bool(group_secret), scale
        self.max_rounds = self.n_iter + (1 if self.eigenvalues else 0)  # the eigenvalue sum: one extra round
        self.n_sites, self.center, self.reveal = int(n_sites), bool(center), bool(reveal_singular_values)
        self.random_state = resolve_random_state(random_state)
        self.norm_bound, self.secure = float(norm_bound), bool(secure)
        self.c = 4.0 if self.center else 1.0  # ||x - mu||^2 <= 4 when ||x||, ||mu|| <= 1
        self.blinding = blinding or Blinding()
        self.nonce = nonce
        self.privacy_note = privacy_note
        if self.secure:
            self._secagg = secagg
            self.cfg = secagg_config or secagg.SecAggConfig(n_sites=self.n_sites)
            value_range = self.cfg.value_range
            self._frac_bits = self.cfg.frac_bits
        else:
            self._secagg, self.cfg = None, None
            value_range = 2.0**20
            self._frac_bits = 52  # plain float sums: rounding at double precision
        if not self.reveal and 2.0**self.blinding.hi > value_range:
            raise ValueError(f"blinding factors up to 2^{self.blinding.hi:g} exceed the secure sum's value range "
                             f"{value_range:g}")
        self._setup = [Phase("pdsvd-setup", self._site_setup, self._agg_setup)]
        if self.secure:
            self._setup += [self._wrap(p) for p in self._secagg.setup_phases(self.cfg)]
            if self.group_secret:
                self._setup.append(self._wrap(self._secagg.group_secret_phase(self.cfg, "pdsvd-group-secret")))
        self._setup += self._sum("pdsvd-n", self._input_count, self._on_count)
        if self.center:
            self._setup += self._sum("pdsvd-mean", self._input_mean, self._on_mean)
        self._iter = self._sum("pdsvd-it", self._input_iter, self._on_iter)
        self._eig = self._sum("pdsvd-eig", self._input_eig, self._on_eig) if self.eigenvalues else []

    # -- phases ------------------------------------------------------------------------------
    def phases(self, round: int) -> Sequence[Phase]:
        if round >= self.n_iter:  # only with eigenvalues=True: the round after the iterations
            return self._eig
        return self._setup + self._iter if round == 0 else self._iter

    def _sum(self, topic: str, get_input: Callable, on_sum: Callable) -> list[Phase]:
        """A secure sum (or, with secure=False, a plain sum) whose site steps first absorb broadcasts."""
        if self.secure:
            masked, unmask = self._secagg.sum_phases(self.cfg, topic, _SUM_INPUT, on_sum)
            return [self._wrap(masked, before=get_input), self._wrap(unmask)]

        def site(state: State, rnd: int, incoming: Payload | None) -> Payload:
            return Payload({"x": np.asarray(get_input(state, rnd), dtype=np.float64)},
                           carries={"x": "NOT MASKED (secure=False: simulation only)"})

        def agg(state: State, rnd: int, msgs: dict[int, Payload]) -> Payload:
            state["_included"] = sorted(msgs)
            total = sum(msgs[s].arrays["x"] for s in sorted(msgs))
            return on_sum(state, rnd, total)

        return [self._wrap(Phase(topic, site, agg))]

    def _wrap(self, phase: Phase, before: Callable | None = None) -> Phase:
        """A phase whose site step first keeps what the broadcast carries; with ``before`` (a secure sum's
        masked phase), then puts ``before(state, round)`` where the sum reads its input."""
        site_fn = phase.site

        def site(state: State, rnd: int, incoming: Payload | None) -> Payload:
            if incoming is not None:
                for key, arr in incoming.arrays.items():
                    if key.startswith("pdsvd/"):
                        state[key] = np.asarray(arr)
                if "pdsvd_nonce" in incoming.meta:
                    state["nonce"] = incoming.meta["pdsvd_nonce"]
                if self.group_secret and incoming.meta.get("secagg") == "group-secret":
                    self._secagg.group_secret(state, incoming)  # decrypt K once; cached in state["secagg"]
            if before is not None:
                state[_SUM_INPUT] = before(state, rnd)
            return site_fn(state, rnd, incoming)

        return Phase(phase.topic, site, phase.aggregator, phase.site_spec, phase.broadcast_spec,
                     phase.allow_dropout)

    # -- parties -------------------------------------------------------------------------------
    def site_init(self, site: int, data: Any) -> State:
        secret = None
        if isinstance(data, SiteInput):
            data, secret = data.data, data.secret
        if self.group_secret:
            if secret is not None:
                raise ValueError(f"site {site}: group_secret=True agrees the sites' secret inside the run; do not "
                                 "also give one in SiteInput")
        elif not self.reveal:
            if not isinstance(secret, (bytes, bytearray)) or not 16 <= len(secret) <= 64:
                raise ValueError(f"site {site}: PD-SVD needs the sites' shared secret (16-64 bytes) to blind "
                                 "the normalised sums; give SiteInput(data, secret)")
        src = as_source(data).validate(f"site {site}")
        if self.k > src.dim:
            raise ValueError(f"site {site}: k = {self.k} exceeds the number of features D = {src.dim}")
        max_norm = _max_scaled_norm(src, self.scale)
        if max_norm > self.norm_bound * (1 + 1e-9):
            after = " (after unit scaling)" if self.scale is not None else ""
            raise ValueError(f"site {site}: a column has norm {max_norm:.6g}{after} above the public norm bound "
                             f"{self.norm_bound:.6g}; nothing was sent")
        ledger = PrivacyLedger(owner=f"site-{site}")
        ledger.mark_not_private(self.privacy_note or _NOTE)
        if self.scale is not None:
            ledger.note(f"PD-SVD: {scale_note(self.scale)}")
        ledger.note(f"PD-SVD data divided by the public norm bound {self.norm_bound:.6g}")
        if self.eigenvalues:
            ledger.note("PD-SVD eigenvalues=True: the final k eigenvalues of the pooled second-moment matrix are "
                        "revealed to the aggregator and every site (not blinded)")
        state: State = {"site": site, "_src": src, "_secret": None if secret is None else bytes(secret),
                        "dim": src.dim, "ledger": ledger}
        # stochastic rounding in the fixed-point secure sum (not privacy noise)
        state["rounding_rng"] = np.random.default_rng(
            None if self.random_state is None else [int(self.random_state), int(site), 7])
        return state

    def aggregator_init(self) -> State:
        return {"transcript": []}

    # -- data scaling --------------------------------------------------------------------------
    def _factors(self, B: np.ndarray) -> np.ndarray | None:
        """Per-column multipliers of ``scale`` for one block (None: no scaling)."""
        return None if self.scale is None else scale_factors(column_norms(B), self.scale)

    # -- blinding -----------------------------------------------------------------------------
    def _key(self, state: State) -> bytes:
        if self.group_secret:  # agreed in the run (pdsvd-group-secret), decrypted when its broadcast arrived
            return self._secagg.group_secret(state)
        return state["_secret"]

    def _u(self, state: State, label: str) -> float:
        return _prf_uniform(self._key(state), f"dpneuro-pdsvd:{state['nonce']}:{label}")

    def _count_factor(self, state: State) -> float:
        return 1.0 if self.reveal else 2.0 ** (_COUNT_BITS * self._u(state, "n"))

    def _mean_factor(self, state: State) -> float:
        b = self.blinding
        return 1.0 if self.reveal else 2.0 ** (b.lo + (b.fixed + b.fresh) * self._u(state, "mean"))

    def _iter_factors(self, state: State, t: int) -> np.ndarray:
        b = self.blinding
        if self.reveal:  # a public factor only: uses the fixed-point range like the blinded inputs do
            return np.full(self.k, 2.0**b.lo)
        return np.array([2.0 ** (b.lo + b.fixed * self._u(state, f"rho:{i}") + b.fresh * self._u(state, f"eta:{t}:{i}"))
                         for i in range(self.k)])

    # -- set-up ----------------------------------------------------------------------------------
    def _site_setup(self, state: State, rnd: int, incoming: Payload | None) -> Payload:
        return Payload({"dim": np.array([state["dim"]], dtype=np.int64)}, {}, carries={"dim": "public"})

    def _agg_setup(self, state: State, rnd: int, msgs: dict[int, Payload]) -> Payload:
        dims = {s: int(m.arrays["dim"][0]) for s, m in msgs.items()}
        if len(set(dims.values())) != 1:
            raise ValueError(f"all sites must have the same number of features D; got {dims}")
        if len(msgs) != self.n_sites:
            raise RuntimeError(f"PD-SVD needs all {self.n_sites} sites; {len(msgs)} answered")
        D = dims[min(dims)]
        if self.k > D:
            raise ValueError(f"k = {self.k} exceeds D = {D}")
        rng = np.random.default_rng(self.random_state)
        V0 = orthonormalize(rng.normal(0.0, 1.0 / math.sqrt(D), (D, self.k)))  # [PD-ML-Lite] Alg. 3 line 1
        state.update(V=V0, dim=D, sites=sorted(msgs))
        nonce = self.nonce or secrets.token_hex(16)
        state["nonce"] = nonce
        return Payload({"pdsvd/V": V0}, {"pdsvd_nonce": nonce})

    def _check_all(self, state: State, topic: str) -> None:
        if self.secure:
            included = sorted(state.get("secagg", {}).get("last", {}).get("included", state["sites"]))
        else:
            included = state.get("_included", state["sites"])
        if included != state["sites"]:
            missing = sorted(set(state["sites"]) - set(included))
            raise RuntimeError(f"site(s) {missing} dropped out during {topic!r}: PD-SVD computes the SVD of all "
                               "sites' data and cannot continue without them")

    def _input_count(self, state: State, rnd: int) -> np.ndarray:
        # the second entry sums to exactly n_sites under a common secret: a check that cannot pass by chance
        f = self._count_factor(state) * _COUNT_UNIT
        return np.array([state["_src"].n_samples * f, f])

    def _on_count(self, state: State, rnd: int, total: np.ndarray) -> Payload:
        self._check_all(state, "pdsvd-n")
        # what the aggregator sees: [n r_n, S r_n], i.e. n itself (S is public)
        state["transcript"].append({"topic": "n", "value": float(total[0]), "check": float(total[1])})
        if self.reveal:
            state["n"] = int(round(float(total[0]) / _COUNT_UNIT))
        return Payload({"pdsvd/nsum": np.asarray(total, dtype=np.float64)})

    def _n(self, state: State) -> int:
        if "n" not in state:
            f = self._count_factor(state) * _COUNT_UNIT
            n = float(state["pdsvd/nsum"][0]) / f
            state["n"] = int(round(n))
            sites = float(state["pdsvd/nsum"][1]) / f
            k = int(round(sites))
            tol = max(1e-9, 4 * self.n_sites * 2.0**-self._frac_bits / f)  # fixed-point error of the sum
            if k != self.n_sites and abs(sites - k) <= tol and 1 <= k < self.n_sites:
                raise RuntimeError(f"site {state['site']}: only {k} of {self.n_sites} sites are in the count sum "
                                   "(a site dropped out): PD-SVD needs all sites")
            if state["n"] < 1 or abs(sites - self.n_sites) > tol:
                raise RuntimeError(f"site {state['site']}: the count sum does not decode ({n}); do all sites "
                                   "share the same secret?")
        return state["n"]

    def _colsum(self, state: State) -> np.ndarray:
        if "_colsum" not in state:
            s = np.zeros(state["dim"])
            for blk in state["_src"].blocks():
                B = np.asarray(blk, dtype=np.float64)
                f = self._factors(B)
                s += B.sum(axis=1) if f is None else B @ f
                del blk, B
            state["_colsum"] = s / self.norm_bound
        return state["_colsum"]

    def _input_mean(self, state: State, rnd: int) -> np.ndarray:
        return self._colsum(state) / self._n(state) * self._mean_factor(state)

    def _on_mean(self, state: State, rnd: int, total: np.ndarray) -> Payload:
        self._check_all(state, "pdsvd-mean")
        state["transcript"].append({"topic": "mean", "norm": float(np.linalg.norm(total))})
        return Payload({"pdsvd/msum": np.asarray(total, dtype=np.float64)})

    # -- iterations --------------------------------------------------------------------------------
    def _mu(self, state: State) -> np.ndarray | None:
        if not self.center:
            return None
        if "_mu" not in state:
            state["_mu"] = state["pdsvd/msum"] / self._mean_factor(state)
        return state["_mu"]

    def _local_product(self, state: State, V: np.ndarray) -> np.ndarray:
        """S_s V for the site's (scaled, centred) data, streamed block by block."""
        Y = np.zeros((state["dim"], V.shape[1]))
        for blk in state["_src"].blocks():
            B = np.asarray(blk, dtype=np.float64)
            f = self._factors(B)
            if f is None:
                Y += B @ (B.T @ V)
            else:  # (B F)(B F)^T V = B (f^2 * (B^T V)), without a scaled copy of the block
                C = B.T @ V
                C *= (f**2)[:, None]
                Y += B @ C
                del C
            del blk, B  # before the next block is read
        Y /= self.norm_bound**2
        mu = self._mu(state)
        if mu is not None:
            s, n_s = self._colsum(state), state["_src"].n_samples
            # (X - mu 1^T)(X - mu 1^T)^T V without forming the centred data
            Y += -np.outer(mu, s @ V) - np.outer(s, mu @ V) + n_s * np.outer(mu, mu @ V)
        return Y

    def _input_iter(self, state: State, rnd: int) -> np.ndarray:
        V = np.asarray(state["pdsvd/V"], dtype=np.float64)
        Y = self._local_product(state, V) / (self.c * self._n(state))
        return Y * self._iter_factors(state, rnd)

    def _on_iter(self, state: State, rnd: int, total: np.ndarray) -> Payload:
        self._check_all(state, "pdsvd-it")
        norms = np.linalg.norm(total, axis=0)
        state["transcript"].append({"topic": "it", "round": int(rnd), "norms": norms.copy()})
        tiny = np.finfo(float).eps * max(1.0, float(norms.max(initial=0.0))) * total.shape[0]
        if np.any(norms <= tiny):
            i = int(np.argmin(norms))
            raise ValueError(f"column {i} of S V vanished in round {rnd}: k = {self.k} exceeds the rank of the "
                             "(centred) pooled data")
        # NORMEDSECSUM output (each column over its norm), then the same orthonormalisation at everyone
        V_new = orthonormalize(total / norms)
        meta: dict[str, Any] = {}
        if rnd >= self.n_iter - 1:
            if self.reveal:
                H = state["V"].T @ total * (self.c * state["n"] / 2.0**self.blinding.lo)
                lam = np.sort(np.linalg.eigvalsh((H + H.T) / 2))[::-1]
                state["singular_values"] = np.sqrt(np.maximum(lam, 0.0)) * self.norm_bound
            if not self.eigenvalues:  # else the eigenvalue round follows and ends the run
                meta["stop"] = True
                state["basis"] = V_new
        state["V"] = V_new
        return Payload({"pdsvd/V": V_new}, meta)

    # -- eigenvalues (eigenvalues=True) ---------------------------------------------------------
    def _input_eig(self, state: State, rnd: int) -> np.ndarray:
        """The site's V^T S_s V / (c n) of the final basis (k x k, flattened): not blinded."""
        V = np.asarray(state["pdsvd/V"], dtype=np.float64)
        Y = self._local_product(state, V)
        return (V.T @ Y).ravel() / (self.c * self._n(state))

    def _on_eig(self, state: State, rnd: int, total: np.ndarray) -> Payload:
        self._check_all(state, "pdsvd-eig")
        # sum_s V^T S_s V / (c n), S_s of the data divided by norm_bound: undo both scalings
        H = np.asarray(total, dtype=np.float64).reshape(self.k, self.k) * (self.c * self.norm_bound**2)
        # Rayleigh-Ritz: the eigenvectors of the projected matrix rotate V within its span, so the basis
        # columns are the best eigenvector estimates the subspace holds and whitening with them is exact there
        lam, U = np.linalg.eigh((H + H.T) / 2)
        order = np.argsort(-lam, kind="stable")
        lam, U = lam[order], U[:, order]
        U *= np.where(U[np.abs(U).argmax(axis=0), np.arange(self.k)] < 0, -1.0, 1.0)  # a fixed sign per column
        V = np.ascontiguousarray(state["V"] @ U)
        state["transcript"].append({"topic": "eigenvalues", "values": lam.copy()})
        state["basis"], state["eigenvalues"] = V, lam
        return Payload({"V": V, "eigenvalues": lam}, {"stop": True}, carries={"V": "public", "eigenvalues": "public"})


# -- convenience entry points ---------------------------------------------------------------------

@dataclass
class PDSVDResult:
    """Output of :func:`pd_svd` / :func:`pd_pca`.

    ``singular_values`` is None unless the run revealed them
    (``reveal_singular_values=True``); ``eigenvalues`` is None unless the run
    computed them (``eigenvalues=True``: the k eigenvalues of the pooled
    second-moment matrix in the final basis, which is then sorted by them);
    ``transcript`` is what the aggregator observed (blinded sums' norms per
    round), for leakage studies.
    """

    basis: np.ndarray
    singular_values: np.ndarray | None
    ledgers: list
    n_iter: int
    transcript: list = field(default_factory=list)
    norm_bound: float = 1.0
    eigenvalues: np.ndarray | None = None


def _sources(X_sites, k: int) -> list[SiteSource]:
    if isinstance(X_sites, np.ndarray) or not isinstance(X_sites, Sequence) or len(X_sites) == 0:
        raise ValueError("X_sites must be a non-empty list with one data matrix (or source) per site")
    return check_sources([as_source(X).validate(f"site {s}") for s, X in enumerate(X_sites)], k)


def pd_svd(X_sites, n_components: int, n_iter: int, *, exchange=None, random_state=None, center: bool = False,
           reveal_singular_values: bool = False, norm_bound: float | None = None, secure: bool = True,
           site_secret: bytes | None = None, secagg_config=None, blinding: Blinding | None = None,
           options: RunOptions | None = None, group_secret: bool = False, eigenvalues: bool = False,
           scale: str | None = None) -> PDSVDResult:
    """PD-SVD: the top-k left singular subspace of ``[X_1 ... X_S]`` without revealing singular values.

    Parameters
    ----------
    X_sites : list
        One D x N_s array (or any :class:`~dpneuro.algorithms.pca.SiteSource` input) per site.
    n_components, n_iter : int
    random_state : None, int or numpy Generator
        Public seed of the initial block (and of the fixed-point rounding); a Generator gives it by one draw.
    center : bool
        PD-PCA (secure centring on the global mean).
    reveal_singular_values : bool
        Plain-SECSUM variant: singular values are revealed and returned.
    norm_bound : float, optional
        Public bound on column norms; None takes the largest column norm of
        the pooled data (a simulation shortcut: treated as public; 1 with
        ``scale="unit"``).
    secure : bool
        Secure aggregation (default) or a plain sum (simulations only).
    site_secret : bytes, optional
        The sites' shared secret; None draws a fresh one (given to the sites only).
    group_secret, eigenvalues, scale
        See :class:`PDSVD`; with ``group_secret=True`` the sites agree the
        secret in the run (``site_secret`` must then be None).

    Returns
    -------
    PDSVDResult
    """
    k = check_k(n_components)  # the papers' k
    srcs = _sources(X_sites, k)
    if group_secret and site_secret is not None:
        raise ValueError("group_secret=True agrees the sites' secret inside the run; do not give site_secret")
    if norm_bound is None:
        norm_bound = max(_max_scaled_norm(s, scale) for s in srcs) or 1.0
    proto = PDSVD(k, n_iter, n_sites=len(srcs), center=center, reveal_singular_values=reveal_singular_values,
                  random_state=random_state, norm_bound=norm_bound, secure=secure, secagg_config=secagg_config,
                  blinding=blinding, group_secret=group_secret, eigenvalues=eigenvalues, scale=scale)
    if group_secret:
        data = list(srcs)
    else:
        secret = site_secret if site_secret is not None else os.urandom(32)
        data = [SiteInput(s, secret) for s in srcs]
    res = simulate(proto, data, exchange=exchange, options=options)
    agg = res.aggregator
    leds = [s["ledger"] if s is not None else None for s in res.sites]
    return PDSVDResult(agg["basis"], agg.get("singular_values"), leds, proto.n_iter, agg["transcript"],
                       float(norm_bound), agg.get("eigenvalues"))


def pd_pca(X_sites, n_components: int, n_iter: int, **kw) -> PDSVDResult:
    """PD-PCA ([PD-ML-Lite] App. D, Alg. 6): securely centre on the global mean, then PD-SVD."""
    return pd_svd(X_sites, n_components, n_iter, center=True, **kw)


# -- KS distributional privacy ([PD-ML-Lite] Sec. 4, Alg. 5) -------------------------------------------

@dataclass
class KSPrivacyResult:
    """p-values of the KS two-sample test per statistic and their minimum pi ([PD-ML-Lite] Alg. 5).

    A small p-value means the statistic tells runs with the target unit from
    runs without it (leakage); a large one that this statistic could not.
    """

    p_values: dict
    pi: float
    samples: dict  # name -> (values with the target, values without)
    n_trials: int


def covariance_statistics(sigma2: np.ndarray | None = None) -> dict[str, Callable]:
    """The two statistic families of [PD-ML-Lite] Sec. 5.2, for an observed basis V (D x k).

    With S_hat = V diag(sigma^2) V^T (sigma^2 from the observation's revealed
    singular values, else ``sigma2``, else ones: an adversary without Sigma)
    and P = X_u X_u^T for the target unit X_u (D x n_u):
    ``w_*`` reduce W = |S_hat o P| (max, sum, sum of squares);
    ``d_*`` reduce |S_hat / ||S_hat||_F - P / ||P||_F|. D x D: small D only.
    """

    def s_hat(obs) -> np.ndarray:
        V = np.asarray(obs.basis)
        sv = getattr(obs, "singular_values", None)
        s2 = np.asarray(sv) ** 2 if sv is not None else (np.ones(V.shape[1]) if sigma2 is None else sigma2)
        return (V * s2) @ V.T

    def outer(x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        x = x[:, None] if x.ndim == 1 else x
        return x @ x.T

    def w(reduce):
        return lambda obs, x: float(reduce(np.abs(s_hat(obs) * outer(x))))

    def d(reduce):
        def f(obs, x):
            S, P = s_hat(obs), outer(x)
            return float(reduce(np.abs(S / np.linalg.norm(S) - P / np.linalg.norm(P))))
        return f

    sumsq = lambda a: np.sum(a**2)  # noqa: E731
    return {"w_max": w(np.max), "w_sum": w(np.sum), "w_sumsq": w(sumsq),
            "d_max": d(np.max), "d_sum": d(np.sum), "d_sumsq": d(sumsq)}


def ks_privacy(statistic_fn, X_sites, *, target: tuple[int, Any] = (0, 0), mechanism: Callable | None = None,
               k: int | None = None, n_iter: int = 30, n_trials: int = 50, subsample: float = 0.8,
               random_state=None, **mechanism_kw) -> KSPrivacyResult:
    """Measure pi-KSDP of a mechanism for one unit ([PD-ML-Lite] Alg. 5).

    For i = 1..t (``n_trials``): draw sub-databases X'_i (every site keeps a
    random ``subsample`` fraction of its columns) that contain the target
    unit x, and independent sub-databases Y_i that do not (the victim site
    keeps the same number of other columns); evaluate the mechanism on both;
    for every statistic s, run the KS two-sample test on
    {s(f(X'_i), x)} vs {s(f(Y_i), x)}; pi = min over statistics of p.

    Parameters
    ----------
    statistic_fn : callable or dict of callables
        ``s(observation, x) -> float``; ``x`` is the target's D x n_u block.
    X_sites : list of arrays
        The sites' full data (D x N_s).
    target : (site, columns)
        The unit whose membership is tested: a column index, a slice or a
        list of columns (a subject) at that site.
    mechanism : callable, optional
        ``mechanism(list of D x n arrays) -> observation``. Default: PD-SVD
        (``pd_svd(..., k, n_iter, secure=False)``, same public seed and norm
        bound in every run -- secure aggregation does not change what is
        observed, only who can see the individual inputs).
    n_trials, subsample, random_state
        Samples per distribution, fraction of columns kept, RNG seed (None, an int or a Generator, which
        gives the seed by one draw).
    **mechanism_kw
        Extra keywords for the default mechanism (e.g. ``reveal_singular_values``).

    Returns
    -------
    KSPrivacyResult
    """
    from scipy import stats  # deferred: scipy.stats takes about 0.3 s to load and only this measurement needs it

    seed = resolve_random_state(random_state)
    stats_fns = statistic_fn if isinstance(statistic_fn, dict) else {"statistic": statistic_fn}
    if not stats_fns or not all(callable(f) for f in stats_fns.values()):
        raise ValueError("statistic_fn must be a callable or a dict of callables")
    Xs = [np.asarray(X, dtype=np.float64) for X in X_sites]
    if not Xs or any(X.ndim != 2 for X in Xs):
        raise ValueError("X_sites must be a list of D x N_s arrays")
    if len({X.shape[0] for X in Xs}) != 1:
        raise ValueError(f"all sites must have the same D; got {[X.shape[0] for X in Xs]}")
    if not 0 < subsample <= 1:
        raise ValueError(f"subsample must be in (0, 1], got {subsample}")
    if isinstance(n_trials, bool) or not isinstance(n_trials, (int, np.integer)) or n_trials < 2:
        raise ValueError(f"n_trials must be an integer >= 2, got {n_trials!r}")
    site, cols = target
    N_v = Xs[site].shape[1]
    x_idx = np.arange(N_v)[cols] if not isinstance(cols, (int, np.integer)) else np.array([int(cols)])
    x_idx = np.atleast_1d(x_idx)
    x = Xs[site][:, x_idx]
    others_v = np.setdiff1d(np.arange(N_v), x_idx)
    if mechanism is None:
        if k is None:
            raise ValueError("give k (and n_iter) for the default PD-SVD mechanism, or a mechanism")
        bound = max(float(np.linalg.norm(X, axis=0).max()) for X in Xs)
        v0_seed = 0 if seed is None else int(seed)

        def mechanism(sub):
            return pd_svd(sub, k, n_iter, secure=False, random_state=v0_seed, norm_bound=bound, **mechanism_kw)

    rng = np.random.default_rng(seed)
    keep = [max(1, int(round(subsample * X.shape[1]))) for X in Xs]
    keep[site] = min(keep[site], len(others_v) + len(x_idx))
    n_other = keep[site] - len(x_idx)
    if n_other < 1 or len(others_v) < keep[site]:
        raise ValueError("the victim site needs more columns than the target unit for with/without sub-databases")

    def draw(with_x: bool) -> list[np.ndarray]:
        sub = []
        for s, X in enumerate(Xs):
            if s != site:
                sub.append(X[:, np.sort(rng.choice(X.shape[1], keep[s], replace=False))])
            elif with_x:
                sub.append(np.hstack([X[:, np.sort(rng.choice(others_v, n_other, replace=False))], x]))
            else:
                sub.append(X[:, np.sort(rng.choice(others_v, keep[s], replace=False))])
        return sub

    w_vals = {name: [] for name in stats_fns}
    wo_vals = {name: [] for name in stats_fns}
    for _ in range(n_trials):
        obs_with, obs_without = mechanism(draw(True)), mechanism(draw(False))
        for name, f in stats_fns.items():
            w_vals[name].append(float(f(obs_with, x)))
            wo_vals[name].append(float(f(obs_without, x)))
    p_values, samples = {}, {}
    for name in stats_fns:
        a, b = np.array(w_vals[name]), np.array(wo_vals[name])
        p_values[name] = float(stats.ks_2samp(a, b).pvalue)
        samples[name] = (a, b)
    return KSPrivacyResult(p_values, min(p_values.values()), samples, int(n_trials))
