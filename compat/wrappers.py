"""``leanstate.offload_wrapper``: the reference wrapper with the chosen backend's copier.

The wrappers are one implementation (``leanstate.reference.wrappers``); what differs per
device is how an offloaded activation's bytes move. Under ``auto`` a CUDA machine gets
the ``torch`` copier (a side stream, ordered by events; ``accelerated/torch_wrappers.py``),
every other machine the reference's synchronous one.
"""

from __future__ import annotations

from torch import nn

from leanstate import _backends
from leanstate.reference.pinned_pool import PinnedMemoryPool
from leanstate.reference.wrappers import DEFAULT_MIN_OFFLOAD_BYTES, OffloadWrapper


def offload_wrapper(
    module: nn.Module,
    *,
    pin_memory: bool | str = "auto",
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    pinned_budget_bytes: int | None = None,
    pool: PinnedMemoryPool | None = None,
    backend: str | None = None,
) -> OffloadWrapper:
    """Wrap ``module`` in an :class:`OffloadWrapper` whose copies use ``backend``'s copier
    (default: the import-time choice for ``offload``). A no-op for CPU activations.

    Example::

        >>> model = offload_wrapper(model, pinned_budget_bytes=2**30)
    """
    _, implementation = _backends.resolve("offload", backend)
    return OffloadWrapper(
        module,
        pin_memory=pin_memory,
        min_offload_bytes=min_offload_bytes,
        pinned_budget_bytes=pinned_budget_bytes,
        pool=pool,
        copier=implementation.Copier(),
    )
