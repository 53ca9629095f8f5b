"""``leanstate.ZeroRedundancyOptimizer``: ZeRO stage 1, torch-compatible, production grade.

The textbook is ``leanstate.reference.zero`` (partition, local step, one broadcast per
parameter, gather, renumber); this is its hardened, faster form, held to it by the
differential scenarios of ``tests/compat/zero/test_zero.py`` (bit-identical parameters and
state dicts), with bucket views, asynchronous and overlapped broadcasts, point-to-point
consolidation (``leanstate.zero._consolidation``), trainability changes, clipping and
``Join``. The partition and the state-dict renumbering are the textbook's own pure
functions.

Same constructor, methods and state-dict format as
``torch.distributed.optim.ZeroRedundancyOptimizer``: every rank holds all parameters and
their gradients, but each parameter's optimizer state lives on one rank, which steps it
and then broadcasts it. The partition is torch's: within each parameter group, largest
first, each parameter to the rank with the fewest elements so far.

Differences from torch (each a fix, see ``spec/zero.md``): ``load_state_dict`` never
mutates the caller's dict and leaves no ``None`` in ``.state``; consolidation gathers
to the target rank only and moves bytes with ``torch.frombuffer``; ``clip_grad_norm_``
across shards with one all-reduce; parameter groups may be given as dicts.

``overlap_broadcast=True`` (bucket views required): with the waits of
:meth:`overlap_with` installed, ``step()`` starts one asynchronous broadcast per rank
bucket and returns; each module's forward pre-hook waits only for the buckets holding
its parameters, so the first layers compute while later buckets are in flight. Until
those hooks are installed (or once they are all removed) ``step()`` waits for its own
broadcasts, so parameters are never read half-broadcast. Anything else that reads
parameters or state (the next ``step``, ``consolidate_state_dict``, ``state_dict``,
``load_state_dict``, ``add_param_group``, ``clip_grad_norm_``) waits for all of them first.

Example (on every rank)::

    >>> optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    >>> loss.backward(); optimizer.step()
    >>> optimizer.consolidate_state_dict(to=0)
    >>> if rank == 0: torch.save(optimizer.state_dict(), "optim.pt")  # loads into torch.optim.Adam
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from leanstate.reference.zero import global_state_dict, local_state_dict, partition
from leanstate.zero._consolidation import gather_state_dicts


def _trainable(param: torch.Tensor) -> bool:
    return param.requires_grad


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wrap ``optimizer_class`` so that each rank keeps the state of its shard only.

    Args:
        params: parameters, or parameter-group dicts, identical on every rank.
        optimizer_class: a ``torch.optim.Optimizer`` subclass; the local one is ``.optim``.
        process_group: the data-parallel group (default: the world).
        parameters_as_bucket_view: each rank's trainable parameters on a device are
            views of one flat buffer, broadcast in one collective per rank per step.
        overlap_broadcast: overlap the broadcasts with the next forward, once
            :meth:`overlap_with` installed the waits (needs ``parameters_as_bucket_view``).
        **defaults: the optimizer's arguments (``lr``, ``betas``...).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        optimizer_class: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        *,
        overlap_broadcast: bool = False,
        **defaults: Any,
    ) -> None:
        if overlap_broadcast and not parameters_as_bucket_view:
            raise ValueError(
                "overlap_broadcast=True needs parameters_as_bucket_view=True (one broadcast per bucket)"
            )
        self.overlap_broadcast = overlap_broadcast
        self._pending: dict[int, list[dist.Work]] = {}  # rank -> its shard's broadcasts
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._initialized = False
        super().__init__(params, defaults)
        if not self.param_groups or not any(g["params"] for g in self.param_groups):
            raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
        self._check_one_dense_type()
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._optimizer_class = optimizer_class
        self._defaults = defaults
        self._partition: list[list[dict]] = partition(self.param_groups, self.world_size)
        self.optim: Optimizer = optimizer_class(self._partition[self.rank], **defaults)
        self._sync_hyperparameters(self.optim.param_groups, self.param_groups)
        self._trainable_mask = self._agree_on_mask()()
        self._buckets: dict[torch.device, list[torch.Tensor]] = {}
        self._build_buckets()
        self._gathered: list[dict] | None = None
        self._initialized = True
        Joinable.__init__(self)

    def _check_one_dense_type(self) -> None:
        """As torch's: every parameter dense and of one tensor type (dtype and device kind)."""
        params = self._all_params
        for param in params:
            if param.layout != torch.strided:
                raise ValueError(
                    f"ZeroRedundancyOptimizer only supports dense parameters; got a {param.layout} one "
                    f"of shape {tuple(param.shape)}"
                )
        kinds = {(p.dtype, p.device.type) for p in params}
        if len(kinds) > 1:
            names = ", ".join(f"{dtype} on {device}" for dtype, device in sorted(kinds, key=str))
            raise ValueError(
                f"ZeroRedundancyOptimizer only supports parameters of one dense type; got {names}"
            )

    # -- partition ------------------------------------------------------------------

    @property
    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _mask(self) -> list[bool]:
        return [_trainable(p) for p in self._all_params]

    def _agree_on_mask(self) -> Callable[[], list[bool]]:
        """Start agreeing on which parameters go in buckets: those trainable on every rank.

        The bucket layout must be the same on every rank, so with bucket views the local
        masks are combined with one all-reduce (a parameter frozen on one rank only is
        left out of the buckets and broadcast on its own, as a frozen one is). The
        all-reduce runs in the background; the returned function waits for it and gives
        the agreed mask.
        """
        mask = self._mask()
        if not self.parameters_as_bucket_view:
            return lambda: mask
        agreed = torch.tensor(mask, dtype=torch.int32, device=self.join_device)
        work = dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.process_group, async_op=True)

        def result() -> list[bool]:
            work.wait()
            return [bool(x) for x in agreed.tolist()]

        return result

    def _owner(self) -> dict[torch.Tensor, int]:
        return {p: rank for rank, groups in enumerate(self._partition) for g in groups for p in g["params"]}

    def _global_rank(self, rank: int) -> int:
        return (
            dist.get_global_rank(self.process_group, rank)
            if self.process_group is not dist.group.WORLD
            else rank
        )

    @staticmethod
    def _sync_hyperparameters(source: list[dict], target: list[dict]) -> None:
        for src, dst in zip(source, target, strict=True):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value

    # -- buckets ----------------------------------------------------------------------

    def _build_buckets(self) -> None:
        """One flat buffer per device per rank holding that rank's trainable parameters."""
        if not self.parameters_as_bucket_view:
            return
        self._buckets = {}
        in_bucket = dict(zip(self._all_params, self._trainable_mask, strict=True))
        devices = {p.device for p in self._all_params}
        for device in sorted(devices, key=str):
            buckets = []
            for groups in self._partition:
                params = [p for g in groups for p in g["params"] if p.device == device]
                trainable = [p for p in params if in_bucket[p]]
                for frozen in (p for p in params if not in_bucket[p]):
                    frozen.data = frozen.data.detach().clone()  # out of any old bucket
                dtypes = {p.dtype for p in trainable}
                if len(dtypes) > 1:
                    raise ValueError(
                        f"parameters_as_bucket_view needs one dtype per device; {device} has {dtypes}"
                    )
                dtype = dtypes.pop() if dtypes else torch.float32
                bucket = torch.empty(max(1, sum(p.numel() for p in trainable)), dtype=dtype, device=device)
                offset = 0
                for param in trainable:
                    view = bucket[offset : offset + param.numel()].view_as(param)
                    view.copy_(param.data)
                    param.data = view
                    offset += param.numel()
                buckets.append(bucket)
            self._buckets[device] = buckets

    # -- step -------------------------------------------------------------------------

    def _shard_tensors(self, rank: int) -> list[torch.Tensor]:
        """What rank ``rank`` broadcasts: its buckets and, beside them, its parameters outside
        any bucket (frozen ones too, so that frozen parameters stay equal across ranks)."""
        if not self.parameters_as_bucket_view:
            return [p.data for g in self._partition[rank] for p in g["params"]]
        in_bucket = dict(zip(self._all_params, self._trainable_mask, strict=True))
        outside = [p.data for g in self._partition[rank] for p in g["params"] if not in_bucket[p]]
        return [buckets[rank] for buckets in self._buckets.values()] + outside

    def _start_broadcasts(self) -> dict[int, list[dist.Work]]:
        """Each rank's updated shard to every rank, asynchronously: rank -> its works."""
        return {
            rank: [
                dist.broadcast(t, src=self._global_rank(rank), group=self.process_group, async_op=True)
                for t in self._shard_tensors(rank)
            ]
            for rank in range(self.world_size)
        }

    def _broadcast(self) -> None:
        self._pending = self._start_broadcasts()
        # Without a pre-forward wait nothing would make the next forward wait for its
        # parameters: then the step waits itself (correct by default, just not overlapped).
        if not (self.overlap_broadcast and self._hooks_installed()):
            self._wait()

    def _wait(self, ranks: Iterable[int] | None = None) -> None:
        """Wait for the broadcasts in flight (of the shards of ``ranks``, default all)."""
        for rank in list(self._pending) if ranks is None else ranks:
            for work in self._pending.pop(rank, ()):
                work.wait()

    def _hooks_installed(self) -> bool:
        """Whether some pre-forward wait installed by :meth:`overlap_with` is still registered."""
        return any(
            (hooks := handle.hooks_dict_ref()) is not None and handle.id in hooks for handle in self._handles
        )

    def overlap_with(self, model: nn.Module) -> list[OverlapHandle]:
        """Make each module of ``model`` wait, before its forward, for its parameters' buckets.

        Returns one handle per hook; ``handle.remove()`` first waits for the broadcasts in
        flight (no later forward would wait for them).
        """
        owner = self._owner()
        handles = []
        for module in model.modules():
            ranks = sorted({owner[p] for p in module.parameters(recurse=False) if p in owner})
            if ranks:
                hook = module.register_forward_pre_hook(lambda _m, _a, r=tuple(ranks): self._wait(r))
                handles.append(OverlapHandle(self._wait, hook))
        self._handles += [handle.hook for handle in handles]
        return handles

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step this rank's shard, then broadcast every shard. Call on every rank."""
        self._wait()
        Join.notify_join_context(self)
        agreed = self._agree_on_mask()  # overlaps the local step
        self._sync_hyperparameters(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(closure, **kwargs) if closure is not None else self.optim.step(**kwargs)
        self._sync_hyperparameters(self.optim.param_groups, self.param_groups)
        mask = agreed()
        if mask != self._trainable_mask:  # rebuilt after the step: the buckets take the new values
            self._trainable_mask = mask
            self._build_buckets()
        self._broadcast()
        return loss

    # -- uneven inputs: torch.distributed.algorithms.join ---------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For ``Join``: a rank out of inputs keeps stepping its shard and broadcasting it."""
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the collectives ``Join`` runs for this optimizer."""
        return self._all_params[0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The process group of the collectives ``Join`` runs for this optimizer."""
        return self.process_group

    def add_param_group(self, param_group: dict) -> None:
        """Add a group on every rank; earlier groups keep their ranks, so nothing moves."""
        if self._initialized:
            self._wait()
        super().add_param_group(param_group)
        if not self._initialized:
            return
        self._partition = partition(self.param_groups, self.world_size)
        self.optim.add_param_group(self._partition[self.rank][-1])
        self._trainable_mask = self._agree_on_mask()()
        self._build_buckets()

    # -- clipping ---------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, with one all-reduce.

        Each rank computes the norms of its shard's gradients; one all-reduce of the
        per-parameter norms (zeros elsewhere, so the sum is exact) gives every rank the
        same vector, reduced exactly as torch does. Every rank scales every gradient.
        """
        self._wait()
        params = [p for p in self._all_params if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        owner = self._owner()
        mine = [i for i, p in enumerate(params) if owner[p] == self.rank]
        norm_type = float(norm_type)
        norms = torch.zeros(len(params), dtype=torch.float32, device=params[0].grad.device)
        if mine:
            local = torch._foreach_norm([params[i].grad for i in mine], norm_type)
            norms[mine] = torch.stack(local).to(norms.dtype)
        dist.all_reduce(norms, group=self.process_group)
        total = torch.linalg.vector_norm(norms, norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([p.grad for p in params], coefficient)
        return total

    # -- state dicts ------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's local state to rank ``to`` (of the group). Call on every rank."""
        self._wait()
        self._sync_hyperparameters(self.param_groups, self.optim.param_groups)
        self._gathered = gather_state_dicts(
            self.optim.state_dict(),
            to,
            rank=self.rank,
            world_size=self.world_size,
            group=self.process_group,
            global_rank=self._global_rank,
        )

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state in ``torch.optim`` format (after consolidation here)."""
        if self._gathered is None:
            raise RuntimeError(
                f"the optimizer state is not consolidated on rank {self.rank}; call "
                f"consolidate_state_dict(to={self.rank}) on every rank first"
            )
        return global_state_dict(self.param_groups, self._partition, self._gathered, self.rank)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim``-format state dict (from any world size or a plain optimizer).

        Only this rank's parameters take state; the caller's dict is not modified.
        """
        self._wait()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(group["params"]) for saved, group in zip(groups, self.param_groups)
        ):
            sizes = [len(g["params"]) for g in self.param_groups]
            raise ValueError(
                f"state_dict has param groups of sizes {[len(g['params']) for g in groups]}; "
                f"this optimizer has {sizes}"
            )
        # Only this rank's parameters, renumbered; their state copied (torch.optim's load
        # would alias the caller's tensors).
        self.optim.load_state_dict(local_state_dict(state_dict, self.param_groups, self.optim.param_groups))
        for saved, group in zip(groups, self.param_groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    group[key] = copy.deepcopy(value)
        self._sync_hyperparameters(self.param_groups, self.optim.param_groups)


class _ZeroJoinHook(JoinHook):
    """What a joined rank does each time the others step: the same step, so the
    broadcasts of every shard still meet on every rank (as torch's ZeRO does)."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


class OverlapHandle:
    """A pre-forward wait's handle (from ``overlap_with``) whose ``remove()`` first waits
    for the broadcasts in flight."""

    def __init__(self, wait: Callable[[], None], hook: torch.utils.hooks.RemovableHandle) -> None:
        self.wait, self.hook = wait, hook

    def remove(self) -> None:
        """Wait for the broadcasts in flight, then remove the hook."""
        self.wait()
        self.hook.remove()
