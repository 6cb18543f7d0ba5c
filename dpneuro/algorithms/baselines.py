"""The source papers' baselines, which benchmarks and tests compare the product's methods against.

None of them is a step of a run: pooled DP PCA (Analyze Gauss on pooled data, a trusted curator), local PCA and
local DP ICA (one site alone), DPdisPCA ([DPdisPCA]: each site sends its top subspace), and capeAGN's
one-shot tensor baselines (AVN's Laplace-like noise, the non-private orthogonal tensor decomposition, one site
alone). They live beside the methods they share code with; this module is where a comparison imports them.
"""

from dpneuro.algorithms.agn import agn, avn, local_agn, otd
from dpneuro.algorithms.djica import local_dp_ica
from dpneuro.algorithms.pca import DPdisPCA, dpdispca, local_pca, pooled_dp_pca

__all__ = ["DPdisPCA", "agn", "avn", "dpdispca", "local_agn", "local_dp_ica", "local_pca", "otd", "pooled_dp_pca"]
