"""The ``torch`` ZeRO path: bucket broadcasts that overlap the next forward.

Same class and results as ``leanstate.reference.zero.ZeroRedundancyOptimizer``; with
``overlap_broadcast=True`` (bucket views required) and the waits of
:meth:`overlap_with` installed, ``step()`` starts one asynchronous broadcast per rank
bucket and returns. :meth:`overlap_with` installs a forward pre-hook on every module
that owns parameters: it waits only for the buckets holding that module's parameters,
so the first layers compute while later buckets are still in flight. Until those hooks
are installed (or once they are all removed) ``step()`` waits for its own broadcasts,
so the parameters are never read half-broadcast. Anything else that reads parameters or state (the next ``step``,
``consolidate_state_dict``, ``state_dict``, ``load_state_dict``, ``add_param_group``,
``clip_grad_norm_``) waits for all of them first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leanstate.reference.zero import ZeroRedundancyOptimizer as ReferenceZero


class ZeroRedundancyOptimizer(ReferenceZero):
    """ZeRO with optional broadcast/forward overlap; see the reference class.

    Example::

        >>> zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
        ...                                parameters_as_bucket_view=True, overlap_broadcast=True, lr=1e-3)
        >>> zero.overlap_with(model)
    """

    backend = "torch"

    def __init__(
        self,
        params,
        optimizer_class,
        process_group=None,
        parameters_as_bucket_view=False,
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
        super().__init__(params, optimizer_class, process_group, parameters_as_bucket_view, **defaults)

    def _wait(self, ranks=None) -> None:
        for rank in list(self._pending) if ranks is None else ranks:
            for work in self._pending.pop(rank, ()):
                work.wait()

    def _hooks_installed(self) -> bool:
        """Whether some pre-forward wait installed by :meth:`overlap_with` is still registered."""
        return any(
            (hooks := handle.hooks_dict_ref()) is not None and handle.id in hooks for handle in self._handles
        )

    def _broadcast(self) -> None:
        # Without a pre-forward wait nothing would make the next forward wait for its
        # parameters: then the step waits itself (correct by default, just not overlapped).
        if not (self.overlap_broadcast and self._hooks_installed()):
            super()._broadcast()
            return
        self._pending = self._start_broadcasts()

    def overlap_with(self, model: nn.Module) -> list[_OverlapHandle]:
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
                handles.append(_OverlapHandle(self, hook))
        self._handles += [handle.hook for handle in handles]
        return handles

    def step(self, closure=None, **kwargs: Any):
        self._wait()
        return super().step(closure, **kwargs)

    def consolidate_state_dict(self, to: int = 0) -> None:
        self._wait()
        super().consolidate_state_dict(to)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._wait()
        super().load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        if self._initialized:
            self._wait()
        super().add_param_group(param_group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self._wait()
        return super().clip_grad_norm_(max_norm, norm_type)


class _OverlapHandle:
    """A pre-forward wait's handle whose ``remove()`` first waits for what is in flight."""

    def __init__(self, zero: ZeroRedundancyOptimizer, hook: torch.utils.hooks.RemovableHandle) -> None:
        self.zero, self.hook = zero, hook

    def remove(self) -> None:
        self.zero._wait()
        self.hook.remove()
