"""Algorithms: one module per method (site steps, aggregator steps, convenience entry points)."""

from .pca import CapePCA, DPdisPCA, PCAResult, SiteSource, cape_pca, dpdispca, local_pca, pooled_dp_pca
from .pdsvd import PDSVD, PDSVDResult, ks_privacy, pd_pca, pd_svd
