from __future__ import annotations

import os

import torch  # noqa: E402

# On CPU, Triton kernels run under the interpreter; set before anything imports triton.
# On a GPU machine (tests/gpu) they must run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (converted from the GGUF on first use)."""
    from engine.bundled import bundled_model_dir as convert

    return convert()


@pytest.fixture(scope="session")
def hf_bundled(bundled_model_dir: Path) -> Any:
    """transformers' model for the bundled directory, fp32 on CPU."""
    from tests.hf_reference import hf_model

    return hf_model(bundled_model_dir)
