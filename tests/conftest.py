"""Shared test helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import settings

VECTORS = Path(__file__).resolve().parents[1] / "spec" / "vectors"

settings.register_profile("default", deadline=None, max_examples=60)
settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture
def vectors():
    """Load a golden vector file from spec/vectors by name."""
    return lambda name: json.loads((VECTORS / name).read_text())


class FakeClock:
    """A settable clock in whole seconds, for deterministic headers."""

    def __init__(self, now: int = 1_700_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now
