"""ZeRO stage 1, stated in the most obvious terms: each rank keeps the optimizer state of
its share of the parameters only.

Every rank holds all parameters and their gradients. The parameters are partitioned
once, as ``torch.distributed.optim.ZeroRedundancyOptimizer`` does: within each
parameter group, largest first, each parameter goes to the rank with the fewest
elements so far. A step is three moves:

1. every rank steps a local ``optimizer_class`` over its own share;
2. every parameter is broadcast from the rank that owns it, one at a time;
3. (when asked) ``consolidate_state_dict(to)`` gathers each rank's local state on one
   rank, and ``state_dict()`` there renumbers it into the ``torch.optim`` format, which
   loads into a plain optimizer or into a ZeRO optimizer on any world size.

The partition and the two renumberings (:func:`partition`, :func:`global_state_dict`,
:func:`local_state_dict`) are pure functions, which the production class calls too.
This module is the reference: no bucket views, asynchronous broadcasts, overlap hooks,
point-to-point transfers or ``Join`` support. ``leanstate.ZeroRedundancyOptimizer`` is
the production implementation, held to this one by differential tests (bit-identical
parameters and state dicts). See ``spec/zero.md``.

Example (on every rank)::

    >>> optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    >>> loss.backward(); optimizer.step()
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer


class ZeroRedundancyOptimizer(Optimizer):
    """Wrap ``optimizer_class`` so that each rank keeps the state of its share only.

    Args:
        params: parameters, or parameter-group dicts, identical on every rank.
        optimizer_class: a ``torch.optim.Optimizer`` subclass; the local one is ``.optim``.
        process_group: the data-parallel group (default: the world).
        parameters_as_bucket_view: accepted for the signature; the reference broadcasts
            each parameter on its own (the same values).
        **defaults: the optimizer's arguments (``lr``, ``betas``...).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        optimizer_class: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        **defaults: Any,
    ) -> None:
        super().__init__(params, defaults)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.shares = partition(self.param_groups, self.world_size)
        self.optim = optimizer_class(self.shares[self.rank], **defaults)
        self.gathered: list[dict] | None = None

    def _group_rank_to_global(self, rank: int) -> int:
        return dist.get_global_rank(self.process_group, rank)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step this rank's share, then broadcast every parameter from its owner. Call on every rank."""
        for group, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            local.update({k: v for k, v in group.items() if k != "params"})  # e.g. a scheduler's lr
        loss = self.optim.step(closure)
        for rank, share in enumerate(self.shares):
            for group in share:
                for param in group["params"]:
                    dist.broadcast(param.data, src=self._group_rank_to_global(rank), group=self.process_group)
        return loss

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's local state dict on rank ``to`` (of the group). Call on every rank."""
        local = self.optim.state_dict()
        gathered = [None] * self.world_size if self.rank == to else None
        dist.gather_object(local, gathered, dst=self._group_rank_to_global(to), group=self.process_group)
        self.gathered = copy.deepcopy(gathered) if self.rank == to else None

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state in ``torch.optim`` format (on the consolidating rank)."""
        if self.gathered is None:
            raise RuntimeError(f"call consolidate_state_dict(to={self.rank}) on every rank first")
        return global_state_dict(self.param_groups, self.shares, self.gathered, self.rank)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim``-format state dict: this rank's parameters take their state."""
        self.optim.load_state_dict(local_state_dict(state_dict, self.param_groups, self.optim.param_groups))
        for saved, group in zip(state_dict["param_groups"], self.param_groups, strict=True):
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})


def partition(param_groups: list[dict], world_size: int) -> list[list[dict]]:
    """Share ``param_groups`` out among ``world_size`` ranks, as torch's ZeRO does.

    Within each group in order, its parameters sorted by ``numel``, largest first (a
    stable sort: equal sizes keep their order), each goes to the rank with the fewest
    elements assigned so far, counting every earlier group (ties to the lowest rank).
    Returns, per rank, one group per parameter group: a copy of the group (the same
    hyperparameters) holding only that rank's parameters, possibly none. Repartitioning
    after a group is appended leaves the earlier groups' parameters where they were.
    """
    elements = [0] * world_size
    shares: list[list[dict]] = [[] for _ in range(world_size)]
    for group in param_groups:
        assigned: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for param in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
            rank = elements.index(min(elements))
            assigned[rank].append(param)
            elements[rank] += param.numel()
        for rank in range(world_size):
            shares[rank].append({**group, "params": assigned[rank]})
    return shares


def global_state_dict(
    param_groups: list[dict], shares: list[list[dict]], gathered: list[dict], rank: int
) -> dict[str, Any]:
    """Every rank's local state dict renumbered into one ``torch.optim`` state dict.

    ``gathered[r]`` is the ``state_dict()`` of rank ``r``'s local optimizer, whose groups
    are ``shares[r]`` (see :func:`partition`). A parameter's state is keyed by its
    position across all of ``param_groups``, in ascending order; each group takes the
    hyperparameters of rank ``rank``'s local group, overridden by those of
    ``param_groups``, and lists its parameters' positions.
    """
    number = {param: i for i, param in enumerate(p for g in param_groups for p in g["params"])}
    state = {}
    for share, local in zip(shares, gathered, strict=True):
        for group, local_group in zip(share, local["param_groups"], strict=True):
            for param, local_number in zip(group["params"], local_group["params"], strict=True):
                if local_number in local["state"]:
                    state[number[param]] = local["state"][local_number]
    groups = []
    for group, local_group in zip(param_groups, gathered[rank]["param_groups"], strict=True):
        entry = {k: v for k, v in local_group.items() if k != "params"}
        entry.update({k: v for k, v in group.items() if k != "params"})
        entry["params"] = [number[p] for p in group["params"]]
        groups.append(entry)
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def local_state_dict(
    state_dict: dict[str, Any], param_groups: list[dict], local_param_groups: list[dict]
) -> dict[str, Any]:
    """The part of a ``torch.optim`` state dict that one rank's local optimizer loads.

    ``state_dict`` numbers the parameters of ``param_groups`` (the whole optimizer's
    groups, in order); ``local_param_groups`` are this rank's local groups, one per
    group. The result numbers the local parameters in order, gives each the saved state
    of its parameter (if it has one) and each local group the saved hyperparameters. It
    is a deep copy: loading it never aliases the caller's tensors.
    """
    saved_number = {}
    for saved, group in zip(state_dict["param_groups"], param_groups, strict=True):
        saved_number.update(zip(group["params"], saved["params"], strict=True))
    local_state, local_groups, number = {}, [], 0
    for saved, local_group in zip(state_dict["param_groups"], local_param_groups, strict=True):
        numbers = []
        for param in local_group["params"]:
            if saved_number[param] in state_dict["state"]:
                local_state[number] = state_dict["state"][saved_number[param]]
            numbers.append(number)
            number += 1
        local_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": numbers})
    return copy.deepcopy({"state": local_state, "param_groups": local_groups})
