"""Every place an engine or a front class makes the host wait for a device value goes
through ``host_read``, which counts it.

On a GPU each such wait stalls the Python thread until every kernel queued before it has
finished, so the hot paths budget them (``spec/backends.md``): a ``get`` makes none, a
``set`` at most two. Reading the count before and after a call is how the simulator
tests hold the numba-cuda engine to that budget; on a GPU, torch's sync debug mode
counts the same waits.

It lives beside the front classes, which wait through it too: ``import leanstate`` loads
no ``leanstate.accelerated`` module, so the front classes cannot import it from there.
It is the one module of ``leanstate`` that an engine may import (``spec/backends.md``,
"Where each kind of code lives"), and it imports nothing from the package.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

_lock = threading.Lock()
_reads = 0


def host_read(op: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``op(*args, **kwargs)``, counted as one wait for the device: ``int(t)``,
    ``t.tolist()``, or a torch op whose output size depends on values (``torch.unique``)."""
    global _reads
    with _lock:
        _reads += 1
    return op(*args, **kwargs)


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """The index of ``mask``'s first True, or -1, as a 0-d tensor on its device: computed
    there, so a check costs one read (of this, or of a tensor holding it)."""
    if not len(mask):
        return torch.tensor(-1, device=mask.device)
    return torch.where(mask.any(), torch.argmax(mask.to(torch.uint8)), -1)


def host_reads() -> int:
    """How many counted waits this process has made so far."""
    return _reads
