"""Every accelerated embedding engine held to the reference engine, bit for bit.

Hypothesis draws optimizers, pooling, weights, offloading, weight decay, row dtypes and a few
training steps on ragged batches (duplicates, padding ids, empty bags); every pooled
output and, after each backward, every row of every store (headers included) must
have the same bytes as the reference's.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leanstate import _backends
from leanstate.embedding import KVEmbeddingBag
from tests.harness import FakeClock

ACCELERATED = sorted(b for b in _backends.available("embedding") if b != "reference")
D = 6


def rows_of(bag):
    keys = bag.store.keys()
    rows = [keys, bag.store.get_rows(keys)]
    if bag.state_store is not None:
        rows.append(bag.state_store.get_rows(keys))
    return [r.view(torch.uint8) if r.dtype != torch.int64 else r for r in rows]


batches = st.lists(
    st.lists(st.integers(-1, 30), min_size=0, max_size=6), min_size=1, max_size=5
)  # bags of ids; -1 is padding


@pytest.mark.parametrize("backend", ACCELERATED)
@settings(max_examples=40, deadline=None)
@given(
    optimizer=st.sampled_from(["sgd", "rowwise_adagrad", "adam"]),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    offloading=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.01]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    steps=st.lists(batches, min_size=1, max_size=3),
    seed=st.integers(0, 2**32),
)
def test_engine_trains_bit_for_bit_like_the_reference(
    backend, optimizer, mode, weighted, offloading, weight_decay, dtype, steps, seed
):
    weighted = weighted and mode == "sum"
    bags = [
        KVEmbeddingBag(
            None,
            D,
            mode=mode,
            optimizer=optimizer,
            lr=0.1,
            weight_decay=weight_decay,
            optimizer_offloading=offloading,
            return_whole_row=offloading,
            dtype=dtype,
            seed=seed,
            clock=FakeClock(),
            backend=name,
        )
        for name in ("reference", backend)
    ]
    generator = torch.Generator().manual_seed(seed)
    for step in steps:
        ids = torch.tensor([i for bag in step for i in bag], dtype=torch.int64)
        offsets = torch.tensor([0, *torch.cumsum(torch.tensor([len(b) for b in step]), 0).tolist()[:-1]])
        weights = torch.rand(len(ids), generator=generator) if weighted else None
        upstream = torch.randn(len(step), D, generator=generator)
        outputs = []
        for bag in bags:
            pooled = bag(ids, offsets, weights)
            (pooled * upstream).sum().backward()
            outputs.append(pooled.detach())
        assert torch.equal(outputs[0].view(torch.uint8), outputs[1].view(torch.uint8))
        for a, b in zip(rows_of(bags[0]), rows_of(bags[1]), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ACCELERATED)
@settings(max_examples=30, deadline=None)
@given(
    steps=st.lists(batches, min_size=1, max_size=1),
    mean=st.booleans(),
    weighted=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_pooling_and_gradients_of_given_rows_match_the_reference(backend, steps, mean, weighted, seed):
    """``pool_rows`` / ``row_gradients`` (what the sharded collection runs on received rows)."""
    from leanstate.reference.embedding import pool_rows, row_gradients

    bag = KVEmbeddingBag(None, D, backend=backend)
    ids = torch.tensor([max(i, 0) for b in steps[0] for i in b], dtype=torch.int64)
    offsets = torch.tensor([0, *torch.cumsum(torch.tensor([len(b) for b in steps[0]]), 0).tolist()])
    unique, inverse = torch.unique(ids, return_inverse=True)
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(unique), D, generator=generator)
    weights = torch.rand(len(ids), generator=generator) if weighted else None
    grad_output = torch.randn(len(offsets) - 1, D, generator=generator)
    got = bag.engine.pool_rows(rows, inverse, offsets, weights, mean)
    assert torch.equal(
        got.view(torch.int32), pool_rows(rows, inverse, offsets, weights, mean).view(torch.int32)
    )
    got = bag.engine.row_gradients(len(unique), inverse, offsets, weights, mean, grad_output)
    want = row_gradients(len(unique), inverse, offsets, weights, mean, grad_output)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
