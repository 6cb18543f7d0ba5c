"""Spatial group ICA on the consortium's released PCA basis: post-processing, no further release.

In spatial group ICA (the model of CanICA, MELODIC and GIFT) the independent
sources are maps over the features (voxels or parcels) that every site shares.
capePCA releases the top-R eigenvectors V (D x R) of the consortium's second
moment of the features; the maps are a rotation of those eigenmaps,
M = V Q, chosen by FastICA so that the columns of M are as independent
(non-Gaussian over features) as possible. Only the released V and Lambda are
used, so by post-processing the ICA costs no privacy.

The result is written in capeDJICA's parametrisation so that everything
downstream (maps, time courses, reports, deployments) is shared:

- maps A = V Lambda^{1/2} W^{-1} = V Q  with  W = Q^{-1} Lambda^{1/2};
- time courses t = W z = Q^{-1} V^T x for a unit-norm time point x with whitened
  z = Lambda^{-1/2} V^T x: the least-squares fit of x on the maps within the
  released subspace (the first stage of dual regression), computed by each site
  on its own data, so nothing leaves the site.

FastICA starts from a fixed, public rotation: an ICA of released values needs
no secret randomness, and a fixed start makes the aggregator's result
reproducible from what it received.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

__all__ = ["SpatialICAResult", "spatial_ica"]


@dataclass
class SpatialICAResult:
    """Spatial ICA of a released basis.

    Attributes
    ----------
    W : ndarray, shape (R, R)
        Unmixing in capeDJICA's parametrisation (time courses ``W z``).
    maps : ndarray, shape (D, R)
        The independent maps ``V Q`` (unit variance over features, positive skew).
    status : str
        ``"converged"`` or ``"not converged"`` (FastICA within ``max_iter``).
    n_iter : int
        FastICA iterations.
    """

    W: np.ndarray
    maps: np.ndarray
    status: str
    n_iter: int


def spatial_ica(basis, eigenvalues, *, max_iter: int = 2000, tol: float = 1e-12,
                init_seed: int = 0) -> SpatialICAResult:
    """FastICA (logcosh, as CanICA) of the eigenmaps in ``basis``.

    Components are signed so that each map's skew is positive (CanICA's
    convention: the network is the heavy tail) and ordered by the variance of
    the data they explain, largest first.

    Parameters
    ----------
    basis : ndarray, shape (D, R)
        Orthonormal columns V (capePCA's basis), D > R.
    eigenvalues : ndarray, shape (R,)
        The matching eigenvalues (positive).
    max_iter, tol : FastICA's iteration limit and tolerance. FastICA stops when 1 - |cos| of every
        component's step is below ``tol``: an angle of sqrt(tol). The tolerance is tight (1e-6 rad) so that
        bases equal to the last bits (a deployment and its simulation) give maps equal to ~1e-5, not to
        wherever a loose tolerance happens to stop a slowly converging iteration (1e-8: ~1e-3).
    init_seed : int
        Seed of FastICA's initial rotation (public; see the module notes).
    """
    from sklearn.decomposition import FastICA
    from sklearn.exceptions import ConvergenceWarning

    from .djica import _check_basis

    V, lam = _check_basis(basis, eigenvalues)
    D, R = V.shape
    if D <= R:
        raise ValueError(f"spatial ICA needs more features than components (D = {D}, R = {R})")
    # whiten here: the eigenmaps are orthonormal, so after centring an SVD makes them exactly white
    # (FastICA's own whitening of such nearly isotropic input can return duplicated components)
    Vc = V - V.mean(axis=0)
    _, sv, Vt = np.linalg.svd(Vc, full_matrices=False)
    if sv[-1] <= 1e-12 * sv[0]:
        raise ValueError("the centred eigenmaps are rank deficient: choose fewer components")
    white = Vt.T * (np.sqrt(D) / sv)  # Vc @ white has identity covariance over features
    ica = FastICA(whiten=False, fun="logcosh", max_iter=max_iter, tol=tol, random_state=init_seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        ica.fit(Vc @ white)
    converged = not any(issubclass(w.category, ConvergenceWarning) for w in caught)
    Q = white @ np.asarray(ica.components_, np.float64).T  # V Q: the sources, up to a constant per map
    M = V @ Q
    sd = M.std(axis=0)
    skew = (((M - M.mean(axis=0)) / sd) ** 3).mean(axis=0)
    scale = np.where(skew < 0, -1.0, 1.0) / sd  # unit variance over features, heavy tail positive
    Q, M = Q * scale, M * scale
    Qinv = np.linalg.inv(Q)
    # the data's second moment each component carries: E[t_j^2] ||M_j||^2 with E[t t^T] = Q^-1 Lambda Q^-T
    explained = np.einsum("ij,j,ij->i", Qinv, lam, Qinv) * np.sum(M**2, axis=0)
    order = np.argsort(-explained, kind="stable")
    return SpatialICAResult(W=Qinv[order] * np.sqrt(lam), maps=M[:, order],
                            status="converged" if converged else "not converged", n_iter=int(ica.n_iter_))
