"""Algorithms on arrays: one module per method (its site steps, aggregator steps and a convenience entry point),
the metrics, and the papers' baselines (:mod:`dpneuro.algorithms.baselines`)."""

from dpneuro.algorithms.agn import AGNResult, cape_agn
from dpneuro.algorithms.djica import (
    CapeDJICA,
    DJICAResult,
    LearningRate,
    cape_djica,
    spatial_maps,
    time_courses,
    whiten,
)
from dpneuro.algorithms.pca import CapePCA, PCAResult, SiteSource, cape_pca
from dpneuro.algorithms.pdsvd import PDSVD, PDSVDResult, ks_privacy, pd_pca, pd_svd
from dpneuro.algorithms.spatial_ica import SpatialICAResult, spatial_ica
