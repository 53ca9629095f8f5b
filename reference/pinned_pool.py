"""A bounded pool of host buffers for offloaded activations.

Buffers are reused by size class (the next power of two, at least 4 KiB), so after the
first training step the pool stops allocating. The cap counts the real bytes of every
buffer the pool holds, idle or in use; a request that does not fit falls back to
ordinary pageable memory (counted in ``fallback_bytes``), never over the cap
(pytorch#86097: pinned memory over-allocated by an offloader starves the host). Idle
buffers are kept, not traded for other sizes, so the same step finds the same buffers.

The allocator is injectable, so the cap is testable without a GPU.

Example::

    >>> pool = PinnedMemoryPool(budget_bytes=2**20, allocator=lambda n: torch.empty(n, dtype=torch.uint8))
    >>> buffer = pool.acquire(1000)   # buffer.data: 1000 bytes of a 4096-byte class
    >>> pool.release(buffer)
    >>> pool.pooled_bytes, pool.in_use_bytes
    (4096, 0)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

import torch

MIN_CLASS_BYTES = 4096


def size_class(nbytes: int) -> int:
    """The buffer size serving a request of ``nbytes``: a power of two >= 4 KiB."""
    return max(MIN_CLASS_BYTES, 1 << max(0, nbytes - 1).bit_length())


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _pageable(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class PinnedMemoryPool:
    """Host buffers by size class under a hard cap, with a pageable fallback.

    Args:
        budget_bytes: the most bytes the pool may hold; None for no cap.
        pin: allocate page-locked memory (``"auto"``: when CUDA is available).
        allocator: ``allocator(nbytes) -> uint8 tensor``; overrides ``pin``.
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        *,
        pin: bool | str = "auto",
        allocator: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None; got {budget_bytes}")
        if pin == "auto":
            pin = torch.cuda.is_available()
        self.budget_bytes = budget_bytes
        self.pin = bool(pin)
        self._allocate = allocator or (_pinned if self.pin else _pageable)
        self._idle: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.pooled_bytes = 0  # bytes of every buffer the pool holds, idle or in use
        self.in_use_bytes = 0
        self.high_water_bytes = 0
        self.fallback_bytes = 0
        self.allocations = 0

    def __repr__(self) -> str:
        return (
            f"PinnedMemoryPool(budget_bytes={self.budget_bytes}, pin={self.pin}, pooled={self.pooled_bytes}, "
            f"in_use={self.in_use_bytes}, high_water={self.high_water_bytes}, fallback={self.fallback_bytes})"
        )

    def acquire(self, nbytes: int) -> HostBuffer:
        """A host buffer of ``nbytes``: a pooled one of its size class, or a pageable fallback."""
        cls = size_class(nbytes)
        with self._lock:
            if self._idle[cls]:
                buffer = self._idle[cls].pop()
            else:
                if self.budget_bytes is not None and self.pooled_bytes + cls > self.budget_bytes:
                    self.fallback_bytes += nbytes
                    return HostBuffer(_pageable(nbytes), None)
                buffer = self._allocate(cls)
                self.pooled_bytes += cls
                self.allocations += 1
            self.in_use_bytes += cls
            self.high_water_bytes = max(self.high_water_bytes, self.in_use_bytes)
        return HostBuffer(buffer[:nbytes], buffer)

    def release(self, buffer: HostBuffer) -> None:
        """Give back a buffer from :meth:`acquire`; a pooled one becomes idle for reuse."""
        if buffer.pooled is None:
            return
        cls = buffer.pooled.numel()
        with self._lock:
            self._idle[cls].append(buffer.pooled)
            self.in_use_bytes -= cls
        buffer.pooled = None


class HostBuffer:
    """A buffer handed out by :class:`PinnedMemoryPool`: ``data`` is the uint8 tensor."""

    __slots__ = ("data", "pooled")

    def __init__(self, data: torch.Tensor, pooled: torch.Tensor | None) -> None:
        self.data = data
        self.pooled = pooled  # the whole size-class buffer, or None for a fallback
