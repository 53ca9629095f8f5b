"""What the ZeRO tests train: a small model, its batches, DDP-style gradient averaging,
and the checks that a ZeRO model and a plain-optimizer replica stay bitwise equal."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def backward(model: nn.Module, x: torch.Tensor, group=None) -> torch.Tensor:
    """Loss and averaged gradients: by DistributedDataParallel when ``model`` is one,
    else by an all-reduce per gradient (DDP's sum-then-divide arithmetic)."""
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    if isinstance(model, DDP):
        return loss
    size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= size
    return loss


def inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def assert_same(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{what}: {name} differs"


def assert_equal_across_ranks(model: nn.Module, group=None) -> None:
    for name, p in model.named_parameters():
        copies = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, p.detach().contiguous(), group=group)
        assert all(torch.equal(c, copies[0]) for c in copies), f"{name} differs across ranks"


def train_pair(zero_model, plain_model, zero, plain, steps, rank, start=0, flips=True, group=None):
    for step in range(start, start + steps):
        if flips and step in (10, 15):
            for model in (zero_model, plain_model):
                inner(model)[2].weight.requires_grad_(step == 15)  # frozen at 10, trainable again at 15
        for model in (zero_model, plain_model):
            backward(model, batch(step, rank), group)
        zero.step()
        plain.step()
        assert_same(zero_model, plain_model, f"step {step}")
    assert_equal_across_ranks(zero_model, group)
