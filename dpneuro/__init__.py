"""dpneuro: differentially private decentralized fMRI analysis (CAPE)."""

__version__ = "0.1.0"
