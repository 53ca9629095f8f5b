"""Where the rows a DCP save writes come from: a live store, or a native checkpoint's
file being converted. Both cut the rows into the chunks of the table's index and read
one chunk at a time, through the checkpoint core's chunk loop."""

from __future__ import annotations

import torch

from leanstate.checkpoint.core import (
    CHECKSUM,
    TableRead,
    chunk_spans,
    gather,
    read_chunks,
    rows_per_chunk,
    saving_order,
)
from leanstate.dcp._state import NROWS, OFFSET, NativeTable


class StoreRows:
    """A store's rows in saving order (ascending ids, or bucket-major), cut into chunks of
    about ``chunk_bytes``; each chunk's index entry is
    ``[first row, rows, min id, max id, first bucket, last bucket]``."""

    def __init__(self, store, bucketing: tuple[int, int | None] | None, chunk_bytes: int) -> None:
        self.store = store
        self.layout = store.layout
        self.keys, buckets = saving_order(store, bucketing)
        self.chunks = []
        for start, end in chunk_spans(len(self.keys), rows_per_chunk(self.layout, chunk_bytes)):
            ids = self.keys[start:end]
            first, last = (
                (int(buckets[start]), int(buckets[end - 1])) if buckets is not None else (None, None)
            )
            self.chunks.append([start, end - start, int(ids.min()), int(ids.max()), first, last])

    def read(self, k: int) -> torch.Tensor:
        """Chunk ``k``'s rows as ``uint8 [n, R]``, gathered now."""
        start, n = self.chunks[k][OFFSET], self.chunks[k][NROWS]
        rows = gather(self.store, self.keys[start : start + n])
        if len(rows) != n:  # the index already promised n rows
            raise RuntimeError(
                "leanstate.dcp.save: ids were deleted from a store while it was being saved; "
                "save while the stores are not written"
            )
        data = rows.contiguous().view(torch.uint8)
        # torch.save writes a tensor's whole storage: a view into a larger one is copied out
        return data if data.untyped_storage().nbytes() == data.numel() else data.clone()

    def known_crc(self, k: int) -> int | None:
        """None: a store's chunk is checksummed when it is read."""
        return None


class NativeRows:
    """A native table's chunks, as they are in its file (their CRC-32C is already known)."""

    def __init__(self, source: NativeTable) -> None:
        self.source, self.layout = source, source.layout
        self.chunks = []
        row = 0
        for c in source.table["chunks"]:
            self.chunks.append([row, c["rows"], c["min_id"], c["max_id"], None, None])
            row += c["rows"]

    def read(self, k: int) -> torch.Tensor:
        """Chunk ``k``'s bytes as ``uint8 [n, R]``, verified."""
        read = TableRead.of_v1(self.source.name, self.source.table, [(k, self.source.table["chunks"][k])])
        data = bytearray()
        for _, _, part in read_chunks(self.source.path, read, 2**62):
            if part is not None:
                data += part
        return torch.frombuffer(data, dtype=torch.uint8).view(-1, self.layout.row_bytes)

    def known_crc(self, k: int) -> int | None:
        """The saved CRC-32C of chunk ``k`` (None for a CRC-32 table: DCP's index is CRC-32C)."""
        chunk = self.source.table["chunks"][k]
        return chunk["crc"] if self.source.table["checksum"] == CHECKSUM else None
