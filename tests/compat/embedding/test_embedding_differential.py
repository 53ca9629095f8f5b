"""Every accelerated embedding engine held to the reference engine, bit for bit.

Hypothesis draws optimizers, pooling, weights, offloading, weight decay, row dtypes, dims
(past 64 and 128, odd) and a few training steps on ragged batches from
``leanstate.testing``'s strategies (the int64 edges, duplicates, colliding ids, padding,
empty bags); every pooled output and, after each backward, every row of every store
(headers included) must have the same bytes as the reference's.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leanstate import _backends
from leanstate.embedding import KVEmbeddingBag
from leanstate.testing import dims, dtypes, id_batches
from tests.harness import FakeClock

ACCELERATED = sorted(b for b in _backends.available("embedding") if b != "reference")


def widest(backend):
    """The simulator runs each kernel thread as Python: its dims stay small."""
    return 12 if backend == "numba-cuda" else 300


def rows_of(bag):
    keys = bag.store.keys()
    rows = [keys, bag.store.get_rows(keys)]
    if bag.state_store is not None:
        rows.append(bag.state_store.get_rows(keys))
    return [r.view(torch.uint8) if r.dtype != torch.int64 else r for r in rows]


@st.composite
def batches(draw):
    """Bags of ids (negative ids are padding, a bag may be empty): one batch of ids cut at
    drawn offsets."""
    ids = draw(id_batches(max_size=20, padding=True))
    cuts = draw(st.lists(st.integers(0, len(ids)), min_size=0, max_size=4))
    bounds = [0, *sorted(cuts), len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


TRAINING = {
    "optimizer": st.sampled_from(["sgd", "rowwise_adagrad", "adam"]),
    "mode": st.sampled_from(["sum", "mean"]),
    "weighted": st.booleans(),
    "offloading": st.booleans(),
    "weight_decay": st.sampled_from([0.0, 0.01]),
    "dtype": dtypes(),
    "steps": st.lists(batches(), min_size=1, max_size=3),
    "seed": st.integers(0, 2**32),
    "data": st.data(),
}


@pytest.mark.parametrize("backend", ACCELERATED)
@settings(max_examples=40, deadline=None)
@given(**TRAINING)
def test_engine_trains_bit_for_bit_like_the_reference(
    backend, optimizer, mode, weighted, offloading, weight_decay, dtype, steps, seed, data
):
    trains_like_the_reference(
        backend,
        widest(backend),
        optimizer,
        mode,
        weighted,
        offloading,
        weight_decay,
        dtype,
        steps,
        seed,
        data,
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ACCELERATED)
@settings(max_examples=120, deadline=None)
@given(**TRAINING)
def test_engine_trains_bit_for_bit_like_the_reference_at_length(
    backend, optimizer, mode, weighted, offloading, weight_decay, dtype, steps, seed, data
):
    """The long run (``make test-slow``): three times the examples, and in the simulator rows
    past 32 wide (a warp's width)."""
    width = 40 if backend == "numba-cuda" else widest(backend)
    trains_like_the_reference(
        backend, width, optimizer, mode, weighted, offloading, weight_decay, dtype, steps, seed, data
    )


def trains_like_the_reference(
    backend, width, optimizer, mode, weighted, offloading, weight_decay, dtype, steps, seed, data
):
    weighted = weighted and mode == "sum"
    dim = data.draw(dims(width), label="dim")
    bags = [
        KVEmbeddingBag(
            None,
            dim,
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
        upstream = torch.randn(len(step), dim, generator=generator)
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
@given(bags=batches(), mean=st.booleans(), weighted=st.booleans(), seed=st.integers(0, 2**32), data=st.data())
def test_pooling_and_gradients_of_given_rows_match_the_reference(backend, bags, mean, weighted, seed, data):
    """``pool_rows`` / ``row_gradients`` (what the sharded collection runs on received rows)."""
    from leanstate.reference.embedding import pool_rows, row_gradients

    dim = data.draw(dims(widest(backend)), label="dim")
    bag = KVEmbeddingBag(None, dim, backend=backend)
    ids = torch.tensor([max(i, 0) for b in bags for i in b], dtype=torch.int64)
    offsets = torch.tensor([0, *torch.cumsum(torch.tensor([len(b) for b in bags]), 0).tolist()])
    unique, inverse = torch.unique(ids, return_inverse=True)
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(unique), dim, generator=generator)
    weights = torch.rand(len(ids), generator=generator) if weighted else None
    grad_output = torch.randn(len(offsets) - 1, dim, generator=generator)
    got = bag.engine.pool_rows(rows, inverse, offsets, weights, mean)
    assert torch.equal(
        got.view(torch.int32), pool_rows(rows, inverse, offsets, weights, mean).view(torch.int32)
    )
    got = bag.engine.row_gradients(len(unique), inverse, offsets, weights, mean, grad_output)
    want = row_gradients(len(unique), inverse, offsets, weights, mean, grad_output)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
