"""Algorithms: one module per method (site steps, aggregator steps, convenience entry points)."""

from dpneuro.algorithms.agn import AGNResult, agn, avn, cape_agn, local_agn, otd
from dpneuro.algorithms.djica import (
    CapeDJICA,
    DJICAResult,
    LearningRate,
    cape_djica,
    local_dp_ica,
    spatial_maps,
    time_courses,
    whiten,
)
from dpneuro.algorithms.pca import (
    CapePCA,
    DPdisPCA,
    PCAResult,
    SiteSource,
    cape_pca,
    dpdispca,
    local_pca,
    pooled_dp_pca,
)
from dpneuro.algorithms.pdsvd import PDSVD, PDSVDResult, ks_privacy, pd_pca, pd_svd
from dpneuro.algorithms.spatial_ica import SpatialICAResult, spatial_ica
