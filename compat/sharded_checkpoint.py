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

import os
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from leanstate import _checkpoint_files as files
from leanstate._checkpoint_chunks import chunk_slices, describe_chunk, open_data_file, write_store
from leanstate._checkpoint_format import (
    CHECKSUM,
    DEFAULT_CHUNK_BYTES,
    DTYPES,
    MANIFEST,
    check_chunk_bytes,
    check_layout,
    checked_problem,
    extra_problem,
    is_count,
    layout_fields,
    plain_name,
    saved_across_ranks,
    targets_of,
)
from leanstate._checkpoint_ranks import broadcast, from_every_rank, staged_by_rank_0
from leanstate.reference.checkpoint import FORMAT_NAME, CheckpointError
from leanstate.reference.kv_store import SupportsRows
from leanstate.reference.row_format import header_words
from leanstate.reference.sharding import BucketedTable, bucket_of, describe_bucketing, owner_of_bucket

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


def read_manifest_v2(path: Path) -> dict:
    """A version-1 manifest (checked by the v1 reader) or a version-2 one (checked here)."""
    file = path / MANIFEST
    if not os.path.lexists(file):
        return files.read_manifest(path)  # raises, naming what is missing
    manifest = files.parse_manifest(file)
    if not saved_across_ranks(manifest):
        return files.read_manifest(path)
    problem = checked_problem(_manifest_problem, manifest)
    if problem is not None:
        raise CheckpointError(f"{file}: {problem}")
    return manifest


def _manifest_problem(manifest: dict) -> str | None:
    missing = [key for key in ("format", "version", "world_size", "tables", "extra") if key not in manifest]
    if missing:
        return f"the required key {missing[0]!r} is missing"
    if manifest.get("format") != FORMAT_NAME:
        return f"format is {manifest.get('format')!r}, not {FORMAT_NAME!r}"
    if not isinstance(manifest.get("tables"), dict):
        return "'tables' must be an object"
    problem = extra_problem(manifest["extra"])
    if problem is not None:
        return problem
    for name, table in manifest["tables"].items():
        if not isinstance(table, dict) or not isinstance(table.get("files"), list):
            return f"tables[{name!r}] must be an object with a 'files' list"
        bucketing = table.get("bucketing")
        if not isinstance(bucketing, dict) or not is_count(bucketing.get("buckets")):
            return f"tables[{name!r}].bucketing must hold a bucket count"
        total = 0
        for f in table["files"]:
            if (
                not isinstance(f, dict)
                or not plain_name(f.get("file"))
                or not isinstance(f.get("chunks"), list)
            ):
                return f"tables[{name!r}].files entries must name a plain file and list its chunks"
            offset = 0
            for i, chunk in enumerate(f["chunks"]):
                keys = ("offset", "rows", "min_id", "max_id", "bucket", "crc")
                if not isinstance(chunk, dict) or not all(is_count(chunk.get(k)) for k in keys):
                    return f"{f['file']} chunk {i}: needs non-negative integers {', '.join(keys)}"
                if chunk["offset"] != offset:
                    return f"{f['file']} chunk {i}: offset {chunk['offset']}, expected {offset} (contiguous)"
                offset += chunk["rows"] * table.get("row_bytes", 0)
                total += chunk["rows"]
            if f.get("bytes") != offset:
                return f"{f['file']}: bytes {f.get('bytes')} but its chunks cover {offset}"
        if table.get("rows") != total:
            return f"tables[{name!r}]: rows {table.get('rows')} but its chunks hold {total}"
    return None


def _files_of(table: dict) -> list[dict]:
    """A table's files, each with its chunks: version 2's list, or version 1's one file."""
    if "files" in table:
        return table["files"]
    return [{"file": table["file"], "bytes": table["bytes"], "chunks": table["chunks"]}]


def load_sharded(
    path: str | os.PathLike,
    tables: Mapping[str, BucketedTable],
    *,
    process_group: dist.ProcessGroup | None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict[str, object]:
    """Load this rank's share of ``tables`` from a checkpoint of any world size. Call on every
    rank (``process_group=None``: one process, which owns every id and reads every chunk).

    Version 2: only the chunks of buckets this rank owns are read. Version 1: every chunk
    is read and only owned rows are applied. Returns the extra state; the statistics of
    the load are in :data:`last_load_stats` (this rank's bytes and chunks read). If any
    rank fails, every rank raises and rows loaded into empty stores are removed.
    """
    method = "load_checkpoint"
    _check_tables(tables, method)
    path = Path(path)
    if process_group is None:  # one process: it owns every id and reads every chunk
        rank, world = 0, 1
    else:
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    stats = {"bytes_read": 0, "chunks_read": 0, "rows_loaded": 0}
    # Every rank takes the same path: one pass when every store on every rank is empty
    # (a failure empties them again), else verify everywhere, agree, then apply.
    empty = all(from_every_rank(all(len(t.store) == 0 for t in tables.values()), process_group))
    problem, extra, plan = None, {}, []
    try:
        manifest = read_manifest_v2(path)
        missing = [name for name in tables if name not in manifest["tables"]]
        if missing:
            raise CheckpointError(
                f"{path / MANIFEST}: no table {missing[0]!r} (it has {list(manifest['tables'])})"
            )
        for name, table in tables.items():
            _check_table(path, name, manifest["tables"][name], table)
        extra = files.read_extra(path, manifest)
        plan = [(name, table, manifest["tables"][name]) for name, table in tables.items()]
        if not empty:  # rows already there could not be restored: verify every chunk first
            for name, table, saved in plan:
                _load_table(path, name, table, saved, rank, world, stats, apply=False)
            stats = dict.fromkeys(stats, 0)
    except Exception as exc:
        problem = f"rank {rank}: {exc}"
    _record(stats)  # also when the load fails: what this rank read before it did
    _raise_if_any(from_every_rank(problem, process_group), method, undo=None, outcome="nothing was applied")
    try:
        for name, table, saved in plan:
            _load_table(path, name, table, saved, rank, world, stats, apply=True)
        problem = None
    except Exception as exc:
        problem = f"rank {rank}: {exc}"
    _record(stats)
    _raise_if_any(
        from_every_rank(problem, process_group),
        method,
        undo=tables.values() if empty else None,
        outcome="the stores were emptied again" if empty else "verified rows were being applied",
    )
    return extra


def _record(stats: dict[str, int]) -> None:
    last_load_stats.clear()
    last_load_stats.update(stats)


def _raise_if_any(problems: list, method: str, *, undo, outcome: str) -> None:
    """Raise the first rank's problem on every rank, after emptying the ``undo`` stores."""
    failed = [p for p in problems if p is not None]
    if failed:
        for table in undo or ():
            table.store.delete(table.store.keys())
        raise CheckpointError(f"{method}: the load across ranks failed ({outcome}): {failed[0]}")


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


def _read_chunk(
    handle, name: str, file: Path, index: int, chunk: dict, saved: dict, dtype: torch.dtype
) -> torch.Tensor:
    """Chunk ``index`` of ``file`` as rows: its size, CRC, ascending ids and (version 2)
    bucket checked."""
    row_bytes = saved["row_bytes"]
    buffer = bytearray(chunk["rows"] * row_bytes)  # the whole chunk: one slice
    where = describe_chunk(name, file, index, chunk, row_bytes)
    for _ in chunk_slices(handle, where, chunk, row_bytes, saved.get("checksum", "crc32"), buffer):
        pass
    rows = torch.frombuffer(buffer, dtype=dtype).view(chunk["rows"], -1)
    if "bucket" in chunk:
        bucketing = saved["bucketing"]
        buckets = bucket_of(
            header_words(rows)[:, 0],
            total_num_buckets=bucketing["buckets"],
            bucket_size=bucketing["bucket_size"],
        )
        if not bool((buckets == chunk["bucket"]).all()):
            raise CheckpointError(f"{where}: holds ids outside bucket {chunk['bucket']}")
    return rows


def _load_table(path, name, table: BucketedTable, saved: dict, rank, world, stats, *, apply: bool) -> None:
    for f in _files_of(saved):
        file = path / f["file"]
        with open_data_file(path, name, f["file"], f["bytes"]) as handle:
            for i, chunk in enumerate(f["chunks"]):
                if "bucket" in chunk and (
                    owner_of_bucket(chunk["bucket"], world_size=world, total_num_buckets=table.buckets)
                    != rank
                ):
                    continue  # another rank's bucket: not even read
                rows = _read_chunk(handle, name, file, i, chunk, saved, table.store.layout.dtype)
                stats["bytes_read"] += rows.numel() * rows.element_size()
                stats["chunks_read"] += 1
                if apply:
                    rows = rows[table.owner(header_words(rows)[:, 0], world) == rank]
                    table.store.set_rows(rows)
                    stats["rows_loaded"] += len(rows)


def verify_sharded(path: str | os.PathLike):
    """Check every chunk of every rank's files of a version-2 checkpoint, then the extra
    state; yield (table, file, chunk) as each passes. Raises ``CheckpointError`` at the first bad one."""
    path = Path(path)
    manifest = read_manifest_v2(path)
    for name, saved in manifest["tables"].items():
        dtype = DTYPES[saved["dtype"]]
        for f in _files_of(saved):
            with open_data_file(path, name, f["file"], f["bytes"]) as handle:
                for i, chunk in enumerate(f["chunks"]):
                    _read_chunk(handle, name, path / f["file"], i, chunk, saved, dtype)
                    yield name, f["file"], i
    files.read_extra(path, manifest)


def load_into_plain(
    path: str | os.PathLike, tables: Mapping[str, SupportsRows], **kwargs
) -> dict[str, object]:
    """Load a version-2 checkpoint into plain stores (or whole-row KVTensors) in one process:
    every rank's file is read, every row applied, with the same checks and all-or-nothing."""
    manifest = read_manifest_v2(Path(path))
    bucketed = {}
    for target in targets_of(tables, "load_checkpoint"):
        if target.view is not None and target.view.read_only:
            continue  # the optimizer's view: its rows arrive inside the whole rows
        saved = manifest["tables"].get(target.name, {}).get("bucketing") or {
            "buckets": 1,
            "bucket_size": None,
        }
        bucketed[target.name] = BucketedTable(target.store, saved["buckets"], saved["bucket_size"])
    return load_sharded(path, bucketed, process_group=None, **kwargs)
