"""KV tables through ``torch.distributed.checkpoint``: one ``dcp.save`` for the whole model.

A state dict may hold KV tables beside dense tensors: a ``KVStore``, a ``KVTensor`` of
one (``module.state_dict()`` of a plain bag), or a sharded module's
``checkpoint_tables()`` (``BucketedTable`` values). :class:`KVSavePlanner` writes each
table's exact whole rows as chunked ``uint8 [N, R]`` items, a schema and a CRC per
chunk; :class:`KVLoadPlanner` streams them back chunk by chunk into the stores, each
rank reading only the chunks that can hold ids it owns, with memory about one chunk
whatever the table size. The dense part goes through DCP's default planners
untouched. :class:`SafeFileSystemReader` reads ``.metadata`` with an allow-list
unpickler. :func:`save` and :func:`load` add what a bare ``dcp.save``/``dcp.load``
cannot: an atomic save (a staging directory renamed into place) and a load that
changes no store on any rank when any chunk on any rank is bad. See ``spec/dcp.md``.

Example (on every rank)::

    >>> state = {"dense": mlp.state_dict(), "sparse": ebc.checkpoint_tables()}
    >>> leanstate.dcp.save(state, checkpoint_id="ckpt", process_group=group)
    >>> leanstate.dcp.load(fresh_state, checkpoint_id="ckpt", process_group=group)
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import secrets
import shutil
import stat
import struct
import threading
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path

import crc32c
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    LoadPlan,
    Metadata,
    ReadItem,
    SavePlan,
    WriteItem,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import LoadItemType, TensorWriteData, WriteItemType
from torch.futures import Future

from leanstate.reference import checkpoint as native
from leanstate.reference.checkpoint import CheckpointError
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import RowLayout, header_words
from leanstate.reference.sharded_checkpoint import BucketedTable
from leanstate.reference.sharding import bucket_of, owner_of_bucket

__all__ = ["KVLoadPlanner", "KVSavePlanner", "SafeFileSystemReader", "convert", "load", "save"]

FORMAT_NAME = "leanstate-dcp-kv"
FORMAT_VERSION = 1
INDEX_KEY = "leanstate_kv"  # in Metadata.planner_data: the schema and chunk index of every table
ROWS, CRC, SCHEMA = "/rows", "/crc", "/schema"
DEFAULT_CHUNK_BYTES = 16 * 2**20
# index entry of a chunk: [global row offset, rows, min id, max id, first bucket, last bucket]
OFFSET, NROWS, MIN_ID, MAX_ID, FIRST_BUCKET, LAST_BUCKET = range(6)


# -- what a state dict holds --------------------------------------------------------


@dataclasses.dataclass
class _Entry:
    """One KV value of a state dict: its key, its store and how the store is shared."""

    fqn: str
    store: object
    bucketing: tuple[int, int | None] | None  # (buckets, bucket_size) of a sharded table
    view: KVTensor | None


def _is_store(value: object) -> bool:
    return all(hasattr(value, name) for name in ("get_rows", "set_rows", "keys", "layout"))


def _split(state_dict: Mapping, method: str) -> tuple[dict, dict[str, _Entry]]:
    """The state dict without its KV values (same nesting, tensors shared) and those values by key.

    Keys join nested dict keys with ``"."``, as DCP's flattening does.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{method}: state_dict must be a dict; got {type(state_dict).__name__}")
    entries: dict[str, _Entry] = {}

    def walk(node: Mapping, prefix: str) -> dict:
        dense = {}
        for key, value in node.items():
            fqn = f"{prefix}{key}"
            if isinstance(value, BucketedTable):
                entries[fqn] = _Entry(fqn, value.store, (value.buckets, value.bucket_size), None)
            elif isinstance(value, KVTensor):
                entries[fqn] = _Entry(fqn, value.store, None, value)
            elif isinstance(value, _NativeTable) or _is_store(value):
                entries[fqn] = _Entry(fqn, value, None, None)
            elif isinstance(value, Mapping):
                dense[key] = walk(value, f"{fqn}.")
            else:
                dense[key] = value
        return dense

    dense = walk(state_dict, "")
    for fqn in entries:
        if any(fqn.endswith(suffix) for suffix in (ROWS, CRC, SCHEMA)):
            raise ValueError(f"{method}: key {fqn!r} ends in a suffix leanstate.dcp reserves")
    return dense, entries


def _tables_and_views(entries: dict[str, _Entry], method: str) -> tuple[dict[str, _Entry], dict[str, str]]:
    """Which key saves each store's whole rows (the first writable one) and which keys alias it."""
    tables: dict[str, _Entry] = {}
    by_store: dict[int, str] = {}
    for fqn, entry in entries.items():
        if entry.view is not None and entry.view.read_only:
            continue
        if id(entry.store) not in by_store:
            by_store[id(entry.store)] = fqn
            tables[fqn] = entry
    views = {}
    for fqn, entry in entries.items():
        if fqn in tables:
            continue
        if id(entry.store) not in by_store:
            raise ValueError(
                f"{method}: {fqn!r} is a read-only view whose store no other key saves; add the store "
                "(or a writable KVTensor of it) to the state dict"
            )
        views[fqn] = by_store[id(entry.store)]
    return tables, views


def _schema(layout, bucketing: tuple[int, int | None] | None) -> dict:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dim": layout.dim,
        "optimizer_state_dim": layout.state_dim,
        "dtype": native.dtype_name(layout.dtype),
        "header_elems": layout.header_elems,
        "width": layout.width,
        "row_bytes": layout.row_bytes,
        "checksum": "crc32c",
        # rows are ascending by (bucket, id) under this bucketing, or by id when None
        "bucketing": None if bucketing is None else list(bucketing),
    }


def _crc(data: torch.Tensor) -> int:
    return crc32c.crc32c(memoryview(data.numpy()).cast("B"))


# -- sources of rows to save --------------------------------------------------------


class _StoreRows:
    """A store's rows in saving order, cut into chunks of at most ``rows_per_chunk``."""

    def __init__(self, store, bucketing: tuple[int, int | None] | None, chunk_bytes: int) -> None:
        self.store = store
        self.layout = store.layout
        keys = store.keys().cpu()
        if bucketing is not None:
            buckets = bucket_of(keys, total_num_buckets=bucketing[0], bucket_size=bucketing[1])
            order = torch.argsort(buckets, stable=True)  # keys ascend: (bucket, id) order
            keys, buckets = keys[order], buckets[order]
        self.keys = keys
        step = max(1, chunk_bytes // self.layout.row_bytes)
        self.chunks = []
        for start in range(0, len(keys), step):
            ids = keys[start : start + step]
            first, last = (
                (int(buckets[start]), int(buckets[start + len(ids) - 1])) if bucketing else (None, None)
            )
            self.chunks.append([start, len(ids), int(ids.min()), int(ids.max()), first, last])

    def read(self, k: int) -> torch.Tensor:
        start, n = self.chunks[k][OFFSET], self.chunks[k][NROWS]
        rows = self.store.get_rows(self.keys[start : start + n]).cpu().contiguous()
        if not bool((header_words(rows)[:, 1] < 0).all()):  # the header's used flag
            raise RuntimeError(
                "leanstate.dcp.save: ids were deleted from a store while it was being saved; "
                "save while the stores are not written"
            )
        data = rows.view(torch.uint8)
        # torch.save writes a tensor's whole storage: a view into a larger one is copied out
        return data if data.untyped_storage().nbytes() == data.numel() else data.clone()

    def known_crc(self, k: int) -> int | None:
        return None


class _NativeTable:
    """A table of a whole-row (version 1) checkpoint directory, read chunk by chunk: what
    ``convert`` saves to DCP, its chunks unchanged."""

    def __init__(self, path: Path, name: str, table: dict) -> None:
        self.path, self.name, self.table = path, name, table
        self.layout = RowLayout(table["dim"], table["optimizer_state_dim"], native.DTYPES[table["dtype"]])


class _NativeRows:
    def __init__(self, source: _NativeTable) -> None:
        self.source, self.layout = source, source.layout
        self.chunks = []
        row = 0
        for c in source.table["chunks"]:
            self.chunks.append([row, c["rows"], c["min_id"], c["max_id"], None, None])
            row += c["rows"]

    def read(self, k: int) -> torch.Tensor:
        chunks = [(k, self.source.table["chunks"][k])]
        data = bytearray()
        for _, part in native.read_chunks(
            self.source.path, self.source.name, self.source.table, chunks, 2**62
        ):
            if part is not None:
                data += part
        return torch.frombuffer(data, dtype=torch.uint8).view(-1, self.layout.row_bytes)

    def known_crc(self, k: int) -> int | None:
        chunk = self.source.table["chunks"][k]
        return chunk["crc"] if self.source.table["checksum"] == "crc32c" else None


class _Refusal:
    """What a table's key holds for DCP's stock planner: unpickled by ``DefaultLoadPlanner``
    (which loads bytes with ``weights_only=False``), it raises the error naming the fix."""

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn

    def __reduce__(self):
        return (_refuse_stock_planner, (self.fqn,))


def _refuse_stock_planner(fqn: str) -> None:
    """Raise the error for a leanstate KV table loaded by DCP's stock ``DefaultLoadPlanner``."""
    raise CheckpointError(
        f"{fqn!r} is a leanstate KV table: the stock DefaultLoadPlanner would leave it unloaded. Load "
        "with leanstate.dcp.load(...), or dcp.load(..., planner=leanstate.dcp.KVLoadPlanner(), "
        "storage_reader=leanstate.dcp.SafeFileSystemReader(path))"
    )


# -- save -----------------------------------------------------------------------------


def _write_item(fqn: str, offsets, sizes, size, dtype: torch.dtype, *, shard: bool = True) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD if shard else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(size),
        ),
    )


def _moved(item: WriteItem, offsets, size) -> WriteItem:
    """``item`` at global ``offsets`` of a tensor of global ``size``."""
    data = item.tensor_data
    return dataclasses.replace(
        item,
        index=MetadataIndex(item.index.fqn, torch.Size(offsets)),
        tensor_data=dataclasses.replace(
            data,
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=data.chunk.sizes),
            size=torch.Size(size),
        ),
    )


class KVSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` for the dense part; each KV table becomes ``<key>/rows`` (its whole
    rows, ``uint8 [N, R]`` in chunks of about ``chunk_bytes``), ``<key>/crc`` (one CRC-32C per
    chunk), ``<key>/schema`` (JSON bytes) and its chunk index in ``Metadata.planner_data``.

    Every rank saves the rows of its sharded tables (``BucketedTable`` values, rank after
    rank in the global row order); a plain store or KVTensor is saved from a one-rank group
    only. Other keys of a saved store (the optimizer's read-only views) are recorded as
    views of it. Chunks are read from the stores when DCP writes them: memory is about one
    chunk, whatever the table size.
    """

    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, **kwargs) -> None:
        native.check_chunk_bytes("KVSavePlanner", chunk_bytes)
        kwargs["enable_plan_caching"] = False  # row counts change between saves
        super().__init__(**kwargs)
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        dense, entries = _split(state_dict, "KVSavePlanner")
        tables, views = _tables_and_views(entries, "KVSavePlanner")
        self._sources = {}
        self._schemas = {}
        for fqn, entry in tables.items():
            if isinstance(entry.store, _NativeTable):
                self._sources[fqn] = _NativeRows(entry.store)
            else:
                self._sources[fqn] = _StoreRows(entry.store, entry.bucketing, self.chunk_bytes)
            self._schemas[fqn] = _schema(self._sources[fqn].layout, entry.bucketing)
        self._views = {
            fqn: {"view_of": table, "rows": len(entries[fqn].store)} for fqn, table in views.items()
        }
        self._sharded = {fqn: entry.bucketing is not None for fqn, entry in tables.items()}
        self._crcs: dict[str, dict[int, int]] = {fqn: {} for fqn in self._sources}
        super().set_up_planner(dense, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        local = {}
        for fqn, source in self._sources.items():
            r = self._schemas[fqn]["row_bytes"]
            n_local = sum(c[NROWS] for c in source.chunks)
            for start, n, *_ in source.chunks:
                items.append(_write_item(fqn + ROWS, (start, 0), (n, r), (n_local, r), torch.uint8))
            if source.chunks:
                k = len(source.chunks)
                items.append(_write_item(fqn + CRC, (0,), (k,), (k,), torch.int64))
            if self.is_coordinator:
                size = len(json.dumps(self._schemas[fqn]).encode())
                items.append(_write_item(fqn + SCHEMA, (0,), (size,), (size,), torch.uint8, shard=False))
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            local[fqn] = {
                "schema": self._schemas[fqn],
                "chunks": source.chunks,
                "sharded": self._sharded[fqn],
            }
        planner_data = dict(plan.planner_data or {})
        planner_data[INDEX_KEY] = {"tables": local, "views": self._views}
        self.plan = dataclasses.replace(plan, items=items, planner_data=planner_data)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        world = len(all_plans)
        locals_ = []
        for plan in all_plans:
            data = dict(plan.planner_data)
            locals_.append(data.pop(INDEX_KEY))
        tables: dict[str, dict] = {}
        for fqn in locals_[0]["tables"]:
            mine = [local["tables"].get(fqn) for local in locals_]
            for rank, entry in enumerate(mine):
                if entry is None or entry["schema"] != mine[0]["schema"]:
                    raise ValueError(
                        f"KVSavePlanner: table {fqn!r}: rank {rank} "
                        + ("does not hold it" if entry is None else "has another layout or bucketing")
                        + "; every rank must save the same tables"
                    )
            if world > 1 and not mine[0]["sharded"]:
                raise ValueError(
                    f"KVSavePlanner: {fqn!r} is a plain store on a {world}-rank group, where each rank's rows "
                    "would be saved on top of the others'; pass a sharded module's checkpoint_tables() "
                    "(BucketedTable values), or save it from a one-rank group"
                )
            tables[fqn] = {"schema": mine[0]["schema"], "per_rank": mine}
        for local in locals_[1:]:
            extra = set(local["tables"]) - set(tables)
            if extra:
                raise ValueError(f"KVSavePlanner: rank 0 does not hold tables {sorted(extra)}")
        index = {"version": FORMAT_VERSION, "tables": {}, "views": locals_[0]["views"]}
        row_base = [dict.fromkeys(tables, 0) for _ in range(world)]
        chunk_base = [dict.fromkeys(tables, 0) for _ in range(world)]
        for fqn, table in tables.items():
            rows = chunks = 0
            entries = []
            for rank, entry in enumerate(table["per_rank"]):
                row_base[rank][fqn], chunk_base[rank][fqn] = rows, chunks
                for chunk in entry["chunks"]:
                    entries.append([chunk[OFFSET] + rows, *chunk[1:]])
                rows += sum(c[NROWS] for c in entry["chunks"])
                chunks += len(entry["chunks"])
            index["tables"][fqn] = {"schema": table["schema"], "rows": rows, "chunks": entries}
        moved = []
        for rank, plan in enumerate(all_plans):
            items = []
            for item in plan.items:
                fqn, suffix = _split_key(item.index.fqn)
                if fqn in tables and suffix == ROWS:
                    total = index["tables"][fqn]["rows"]
                    off = item.index.offset[0] + row_base[rank][fqn]
                    item = _moved(item, (off, 0), (total, item.tensor_data.size[1]))
                elif fqn in tables and suffix == CRC:
                    total = len(index["tables"][fqn]["chunks"])
                    item = _moved(item, (chunk_base[rank][fqn],), (total,))
                items.append(item)
            data = dict(plan.planner_data)
            del data[INDEX_KEY]
            moved.append(dataclasses.replace(plan, items=items, planner_data=data))
        plans, metadata = super().create_global_plan(moved)
        metadata.planner_data = {**(metadata.planner_data or {}), INDEX_KEY: index}
        self.metadata = metadata
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        self._base = {}
        for item in plan.items:
            fqn, suffix = _split_key(item.index.fqn)
            if fqn in self._sources and suffix == ROWS:
                self._base[fqn] = min(self._base.get(fqn, item.index.offset[0]), item.index.offset[0])
        self._chunk_at = {
            fqn: {c[OFFSET]: k for k, c in enumerate(source.chunks)} for fqn, source in self._sources.items()
        }
        return plan

    def resolve_data(self, write_item: WriteItem):
        fqn, suffix = _split_key(write_item.index.fqn)
        if fqn not in self._sources:
            return super().resolve_data(write_item)
        source = self._sources[fqn]
        if suffix == ROWS:
            k = self._chunk_at[fqn][write_item.index.offset[0] - self._base[fqn]]
            return self._chunk(fqn, k)
        if suffix == CRC:
            return torch.tensor([self._crc_of(fqn, k) for k in range(len(source.chunks))], dtype=torch.int64)
        if suffix == SCHEMA:
            return torch.frombuffer(bytearray(json.dumps(self._schemas[fqn]).encode()), dtype=torch.uint8)
        buffer = io.BytesIO()  # the table's own key: what the stock planner would load
        pickle.dump(_Refusal(fqn), buffer)
        buffer.seek(0)
        return buffer

    def _chunk(self, fqn: str, k: int) -> torch.Tensor:
        data = self._sources[fqn].read(k)
        crc = self._sources[fqn].known_crc(k)
        with self._lock:
            self._crcs[fqn][k] = _crc(data) if crc is None else crc
        return data

    def _crc_of(self, fqn: str, k: int) -> int:
        with self._lock:
            crc = self._crcs[fqn].get(k)
        if crc is None:  # the writer asked for the CRCs before this chunk: read it now
            crc = self._sources[fqn].known_crc(k)
            if crc is None:
                self._chunk(fqn, k)
                crc = self._crcs[fqn][k]
        return crc


def _split_key(key: str) -> tuple[str, str]:
    """``"t/rows"`` -> ``("t", "/rows")``; a key without a leanstate suffix -> ``(key, "")``."""
    for suffix in (ROWS, CRC, SCHEMA):
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    return key, ""


# -- load -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    """One store to fill from one saved table."""

    table: str  # the saved table's key
    entry: _Entry
    saved: dict  # its index entry: schema, rows, chunks
    chunks: list[int]  # the chunks this rank reads
    crc: torch.Tensor  # the saved CRC of every chunk, as read
    crc_read: torch.Tensor  # which of them have been read
    computed: dict[int, int]  # chunk -> CRC of the bytes read, not yet compared
    expected_rows: int = 0  # about the rows this rank applies: what an empty store reserves
    reserved: bool = False


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
    before it applies any into stores that already hold rows.
    """

    def __init__(self, *, process_group: dist.ProcessGroup | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.process_group = process_group
        self.stats: dict[str, dict[str, int]] = {}
        self._apply = True
        self._dense = True

    def set_up_planner(
        self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        method = "KVLoadPlanner"
        dense, entries = _split(state_dict, method)
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
            native.check_layout(Path(saved_fqn), fqn, saved["schema"], entry.store)
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

    def _may_own(self, entry: _Entry, schema: dict, chunk: list) -> bool:
        """Whether ``chunk`` can hold ids this rank owns (by its bucket or id range)."""
        if entry.bucketing is None:
            return True
        buckets, size = entry.bucketing
        if schema["bucketing"] == [buckets, size]:
            first, last = chunk[FIRST_BUCKET], chunk[LAST_BUCKET]
        elif size is not None:  # chunk mode: buckets ascend with ids
            first, last = (
                int(bucket_of(torch.tensor([chunk[i]]), total_num_buckets=buckets, bucket_size=size))
                for i in (MIN_ID, MAX_ID)
            )
        else:
            return True
        low, high = (
            owner_of_bucket(b, world_size=self._world, total_num_buckets=buckets) for b in (first, last)
        )
        return low <= self._rank <= high

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan() if self._dense else LoadPlan([])
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
        fqn, suffix = _split_key(key)
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

    def _takes_loaded(self, read_item: ReadItem) -> bool:
        """Whether ``read_item`` is a KV chunk, which :class:`SafeFileSystemReader` hands over as
        loaded (the reused buffer of ``resolve_tensor`` is for other readers)."""
        job, suffix = self._job_of(read_item.dest_index.fqn)
        return job is not None and suffix == ROWS

    def _commit_loaded(self, read_item: ReadItem, rows: torch.Tensor) -> None:
        job, _ = self._job_of(read_item.dest_index.fqn)
        self._commit_rows(job, read_item, rows.contiguous())
        self._count_commit()

    def _commit_rows(self, job: _Job, read_item: ReadItem, rows: torch.Tensor) -> None:
        offset = read_item.dest_offsets[0]
        k = next(i for i in job.chunks if job.saved["chunks"][i][OFFSET] == offset)
        chunk = job.saved["chunks"][k]
        where = f"table {job.table!r}: chunk {k} (rows {offset}..{offset + chunk[NROWS]})"
        crc = _crc(rows)
        with self._lock:
            known = bool(job.crc_read[k])
            if not known:
                job.computed[k] = crc
        if known and crc != int(job.crc[k]):
            raise CheckpointError(f"KVLoadPlanner: {where} fails its crc32c check; the checkpoint is corrupt")
        schema = job.saved["schema"]
        layout = job.entry.store.layout
        ids = rows[:, :8].contiguous().view(torch.int64).flatten()
        if schema["bucketing"] is None:
            ascending = bool((ids[1:] > ids[:-1]).all())
        else:
            b = bucket_of(ids, total_num_buckets=schema["bucketing"][0], bucket_size=schema["bucketing"][1])
            step = b[1:] - b[:-1]
            ascending = bool(((step > 0) | ((step == 0) & (ids[1:] > ids[:-1]))).all())
        if not ascending or (int(ids.min()), int(ids.max())) != (chunk[MIN_ID], chunk[MAX_ID]):
            raise CheckpointError(
                f"KVLoadPlanner: {where}: its ids are out of order or outside {chunk[MIN_ID]}..{chunk[MAX_ID]}"
            )
        stats = self.stats[job.table]
        stats["chunks"] += 1
        if not self._apply:
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
            if len(job.entry.store) == 0 and hasattr(job.entry.store, "reserve"):
                job.entry.store.reserve(job.expected_rows)
        if len(values):
            job.entry.store.set_rows(values.to(getattr(job.entry.store, "device", "cpu")))
        stats["rows"] += len(values)

    def _check_deferred(self) -> None:
        """Compare the chunks that arrived before their CRC (another file's order)."""
        for job in self._jobs.values():
            for k, crc in sorted(job.computed.items()):
                if not bool(job.crc_read[k]) or crc != int(job.crc[k]):
                    raise CheckpointError(
                        f"KVLoadPlanner: table {job.table!r}: chunk {k} fails its crc32c check; the checkpoint "
                        "is corrupt"
                    )
            job.computed.clear()

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


# -- safe metadata --------------------------------------------------------------------

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# What a DCP .metadata of torch 2.4 to 2.13 holds: DCP's own dataclasses and the plain
# types of their fields. Nothing else is constructed.
_ALLOWED = (
    {
        (_METADATA_MODULE, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
            "StorageMeta",
            "MetadataIndex",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint._extension", "ExtensionRegistry"),
        ("torch", "Size"),
        ("torch._utils", "_get_layout"),  # builds a layout (torch.strided) from its name
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
    }
    | {
        ("torch", str(dtype).removeprefix("torch."))
        for dtype in vars(torch).values()
        if isinstance(dtype, torch.dtype)
    }
)


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, file, name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise CheckpointError(
                f"{self.name}: refuses to unpickle {module}.{name}: a DCP .metadata holds only DCP's own "
                "metadata classes, so this file is corrupt or crafted; nothing was loaded"
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by an allow-list unpickler.

    Only DCP's metadata classes, ``torch.Size``, dtypes, paths and builtin containers are
    constructed; any other global (a crafted file's ``os.system`` or ``open``) raises a
    :class:`CheckpointError` naming the file before anything runs. The metadata file must
    be a regular file inside the checkpoint (no FIFO, symlink or device). Tensor data is
    read with ``weights_only=True``, as the stock reader does.
    """

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        file = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            info = os.lstat(file)
        except FileNotFoundError as exc:
            raise CheckpointError(f"no DCP checkpoint at {self.path}: {file} does not exist") from exc
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{file} is not a regular file; refusing to read it")
        with open(file, "rb") as f:
            try:
                metadata = _SafeUnpickler(f, str(file)).load()
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(
                    f"{file}: not a DCP metadata file ({type(exc).__name__}: {exc})"
                ) from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner):
        """Read each item with ``weights_only=True``, from regular files inside the checkpoint
        only; an item that cannot be read names its key (and for a KV chunk, its table and chunk)."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative, items in per_file.items():
            file = Path(self.path) / relative
            if Path(relative).name != relative or not stat.S_ISREG(_lstat_mode(file)):
                raise CheckpointError(
                    f"{file} is not a regular file inside the checkpoint; refusing to read it"
                )
            with open(file, "rb") as f:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    what = _describe(planner, item)
                    if info.transform_descriptors:
                        raise CheckpointError(
                            f"{file}: {what} is stored transformed; SafeFileSystemReader reads plain items"
                        )
                    if getattr(planner, "_takes_loaded", lambda _: False)(item) and not any(
                        item.storage_offsets
                    ):
                        rows = _read_stored_rows(f, info, item.lengths, file, what)
                        planner._commit_loaded(item, rows)  # read straight into one reused buffer
                        continue
                    f.seek(info.offset)
                    data = f.read(info.length)
                    if len(data) != info.length:
                        raise CheckpointError(f"{file}: {what} is truncated")
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(data))
                        continue
                    try:
                        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                    except Exception as exc:
                        raise CheckpointError(
                            f"{file}: {what} cannot be read ({type(exc).__name__}: {exc}); the file is corrupt"
                        ) from exc
                    if not isinstance(tensor, torch.Tensor):
                        raise CheckpointError(f"{file}: {what} holds a {type(tensor).__name__}, not a tensor")
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        if start + length > tensor.size(dim):
                            raise CheckpointError(f"{file}: {what} is smaller than its metadata says")
                        tensor = tensor.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != tensor.size():
                        raise CheckpointError(
                            f"{file}: {what} has shape {tuple(tensor.size())}, expected {tuple(target.size())}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        future: Future = Future()
        future.set_result(None)
        return future


class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a seekable file of its own."""

    def __init__(self, f, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.position = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = min(max(0, base + position), self.length)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")[: self.length - self.position]
        self.f.seek(self.offset + self.position)
        n = self.f.readinto(view)
        self.position += n
        return n


_ROW_BUFFERS = threading.local()


def _read_stored_rows(f, info, lengths, file: Path, what: str) -> torch.Tensor:
    """The ``uint8 [n, R]`` tensor DCP stored for a KV chunk (a ``torch.save`` zip), read from its
    uncompressed data record into a reused buffer: one copy, as the native load makes."""
    n, r = lengths
    try:
        records = zipfile.ZipFile(_Slice(f, info.offset, info.length)).infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise CheckpointError(f"{file}: {what} is not a tensor record ({exc}); the file is corrupt") from exc
    data = [record for record in records if record.filename.endswith("/data/0")]
    if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED or data[0].file_size != n * r:
        raise CheckpointError(f"{file}: {what} does not hold a uint8 [{n}, {r}] tensor; the file is corrupt")
    f.seek(info.offset + data[0].header_offset)
    header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{file}: {what} has a broken record header; the file is corrupt")
    name_length, extra_length = struct.unpack("<2H", header[26:30])
    f.seek(info.offset + data[0].header_offset + 30 + name_length + extra_length)
    buffer = getattr(_ROW_BUFFERS, "buffer", None)
    if buffer is None or len(buffer) < n * r:
        buffer = _ROW_BUFFERS.buffer = bytearray(n * r)
    if f.readinto(memoryview(buffer)[: n * r]) != n * r:
        raise CheckpointError(f"{file}: {what} is truncated")
    return torch.frombuffer(buffer, dtype=torch.uint8, count=n * r).view(n, r)


def _lstat_mode(file: Path) -> int:
    try:
        return os.lstat(file).st_mode
    except FileNotFoundError as exc:
        raise CheckpointError(f"{file} is missing") from exc


def _describe(planner, item: ReadItem) -> str:
    describe = getattr(planner, "describe", None)
    if describe is not None:
        return describe(item)
    return f"item {item.storage_index.fqn!r}"


class _Writer(FileSystemWriter):
    """``FileSystemWriter`` that keeps the machine's path out of ``.metadata``."""

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None:
            meta.checkpoint_id = None
        return meta


# -- save and load, all or nothing -----------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_rank(group) -> tuple[int, int]:
    if not _distributed():
        return 0, 1
    group = group or dist.group.WORLD
    return dist.get_rank(group), dist.get_world_size(group)


def _broadcast(value, group):
    if _group_rank(group)[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return box[0]


def _all_true(flag: bool, group) -> bool:
    if _group_rank(group)[1] == 1:
        return flag
    value = torch.tensor([1 if flag else 0])
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def _unwrap(exc: CheckpointException, method: str, path) -> CheckpointError:
    """The first rank's real error, as a CheckpointError naming the rank."""
    parts = []
    for rank, (error, _) in sorted(exc.failures.items()):
        parts.append(f"rank {rank}: {type(error).__name__}: {error}")
    return CheckpointError(f"{method} {path}: " + "; ".join(parts))


def save(
    state_dict: Mapping,
    *,
    checkpoint_id: str | os.PathLike,
    process_group: dist.ProcessGroup | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Path:
    """``dcp.save`` of ``state_dict`` (dense tensors and KV tables) with :class:`KVSavePlanner`,
    atomically: into a staging directory that rank 0 renames into place when every rank
    has written and fsynced. A failure on any rank raises :class:`CheckpointError` naming
    the rank on every rank and leaves ``checkpoint_id`` as it was. Call on every rank.
    """
    method = "leanstate.dcp.save"
    path = Path(checkpoint_id)
    rank, _ = _group_rank(process_group)
    staging, problem = None, None
    if rank == 0:
        try:
            if (
                path.exists()
                and not (path / ".metadata").is_file()
                and (not path.is_dir() or any(path.iterdir()))
            ):
                raise ValueError(f"{path} exists and is not a DCP checkpoint; refusing to replace it")
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.parent / f".{path.name}.saving-{secrets.token_hex(4)}"
            staging.mkdir()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
    staging, problem = _broadcast((staging, problem), process_group)
    if problem is not None:
        raise CheckpointError(f"{method}: rank 0: {problem}")
    try:
        with _quiet():
            dcp.save(
                state_dict,
                storage_writer=_Writer(staging),
                planner=KVSavePlanner(chunk_bytes=chunk_bytes),
                process_group=process_group,
                no_dist=not _distributed(),
            )
    except CheckpointException as exc:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise _unwrap(exc, method, path) from None
    if rank == 0:
        _publish(staging, path)
    _all_true(True, process_group)  # every rank returns once the checkpoint is in place
    return path


def _publish(staging: Path, path: Path) -> None:
    """Rename the fsynced ``staging`` to ``path``; the old checkpoint waits aside until then."""
    previous = path.parent / f".{path.name}.previous-{secrets.token_hex(4)}"
    native.replace_directory(staging, path, previous)
    if previous.exists():
        (previous / ".metadata").unlink(missing_ok=True)  # first: a half-deleted copy never looks whole
        shutil.rmtree(previous, ignore_errors=True)


def load(
    state_dict: Mapping,
    *,
    checkpoint_id: str | os.PathLike,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, dict[str, int]]:
    """``dcp.load`` into ``state_dict`` with :class:`KVLoadPlanner` and :class:`SafeFileSystemReader`,
    all or nothing for the KV tables on every rank; returns the planner's ``stats``.

    When every store is empty (on every rank) rows are applied as they are read and a
    failure anywhere empties them again; otherwise every rank first verifies all its
    chunks, the ranks agree, and only then does any rank apply. Call on every rank.
    """
    method = "leanstate.dcp.load"
    _, entries = _split(state_dict, method)
    SafeFileSystemReader(checkpoint_id).read_metadata()  # a bad .metadata is named, not wrapped
    stores = list(
        {id(e.store): e.store for e in entries.values() if not (e.view and e.view.read_only)}.values()
    )
    empty = _all_true(all(len(store) == 0 for store in stores), process_group)
    try:
        if not empty:
            check = KVLoadPlanner(process_group=process_group)
            check._apply = check._dense = False
            kv_only = {}
            for fqn, entry in entries.items():
                kv_only[fqn] = entry.view if entry.view is not None else _as_value(entry)
            _load_with(kv_only, check, checkpoint_id, process_group)
        planner = KVLoadPlanner(process_group=process_group)
        _load_with(state_dict, planner, checkpoint_id, process_group)
    except CheckpointException as exc:
        if empty:
            for store in stores:
                store.delete(store.keys())
        raise _unwrap(exc, method, checkpoint_id) from None
    except BaseException:
        if empty:
            for store in stores:
                store.delete(store.keys())
        raise
    return planner.stats


@contextlib.contextmanager
def _quiet():
    """Silence DCP's warning that one process without a process group means one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _load_with(state_dict, planner: KVLoadPlanner, checkpoint_id, process_group) -> None:
    with _quiet():
        dcp.load(
            state_dict,
            storage_reader=SafeFileSystemReader(checkpoint_id),
            planner=planner,
            process_group=process_group,
            no_dist=not _distributed(),
        )


def _as_value(entry: _Entry):
    if entry.bucketing is not None:
        return BucketedTable(entry.store, *entry.bucketing)
    return entry.store


# -- conversion -------------------------------------------------------------------------

NATIVE_MANIFEST, NATIVE_EXTRA = "leanstate.native.manifest", "leanstate.native.extra"


class _FileSink:
    """What a DCP table loads into on its way to a whole-row file: rows appended in the
    saved order, which must ascend by id across chunks (the native format's rule)."""

    def __init__(self, file: Path, layout: RowLayout) -> None:
        self.file, self.layout = file, layout
        self.out = open(file, "wb")
        self.chunks: list[dict] = []
        self.offset, self.last = 0, -1

    def __len__(self) -> int:
        return 0

    def keys(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    def get_rows(self, ids):
        raise TypeError("convert: a conversion sink is written, not read")

    def delete(self, ids) -> None:
        """Nothing to undo: a failed conversion removes the whole staging directory."""

    def set_rows(self, rows: torch.Tensor) -> None:
        data = native.row_bytes_of(rows)
        ids = header_words(rows)[:, 0]
        if int(ids[0]) <= self.last:
            raise CheckpointError(
                f"convert: table {self.file.stem!r} was saved in bucket order by several ranks, not ascending "
                "by id; load it with leanstate.dcp.load and save it with leanstate.save_checkpoint"
            )
        self.last = int(ids[-1])
        self.out.write(data)
        self.chunks.append(native.chunk_entry(rows, self.offset, native.new_chunk_checksum(data)))
        self.offset += len(data)

    def close(self) -> dict:
        self.out.flush()
        os.fsync(self.out.fileno())
        self.out.close()
        return native.table_entry(self.layout, self.file, self.chunks)


def convert(
    source: str | os.PathLike, target: str | os.PathLike, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> str:
    """Convert a whole-row checkpoint (version 1) to DCP or a DCP checkpoint back; returns
    the format written (``"dcp"`` or ``"native"``).

    Native to DCP keeps every chunk as it was and carries the manifest and the extra
    state's bytes along, so converting back gives byte-identical files. A DCP checkpoint
    saved otherwise converts when its tables ascend by id (one rank, or chunk-mode
    bucketing); its dense entries are not part of a native checkpoint and are left out.
    """
    source, target = Path(source), Path(target)
    if (source / native.MANIFEST).is_file():
        manifest = native.read_manifest(source)
        if manifest["version"] != native.FORMAT_VERSION:
            raise CheckpointError(
                f"convert: {source} is a version-{manifest['version']} (sharded) checkpoint; load it into a "
                "sharded module and save it with leanstate.dcp.save"
            )
        state: dict[str, object] = {
            name: _NativeTable(source, name, table) for name, table in manifest["tables"].items()
        }
        state[NATIVE_MANIFEST] = torch.frombuffer(
            bytearray((source / native.MANIFEST).read_bytes()), dtype=torch.uint8
        )
        if manifest["extra"] is not None:
            native.read_extra(source, manifest)  # checked first
            name = manifest["extra"] if isinstance(manifest["extra"], str) else manifest["extra"]["file"]
            state[NATIVE_EXTRA] = torch.frombuffer(bytearray((source / name).read_bytes()), dtype=torch.uint8)
        save(state, checkpoint_id=target, chunk_bytes=chunk_bytes)
        return "dcp"
    metadata = SafeFileSystemReader(source).read_metadata()
    index = (metadata.planner_data or {}).get(INDEX_KEY)
    if index is None:
        raise CheckpointError(f"convert: {source} holds no leanstate KV tables")
    target = native.checked_target(target, "convert")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.saving-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        sinks = {}
        for name, table in index["tables"].items():
            schema = table["schema"]
            layout = RowLayout(schema["dim"], schema["optimizer_state_dim"], native.DTYPES[schema["dtype"]])
            sinks[name] = _FileSink(staging / f"{name}.rows", layout)
        state = dict(sinks)
        carried = {key: metadata.state_dict_metadata.get(key) for key in (NATIVE_MANIFEST, NATIVE_EXTRA)}
        for key, entry in carried.items():
            if entry is not None:
                state[key] = torch.empty(entry.size, dtype=torch.uint8)
        try:
            load(state, checkpoint_id=source)
        finally:
            entries = {name: sink.close() for name, sink in sinks.items()}
        if carried[NATIVE_MANIFEST] is not None:
            manifest_bytes = bytes(state[NATIVE_MANIFEST].numpy())
            manifest = json.loads(manifest_bytes)
            for name, entry in entries.items():
                if [c["crc"] for c in entry["chunks"]] != [
                    c["crc"] for c in manifest["tables"][name]["chunks"]
                ]:
                    raise CheckpointError(f"convert: table {name!r} does not match the manifest it carries")
        else:
            manifest = {
                "format": native.FORMAT_NAME,
                "version": native.FORMAT_VERSION,
                "tables": entries,
                "views": {},
                "extra": None,
            }
            manifest_bytes = None
        if carried[NATIVE_EXTRA] is not None:
            extra = manifest["extra"]
            name = extra if isinstance(extra, str) else extra["file"]
            with open(staging / name, "wb") as f:
                f.write(bytes(state[NATIVE_EXTRA].numpy()))
                f.flush()
                os.fsync(f.fileno())
        if manifest_bytes is None:
            native.publish(
                staging, manifest, target, target.parent / f".{target.name}.previous-{secrets.token_hex(4)}"
            )
        else:
            with open(staging / native.MANIFEST, "wb") as f:
                f.write(manifest_bytes)
                f.flush()
                os.fsync(f.fileno())
            _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return "native"
