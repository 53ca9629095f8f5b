"""``KVLoadPlanner``: DCP's default load planner, with each KV table streamed chunk by
chunk into its store: only the chunks that can hold ids this rank owns are read, each
one's CRC-32C, id order and id range checked before its rows are applied."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan, Metadata, ReadItem
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType

from leanstate.checkpoint.core import BucketedTable, check_layout, in_saving_order
from leanstate.dcp._state import (
    CRC,
    FIRST_BUCKET,
    INDEX_KEY,
    LAST_BUCKET,
    MAX_ID,
    MIN_ID,
    NROWS,
    OFFSET,
    ROWS,
    SCHEMA,
    Entry,
    crc_of,
    split_key,
    split_state,
)
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.kv_store import ReadsInPlace
from leanstate.reference.sharding import bucket_of, owner_of_bucket


@dataclasses.dataclass
class _Job:
    """One store to fill from one saved table."""

    table: str  # the saved table's key
    entry: Entry
    saved: dict  # its index entry: schema, rows, chunks
    chunks: list[int]  # the chunks this rank reads
    crc: torch.Tensor  # the saved CRC of every chunk, as read
    crc_read: torch.Tensor  # which of them have been read
    computed: dict[int, int]  # chunk -> CRC of the bytes read, not yet compared
    # chunk -> its first and last row in saving order, as (bucket, id): chunks read must
    # follow each other in that order (a row repeating the chunk before's last id is damage)
    ends: dict[int, tuple[tuple[int, int], tuple[int, int]]] = dataclasses.field(default_factory=dict)
    expected_rows: int = 0  # about the rows this rank applies: what an empty store reserves
    reserved: bool = False
    # Read in place (an empty store whose engine offers it, every planned row this rank's):
    engine: ReadsInPlace | None = None
    first: int = 0  # the first claimed block
    slots: dict[int, int] = dataclasses.field(default_factory=dict)  # chunk -> its first block - first
    adopted: set[int] = dataclasses.field(default_factory=set)
    unlock: contextlib.ExitStack | None = None


class KVLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` for the dense part; KV tables stream into their stores.

    For every KV value of the state dict (a store, a KVTensor of one, or a sharded
    module's ``BucketedTable``), each rank of ``process_group`` (default the world, or
    one process) reads only the saved chunks that can hold ids it owns, checks each
    one's CRC-32C, id order and id range, and upserts the rows it owns by the id in
    their headers. Read-only views are no-ops counted in their ``ignored_writes``.
    DCP hands each chunk to a reused buffer: memory is about two chunks. Bytes entries
    of the dense part load with ``weights_only=True``.

    ``stats`` (after the load): per table, ``chunks`` read of ``of``, and ``rows`` applied.
    Applying starts with the first chunk: :func:`load` verifies every rank's chunks
    before it applies any into stores that already hold rows, with a
    ``verify_only=True`` planner, which reads and checks the KV chunks and changes
    nothing (no row applied, no dense entry read).

    ``in_place`` (the stores are empty on every rank; :func:`load` decides): a table whose
    store offers ``rows_in_place()`` and whose planned chunks hold only this rank's rows
    is read straight into blocks its engine claims and adopted chunk by chunk, as the
    whole-row load does (``leanstate.checkpoint._load``); :meth:`close` gives back the
    blocks a failed load did not adopt and releases the engine.
    """

    def __init__(
        self,
        *,
        process_group: dist.ProcessGroup | None = None,
        verify_only: bool = False,
        in_place: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.process_group = process_group
        self.verify_only = verify_only
        self.in_place = in_place and not verify_only
        self.stats: dict[str, dict[str, int]] = {}
        self._jobs: dict[str, _Job] = {}

    def set_up_planner(
        self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        method = "KVLoadPlanner"
        dense, entries = split_state(state_dict, method)
        self._outer = state_dict
        if dist.is_available() and dist.is_initialized():
            group = self.process_group or dist.group.WORLD
            self._rank, self._world = dist.get_rank(group), dist.get_world_size(group)
        else:
            self._rank, self._world = 0, 1
        index = (metadata.planner_data or {}).get(INDEX_KEY) if metadata is not None else None
        if entries and index is None:
            raise CheckpointError(
                f"{method}: the checkpoint holds no leanstate KV tables, but the state dict asks for "
                f"{sorted(entries)}"
            )
        self._jobs: dict[str, _Job] = {}
        by_store: dict[int, str] = {}
        for fqn, entry in entries.items():
            saved_fqn = index["views"].get(fqn, {}).get("view_of", fqn)
            if saved_fqn not in index["tables"]:
                have = ", ".join(sorted(index["tables"])) or "none"
                raise CheckpointError(f"{method}: table {fqn!r} is not in the checkpoint (it has: {have})")
            saved = index["tables"][saved_fqn]
            if entry.view is not None and entry.view.read_only:
                entry.view.ignored_writes += index["views"].get(fqn, {}).get("rows", saved["rows"])
                continue
            if entry.bucketing is None and self._world > 1:
                raise CheckpointError(
                    f"{method}: {fqn!r} is a plain store on a {self._world}-rank group; pass a sharded "
                    "module's checkpoint_tables() (BucketedTable values), or load it in a one-rank group"
                )
            check_layout(Path(saved_fqn), fqn, saved["schema"], entry.store)
            if id(entry.store) in by_store:
                if self._jobs[by_store[id(entry.store)]].table != saved_fqn:
                    raise CheckpointError(
                        f"{method}: {fqn!r} and {by_store[id(entry.store)]!r} share a store"
                    )
                continue
            by_store[id(entry.store)] = fqn
            count = len(saved["chunks"])
            self._jobs[fqn] = _Job(
                saved_fqn,
                entry,
                saved,
                [
                    k
                    for k, chunk in enumerate(saved["chunks"])
                    if self._may_own(entry, saved["schema"], chunk)
                ],
                torch.zeros(count, dtype=torch.int64),
                torch.zeros(count, dtype=torch.bool),
                {},
            )
        self._buffers = threading.local()
        self._lock = threading.Lock()
        self._kv_items = 0
        self._committed = 0
        super().set_up_planner(dense, metadata, is_coordinator)

    def _owners(self, entry: Entry, schema: dict, chunk: list) -> tuple[int, int]:
        """The lowest and highest rank that may own ids of ``chunk`` (by its buckets or id
        range; every rank when neither tells)."""
        if entry.bucketing is None:
            return self._rank, self._rank
        buckets, size = entry.bucketing
        if schema["bucketing"] == [buckets, size]:
            first, last = chunk[FIRST_BUCKET], chunk[LAST_BUCKET]
        elif size is not None:  # chunk mode: buckets ascend with ids
            first, last = (
                int(bucket_of(torch.tensor([chunk[i]]), total_num_buckets=buckets, bucket_size=size))
                for i in (MIN_ID, MAX_ID)
            )
        else:
            return 0, self._world - 1
        low, high = (
            owner_of_bucket(b, world_size=self._world, total_num_buckets=buckets) for b in (first, last)
        )
        return low, high

    def _may_own(self, entry: Entry, schema: dict, chunk: list) -> bool:
        """Whether ``chunk`` can hold ids this rank owns."""
        low, high = self._owners(entry, schema, chunk)
        return low <= self._rank <= high

    def _plan_in_place(self, job: _Job) -> None:
        """Whether ``job`` is read in place: its store offers it and every planned chunk holds
        only this rank's rows. Blocks are claimed at the first chunk (:meth:`_slot`), once
        the reader has compared every item's size with its file."""
        rows_in_place = getattr(job.entry.store, "rows_in_place", None)
        engine = rows_in_place() if rows_in_place is not None else None
        chunks = [job.saved["chunks"][k] for k in job.chunks]
        mine = (self._rank, self._rank)
        if engine is None or not chunks:
            return
        if self._world > 1 and any(self._owners(job.entry, job.saved["schema"], c) != mine for c in chunks):
            return  # a chunk holds other ranks' rows: filtered through set_rows
        job.engine, at = engine, 0
        for k, chunk in zip(job.chunks, chunks, strict=True):
            job.slots[k] = at
            at += chunk[NROWS]

    def destination(self, read_item: ReadItem) -> torch.Tensor | None:
        """Where a reader puts a KV chunk's bytes: the blocks claimed for it (``uint8 [n, R]``)
        when its table is read in place, else None (the reader's own buffer)."""
        job, _ = self._job_of(read_item.dest_index.fqn)
        if job is None or job.engine is None:
            return None
        return self._slot(job, self._chunk_of(job, read_item))

    def _slot(self, job: _Job, k: int) -> torch.Tensor:
        """Chunk ``k``'s claimed blocks, as bytes; the first call claims the job's blocks and
        holds its engine's write lock until :meth:`close`."""
        if job.unlock is None:
            job.unlock = contextlib.ExitStack()
            job.unlock.enter_context(job.engine.writing())
            job.first = job.engine.claim(sum(job.saved["chunks"][i][NROWS] for i in job.slots))
        start = job.first + job.slots[k]
        return job.engine.rows[start : start + job.saved["chunks"][k][NROWS]].view(torch.uint8)

    def _chunk_of(self, job: _Job, read_item: ReadItem) -> int:
        offset = read_item.dest_offsets[0]
        return next(i for i in job.chunks if job.saved["chunks"][i][OFFSET] == offset)

    def close(self) -> None:
        """Give back the claimed blocks no chunk was adopted into (a failed load) and release
        the engines. Idempotent; :func:`load` calls it after every load."""
        for job in self._jobs.values():
            if job.unlock is None:
                continue
            for k, start in job.slots.items():
                if k not in job.adopted:
                    job.engine.abandon(job.first + start, job.saved["chunks"][k][NROWS])
            job.unlock.close()
            job.unlock = None

    def create_local_plan(self) -> LoadPlan:
        plan = LoadPlan([]) if self.verify_only else super().create_local_plan()
        meta, rows = [], []
        for job in self._jobs.values():
            stored = self.metadata.state_dict_metadata
            for chunk in stored[job.table + CRC].chunks if job.saved["chunks"] else []:
                meta.append(_read_item(job.table + CRC, chunk.offsets, chunk.sizes))
            size = len(json.dumps(job.saved["schema"]).encode())
            meta.append(_read_item(job.table + SCHEMA, (0,), (size,)))
            r = job.saved["schema"]["row_bytes"]
            for k in job.chunks:
                chunk = job.saved["chunks"][k]
                rows.append(_read_item(job.table + ROWS, (chunk[OFFSET], 0), (chunk[NROWS], r)))
            self.stats[job.table] = {"chunks": 0, "of": len(job.saved["chunks"]), "rows": 0}
            planned = sum(job.saved["chunks"][k][NROWS] for k in job.chunks)
            pruned = len(job.chunks) < len(job.saved["chunks"]) or self._world == 1
            job.expected_rows = planned if pruned else -(-planned // self._world)
            if self.in_place:
                self._plan_in_place(job)
        self._kv_items = len(meta) + len(rows)
        # The CRCs first: the reader reads a file's items in plan order, so each chunk's CRC
        # is known before the chunk arrives.
        return dataclasses.replace(plan, items=meta + list(plan.items) + rows)

    def describe(self, read_item: ReadItem) -> str:
        """What ``read_item`` is, in words: a KV table's chunk by table and number."""
        job, suffix = self._job_of(read_item.dest_index.fqn)
        if job is not None and suffix == ROWS:
            offset = read_item.dest_offsets[0]
            k = next(i for i in job.chunks if job.saved["chunks"][i][OFFSET] == offset)
            return f"table {job.table!r} chunk {k} (rows {offset}..{offset + read_item.lengths[0]})"
        if job is not None:
            return f"table {job.table!r} {suffix[1:]}"
        return f"item {read_item.dest_index.fqn!r}"

    def _job_of(self, key: str) -> tuple[_Job | None, str]:
        fqn, suffix = split_key(key)
        if suffix:
            for job in self._jobs.values():
                if job.table == fqn:
                    return job, suffix
        return None, suffix

    def resolve_tensor(self, read_item: ReadItem):
        job, suffix = self._job_of(read_item.dest_index.fqn)
        if job is None:
            return super().resolve_tensor(read_item)
        if suffix == CRC:
            start, length = read_item.dest_offsets[0], read_item.lengths[0]
            return job.crc.narrow(0, start, length)
        if suffix == SCHEMA:
            return torch.empty(read_item.lengths[0], dtype=torch.uint8)
        n, r = read_item.lengths
        buffers = self._buffers.__dict__
        buffer = buffers.get(r)
        if buffer is None or buffer.numel() < n * r:
            buffer = buffers[r] = torch.empty(n * r, dtype=torch.uint8)
        return buffer[: n * r].view(n, r)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        job, suffix = self._job_of(read_item.dest_index.fqn)
        if job is None:
            return super().commit_tensor(read_item, tensor)
        if suffix == CRC:
            start, length = read_item.dest_offsets[0], read_item.lengths[0]
            with self._lock:
                job.crc_read[start : start + length] = True
        elif suffix == SCHEMA:
            if bytes(tensor.numpy()) != json.dumps(job.saved["schema"]).encode():
                raise CheckpointError(
                    f"KVLoadPlanner: table {job.table!r}: its schema item differs from the index in .metadata"
                )
        else:
            self._commit_rows(job, read_item, tensor)
        self._count_commit()

    def _count_commit(self) -> None:
        with self._lock:
            self._committed += 1
            last = self._committed == self._kv_items
        if last:
            self._check_deferred()

    def accepts_loaded(self, read_item: ReadItem) -> bool:
        """Whether ``read_item`` is a KV chunk, which :class:`SafeFileSystemReader` reads into
        its own reused buffer and hands to :meth:`commit_loaded` (the buffer of
        ``resolve_tensor`` is for other readers)."""
        job, suffix = self._job_of(read_item.dest_index.fqn)
        return job is not None and suffix == ROWS

    def commit_loaded(self, read_item: ReadItem, rows: torch.Tensor) -> None:
        """Check and apply a KV chunk a reader has loaded (``uint8 [n, R]``)."""
        job, _ = self._job_of(read_item.dest_index.fqn)
        self._commit_rows(job, read_item, rows.contiguous())
        self._count_commit()

    def _commit_rows(self, job: _Job, read_item: ReadItem, rows: torch.Tensor) -> None:
        offset = read_item.dest_offsets[0]
        k = self._chunk_of(job, read_item)
        chunk = job.saved["chunks"][k]
        where = f"table {job.table!r}: chunk {k} (rows {offset}..{offset + chunk[NROWS]})"
        crc = crc_of(rows)
        with self._lock:
            known = bool(job.crc_read[k])
            if not known:
                job.computed[k] = crc
        if known and crc != int(job.crc[k]):
            raise CheckpointError(f"KVLoadPlanner: {where} fails its crc32c check; the checkpoint is corrupt")
        schema = job.saved["schema"]
        layout = job.entry.store.layout
        ids = rows[:, :8].contiguous().view(torch.int64).flatten()
        ascending = in_saving_order(ids, schema["bucketing"])
        if not ascending or (int(ids.min()), int(ids.max())) != (chunk[MIN_ID], chunk[MAX_ID]):
            raise CheckpointError(
                f"KVLoadPlanner: {where}: its ids are out of order or outside {chunk[MIN_ID]}..{chunk[MAX_ID]}"
            )
        bucketing = schema["bucketing"]
        edges = ids[[0, -1]]
        buckets = (
            [0, 0]
            if bucketing is None
            else bucket_of(edges, total_num_buckets=bucketing[0], bucket_size=bucketing[1]).tolist()
        )
        first, last = edges.tolist()
        with self._lock:
            job.ends[k] = ((buckets[0], first), (buckets[1], last))
        stats = self.stats[job.table]
        stats["chunks"] += 1
        if self.verify_only:
            return
        if job.engine is not None:  # read in place: index the claimed blocks by their keys
            slot = self._slot(job, k)
            if rows.data_ptr() != slot.data_ptr():  # (a reader that used its own buffer)
                slot.copy_(rows)
            job.engine.adopt(job.first + job.slots[k], len(rows))
            job.adopted.add(k)
            stats["rows"] += len(rows)
            return
        values = rows.view(layout.dtype)
        if job.entry.bucketing is not None:
            buckets, size = job.entry.bucketing
            table = BucketedTable(job.entry.store, buckets, size)
            mine = table.owner(ids, self._world) == self._rank
            if not bool(mine.all()):
                values = values[mine]
        if not job.reserved:  # grow an empty store once, as the native load does
            job.reserved = True
            if len(job.entry.store) == 0:
                job.entry.store.reserve(job.expected_rows)
        if len(values):
            job.entry.store.set_rows(values.to(getattr(job.entry.store, "device", "cpu")))
        stats["rows"] += len(values)

    def _check_deferred(self) -> None:
        """Once every chunk is in: compare the chunks that arrived before their CRC (another
        file's order), and check that the chunks read follow each other in saving order."""
        for job in self._jobs.values():
            for k, crc in sorted(job.computed.items()):
                if not bool(job.crc_read[k]) or crc != int(job.crc[k]):
                    raise CheckpointError(
                        f"KVLoadPlanner: table {job.table!r}: chunk {k} fails its crc32c check; the checkpoint "
                        "is corrupt"
                    )
            job.computed.clear()
            read = sorted(job.ends)
            for before, k in zip(read, read[1:]):
                if job.ends[before][1] >= job.ends[k][0]:
                    raise CheckpointError(
                        f"KVLoadPlanner: table {job.table!r}: chunk {k} starts at id {job.ends[k][0][1]}, not "
                        f"after chunk {before}'s last id {job.ends[before][1][1]} (ids must ascend across "
                        "chunks, in saving order); the checkpoint is corrupt"
                    )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"KVLoadPlanner: {read_item.dest_index.fqn!r} does not load with weights_only=True "
                f"({type(exc).__name__}); only tensors, numbers, strings and containers of them load"
            ) from exc
        path = (
            self.mappings.get(read_item.dest_index.fqn, (read_item.dest_index.fqn,))
            if self.flatten_state_dict
            else (read_item.dest_index.fqn,)
        )
        for root in (self.original_state_dict, self._outer):
            _set_path(root, path, loaded)


def _set_path(root, path: tuple, value) -> None:
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _read_item(fqn: str, offsets, lengths) -> ReadItem:
    offsets = torch.Size(offsets)
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, offsets),
        dest_offsets=offsets,
        storage_index=MetadataIndex(fqn, offsets),
        storage_offsets=torch.Size([0] * len(offsets)),
        lengths=torch.Size(lengths),
    )
