"""The textbook ZeRO (``leanstate.reference.zero``) on real gloo groups of 1-3 ranks: it
trains bit for bit as the plain optimizer it wraps, and its consolidated state dict loads
into that plain optimizer and back."""

from __future__ import annotations

import pytest
from torch.nn.parallel import DistributedDataParallel as DDP

from leanstate.reference.zero import ZeroRedundancyOptimizer
from tests.harness import run_world
from tests.zero_models import OPTIMIZERS, backward, batch, make_model, train_pair


def parity(name: str):
    def scenario(rank, world, folder):
        cls, kwargs = OPTIMIZERS[name]
        zero_model, plain_model = (DDP(make_model(), find_unused_parameters=True) for _ in range(2))
        zero = ZeroRedundancyOptimizer(zero_model.parameters(), cls, **kwargs)
        plain = cls(plain_model.parameters(), **kwargs)
        train_pair(zero_model, plain_model, zero, plain, 12, rank)
        shares = [sum(p.numel() for g in share for p in g["params"]) for share in zero.shares]
        assert sum(shares) == sum(p.numel() for p in zero_model.parameters())

    return scenario


def state_dict_round_trip(rank, world, folder):
    cls, kwargs = OPTIMIZERS["adam"]
    model, plain_model = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), cls, **kwargs)
    for step in range(3):
        backward(model, batch(step, rank))
        zero.step()
    zero.consolidate_state_dict(to=0)
    if rank != 0:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            zero.state_dict()
        return
    saved = zero.state_dict()
    plain = cls(plain_model.parameters(), **kwargs)
    plain.load_state_dict(saved)  # the torch.optim format
    assert sorted(plain.state_dict()["state"]) == list(range(len(list(model.parameters()))))
    zero.load_state_dict(plain.state_dict())  # and back: this rank's share takes its state
    for local in zero.optim.state.values():
        assert int(local["step"]) == 3


SCENARIOS = {"parity-adam": parity("adam"), "parity-sgd": parity("sgd"), "state-dict": state_dict_round_trip}
BY_WORLD = {2: list(SCENARIOS), 3: ["parity-adam"]}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero-reference")
    return {world: run_world(world, folder, __name__) for world in BY_WORLD}


CASES = [(world, name) for world, names in BY_WORLD.items() for name in names]


@pytest.mark.parametrize("world, scenario", CASES, ids=[f"world{w}-{n}" for w, n in CASES])
def test_reference_zero(worlds, world, scenario):
    failures = worlds[world][scenario]
    assert not failures, "\n".join(failures)
