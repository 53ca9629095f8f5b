"""``leanstate.offload_wrapper``: the reference wrapper with the chosen backend's copier.

The wrappers are one implementation (``leanstate.reference.wrappers``); what differs per
device is how an offloaded activation's bytes move. Under ``auto`` a CUDA machine gets
the ``torch`` copier (a side stream, ordered by events; ``accelerated/torch_wrappers.py``),
every other machine the reference's synchronous one.
"""

from __future__ import annotations

from torch import nn

from leanstate import _backends
from leanstate.reference.wrappers import OffloadWrapper


def offload_wrapper(module: nn.Module, *, backend: str | None = None, **options) -> OffloadWrapper:
    """Wrap ``module`` in an :class:`OffloadWrapper` whose copies use ``backend``'s copier
    (default: the import-time choice for ``offload``). A no-op for CPU activations.

    ``options`` are the wrapper's keywords, written once there: ``pin_memory`` ("auto"),
    ``min_offload_bytes`` (64 KiB), ``pinned_budget_bytes`` (None: no cap), ``pool``.

    Example::

        >>> model = offload_wrapper(model, pinned_budget_bytes=2**30)
    """
    _, implementation = _backends.resolve("offload", backend)
    return OffloadWrapper(module, copier=implementation.Copier(), **options)
