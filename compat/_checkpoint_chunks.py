"""The one chunk loop of every checkpoint format: rows out of a store into checksummed
chunks of a file, and chunks of a file back, verified, as rows.

Writing (version 1, version 2 across ranks, DCP, conversion): :func:`saving_order`
lists a store's keys in the order the format wants (ascending ids, or bucket-major);
:func:`chunk_spans` cuts them; :func:`gather` reads one span's rows, dropping ids
deleted since the keys were listed; :class:`ChunkFile` appends chunks to a file,
checksums them and keeps their manifest entries, optionally on a writer thread so the
next gather overlaps this write.

Reading: :func:`chunk_slices` yields one chunk's bytes in slices of whole rows and
checks, after the last, its checksum and the manifest's id range; ids must strictly
ascend inside a chunk. :func:`read_chunks` runs it over a table's file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from leanstate._checkpoint_files import open_regular
from leanstate._checkpoint_format import CHECKSUMS, chunk_entry, new_chunk_checksum, row_bytes_of
from leanstate.reference.checkpoint import CheckpointError
from leanstate.reference.kv_store import SupportsRows
from leanstate.reference.row_format import RowLayout, header_words
from leanstate.reference.sharding import bucket_of

# -- writing ------------------------------------------------------------------------------


def saving_order(
    store: SupportsRows, bucketing: tuple[int, int | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The store's keys on the host in saving order, and their buckets: ascending ids, or
    (with ``bucketing = (buckets, bucket_size)``) ascending (bucket, id)."""
    keys = store.keys().cpu()  # recomputed now: the store may have grown since any view was made
    if bucketing is None:
        return keys, None
    buckets = bucket_of(keys, total_num_buckets=bucketing[0], bucket_size=bucketing[1])
    order = torch.argsort(buckets, stable=True)  # keys ascend: (bucket, id) order
    return keys[order], buckets[order]


def rows_per_chunk(layout: RowLayout, chunk_bytes: int) -> int:
    """Whole rows in a chunk of at most ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // layout.row_bytes)


def chunk_spans(count: int, per_chunk: int, buckets: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` spans of ``count`` keys, at most ``per_chunk`` each; with ``buckets``
    (sorted), no span crosses from one bucket into the next."""
    if buckets is None or count == 0:
        return [(start, min(count, start + per_chunk)) for start in range(0, count, per_chunk)]
    firsts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(torch.diff(buckets)).flatten() + 1])
    ends = [*firsts[1:].tolist(), count]
    return [
        (start, min(end, start + per_chunk))
        for first, end in zip(firsts.tolist(), ends, strict=True)
        for start in range(first, end, per_chunk)
    ]


def gather(store: SupportsRows, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Whole rows of ``ids`` on the host, without those deleted since the keys were listed
    (their header's used bit is clear)."""
    rows = store.get_rows(ids) if out is None else store.get_rows(ids, out=out[: len(ids)])
    rows = rows.cpu()
    used = header_words(rows)[:, 1] < 0
    return rows if bool(used.all()) else rows[used]


def host_buffers(store: SupportsRows, rows: int) -> list[torch.Tensor]:
    """Two reused host buffers of ``rows`` whole rows (pinned for a CUDA store), so a device
    store streams to the host chunk by chunk."""
    layout = store.layout
    device = torch.device(getattr(store, "device", None) or "cpu")
    pin = device.type == "cuda" and torch.cuda.is_available()
    return [torch.empty(rows, layout.width, dtype=layout.dtype, pin_memory=pin) for _ in range(2)]


class ChunkFile:
    """A data file being written chunk by chunk; :meth:`close` fsyncs it and returns the
    chunks' manifest entries.

    ``pipelined``: each chunk is checksummed and written on a writer thread (``write`` and
    CRC-32C release the GIL) while the caller gathers the next; :meth:`append` first waits
    for the previous write, so at most two chunks' rows are alive at once.
    """

    def __init__(self, file: Path, *, pipelined: bool = False) -> None:
        self.file = file
        self.chunks: list[dict] = []
        self.offset = 0
        self._out = open(file, "wb")
        self._writer = ThreadPoolExecutor(max_workers=1) if pipelined else None
        self._pending: tuple[Future, torch.Tensor, dict] | None = None

    def _write(self, rows: torch.Tensor) -> int:
        data = row_bytes_of(rows)
        self._out.write(data)
        return new_chunk_checksum(data)

    def _settle(self) -> None:
        if self._pending is not None:
            future, rows, fields = self._pending
            self._pending = None
            self._record(rows, future.result(), fields)

    def _record(self, rows: torch.Tensor, crc: int, fields: dict) -> None:
        entry = chunk_entry(rows, self.offset, crc)
        entry.update(fields)
        self.chunks.append(entry)
        self.offset += rows.numel() * rows.element_size()

    def append(self, rows: torch.Tensor, **fields: object) -> None:
        """Write ``rows`` (id-ascending, on the host) as the next chunk; ``fields`` join its entry."""
        self._settle()
        if len(rows) == 0:
            return
        if self._writer is None:
            self._record(rows, self._write(rows), fields)
        else:
            self._pending = (self._writer.submit(self._write, rows), rows, fields)

    def close(self) -> list[dict]:
        """Finish, fsync and close the file; the chunks' manifest entries."""
        try:
            self._settle()
            self._out.flush()
            os.fsync(self._out.fileno())
        finally:
            if self._writer is not None:
                self._writer.shutdown()
            self._out.close()
        return self.chunks

    def abort(self) -> None:
        """Close without finishing (the caller removes the staging directory)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self._out.close()


def write_store(
    store: SupportsRows,
    file: Path,
    chunk_bytes: int,
    *,
    bucketing: tuple[int, int | None] | None = None,
    pipelined: bool = False,
    progress=None,
) -> list[dict]:
    """Stream a store's rows into ``file`` in saving order, in chunks (within one bucket when
    bucketed, each entry then naming its ``bucket``); the chunks' manifest entries.

    ``progress(rows_done, rows_total)`` is called after each chunk. Pipelined, two host
    buffers alternate: the gather of chunk k+1 overlaps the write of chunk k.
    """
    keys, buckets = saving_order(store, bucketing)
    spans = chunk_spans(len(keys), rows_per_chunk(store.layout, chunk_bytes), buckets)
    buffers = (
        host_buffers(store, max((end - start for start, end in spans), default=0)) if pipelined else None
    )
    sink = ChunkFile(file, pipelined=pipelined)
    try:
        for k, (start, end) in enumerate(spans):
            rows = gather(store, keys[start:end], None if buffers is None else buffers[k % 2])
            fields = {} if buckets is None else {"bucket": int(buckets[start])}
            sink.append(rows, **fields)
            if progress is not None:
                progress(end, len(keys))
        return sink.close()
    except BaseException:
        sink.abort()
        raise


# -- reading ------------------------------------------------------------------------------


def chunk_slices(
    f, where: str, chunk: dict, row_bytes: int, checksum: str, buffer: bytearray
) -> Iterator[memoryview]:
    """Chunk ``chunk`` of the open file ``f`` in slices of whole rows that fill at most
    ``buffer`` (each valid until the next is read).

    Ids must strictly ascend across the chunk's slices; after the last slice the
    checksum and the manifest's ``min_id``/``max_id`` are checked. The first problem
    raises :class:`CheckpointError` naming ``where``.
    """
    update = CHECKSUMS[checksum]
    slice_rows = max(1, len(buffer) // row_bytes)
    f.seek(chunk["offset"])
    crc, first_key, last_key = 0, None, -1
    for first in range(0, chunk["rows"], slice_rows):
        view = memoryview(buffer)[: min(slice_rows, chunk["rows"] - first) * row_bytes]
        if f.readinto(view) != len(view):
            raise CheckpointError(f"{where} is truncated")
        crc = update(view, crc)
        keys = torch.frombuffer(view, dtype=torch.int64).view(-1, row_bytes // 8)[:, 0]
        if bool((keys[1:] <= keys[:-1]).any()) or int(keys[0]) <= last_key:
            raise CheckpointError(
                f"{where}: its row ids do not ascend (they must strictly ascend); the file is corrupt"
            )
        first_key = int(keys[0]) if first_key is None else first_key
        last_key = int(keys[-1])
        yield view
    if crc != chunk["crc"]:
        raise CheckpointError(f"{where} fails its {checksum} check (checksum mismatch); the file is corrupt")
    if (first_key, last_key) != (chunk["min_id"], chunk["max_id"]):
        raise CheckpointError(
            f"{where} holds ids {first_key}..{last_key}, the manifest says {chunk['min_id']}..{chunk['max_id']}"
        )


def open_data_file(path: Path, name: str, file_name: str, size: int):
    """A table's data file, opened only if regular and exactly ``size`` bytes (no
    truncation, no trailing bytes)."""
    file = path / file_name
    f = open_regular(file, f"table {name!r}: data file")
    actual = os.fstat(f.fileno()).st_size
    if actual != size:
        f.close()
        raise CheckpointError(
            f"table {name!r}: {file} has {actual} bytes, the manifest expects {size} "
            f"({'truncated' if actual < size else 'trailing bytes'})"
        )
    return f


def describe_chunk(name: str, file: Path, index: int, chunk: dict, row_bytes: int) -> str:
    """How an error names a chunk: table, file, index and byte range."""
    end = chunk["offset"] + chunk["rows"] * row_bytes
    return f"table {name!r}: chunk {index} of {file} (bytes {chunk['offset']}..{end})"


def read_chunks(
    path: Path, name: str, table: dict, chunks: list[tuple[int, dict]], slice_bytes: int
) -> Iterator[tuple[int, memoryview | None]]:
    """Yield (chunk index, bytes) for the listed chunks of a version-1 table, in slices of
    whole rows of at most ``slice_bytes``; after a chunk's last slice, ``(index, None)``
    marks it verified. The slices share one buffer: each is valid until the next is read.
    """
    row_bytes = table["row_bytes"]
    slice_rows = max(1, slice_bytes // row_bytes)
    buffer = bytearray(min(slice_rows, max((c["rows"] for _, c in chunks), default=0)) * row_bytes)
    with open_data_file(path, name, table["file"], table["bytes"]) as f:
        for index, chunk in chunks:
            where = describe_chunk(name, path / table["file"], index, chunk, row_bytes)
            for view in chunk_slices(f, where, chunk, row_bytes, table["checksum"], buffer):
                yield index, view
            yield index, None
