"""``KVSavePlanner``: DCP's default save planner, with each KV table saved as its whole
rows in chunks, one CRC-32C per chunk, its schema, and a chunk index in the metadata."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import threading

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, Metadata, SavePlan, WriteItem
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItemType

from leanstate.checkpoint.core import check_chunk_bytes
from leanstate.dcp._sources import NativeRows, StoreRows
from leanstate.dcp._state import (
    CRC,
    DEFAULT_CHUNK_BYTES,
    FORMAT_VERSION,
    INDEX_KEY,
    NROWS,
    OFFSET,
    ROWS,
    SCHEMA,
    NativeTable,
    crc_of,
    schema_of,
    split_key,
    split_state,
    tables_and_views,
)
from leanstate.reference.checkpoint_manifest import CheckpointError


class _Refusal:
    """What a table's key (and each key of a view of it) holds for DCP's stock planner:
    unpickled by ``DefaultLoadPlanner`` (which loads bytes with ``weights_only=False``), it
    raises the error naming the fix."""

    def __init__(self, fqn: str, view_of: str | None = None) -> None:
        self.fqn, self.view_of = fqn, view_of

    def __reduce__(self):
        if self.view_of is None:  # the first format's pickle: loads in every version
            return (refuse_stock_planner, (self.fqn,))
        return (refuse_stock_planner, (self.fqn, self.view_of))


def refuse_stock_planner(fqn: str, view_of: str | None = None) -> None:
    """Raise the error for a leanstate KV table (or a view of one, ``view_of`` the table) loaded
    by DCP's stock ``DefaultLoadPlanner``."""
    what = "a leanstate KV table" if view_of is None else f"a view of the leanstate KV table {view_of!r}"
    raise CheckpointError(
        f"{fqn!r} is {what}: the stock DefaultLoadPlanner would leave it unloaded. Load "
        "with leanstate.dcp.load(...), or dcp.load(..., planner=leanstate.dcp.KVLoadPlanner(), "
        "storage_reader=leanstate.dcp.SafeFileSystemReader(path))"
    )


# Saved checkpoints name this function in their pickles: its name stays where the first
# format put it (``leanstate.dcp`` re-exports it there).
refuse_stock_planner.__module__, refuse_stock_planner.__qualname__ = "leanstate.dcp", "_refuse_stock_planner"


def _pickled(refusal: _Refusal) -> io.BytesIO:
    buffer = io.BytesIO()
    pickle.dump(refusal, buffer)
    buffer.seek(0)
    return buffer


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
        check_chunk_bytes("KVSavePlanner", chunk_bytes)
        kwargs["enable_plan_caching"] = False  # row counts change between saves
        super().__init__(**kwargs)
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        dense, entries = split_state(state_dict, "KVSavePlanner")
        tables, views = tables_and_views(entries, "KVSavePlanner")
        self._sources = {}
        self._schemas = {}
        for fqn, entry in tables.items():
            if isinstance(entry.store, NativeTable):
                self._sources[fqn] = NativeRows(entry.store)
            else:
                self._sources[fqn] = StoreRows(entry.store, entry.bucketing, self.chunk_bytes)
            self._schemas[fqn] = schema_of(self._sources[fqn].layout, entry.bucketing)
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
        if self.is_coordinator:  # a view's key too, or the stock planner fails on it as missing, unexplained
            items.extend(
                WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in self._views
            )
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
                fqn, suffix = split_key(item.index.fqn)
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
            fqn, suffix = split_key(item.index.fqn)
            if fqn in self._sources and suffix == ROWS:
                self._base[fqn] = min(self._base.get(fqn, item.index.offset[0]), item.index.offset[0])
        self._chunk_at = {
            fqn: {c[OFFSET]: k for k, c in enumerate(source.chunks)} for fqn, source in self._sources.items()
        }
        return plan

    def resolve_data(self, write_item: WriteItem):
        fqn, suffix = split_key(write_item.index.fqn)
        if fqn in self._views:
            return _pickled(_Refusal(fqn, self._views[fqn]["view_of"]))
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
        return _pickled(_Refusal(fqn))  # the table's own key: what the stock planner would load

    def _chunk(self, fqn: str, k: int) -> torch.Tensor:
        data = self._sources[fqn].read(k)
        crc = self._sources[fqn].known_crc(k)
        with self._lock:
            self._crcs[fqn][k] = crc_of(data) if crc is None else crc
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
