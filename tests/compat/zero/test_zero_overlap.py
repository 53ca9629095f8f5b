"""ZeRO with overlap_broadcast=True (broadcasts overlapping the next forward) held to plain optimizers."""

from __future__ import annotations

import pytest
import torch

from leanstate.zero import ZeroRedundancyOptimizer
from tests.harness import run_world
from tests.zero_models import OPTIMIZERS, backward, batch, make_model, train_pair


def overlap_parity(rank, world, folder):
    cls, kwargs = OPTIMIZERS["adam"]
    zero_model, plain_model = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(
        zero_model.parameters(), cls, parameters_as_bucket_view=True, overlap_broadcast=True, **kwargs
    )
    handles = zero.overlap_with(zero_model)
    assert len(handles) == 3  # the three Linear layers own parameters
    plain = cls(plain_model.parameters(), **kwargs)
    for step in range(20):
        if step in (10, 15):  # trainability flips rebuild the buckets
            for model in (zero_model, plain_model):
                model[2].weight.requires_grad_(step == 15)
        for model in (zero_model, plain_model):
            backward(model, batch(step, rank))  # the forward waits, layer by layer
        assert not zero._pending  # every bucket was awaited by some layer's forward
        zero.step()
        assert len(zero._pending) == world  # one broadcast per rank bucket in flight
        plain.step()
    zero._wait()
    for p, q in zip(zero_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)
    zero.step()  # with no new gradients; consolidation below waits for its broadcasts
    plain.step()
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        assert len(zero.state_dict()["state"]) == 6


def no_overlap_matches_reference(rank, world, folder):
    cls, kwargs = OPTIMIZERS["sgd"]
    zero_model, plain_model = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), cls, **kwargs)
    plain = cls(plain_model.parameters(), **kwargs)
    train_pair(zero_model, plain_model, zero, plain, 20, rank)


def overlap_without_hooks_waits(rank, world, folder):
    """Until the pre-forward waits are installed (and once they are removed) step() waits
    for its own broadcasts, so training is exact without overlap_with."""
    cls, kwargs = OPTIMIZERS["adam"]
    zero_model, plain_model = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(
        zero_model.parameters(), cls, parameters_as_bucket_view=True, overlap_broadcast=True, **kwargs
    )
    plain = cls(plain_model.parameters(), **kwargs)
    train_pair(zero_model, plain_model, zero, plain, 6, rank, flips=False)
    assert not zero._pending
    handles = zero.overlap_with(zero_model)
    for step in range(6, 10):
        if step == 9:
            for handle in handles:
                handle.remove()
        for model in (zero_model, plain_model):
            backward(model, batch(step, rank))
        zero.step()
        plain.step()
        assert bool(zero._pending) == (step < 9)  # in flight only while the waits are installed
    for p, q in zip(zero_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)


def every_method_waits_first(rank, world, folder):
    """Each method that touches parameters or state (spec/zero.md) waits for every broadcast
    in flight before anything else: one dropped wait fails here, on any rank."""
    cls, kwargs = OPTIMIZERS["adam"]
    model = make_model()
    zero = ZeroRedundancyOptimizer(
        model.parameters(), cls, parameters_as_bucket_view=True, overlap_broadcast=True, **kwargs
    )
    zero.overlap_with(model)
    plain_model = make_model()
    plain = cls(plain_model.parameters(), **kwargs)
    backward(plain_model, batch(0, rank))
    plain.step()
    calls = []
    wait = zero._wait

    def spy(ranks=None):
        calls.append((ranks, bool(zero._pending)))
        wait(ranks)

    zero._wait = spy
    methods = {
        "step": zero.step,
        "consolidate_state_dict": lambda: zero.consolidate_state_dict(to=0),
        "clip_grad_norm_": lambda: zero.clip_grad_norm_(1.0),
        "load_state_dict": lambda: zero.load_state_dict(plain.state_dict()),
        "add_param_group": lambda: zero.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]}),
    }
    for name, method in methods.items():
        backward(model, batch(1, rank))
        zero.step()  # its broadcasts stay in flight: the pre-forward waits are installed
        assert zero._pending, name
        calls.clear()
        method()
        assert calls[:1] == [(None, True)], (name, calls)  # first: wait for all, with some in flight


SCENARIOS = {
    "every-method-waits": every_method_waits_first,
    "overlap-parity": overlap_parity,
    "no-overlap": no_overlap_matches_reference,
    "overlap-without-hooks": overlap_without_hooks_waits,
}
BY_WORLD = {2: list(SCENARIOS), 3: list(SCENARIOS)}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("torch-zero")
    return {world: run_world(world, folder, __name__) for world in BY_WORLD}


CASES = [(world, name) for world, names in BY_WORLD.items() for name in names]


@pytest.mark.parametrize("world, scenario", CASES, ids=[f"world{w}-{n}" for w, n in CASES])
def test_torch_zero(worlds, world, scenario):
    failures = worlds[world][scenario]
    assert not failures, "\n".join(failures)


def test_overlap_needs_bucket_views():
    with pytest.raises(ValueError, match="parameters_as_bucket_view=True"):
        ZeroRedundancyOptimizer(
            [torch.zeros(2, requires_grad=True)], torch.optim.SGD, overlap_broadcast=True, lr=0.1
        )
