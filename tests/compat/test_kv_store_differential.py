"""Every accelerated store engine held to the reference engine, bit for bit, through the front class.

The conformance kit's state machine (``leanstate.testing.StoreMachine``) runs the same
random operations on a reference store and on the store of the backend under test and
compares every result (values, whole rows with headers, metadata, keys, evicted ids,
counts) as raw bytes. Shard counts vary with the seed.
"""

from __future__ import annotations

import pytest

from leanstate import _backends
from leanstate.kv_store import KVStore
from leanstate.testing import run_store_machine

ACCELERATED = sorted(b for b in _backends.available("kv_store") if b != "reference")


def factory(backend: str):
    def make_store(dim, *, seed, **options):
        return KVStore(dim, backend=backend, seed=seed, num_shards=1 + seed % 5, **options)

    return make_store


def check_backend(backend: str, examples: int = 80) -> None:
    """Run the state machine on ``backend``'s stores."""
    run_store_machine(factory(backend), examples=examples)


@pytest.mark.parametrize("backend", ACCELERATED)
def test_engine_matches_the_reference(backend):
    # the simulator runs each kernel thread as Python: fewer runs, the same machine
    check_backend(backend, examples=20 if backend == "numba-cuda" else 80)
