"""Device-only tests: skipped without CUDA; refuse to run kernels under Triton's interpreter."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:  # this hook sees the whole session's items: mark only this folder's
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


def pytest_configure(config):
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.exit("tests/gpu must run compiled kernels: unset TRITON_INTERPRET", returncode=2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
