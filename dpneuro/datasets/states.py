"""Synthetic component time courses with planted dynamic connectivity states.

The ground truth for dFNC (:mod:`dpneuro.algorithms.dfnc`). Each subject's R
component time courses switch between K state-specific correlation matrices
by a Markov chain, and are low-pass filtered like BOLD:

1. Components belong to ``n_modules`` networks (modules of about equal size).
   In state k, component r loads a_kr on its module's factor F_m and the module
   factors are correlated by G_k (a random signed low-rank-plus-identity
   correlation between modules), so corr(r, r') = a_kr a_kr' G_k[m(r), m(r')]
   (r != r'). States differ in which modules couple, with which sign, and how
   strongly each component follows its module (a_kr in [0.45, 0.95]).
2. The state sequence is a Markov chain with mean dwell time ``dwell[k]``
   seconds in state k (``p_stay = 1 - TR / dwell``); on leaving a state the
   next one is uniform among the others, so occupancies are unequal (roughly
   proportional to the dwell times).
3. Innovations x_t ~ N(0, C_{s_t}) are low-pass filtered (zero-phase
   Butterworth, ``lowpass`` Hz, as GIFT's dFNC post-processing does); the
   filter acts on all components alike, so inside a segment the correlation is
   that of its state. White noise of std ``noise`` is added after each
   component is standardised (the estimated states' contrast shrinks by about
   1 / (1 + noise^2)).

:func:`mix_voxels` puts the time courses into voxels through maps, e.g.
``dpneuro.datasets.synth.network_model(space, R).A``. Everything is fixed by the seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.signal import butter, sosfiltfilt

from dpneuro.privacy import default_rng, resolve_random_state

__all__ = ["PlantedStates", "StateProcess", "default_dwell", "make_dfnc_consortium", "mix_voxels", "state_correlations",
           "window_labels"]


@dataclass
class PlantedStates:
    """A consortium of component time courses with planted states.

    Attributes
    ----------
    timecourses : list (sites) of list (subjects) of ndarray, R x T
    labels : list (sites) of list (subjects) of ndarray of int, shape (T,)
        The state at every TR.
    states : ndarray, shape (K, R, R)
        The planted correlation matrices.
    tr : float
        Repetition time in seconds.
    dwell : ndarray, shape (K,)
        Mean dwell time of each state in seconds (the chain's parameter).
    """

    timecourses: list
    labels: list
    states: np.ndarray
    tr: float
    dwell: np.ndarray
    params: dict = field(default_factory=dict)

    @property
    def occupancy(self) -> np.ndarray:
        """Fraction of all TRs in each state (all sites and subjects)."""
        lab = np.concatenate([h for site in self.labels for h in site])
        return np.bincount(lab, minlength=len(self.states)) / lab.size


def _modules(R: int, n_modules: int) -> np.ndarray:
    return np.arange(R) * n_modules // R


def state_correlations(n_components: int = 20, n_states: int = 4, *, n_modules: int = 5,
                       random_state=0) -> np.ndarray:
    """K planted R x R correlation matrices (see the module docstring).

    ``random_state``: None, an int or a Generator (which gives the seed by one draw).
    """
    rng = np.random.default_rng([resolve_random_state(random_state, fresh=True), 1])
    m = _modules(n_components, n_modules)
    out = np.empty((n_states, n_components, n_components))
    for k in range(n_states):
        V = rng.choice([-1.0, 0.0, 1.0], size=(n_modules, 2)) * rng.uniform(0.5, 1.0, (n_modules, 2))
        G = V @ V.T + 0.3 * np.eye(n_modules)
        d = np.sqrt(np.diag(G))
        G = G / np.outer(d, d)
        a = rng.uniform(0.45, 0.95, n_components)
        C = np.outer(a, a) * G[np.ix_(m, m)]
        np.fill_diagonal(C, 1.0)  # PSD: a^2 G + diag(1 - a^2)
        out[k] = C
    return out


def window_labels(labels: np.ndarray, weights: np.ndarray, n_states: int) -> np.ndarray:
    """True state of each window: the state with the largest taper weight in it."""
    onehot = np.eye(n_states)[labels]  # T x K
    return np.argmax(weights @ onehot, axis=1)


def _chain(T: int, p_stay: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    K = len(p_stay)
    p0 = (1 / (1 - p_stay)) / np.sum(1 / (1 - p_stay))  # stationary: proportional to dwell
    s = np.empty(T, np.int64)
    s[0] = rng.choice(K, p=p0)
    for t in range(1, T):
        if rng.random() < p_stay[s[t - 1]]:
            s[t] = s[t - 1]
        else:
            s[t] = (s[t - 1] + 1 + rng.integers(K - 1)) % K if K > 1 else 0
    return s


#: scipy's default padding of the order-5 filter's sosfiltfilt
_PADLEN = 18


@dataclass(frozen=True)
class StateProcess:
    """The planted states' generative process, shared by every subject (see the module docstring)."""

    states: np.ndarray
    dwell: np.ndarray
    tr: float
    lowpass: float | None = 0.15
    noise: float = 0.3

    def __post_init__(self):
        K = len(self.states)
        if np.shape(self.dwell) != (K,) or np.any(np.asarray(self.dwell) <= self.tr):
            raise ValueError(f"dwell must give one mean dwell time (seconds, > TR = {self.tr}) per state")
        if self.lowpass is not None and not 0 < self.lowpass < 0.5 / self.tr:
            raise ValueError(f"lowpass must be in (0, {0.5 / self.tr}) Hz (Nyquist at TR {self.tr} s), "
                             f"got {self.lowpass}")

    def subject(self, n_timepoints: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One subject's R x T time courses (each standardised, plus white noise) and its state at every TR."""
        p_stay = 1.0 - self.tr / np.asarray(self.dwell, float)
        h = _chain(n_timepoints, p_stay, rng)
        e = rng.standard_normal((n_timepoints, self.states.shape[1]))
        x = np.einsum("trq,tq->rt", np.linalg.cholesky(self.states)[h], e)
        if self.lowpass is not None:
            sos = butter(5, self.lowpass, btype="low", fs=1.0 / self.tr, output="sos")
            x = sosfiltfilt(sos, x, axis=1, padlen=min(_PADLEN, n_timepoints - 1))  # short scans: shorter padding
        x = (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)
        return x + self.noise * rng.standard_normal(x.shape), h


def default_dwell(n_states: int) -> np.ndarray:
    """Mean dwell times (s): evenly from 30 to 90 s, so occupancies are unequal."""
    return np.linspace(30.0, 90.0, n_states)


def make_dfnc_consortium(n_sites: int = 4, n_subjects: int = 100, n_components: int = 20, n_states: int = 4, *,
                         n_timepoints: int = 200, tr: float = 2.0, dwell=None, lowpass: float | None = 0.15,
                         noise: float = 0.3, n_modules: int = 5, random_state=0) -> PlantedStates:
    """Component time courses of ``n_sites`` x ``n_subjects`` subjects with K planted states.

    ``dwell``: mean dwell time per state in seconds (default :func:`default_dwell`); ``lowpass`` in Hz (None:
    no filter); ``noise``: white noise std relative to the standardised signal. ``n_subjects`` may be a list
    (per site). ``random_state``: None, an int or a Generator (which gives the seed by one draw); ``params``
    records the seed.
    """
    seed = resolve_random_state(random_state, fresh=True)
    if n_states < 1 or n_components < 2 or n_timepoints < 2:
        raise ValueError("need n_states >= 1, n_components >= 2 and n_timepoints >= 2")
    dwell = default_dwell(n_states) if dwell is None else np.asarray(dwell, float)
    proc = StateProcess(state_correlations(n_components, n_states, n_modules=n_modules, random_state=seed),
                        dwell, float(tr), lowpass, noise)
    subjects = [n_subjects] * n_sites if np.isscalar(n_subjects) else list(n_subjects)
    tcs, labs = [], []
    for s, M in enumerate(subjects):
        pairs = [proc.subject(n_timepoints, np.random.default_rng([seed, 2, s, j])) for j in range(int(M))]
        tcs.append([x for x, _ in pairs])
        labs.append([h for _, h in pairs])
    params = dict(n_sites=n_sites, n_subjects=subjects, n_components=n_components, n_states=n_states,
                  n_timepoints=n_timepoints, tr=tr, lowpass=lowpass, noise=noise, n_modules=n_modules,
                  random_state=seed)
    return PlantedStates(tcs, labs, proc.states, float(tr), dwell, params)


def mix_voxels(timecourse: np.ndarray, maps: np.ndarray, *, noise: float = 1.0,
               random_state=0) -> np.ndarray:
    """One subject's voxel data X = A S + noise (D x T) from its R x T time courses and D x R maps.

    ``random_state``: None, an int or a Generator (used as it is) for the noise.
    """
    rng = default_rng(random_state)
    A = np.asarray(maps, np.float64)
    X = A @ np.asarray(timecourse, np.float64)
    return X + noise * rng.standard_normal(X.shape)
