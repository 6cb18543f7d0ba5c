import io
import os
import sys
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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture()
def terminal(monkeypatch):
    """``terminal()`` in a test makes stderr a terminal, where progress bars are drawn (in a log they stay
    silent), and returns it; set in the test itself, after pytest's capture has taken stderr."""
    def start() -> io.StringIO:
        term = _Terminal()
        monkeypatch.setattr(sys, "stderr", term)
        return term

    return start
