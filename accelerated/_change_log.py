"""What the accelerated store engines share for change tracking (``spec/kv_store.md``,
"Change tracking"): the policy itself (``ChangeTracking``, written once), the epoch counter
and the log of removed ids, and a per-block array that grows in place beside a
memory-mapped row pool. Each engine stamps its own blocks with the epoch of their last
write (in its own kernels or tensor ops) and finds the written ids with its own table
scan; what is common is here, so no engine imports another.
"""

from __future__ import annotations

import mmap

import torch


class ChangeLog:
    """The current epoch (from 1) and the ids removed in each epoch.

    Removals are kept as chunks ``(ids, epoch)``; consecutive chunks of one epoch are
    merged as a binary counter merges (a chunk absorbs the next when it is at most twice
    its size), so many small deletes in one epoch cost ``O(n log n)`` and the ids of an
    epoch are kept once each. ``forget`` drops whole epochs. Call every method with the
    engine's write lock held (``since``: the read lock at least).
    """

    def __init__(self) -> None:
        self.epoch = 1
        self.removals: list[tuple[torch.Tensor, int]] = []

    def new_epoch(self) -> int:
        """End the current epoch; its number."""
        ended = self.epoch
        self.epoch += 1
        return ended

    def record(self, ids: torch.Tensor) -> None:
        """``ids`` (distinct, absent now) were removed in the current epoch."""
        if not len(ids):
            return
        chunks = self.removals
        chunks.append((ids, self.epoch))
        while (
            len(chunks) >= 2
            and chunks[-2][1] == chunks[-1][1]
            and len(chunks[-2][0]) <= 2 * len(chunks[-1][0])
        ):
            (older, epoch), (newer, _) = chunks[-2], chunks.pop()
            chunks[-1] = (torch.unique(torch.cat([older, newer])), epoch)

    def removed_since(self, mark: int, device: torch.device) -> torch.Tensor:
        """Every id removed in an epoch after ``mark``, distinct and ascending (some may be
        present again: the engine keeps the absent ones)."""
        chosen = [ids for ids, epoch in self.removals if epoch > mark]
        if not chosen:
            return torch.empty(0, dtype=torch.int64, device=device)
        return torch.unique(torch.cat(chosen))

    def forget(self, mark: int) -> None:
        """Drop the removals of epochs ``<= mark``."""
        self.removals = [(ids, epoch) for ids, epoch in self.removals if epoch > mark]

    def nbytes(self) -> int:
        return sum(ids.numel() * ids.element_size() for ids, _ in self.removals)


class MappedArray:
    """A 1-D CPU tensor in an anonymous memory map that grows in place (``mremap``: no
    copy; new elements are zero and cost nothing until written), for per-block values
    kept beside a pool that grows the same way. ``tensor`` is replaced by each
    ``resize``: no other view of it may be alive then."""

    def __init__(self, length: int, dtype: torch.dtype) -> None:
        self.dtype, self.itemsize = dtype, torch.empty(0, dtype=dtype).element_size()
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._map = mmap.mmap(-1, max(1, length) * self.itemsize, flags=flags)
        self.tensor = torch.frombuffer(self._map, dtype=dtype)[:length]

    def resize(self, length: int) -> None:
        """At least ``length`` elements (existing ones kept)."""
        if length <= len(self.tensor):
            return
        del self.tensor
        self._map.resize(length * self.itemsize)
        self.tensor = torch.frombuffer(self._map, dtype=self.dtype)

    def nbytes(self) -> int:
        return len(self._map)


class ChangeTracking:
    """Change tracking for a store engine, over its two hooks: the epoch stamp of each
    block's last write, read by ``_written_since(mark)`` (the present ids stamped after
    ``mark``, ascending, on the engine's device), and the removal log kept here, fed by
    :meth:`_removed`. The engine calls :meth:`_start_tracking` in its constructor, stamps
    ``_epoch()`` on every write, and provides ``reading()``, ``writing()`` and ``locate``.
    """

    MAX_EPOCH = 2**63 - 1  # the largest epoch its stamps hold

    def _start_tracking(self) -> None:
        self.tracking = True
        self._log = ChangeLog()

    def _epoch(self) -> int:
        """The epoch a write now stamps; 0 (no stamp) when tracking is off."""
        return self._log.epoch if self.tracking else 0

    def _removed(self, ids: torch.Tensor) -> None:
        """``ids`` (distinct) were just removed; call with the write lock held."""
        if self.tracking:
            self._log.record(ids)

    def new_epoch(self) -> int:
        """End the current epoch; its number. Later changes belong to the next one."""
        with self.writing():
            if self._log.epoch >= self.MAX_EPOCH:
                raise OverflowError(
                    f"the {self.backend} store stamps epochs up to {self.MAX_EPOCH}: no epoch can follow"
                )
            return self._log.new_epoch()

    def changes_since(self, mark: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(written, removed)`` after epoch ``mark``, each ascending, on the CPU: present ids
        whose block was stamped later, and absent ids removed later. One snapshot under the lock."""
        with self.reading():
            written = self._written_since(mark)
            removed = self._log.removed_since(mark, written.device)
            removed = removed[self.locate(removed) == -1]
        return written.cpu(), removed.cpu()

    def forget(self, mark: int) -> None:
        """Drop the removals of epochs ``<= mark``."""
        with self.writing():
            self._log.forget(mark)
