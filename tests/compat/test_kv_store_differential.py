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
from tests.harness import check_backend

ACCELERATED = sorted(b for b in _backends.available("kv_store") if b != "reference")


@pytest.mark.parametrize("backend", ACCELERATED)
def test_engine_matches_the_reference(backend):
    # the simulator runs each kernel thread as Python: fewer runs and narrower rows
    simulated = backend == "numba-cuda"
    check_backend(backend, examples=20 if simulated else 80, max_dim=12 if simulated else 300)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ACCELERATED)
def test_engine_matches_the_reference_at_length(backend):
    """The long run of the same machine (``make test-slow``): five times the examples on the
    CPU engines; in the simulator five times the runs on rows up to four times as wide."""
    simulated = backend == "numba-cuda"
    check_backend(backend, examples=100 if simulated else 400, max_dim=48 if simulated else 300)


EDGE_IDS = [7, 2**63 - 1, 0, 1, 2**62, 2**63 - 2, 48]


@pytest.mark.parametrize("backend", ACCELERATED)
def test_edge_ids_one_at_a_time_match_the_reference(backend):
    """The largest ids arrive alone after a small one: none may take another id's slot
    (numba-cuda's "no bid" value was once 2**63-1, which is also an id)."""
    import torch

    stores = [KVStore(3, backend=b, seed=1) for b in ("reference", backend)]
    for n, key in enumerate(EDGE_IDS):
        for store in stores:
            store.set(torch.tensor([key]), torch.full((1, 3), float(n)))
        reference, engine = stores
        ids = torch.tensor(EDGE_IDS)
        assert torch.equal(engine.keys(), reference.keys()), (backend, key)
        assert torch.equal(engine.contains(ids), reference.contains(ids)), (backend, key)
        assert torch.equal(engine.get(ids), reference.get(ids)), (backend, key)
