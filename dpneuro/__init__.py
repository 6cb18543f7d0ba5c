"""dpneuro: differentially private decentralized fMRI analysis (CAPE).

The notebook API: :class:`DecentralizedICA`, :class:`DecentralizedPCA` and
:func:`plan_budget` (see ``docs/api.md``); the ``dpneuro`` command and the
Pydra workflow run the same stages. Every error the package raises on purpose
is a :class:`DpneuroError`.

The package's folders are its layers, lowest first (a module imports only
from its own layer and those below; ``tests/test_import_graph.py`` checks it):

- ``_utils``: the exceptions and the progress bar;
- ``privacy``: Gaussian calibration, the CAPE guarantee, ledgers, random-matrix facts;
- ``protocol``: the driver of site and aggregator steps, CAPE's noise, secure aggregation, the exchanges;
- ``data``: a site's files: discovery, loading, cleaning, atlases and parcels;
- ``algorithms``: capePCA, the ICAs, capeAGN, PD-SVD, dFNC states and the metrics, on arrays;
- ``config``: the run configuration (schema, constraints, generated docs);
- ``datasets``: synthetic consortia with known truth;
- ``report``: figures, NIfTI maps, timings and the HTML report;
- ``run``: the stage table, the roles, the algorithm factory, the planner, the pipeline and the outputs;
- ``deploy``: the parties over a shared folder or COINSTAC, the Pydra workflow, a site's cluster;
- on top: the estimators and the ``dpneuro`` command.
"""

import importlib

__version__ = "0.2.0"

__all__ = ["DecentralizedICA", "DecentralizedPCA", "DpneuroError", "RunConfig", "plan_budget", "__version__"]

_LAZY = {"DecentralizedICA": "estimators", "DecentralizedPCA": "estimators", "plan_budget": "estimators",
         "RunConfig": "config", "DpneuroError": "_utils.errors"}


def __getattr__(name: str):
    # imported on first use, so that `import dpneuro` (and the CLI's --help) stays fast
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'dpneuro' has no attribute {name!r}")
