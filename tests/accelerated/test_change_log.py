"""Change tracking as the accelerated engines share it (``accelerated/_change_log.py``)."""

from __future__ import annotations

import pytest
import torch

from leanstate import _backends
from leanstate.kv_store import KVStore

ENGINES = sorted(b for b in _backends.available("kv_store") if b != "reference")


@pytest.mark.parametrize("backend", ENGINES)
def test_the_last_epoch_a_stamp_holds_ends_with_an_error_not_a_wrapped_stamp(backend):
    """An epoch past what the engine's stamps hold (int32 for numba's blocks) would wrap and
    make old rows look new: ending the last one is an OverflowError naming the bound, and
    the store's changes are as they were."""
    store = KVStore(4, backend=backend)
    store.set(torch.tensor([1, 2]), torch.ones(2, 4))
    engine = store.engine
    engine._log.epoch = engine.MAX_EPOCH  # as if that many epochs had ended
    before = store.changes(since=0)
    with pytest.raises(OverflowError, match=f"stamps epochs up to {engine.MAX_EPOCH}"):
        store.next_epoch()
    after = store.changes(since=0)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
