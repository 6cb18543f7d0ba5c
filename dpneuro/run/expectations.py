"""What a run's planned noise leaves of the maps: the expected noise of the averaged releases, the eigenvalues of
real fMRI that stand above it, and the warnings a user must hear before trusting a run.

The planner prints these for a plan (``dpneuro budget``), and a run's outputs record them next to the ledgers
they are computed from. The eigenvalues come from real fMRI (:data:`REFERENCE_SPECTRUM`); the random-matrix
facts are :mod:`dpneuro.privacy.rmt`'s.
"""

from __future__ import annotations

import math

import numpy as np

from dpneuro.config import RunConfig
from dpneuro.privacy.rmt import detection_threshold, eigenvector_overlap, noise_edge, wigner_edge
from dpneuro.privacy.summary import privacy_warnings
from dpneuro.protocol.cape import ReleaseSpec

__all__ = ["REFERENCE_DIMS", "REFERENCE_SPECTRUM", "REFERENCE_SUBSPACE_SPECTRA", "expected_noise",
           "last_component_overlap", "random_matrix_line", "reference_spectrum", "run_warnings", "signal_components",
           "signal_sentence", "supported_components"]


def expected_noise(cfg: RunConfig, n_samples: dict[str, int], dim: int, privacy: dict) -> dict[str, float]:
    """Expected noise std of the averaged releases: covariance entries (off the diagonal), gradient entries (per
    round), and the covariance noise's spectral norm.

    Under CAPE the zero-sum parts cancel in the N_s-weighted average, which keeps the local parts
    (variance tau_s^2 / S); under 'conv' every site's full noise stays.
    """
    n = dict(n_samples)
    N, S = sum(n.values()), len(n)
    share = 1.0 / S if cfg.plan == "cape" else 1.0
    # the D x D release's off-diagonal entries (what sets its spectral norm) stand for 2 entries of the matrix:
    # symmetrized noise, the releases' default, divides their std by sqrt(2) (dpneuro.protocol.cape.packing)
    copies = 2.0 if ReleaseSpec.symmetric_noise == "symmetrized" else 1.0
    out = {}
    for stage, name, key, c in (("capepca", "A", "covariance", copies), ("capepca-power", "AV", "covariance", 1.0),
                                ("ica", "G", "gradient (per round)", 1.0)):
        var = 0.0
        for site, s in privacy["sites"].items():
            for r in s["ledger"]["releases"]:
                if r["stage"] == stage and r["name"] == name:
                    var += (n[site] / N) ** 2 * share * r["sigma"] ** 2 / c
        if var > 0:
            out[key] = math.sqrt(var)
    if "covariance" in out:
        # semicircle edge of a symmetric Gaussian matrix: 2 sqrt(D) times its off-diagonal std
        out["covariance spectral norm"] = 2 * out["covariance"] * math.sqrt(dim)
    return out


#: eigenvalues (fractions of the total) of real fMRI's normalised second moment, unit-norm time points: 33
#: people, 122 regions of the MIST atlas (OpenNeuro ds000140, as in benchmarks/real_frontier.py). The planner
#: counts how many stand above the expected noise: on that data private maps agreed with the non-private ones
#: at mean |r| ~0.46 when about half of 20 components did, 0.72-0.88 when all did.
REFERENCE_SPECTRUM = (0.237, 0.0851, 0.0649, 0.059, 0.0366, 0.0271, 0.0248, 0.0215, 0.0201, 0.0184, 0.0154,
                      0.0135, 0.0134, 0.0107, 0.0104, 0.0098, 0.00918, 0.00862, 0.00843, 0.00818, 0.00762,
                      0.00749, 0.00725, 0.00716, 0.00694, 0.00681, 0.00673, 0.00599, 0.00592, 0.0058, 0.00568,
                      0.00551, 0.00534, 0.00525, 0.00517, 0.00503, 0.00479, 0.00472, 0.00456, 0.00449)
#: the same people under subspace contributions (pca_contribution = "subspace"; 150-volume windows of their
#: runs): k times the eigenvalues of the subjects' averaged projectors P_m / k on their own top-k subspaces, by k
#: (1 would be a direction every subject shares). A k between two keys uses the nearer one.
REFERENCE_SUBSPACE_SPECTRA: dict[int, tuple[float, ...]] = {
    5: (0.926, 0.693, 0.599, 0.54, 0.283, 0.197, 0.155, 0.124, 0.118, 0.0963),
    10: (0.944, 0.792, 0.732, 0.689, 0.539, 0.451, 0.405, 0.362, 0.345, 0.314, 0.238, 0.219, 0.185, 0.152, 0.148,
         0.139, 0.119, 0.114, 0.108, 0.102),
    15: (0.952, 0.826, 0.777, 0.74, 0.632, 0.57, 0.522, 0.477, 0.47, 0.457, 0.372, 0.349, 0.325, 0.262, 0.246,
         0.237, 0.224, 0.212, 0.209, 0.193, 0.182, 0.181, 0.177, 0.165, 0.157, 0.153, 0.15, 0.138, 0.131, 0.131),
    20: (0.958, 0.845, 0.807, 0.776, 0.691, 0.646, 0.595, 0.556, 0.555, 0.529, 0.462, 0.44, 0.419, 0.347, 0.336,
         0.326, 0.31, 0.296, 0.286, 0.285, 0.266, 0.264, 0.261, 0.251, 0.241, 0.227, 0.222, 0.214, 0.203, 0.196,
         0.195, 0.191, 0.186, 0.183, 0.175, 0.174, 0.168, 0.16, 0.156, 0.151),
    30: (0.967, 0.878, 0.847, 0.819, 0.756, 0.725, 0.692, 0.662, 0.649, 0.632, 0.572, 0.563, 0.542, 0.508, 0.475,
         0.468, 0.46, 0.441, 0.432, 0.423, 0.407, 0.399, 0.395, 0.388, 0.381, 0.364, 0.352, 0.338, 0.333, 0.329,
         0.323, 0.318, 0.315, 0.308, 0.304, 0.294, 0.288, 0.28, 0.275, 0.271),
    40: (0.973, 0.9, 0.876, 0.851, 0.803, 0.776, 0.755, 0.728, 0.714, 0.702, 0.659, 0.647, 0.628, 0.598, 0.581,
         0.569, 0.566, 0.544, 0.536, 0.529, 0.517, 0.512, 0.506, 0.489, 0.484, 0.47, 0.465, 0.454, 0.45, 0.445,
         0.441, 0.431, 0.425, 0.414, 0.408, 0.407, 0.397, 0.392, 0.389, 0.38),
}
#: feature counts the reference spectrum speaks for (region/parcel level; voxels spread the variance thinner)
REFERENCE_DIMS = (50, 400)


def reference_spectrum(contribution: str = "moment", k: int = 20) -> tuple[float, ...]:
    """Eigenvalues of typical region-level fMRI's released matrix: :data:`REFERENCE_SPECTRUM`, or under
    subspace contributions for ``k`` components (:data:`REFERENCE_SUBSPACE_SPECTRA`)."""
    if contribution != "subspace":
        return REFERENCE_SPECTRUM
    near = min(REFERENCE_SUBSPACE_SPECTRA, key=lambda key: (abs(key - k), key))
    return tuple(v / near for v in REFERENCE_SUBSPACE_SPECTRA[near])


def supported_components(spectral_norm: float, dim: int, contribution: str = "moment", k: int = 20) -> int | None:
    """How many components of typical parcel-level fMRI stand above covariance noise of this spectral norm.

    None when ``dim`` is outside :data:`REFERENCE_DIMS` (the reference does not apply).
    """
    if not REFERENCE_DIMS[0] <= dim <= REFERENCE_DIMS[1]:
        return None
    return sum(1 for lam in reference_spectrum(contribution, k) if lam > spectral_norm)


def last_component_overlap(noise_std: float, dim: int, spectrum, n_components: int) -> float:
    """The squared overlap with its noise-free eigenvector expected for the ``n_components``-th eigenvector of
    ``spectrum`` under covariance noise of off-diagonal std ``noise_std`` (spiked Wigner,
    :mod:`dpneuro.privacy.rmt`)."""
    spec = np.asarray(spectrum, np.float64)
    return float(eigenvector_overlap([spec[min(n_components, len(spec)) - 1]], noise_std, dim)[0])


def random_matrix_line(noise_std: float, dim: int, spectrum, n_components: int) -> str:
    """The planner's random-matrix summary for covariance noise of off-diagonal std ``noise_std``
    (:mod:`dpneuro.privacy.rmt`): the edge, how many reference eigenvalues are detectable (BBP), and the squared
    eigenvector overlap expected for the ``n_components``-th."""
    spec = np.asarray(spectrum, np.float64)
    detectable = int(np.sum(spec > detection_threshold(noise_std, dim)))
    overlap = last_component_overlap(noise_std, dim, spec, n_components)
    return (f"random-matrix view: noise edge 2 sigma sqrt(D) = {wigner_edge(noise_std, dim):.3g}; an eigenvalue "
            f"above sigma sqrt(D) = {detection_threshold(noise_std, dim):.3g} leaves the noise (BBP): "
            f"{'{} or more'.format(detectable) if detectable == len(spec) else detectable} of the reference; "
            f"component {n_components}'s eigenvector at squared overlap ~{overlap:.2f} with the noise-free one")


def run_warnings(cfg: RunConfig, n_samples: dict[str, int], dim: int, privacy: dict) -> list[str]:
    """What a user must hear before trusting a run: weak privacy, components the data cannot carry, noise maps.

    ``n_samples``: time points per site (public), ``dim``: features D after reduction.
    """
    out = list(privacy_warnings(privacy))
    n_total = sum(n_samples.values())
    if cfg.n_components >= 0.5 * min(dim, n_total):
        out.append(f"WARNING: n_components = {cfg.n_components} is close to or above half of min(D = {dim}, "
                   f"time points = {n_total}): components cannot be recovered reliably.")
    spec = expected_noise(cfg, n_samples, dim, privacy).get("covariance spectral norm")
    ref = reference_spectrum(cfg.contribution, cfg.n_components)
    supported = supported_components(spec, dim, cfg.contribution, cfg.n_components) if spec is not None else None
    if supported is not None and supported < cfg.n_components and spec <= 1.0 / cfg.n_components:
        out.append(f"WARNING: n_components = {cfg.n_components}, but on real fMRI at the region level only about "
                   f"{supported} components stand above this run's covariance noise (spectral norm ~{spec:.3g}; "
                   f"the {cfg.n_components}th eigenvalue of such data is ~"
                   f"{ref[min(cfg.n_components, len(ref)) - 1]:.2g} of the total): "
                   "expect the weaker components to be noise. Ask for fewer, add subjects or raise the budget.")
    if spec is not None and spec > 1.0 / cfg.n_components:
        out.append(f"WARNING: the covariance noise (spectral norm ~{spec:.3g}) exceeds the average signal "
                   f"eigenvalue of {cfg.n_components} components (~{1 / cfg.n_components:.3g}; unit-norm time "
                   "points put eigenvalues summing to 1): expect noise maps. Add subjects, use fewer features "
                   "(parcels) or components, or a larger budget.")
    return out


def signal_components(eigenvalues, W, noise_std: float | None, dim: int) -> dict:
    """Which components stand above the released matrix's noise, from public quantities only.

    The released eigenvalues above the noise's edge (2 sigma sqrt(D) and the largest noise eigenvalue's 99 %
    fluctuation, :func:`dpneuro.privacy.rmt.noise_edge`) are the m directions the noise leaves: below it an
    eigenvalue is indistinguishable from the noise's own. Component k's map mixes the whitened eigen-directions
    by column k of W^-1 (its map is V Lambda^(1/2) W^-1); its ``share`` is the part of that column in the m
    directions above the edge, and the m components with the largest shares are the signal (the shares of an
    orthogonal W sum to m). Without noise (``noise_std`` None or 0) every component is signal.
    """
    lam = np.asarray(eigenvalues, np.float64)
    K = lam.size
    if not noise_std:
        return {"edge": None, "noise_sd": None, "n_signal": K, "signal": [True] * K, "share": [1.0] * K}
    edge = noise_edge(noise_std, dim)
    above = lam > edge
    M2 = np.linalg.inv(np.asarray(W, np.float64)) ** 2
    share = M2[above].sum(axis=0) / np.maximum(M2.sum(axis=0), np.finfo(float).tiny)
    m = int(above.sum())
    signal = np.zeros(K, bool)
    signal[np.argsort(-share, kind="stable")[:m]] = True
    return {"edge": float(edge), "noise_sd": float(noise_std), "n_signal": m, "signal": signal.tolist(),
            "share": [float(x) for x in share]}


def signal_sentence(signal: dict, expected: int | None = None) -> str:
    """The one sentence every output uses for how many components carry signal (``signal``:
    :func:`signal_components`; ``expected``: the planner's count on typical fMRI, when it applies)."""
    K, m = len(signal["signal"]), signal["n_signal"]
    if signal["edge"] is None:
        return f"All {K} components carry signal: the released matrix carried no privacy noise."
    plan = f"; the plan expected about {min(expected, K)} on typical fMRI" if expected is not None else ""
    rest = (f" The other {K - m} are marked as noise (components.tsv) and left out of the FNC's and the group "
            "statistics' findings." if m < K else "")
    verb = "eigenvalue stands" if m == 1 else "eigenvalues stand"
    return (f"{m} of {K} components carry signal: {m} released {verb} above the privacy noise's edge "
            f"({signal['edge']:.3g}: 2 sigma sqrt(D) and its 99 % fluctuation){plan}.{rest}")
