"""Whole-row checkpoints across ranks (format version 2): bucket-major, one file per rank.

Every rank writes the rows it owns, per table, to ``<table>.rank<r>.rows`` in one
checkpoint directory, bucket-major (ascending bucket, then id), in chunks that never
span two buckets; rank 0 writes the manifest last, after every rank has fsynced, then
renames the directory into place (``spec/sharding.md``). Loading at any world size,
each rank reads only the chunks of the buckets it owns there, each one CRC-checked
before its rows are applied. A version-1 checkpoint (one process, ascending ids) loads
too: each rank then reads every chunk and keeps the rows it owns.

Example (on every rank)::

    >>> save_checkpoint("ckpt", ebc.checkpoint_tables(), extra=ebc.extra_state(), process_group=group)
    >>> load_checkpoint("ckpt", fresh.checkpoint_tables(), process_group=group)
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from leanstate import _checkpoint_files as files
from leanstate._checkpoint_chunks import FileChunks, TableRead, read_chunks, write_store
from leanstate._checkpoint_files import read_manifest
from leanstate._checkpoint_format import (
    CHECKSUM,
    DEFAULT_CHUNK_BYTES,
    MANIFEST,
    SLICE_BYTES,
    Target,
    check_chunk_bytes,
    check_layout,
    layout_fields,
    targets_of,
)
from leanstate._checkpoint_load import (
    apply_tables,
    load_all_or_nothing,
    verify_table,
)
from leanstate._checkpoint_ranks import broadcast, staged_by_rank_0
from leanstate.reference.checkpoint import FORMAT_NAME, CheckpointError
from leanstate.reference.sharding import BucketedTable, describe_bucketing, owner_of_bucket

FORMAT_VERSION = 2


def _check_tables(tables: Mapping[str, BucketedTable], method: str) -> None:
    if not isinstance(tables, Mapping) or not all(isinstance(t, BucketedTable) for t in tables.values()):
        raise TypeError(
            f"{method}: with process_group, tables must be a sharded module's checkpoint_tables() "
            "(name -> BucketedTable)"
        )
    targets_of({name: t.store for name, t in tables.items()}, method)  # the names' rules


def _write_rank_file(table: BucketedTable, file: Path, chunk_bytes: int) -> dict:
    """This rank's rows of one table, bucket-major, chunks within one bucket; the file's entry."""
    chunks = write_store(table.store, file, chunk_bytes, bucketing=(table.buckets, table.bucket_size))
    row_bytes = table.store.layout.row_bytes
    return {"file": file.name, "bytes": sum(c["rows"] for c in chunks) * row_bytes, "chunks": chunks}


def save_sharded(
    path: str | os.PathLike,
    tables: Mapping[str, BucketedTable],
    *,
    process_group: dist.ProcessGroup,
    extra: Mapping[str, object] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Path:
    """Save every rank's share of ``tables`` into one checkpoint at ``path``. Call on every rank.

    ``extra`` is taken from rank 0. A failure on any rank fails the save on every rank
    and leaves ``path`` as it was.
    """
    method = "save_checkpoint"
    _check_tables(tables, method)
    check_chunk_bytes(method, chunk_bytes)
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    path = Path(path)
    extra_bytes = []  # rank 0's, serialised (and checked) before any rank writes

    def prepare() -> Path:
        checked = files.checked_target(path, method)
        if extra is not None:
            extra_bytes.append(files.extra_bytes_of(extra, method))
        return checked

    with staged_by_rank_0(path, method, process_group, prepare) as staging:
        written, problem = {}, None
        try:
            for name, table in tables.items():
                file = staging / f"{name}.rank{rank}.rows"
                written[name] = _write_rank_file(table, file, chunk_bytes)
        except Exception as exc:
            problem = f"rank {rank}: writing {file.name}: {type(exc).__name__}: {exc}"
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(
            (problem, written), gathered, dst=dist.get_global_rank(process_group, 0), group=process_group
        )
        outcome = None
        if rank == 0:
            outcome = next((p for p, _ in gathered if p is not None), None)
            try:
                if outcome is None:
                    _commit(
                        path,
                        staging,
                        tables,
                        [f for _, f in gathered],
                        world,
                        extra_bytes[0] if extra_bytes else None,
                    )
            except Exception as exc:
                outcome = f"rank 0: {type(exc).__name__}: {exc}"
        outcome = broadcast(outcome, process_group)
        if outcome is not None:  # (on rank 0, leaving the block removes the staging directory)
            raise CheckpointError(f"{method}: the save across ranks failed ({outcome}); {path} is unchanged")
    return path


def _commit(path: Path, staging: Path, tables, files_by_rank: list[dict], world: int, extra_bytes) -> None:
    """Rank 0, once every rank has fsynced its files: extra, manifest last, rename into place."""
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "world_size": world,
        "tables": {},
        "extra": None,
    }
    for name, table in tables.items():
        layout = table.store.layout
        per_rank = [dict(by_rank[name], rank=r) for r, by_rank in enumerate(files_by_rank)]
        rows = sum(c["rows"] for f in per_rank for c in f["chunks"])
        manifest["tables"][name] = {
            **layout_fields(layout),
            "rows": rows,
            "checksum": CHECKSUM,
            "bucketing": {"buckets": table.buckets, "bucket_size": table.bucket_size},
            "files": per_rank,
        }
    if extra_bytes is not None:
        manifest["extra"] = files.write_extra(staging, extra_bytes)
    files.publish(staging, path, manifest=manifest)


# -- load ---------------------------------------------------------------------------------


def _files_of(table: dict) -> list[dict]:
    """A table's files, each with its chunks: version 2's list, or version 1's one file."""
    if "files" in table:
        return table["files"]
    return [{"file": table["file"], "bytes": table["bytes"], "chunks": table["chunks"]}]


def _table_read(name: str, saved: dict, buckets: int, rank: int, world: int) -> TableRead:
    """The chunks of a saved table this rank reads: version 2's chunks of the buckets it
    owns (another rank's are not even read), or every chunk of a version-1 file."""
    parts = [
        FileChunks(
            f["file"],
            f["bytes"],
            [
                (i, chunk)
                for i, chunk in enumerate(f["chunks"])
                if "bucket" not in chunk
                or owner_of_bucket(chunk["bucket"], world_size=world, total_num_buckets=buckets) == rank
            ],
        )
        for f in _files_of(saved)
    ]
    bucketing = saved.get("bucketing")
    return TableRead(
        name,
        saved["row_bytes"],
        saved.get("checksum", "crc32"),
        parts,
        None if bucketing is None else (bucketing["buckets"], bucketing["bucket_size"]),
    )


def load_sharded(
    path: str | os.PathLike,
    tables: Mapping[str, BucketedTable],
    *,
    process_group: dist.ProcessGroup | None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    manifest: dict | None = None,
) -> dict[str, object]:
    """Load this rank's share of ``tables`` from a checkpoint of any world size. Call on every
    rank (``process_group=None``: one process, which owns every id and reads every chunk).

    Version 2: only the chunks of buckets this rank owns are read. Version 1: every chunk
    is read and only owned rows are applied. ``manifest``: the checkpoint's, when the
    caller has read it already. Returns the extra state; the statistics of the load are
    in :data:`last_load_stats` (this rank's bytes and chunks read). If any rank fails,
    every rank raises and rows loaded into empty stores are removed.
    """
    method = "load_checkpoint"
    _check_tables(tables, method)
    check_chunk_bytes(method, chunk_bytes)
    path = Path(path)
    if process_group is None:  # one process: it owns every id and reads every chunk
        rank, world = 0, 1
    else:
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    stats = {"bytes_read": 0, "chunks_read": 0, "rows_loaded": 0}
    counting = threading.Lock()
    plan: list[tuple[BucketedTable, TableRead]] = []
    extra: dict[str, object] = {}
    slice_bytes = min(chunk_bytes, SLICE_BYTES)

    def prepare() -> None:
        nonlocal extra
        saved = read_manifest(path)[1] if manifest is None else manifest
        missing = [name for name in tables if name not in saved["tables"]]
        if missing:
            raise CheckpointError(
                f"{path / MANIFEST}: no table {missing[0]!r} (it has {list(saved['tables'])})"
            )
        for name, table in tables.items():
            _check_table(path, name, saved["tables"][name], table)
        extra = files.read_extra(path, saved)
        for name, table in tables.items():
            plan.append((table, _table_read(name, saved["tables"][name], table.buckets, rank, world)))

    def count(read: TableRead):
        def counted(chunk: dict, *_) -> None:
            with counting:
                stats["chunks_read"] += 1
                stats["bytes_read"] += chunk["rows"] * read.row_bytes

        return counted

    def verify() -> None:
        for _, read in plan:
            verify_table(path, read, slice_bytes, count(read))

    def apply(into_empty: bool) -> None:
        stats.update(dict.fromkeys(stats, 0))  # the figures of the pass that applies
        applying = []
        for table, read in plan:
            # A version-1 file holds every rank's rows: apply the ones this rank owns.
            keep = None if world == 1 or read.bucketing is not None else _owned_by(table, rank, world)
            applying.append((read, table.store, keep, count(read)))
        stats["rows_loaded"] = sum(
            apply_tables(path, applying, into_empty=into_empty, slice_bytes=slice_bytes)
        )

    try:
        stores = [table.store for table in tables.values()]
        load_all_or_nothing(
            stores, verify, apply, prepare=prepare, group=process_group, gather_errors=True, method=method
        )
    finally:
        _record(stats)  # also when the load fails: what this rank read before it did
    return extra


def _owned_by(table: BucketedTable, rank: int, world: int):
    return lambda ids: table.owner(ids, world) == rank


def _record(stats: dict[str, int]) -> None:
    last_load_stats.clear()
    last_load_stats.update(stats)


last_load_stats: dict[str, int] = {}
"""This process's statistics of its last ``load_sharded``, failed or not: bytes and chunks
read, rows loaded (``leanstate.last_load_stats`` is this same dict)."""


def _check_table(path: Path, name: str, saved: dict, table: BucketedTable) -> None:
    check_layout(path / MANIFEST, name, saved, table.store)
    bucketing = saved.get("bucketing")
    if bucketing is not None and (bucketing["buckets"], bucketing["bucket_size"]) != (
        table.buckets,
        table.bucket_size,
    ):
        raise CheckpointError(
            f"table {name!r} in {path / MANIFEST}: saved with "
            f"{describe_bucketing(bucketing['buckets'], bucketing['bucket_size'])}, but this module has "
            f"{describe_bucketing(table.buckets, table.bucket_size)} (build it with the same "
            "total_num_buckets and num_embeddings)"
        )


def verify_sharded(path: str | os.PathLike):
    """Check every chunk of every rank's files of a version-2 checkpoint, then the extra
    state; yield (table, file, chunk) as each passes. Raises ``CheckpointError`` at the first bad one."""
    path = Path(path)
    _, manifest = read_manifest(path)
    for name, saved in manifest["tables"].items():
        read = _table_read(name, saved, saved["bucketing"]["buckets"], 0, 1)  # one rank: every chunk
        for part in read.files:
            one_file = dataclasses.replace(read, files=[part])
            for i, _, buffer in read_chunks(path, one_file, SLICE_BYTES):
                if buffer is None:
                    yield name, part.file, i
    files.read_extra(path, manifest)


def load_into_plain(
    path: Path, manifest: dict, targets: list[Target], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> dict[str, object]:
    """Load a version-2 checkpoint (its ``manifest`` already read) into plain stores (or
    whole-row KVTensors) in one process: every rank's file is read, every row applied,
    with the same checks and all-or-nothing."""
    bucketed = {}
    for target in targets:
        if target.view is not None and target.view.read_only:
            continue  # the optimizer's view: its rows arrive inside the whole rows
        saved = manifest["tables"].get(target.name, {}).get("bucketing") or {
            "buckets": 1,
            "bucket_size": None,
        }
        bucketed[target.name] = BucketedTable(target.store, saved["buckets"], saved["bucket_size"])
    return load_sharded(path, bucketed, process_group=None, chunk_bytes=chunk_bytes, manifest=manifest)
