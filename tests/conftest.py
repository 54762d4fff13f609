import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the slow full 0.8B-shape tests")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full") or os.environ.get("HYBRIDRT_FULL_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="full-size test: run with --full or HYBRIDRT_FULL_TESTS=1")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)
