"""dpneuro: differentially private decentralized fMRI analysis (CAPE).

The notebook API: :class:`DecentralizedICA`, :class:`DecentralizedPCA` and
:func:`plan_budget` (see ``docs/api.md``); the ``dpneuro`` command and the
Pydra workflow run the same stages.
"""

import importlib

__version__ = "0.2.0"

__all__ = ["DecentralizedICA", "DecentralizedPCA", "RunConfig", "plan_budget", "__version__"]

_LAZY = {"DecentralizedICA": "estimators", "DecentralizedPCA": "estimators", "plan_budget": "estimators",
         "RunConfig": "config"}


def __getattr__(name: str):
    # imported on first use, so that `import dpneuro` (and the CLI's --help) stays fast
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'dpneuro' has no attribute {name!r}")
