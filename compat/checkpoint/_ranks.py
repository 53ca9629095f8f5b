"""What checkpoints saved or loaded across ranks need of ``torch.distributed``, written
once for version 2 and DCP: a group's rank and size, rank 0's value on every rank,
every rank's value, agreement, and a staging directory that rank 0 creates and every
rank learns (a failure there fails the save on every rank, before anything is written).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from leanstate.checkpoint._files import staged
from leanstate.reference.checkpoint_manifest import CheckpointError


def distributed() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def group_rank(group) -> tuple[int, int]:
    """(rank, size) in ``group``: the default group when it is None, and ``(0, 1)`` when
    there is no process group at all."""
    if not distributed():
        return 0, 1
    group = group or dist.group.WORLD
    return dist.get_rank(group), dist.get_world_size(group)


def broadcast(value, group):
    """Rank 0's ``value`` on every rank of ``group`` (as :func:`group_rank` reads it)."""
    if group_rank(group)[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return box[0]


def all_true(flag: bool, group) -> bool:
    """Whether ``flag`` holds on every rank of ``group``."""
    if group_rank(group)[1] == 1:
        return flag
    value = torch.tensor([1 if flag else 0])
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def from_every_rank(value, group) -> list:
    """``value`` from every rank of ``group``, in rank order (``group=None``: this process only)."""
    if group is None:
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


@contextlib.contextmanager
def staged_by_rank_0(path: Path, method: str, group, prepare: Callable[[], Path]) -> Iterator[Path]:
    """Rank 0 runs ``prepare()`` (its checks; it returns the target path) and creates a locked
    staging directory beside it; every rank of ``group`` gets the directory. A failure on
    rank 0 raises :class:`CheckpointError` on every rank; leaving the block with an
    exception removes rank 0's staging directory."""
    with contextlib.ExitStack() as stack:
        staging, problem = None, None
        if group_rank(group)[0] == 0:
            try:
                staging = stack.enter_context(staged(prepare(), method))
            except Exception as exc:
                problem = f"{type(exc).__name__}: {exc}"
        staging, problem = broadcast((staging, problem), group)
        if problem is not None:
            raise CheckpointError(f"{method}: rank 0: {problem}; {path} is unchanged")
        yield staging
