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
ascend inside a chunk. :func:`read_chunks` runs it over a table's file, optionally one
slice ahead on a reader thread (``read``, CRC-32C and the torch checks release the
GIL), so reading slice k+1 overlaps the caller's apply of slice k. :func:`read_in_place`
reads a table straight into blocks an engine hands out (``ReadsInPlace``) and has the
engine index them slice by slice: no staging copy, the read on its own thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from leanstate._numpy import np
from leanstate.checkpoint._background import Behind, Stopped, one_buffer_ahead, produced_on_a_thread
from leanstate.checkpoint._files import open_regular
from leanstate.checkpoint._format import CHECKSUMS, chunk_entry, new_chunk_checksum, row_bytes_of
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.kv_store import ReadsInPlace, SupportsRows
from leanstate.reference.row_format import RowLayout, header_words
from leanstate.reference.sharding import bucket_of, owner_of_bucket

# -- writing ------------------------------------------------------------------------------


def saving_order(
    store: SupportsRows, bucketing: tuple[int, int | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The store's keys on the host in saving order, and their buckets: ascending ids, or
    (with ``bucketing = (buckets, bucket_size)``) ascending (bucket, id)."""
    keys = store.keys().cpu()  # recomputed now: the store may have grown since any view was made
    return bucket_major(keys, bucketing)


def bucket_major(
    keys: torch.Tensor, bucketing: tuple[int, int | None] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ascending ``keys`` (host int64) in saving order, and their buckets: as they are, or
    (with ``bucketing``) sorted by (bucket, id)."""
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
        self._writer = Behind("leanstate-checkpoint-writer") if pipelined else None

    def _write(self, rows: torch.Tensor, fields: dict) -> None:
        data = row_bytes_of(rows)
        self._out.write(data)
        entry = chunk_entry(rows, self.offset, new_chunk_checksum(data))
        entry.update(fields)
        self.chunks.append(entry)
        self.offset += rows.numel() * rows.element_size()

    def append(self, rows: torch.Tensor, **fields: object) -> None:
        """Write ``rows`` (id-ascending, on the host) as the next chunk; ``fields`` join its entry."""
        if len(rows) == 0:
            return
        if self._writer is None:
            self._write(rows, fields)
        else:
            self._writer.submit(self._write, rows, fields)

    def close(self) -> list[dict]:
        """Finish, fsync and close the file; the chunks' manifest entries."""
        try:
            if self._writer is not None:
                self._writer.settle()
            self._out.flush()
            os.fsync(self._out.fileno())
        finally:
            self.abort()
        return self.chunks

    def abort(self) -> None:
        """Close without finishing (the caller removes the staging directory)."""
        if self._writer is not None:
            self._writer.close()
        self._out.close()


def write_store(
    store: SupportsRows,
    file: Path,
    chunk_bytes: int,
    *,
    keys: torch.Tensor | None = None,
    dropped: list[torch.Tensor] | None = None,
    bucketing: tuple[int, int | None] | None = None,
    pipelined: bool = False,
    progress=None,
) -> list[dict]:
    """Stream a store's rows into ``file`` in saving order, in chunks (within one bucket when
    bucketed, each entry then naming its ``bucket``); the chunks' manifest entries.

    ``keys``: the ids to write (ascending; a delta's written ids), instead of every key;
    with ``bucketing`` they are written bucket-major too.
    ``dropped``: where the ids deleted since the keys were listed are appended.
    ``progress(rows_done, rows_total)`` is called after each chunk. Pipelined, two host
    buffers alternate: the gather of chunk k+1 overlaps the write of chunk k.
    """
    if keys is None:
        keys, buckets = saving_order(store, bucketing)
    else:
        keys, buckets = bucket_major(keys.cpu(), bucketing)
    spans = chunk_spans(len(keys), rows_per_chunk(store.layout, chunk_bytes), buckets)
    buffers = (
        host_buffers(store, max((end - start for start, end in spans), default=0)) if pipelined else None
    )
    sink = ChunkFile(file, pipelined=pipelined)
    try:
        for k, (start, end) in enumerate(spans):
            rows = gather(store, keys[start:end], None if buffers is None else buffers[k % 2])
            if dropped is not None and len(rows) < end - start:
                kept = header_words(rows)[:, 0]
                dropped.append(keys[start:end][~torch.isin(keys[start:end], kept)])
            fields = {} if buckets is None else {"bucket": int(buckets[start])}
            sink.append(rows, **fields)
            if progress is not None:
                progress(end, len(keys))
        return sink.close()
    except BaseException:
        sink.abort()
        raise


# -- reading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileChunks:
    """The chunks one load reads of one data file: ``(index, manifest entry)`` pairs."""

    file: str
    bytes: int
    chunks: list[tuple[int, dict]]


@dataclass(frozen=True)
class TableRead:
    """What one load reads of one saved table: its files' chosen chunks, and what every
    chunk is checked against (row size, checksum, and the bucketing that a chunk naming
    its ``bucket`` must keep to)."""

    name: str
    row_bytes: int
    checksum: str
    files: list[FileChunks]
    bucketing: tuple[int, int | None] | None = None

    @classmethod
    def of_v1(cls, name: str, table: dict, chunks: list[tuple[int, dict]]) -> TableRead:
        """A version-1 table: its one file."""
        return cls(
            name, table["row_bytes"], table["checksum"], [FileChunks(table["file"], table["bytes"], chunks)]
        )

    @classmethod
    def of_saved(cls, name: str, table: dict, rank: int = 0, world: int = 1) -> TableRead:
        """The chunks rank ``rank`` of ``world`` reads of a saved table (checked against its
        schema): a version-2 table's chunks of the buckets it owns in each rank's file
        (another rank's are not even read), or every chunk of a version-1 table's file."""
        files = table.get("files") or [
            {"file": table["file"], "bytes": table["bytes"], "chunks": table["chunks"]}
        ]
        bucketing = table.get("bucketing")
        buckets = None if bucketing is None else bucketing["buckets"]

        def mine(chunk: dict) -> bool:
            if "bucket" not in chunk:
                return True
            return owner_of_bucket(chunk["bucket"], world_size=world, total_num_buckets=buckets) == rank

        parts = [
            FileChunks(f["file"], f["bytes"], [(i, c) for i, c in enumerate(f["chunks"]) if mine(c)])
            for f in files
        ]
        return cls(
            name,
            table["row_bytes"],
            table.get("checksum", "crc32"),
            parts,
            None if bucketing is None else (bucketing["buckets"], bucketing["bucket_size"]),
        )

    @property
    def rows(self) -> int:
        return sum(chunk["rows"] for part in self.files for _, chunk in part.chunks)

    @property
    def chunk_count(self) -> int:
        return sum(len(part.chunks) for part in self.files)


def in_saving_order(
    keys: torch.Tensor | np.ndarray, bucketing: tuple[int, int | None] | list | None = None
) -> bool:
    """Whether ``keys`` (on the host) strictly ascend, or with ``bucketing`` ascend by
    (bucket, id): the order every format saves rows in.

    Compared in numpy, on this thread: a torch comparison of a slice's keys runs on
    torch's OpenMP pool, whose barriers cost a hundred times the work beside a busy core
    (measured: 10 ms for 40,000 keys)."""
    ids = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    ascending = ids[1:] > ids[:-1]
    if bucketing is None:
        return bool(ascending.all())
    buckets = bucket_of(
        torch.as_tensor(ids), total_num_buckets=bucketing[0], bucket_size=bucketing[1]
    ).numpy()
    step = buckets[1:] - buckets[:-1]
    return bool(((step > 0) | ((step == 0) & ascending)).all())


def in_bucket(keys: np.ndarray, bucketing: tuple[int, int | None], bucket: int) -> bool:
    """Whether every key (all >= 0) lies in ``bucket``: ``bucket_of``'s rule, in numpy, because
    a version-2 chunk holds one bucket's rows, a few hundred, and four torch calls a chunk
    cost more than the load's copy of them."""
    return bool((buckets_of(keys, bucketing) == bucket).all())


def buckets_of(keys: np.ndarray, bucketing: tuple[int, int | None]) -> np.ndarray:
    """The bucket of each key (all >= 0): ``bucket_of``'s rule, in numpy."""
    buckets, size = bucketing
    return keys % buckets if size is None else np.minimum(keys // size, buckets - 1)


class _ChunkCheck:
    """What a chunk's slices must show, slice by slice: strictly ascending non-negative
    ids, inside the chunk's bucket when it names one; then, after the last, the checksum
    and the manifest's id range."""

    def __init__(self, file: Path, index: int, chunk: dict, read: TableRead) -> None:
        self.file, self.index, self.chunk, self.read = file, index, chunk, read
        self.row_bytes, self.checksum = read.row_bytes, read.checksum
        self.bucketing = read.bucketing if "bucket" in chunk else None
        self.update = CHECKSUMS[read.checksum]
        self.crc, self.first_key, self.last_key = 0, None, -1

    @property
    def where(self) -> str:
        """The chunk, as an error names it (formatted only for an error)."""
        return describe_chunk(self.read.name, self.file, self.index, self.chunk, self.row_bytes)

    def add(self, view: memoryview, crc: int | None = None) -> None:
        """One more slice; ``crc``: the chunk's running checksum through it, when the
        reader already computed it (while the bytes were still in cache)."""
        self.crc = self.update(view, self.crc) if crc is None else crc
        keys = np.frombuffer(view, dtype=np.int64)[:: self.row_bytes // 8]
        if not in_saving_order(keys) or int(keys[0]) <= self.last_key:
            raise CheckpointError(
                f"{self.where}: its row ids do not ascend (they must strictly ascend); the file is corrupt"
            )
        if self.bucketing is not None and not in_bucket(keys, self.bucketing, self.chunk["bucket"]):
            raise CheckpointError(f"{self.where}: holds ids outside bucket {self.chunk['bucket']}")
        self.first_key = int(keys[0]) if self.first_key is None else self.first_key
        self.last_key = int(keys[-1])

    def finish(self) -> None:
        chunk = self.chunk
        if self.crc != chunk["crc"]:
            raise CheckpointError(
                f"{self.where} fails its {self.checksum} check (checksum mismatch); the file is corrupt"
            )
        if (self.first_key, self.last_key) != (chunk["min_id"], chunk["max_id"]):
            raise CheckpointError(
                f"{self.where} holds ids {self.first_key}..{self.last_key}, "
                f"the manifest says {chunk['min_id']}..{chunk['max_id']}"
            )


def chunk_slices(f, check: _ChunkCheck, buffer: bytearray | Callable[[], bytearray]) -> Iterator[memoryview]:
    """The chunk ``check`` checks, of the open file ``f``, in slices of whole rows, each read
    into ``buffer`` (or into the buffer ``buffer()`` hands out for it) and valid until that
    buffer is reused.

    Ids must strictly ascend across the chunk's slices; after the last slice the
    checksum and the manifest's ``min_id``/``max_id`` are checked. The first problem
    raises :class:`CheckpointError` naming the chunk.
    """
    next_buffer = buffer if callable(buffer) else lambda: buffer
    row_bytes, chunk = check.row_bytes, check.chunk
    f.seek(chunk["offset"])
    first = 0
    while first < chunk["rows"]:
        space = next_buffer()
        rows = min(max(1, len(space) // row_bytes), chunk["rows"] - first)
        view = memoryview(space)[: rows * row_bytes]
        if f.readinto(view) != len(view):
            raise CheckpointError(f"{check.where} is truncated")
        check.add(view)
        first += rows
        yield view
    check.finish()


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
    path: Path, read: TableRead, slice_bytes: int, *, ahead: bool = False
) -> Iterator[tuple[int, dict, memoryview | None]]:
    """Yield (chunk index, chunk entry, bytes) for the chunks ``read`` lists, file after
    file, in slices of whole rows of at most ``slice_bytes``; after a chunk's last slice,
    ``(index, chunk, None)`` marks it verified. Each slice is valid until the next is asked for.

    ``ahead``: a reader thread reads and checks the next slice while the caller holds
    this one (two slice buffers; a problem is raised where it stands in the file, after
    the slices before it). Stopping early stops the thread.
    """
    row_bytes = read.row_bytes
    slice_rows = max(1, slice_bytes // row_bytes)
    largest = max((c["rows"] for f in read.files for _, c in f.chunks), default=0)
    size = min(slice_rows, largest) * row_bytes

    def produce(next_buffer: Callable[[], bytearray]) -> Iterator[tuple[int, dict, memoryview | None]]:
        for part in read.files:
            with open_data_file(path, read.name, part.file, part.bytes) as f:
                for index, chunk in part.chunks:
                    check = _ChunkCheck(path / part.file, index, chunk, read)
                    for view in chunk_slices(f, check, next_buffer):
                        yield index, chunk, view
                    yield index, chunk, None

    if not ahead:
        buffer = np.empty(size, dtype=np.uint8)  # not zeroed: every byte is read into first
        yield from produce(lambda: buffer)
        return
    yield from one_buffer_ahead(produce, [bytearray(size) for _ in range(2)])


def _slices_of(
    chunks: list[tuple[int, dict]], row_bytes: int, slice_rows: int
) -> Iterator[list[tuple[int, dict, int, int]]]:
    """The slices one file's ``chunks`` are read in: at most ``slice_rows`` rows of bytes
    that follow each other in the file, each a list of pieces ``(index, chunk, first row,
    rows)``. A large chunk spans slices; small chunks next to each other share one (a
    version-2 file holds a chunk per bucket, often a few hundred rows: one read, one
    hand-over and one adopt for many)."""
    pieces: list[tuple[int, dict, int, int]] = []
    rows, end = 0, None
    for index, chunk in chunks:
        start = 0
        while start < chunk["rows"]:
            offset = chunk["offset"] + start * row_bytes
            if pieces and (offset != end or rows == slice_rows):
                yield pieces
                pieces, rows = [], 0
            count = min(chunk["rows"] - start, slice_rows - rows)
            pieces.append((index, chunk, start, count))
            rows, start, end = rows + count, start + count, offset + count * row_bytes
    if pieces:
        yield pieces


def read_in_place(
    path: Path,
    read: TableRead,
    engine: ReadsInPlace,
    slice_bytes: int,
    progress: Callable[[dict, int], None] | None = None,
) -> None:
    """Read the chunks ``read`` lists straight into blocks ``engine`` claims, and have it
    adopt each slice once its ids check out: a reader thread reads (and checksums) slice
    k+1 while this one checks and adopts slice k, and faults in the pages ahead of the
    reader while it has nothing to adopt. Every chunk is checked as :func:`chunk_slices`
    checks it; on a problem the rows not yet adopted are given back and the error
    raised (the rows adopted stay: the caller loads into empty stores and empties them).
    ``progress(chunk, rows_done)`` after each chunk."""
    row_bytes = read.row_bytes
    slice_rows = max(1, slice_bytes // row_bytes)
    total = read.rows
    stop = threading.Event()
    with contextlib.ExitStack() as files:
        # Every file's size is compared with the manifest before a block is claimed: a
        # crafted row count can claim no more than the files really hold.
        opened = [files.enter_context(open_data_file(path, read.name, p.file, p.bytes)) for p in read.files]
        if total == 0:  # an empty table: its files are checked, there is nothing to claim
            return
        files.enter_context(engine.writing())
        first = engine.claim(total)
        pool = memoryview(engine.rows[first : first + total].view(torch.uint8).numpy()).cast("B")
        files.callback(pool.release)
        update = CHECKSUMS[read.checksum]

        def read_slices() -> Iterator[tuple[Path, list[tuple], int, int, bool, list[int]]]:
            done = 0
            for part, data in zip(read.files, opened, strict=True):
                crc = 0
                for pieces in _slices_of(part.chunks, row_bytes, slice_rows):
                    rows = sum(piece[3] for piece in pieces)
                    data.seek(pieces[0][1]["offset"] + pieces[0][2] * row_bytes)
                    space = pool[done * row_bytes : (done + rows) * row_bytes]
                    complete = data.readinto(space) == len(space)
                    crcs, at = [], 0
                    for _, _, start, count in pieces:  # each chunk's CRC while its bytes are in cache
                        crc = update(
                            space[at * row_bytes : (at + count) * row_bytes], 0 if start == 0 else crc
                        )
                        crcs.append(crc)
                        at += count
                    if stop.is_set():
                        raise Stopped
                    yield path / part.file, pieces, done, rows, complete, crcs
                    done += rows

        faulted = 0

        def fault_ahead() -> bool:
            """While the reader reads, take the page faults of the blocks ahead of it off its path."""
            nonlocal faulted
            if faulted >= total:
                return False
            step = min(slice_rows, total - faulted)
            engine.fault_in(first + faulted, step)
            faulted += step
            return True

        adopted, check = 0, None
        slices = produced_on_a_thread(read_slices, stop, fault_ahead)
        try:
            for file, pieces, at, rows, complete, crcs in slices:
                finished, offset = [], at
                for (index, chunk, start, count), crc in zip(pieces, crcs, strict=True):
                    if start == 0:
                        check = _ChunkCheck(file, index, chunk, read)
                    if not complete:
                        raise CheckpointError(f"{check.where} is truncated")
                    check.add(pool[offset * row_bytes : (offset + count) * row_bytes], crc)
                    offset += count
                    if start + count == chunk["rows"]:
                        check.finish()
                        finished.append(chunk)
                engine.adopt(first + at, rows)  # the slice's every piece checked first
                adopted = at + rows
                if progress is not None:
                    for chunk in finished:
                        progress(chunk, adopted)
        except BaseException:
            slices.close()  # the reader thread has stopped writing before the rest is zeroed
            engine.abandon(first + adopted, total - adopted)
            raise
        finally:
            slices.close()
