"""pytest hooks and fixtures; the shared helpers live in ``tests.harness``."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import settings

from tests.harness import VECTORS

settings.register_profile("default", deadline=None, max_examples=60)
settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture
def vectors():
    """Load a golden vector file from spec/vectors by name."""
    return lambda name: json.loads((VECTORS / name).read_text())


def pytest_collection_modifyitems(config, items):
    """A test parametrized with the ``numba-cuda`` backend runs in the simulator's process.

    ``numba-cuda`` is available only where its kernels can run (a GPU, or numba's CUDA
    simulator set up before numba is imported), so these items exist only in that
    process; marking them ``cudasim`` lets ``make test`` select them there.
    """
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "numba-cuda" in [
            v for v in callspec.params.values() if isinstance(v, str)
        ]:
            item.add_marker(pytest.mark.cudasim)
