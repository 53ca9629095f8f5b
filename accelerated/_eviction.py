"""Eviction for the accelerated store engines (``spec/kv_store.md``, "Eviction"), written
once: which rows go is :func:`doomed`, a pure function of their metadata and weights, and
``Eviction.evict`` feeds it every present row and removes the doomed ones under the lock."""

from __future__ import annotations

import torch

from leanstate._host_reads import host_read
from leanstate.reference.row_format import COUNT_MAX, header_words


def doomed(
    meta: torch.Tensor,
    weights: torch.Tensor | None,
    *,
    min_count: int | None,
    max_age_s: int | None,
    min_l2_norm: float | None,
    max_rows: int | None,
    now: int,
) -> torch.Tensor:
    """Which rows an eviction removes, a bool per row, for rows given in ascending id order
    by their metadata words and (needed with ``min_l2_norm`` only) their weights.

    A row goes when any rule holds: fewer than ``min_count`` writes, older than
    ``max_age_s``, a weight L2 norm below ``min_l2_norm``. Then, while more than
    ``max_rows`` are left, the fewest-written go, the oldest among those, the smallest id
    among those."""
    stamp, count = meta & 0xFFFFFFFF, (meta >> 32) & COUNT_MAX
    out = torch.zeros(len(meta), dtype=torch.bool, device=meta.device)
    if min_count is not None:
        out |= count < min_count
    if max_age_s is not None:
        out |= (now - stamp) > max_age_s
    if min_l2_norm is not None:
        out |= torch.linalg.vector_norm(weights.float(), dim=1) < min_l2_norm
    if max_rows is not None:
        survivors = host_read(torch.nonzero, ~out).flatten()
        excess = len(survivors) - max_rows
        if excess > 0:  # stable sorts of rows in id order: by count, then stamp, then id
            by_stamp = survivors[torch.argsort(stamp[survivors], stable=True)]
            ranked = by_stamp[torch.argsort(count[by_stamp], stable=True)]
            out[ranked[:excess]] = True
    return out


class Eviction:
    """``evict`` for a store engine, over two hooks: ``_live_sorted()`` (the present ids
    ascending and their blocks, on the engine's device) and ``_remove(keys)`` (delete those
    present ids). The engine provides ``writing()``, ``rows`` and ``layout``."""

    def evict(
        self,
        *,
        min_count: int | None,
        max_age_s: int | None,
        min_l2_norm: float | None,
        max_rows: int | None,
        now: int,
    ) -> torch.Tensor:
        """Decide and delete under the write lock (atomic with respect to every other call);
        the evicted ids, ascending."""
        layout = self.layout
        with self.writing():
            keys, blocks = self._live_sorted()
            rows = self.rows
            weights = None
            if min_l2_norm is not None:
                weights = rows[blocks, layout.weight_offset : layout.weight_offset + layout.dim]
            gone = doomed(
                header_words(rows)[blocks, 1], weights, min_count=min_count, max_age_s=max_age_s,
                min_l2_norm=min_l2_norm, max_rows=max_rows, now=now,
            )  # fmt: skip
            victims = host_read(torch.masked_select, keys, gone)
            self._remove(victims)
        return victims
