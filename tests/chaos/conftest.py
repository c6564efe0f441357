from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.chaos.tools import Stack, chaos_stack


@pytest.fixture(scope="package")
def stack(bundled_model_dir) -> Iterator[Stack]:
    """The chaos stack (tools.chaos_stack): one for every chaos case that leaves it standing."""
    with chaos_stack(bundled_model_dir) as s:
        yield s
