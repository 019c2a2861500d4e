"""Make `tests/support` importable from every test module; the suite-wide dtype switch."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.suite_dtype import CHOICES, ENV, suite_dtype  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--dtype", choices=CHOICES, default=None,
                     help=f"serve the real model in this dtype in every test that does not need its own "
                          f"(default: ${ENV}, else auto)")


def pytest_configure(config):
    # Through the environment, so that server and bench subprocesses see the same choice.
    if config.getoption("--dtype"):
        os.environ[ENV] = config.getoption("--dtype")
    suite_dtype()  # a bad value fails here, once, with its name


def pytest_report_header(config):
    return f"foresight suite dtype: {suite_dtype()} (${ENV} / --dtype)"
