import os
import tempfile

import pytest

os.environ.setdefault("NO_ET", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("NILEARN_DATA", tempfile.mkdtemp(prefix="nilearn_data_"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run heavy tests")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="heavy test: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
