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
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from leanstate.reference import checkpoint as v1
from leanstate.reference.kv_store import KVStore
from leanstate.reference.row_format import RowLayout, header_words
from leanstate.reference.sharding import bucket_of, bucket_owner, describe_bucketing, owner_of_bucket

FORMAT_VERSION = 2


@dataclass(frozen=True)
class BucketedTable:
    """One table of a sharded module as a checkpoint sees it: this rank's store and the
    table's bucketing (``buckets`` buckets; chunk mode with ``bucket_size``, else interleaved)."""

    store: KVStore
    buckets: int
    bucket_size: int | None

    def owner(self, ids: torch.Tensor, world_size: int) -> torch.Tensor:
        """The rank owning each id at ``world_size``."""
        return bucket_owner(
            ids, world_size=world_size, total_num_buckets=self.buckets, bucket_size=self.bucket_size
        )

    def bucket(self, ids: torch.Tensor) -> torch.Tensor:
        """The bucket of each id."""
        return bucket_of(ids, total_num_buckets=self.buckets, bucket_size=self.bucket_size)


def _check_tables(tables: Mapping[str, BucketedTable], method: str) -> None:
    if not isinstance(tables, Mapping) or not all(isinstance(t, BucketedTable) for t in tables.values()):
        raise TypeError(
            f"{method}: with process_group, tables must be a sharded module's checkpoint_tables() "
            "(name -> BucketedTable)"
        )
    v1.targets_of({name: t.store for name, t in tables.items()}, method)  # the names' rules


def _agree(value: object, group: dist.ProcessGroup) -> object:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _write_rank_file(table: BucketedTable, file: Path, chunk_bytes: int) -> dict:
    """This rank's rows of one table, bucket-major, chunks within one bucket; the file's entry."""
    layout = table.store.layout
    rows_per_chunk = max(1, chunk_bytes // layout.row_bytes)
    keys = table.store.keys()
    buckets = table.bucket(keys)
    order = torch.argsort(buckets, stable=True)  # keys ascend: (bucket, id) order
    keys, buckets = keys[order], buckets[order]
    chunks, offset = [], 0
    with open(file, "wb") as f:
        starts = torch.cat(
            [torch.zeros(1, dtype=torch.int64), torch.nonzero(torch.diff(buckets)).flatten() + 1]
        )
        ends = torch.cat([starts[1:], torch.tensor([len(keys)])])
        for first, end in zip(starts.tolist(), ends.tolist(), strict=True):
            if first == end:
                continue
            for start in range(first, end, rows_per_chunk):
                rows = table.store.get_rows(keys[start : min(end, start + rows_per_chunk)])
                rows = rows[header_words(rows)[:, 1] < 0]  # drop ids deleted since keys() listed them
                if len(rows) == 0:
                    continue
                data = v1.row_bytes_of(rows)
                f.write(data)
                entry = v1.chunk_entry(rows, offset, v1.new_chunk_checksum(data))
                entry["bucket"] = int(buckets[first])
                chunks.append(entry)
                offset += len(data)
        f.flush()
        os.fsync(f.fileno())
    return {"file": file.name, "bytes": offset, "chunks": chunks}


def save_sharded(
    path: str | os.PathLike,
    tables: Mapping[str, BucketedTable],
    *,
    process_group: dist.ProcessGroup,
    extra: Mapping[str, object] | None = None,
    chunk_bytes: int = v1.DEFAULT_CHUNK_BYTES,
) -> Path:
    """Save every rank's share of ``tables`` into one checkpoint at ``path``. Call on every rank.

    ``extra`` is taken from rank 0. A failure on any rank fails the save on every rank
    and leaves ``path`` as it was.
    """
    method = "save_checkpoint"
    _check_tables(tables, method)
    v1.check_chunk_bytes(method, chunk_bytes)
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    path = Path(path)
    problem, staging, extra_bytes = None, None, None
    if rank == 0:
        try:
            path = v1.checked_target(path, method)
            extra_bytes = None if extra is None else v1.extra_bytes_of(extra, method)
            path.parent.mkdir(parents=True, exist_ok=True)
            v1.remove_stale_staging(path)
            staging = path.parent / f".{path.name}.saving-{secrets.token_hex(4)}"
            staging.mkdir()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
    staging, problem = _agree((staging, problem), process_group)
    if problem is not None:
        raise v1.CheckpointError(f"{method}: rank 0: {problem}; {path} is unchanged")
    files, problem = {}, None
    try:
        for name, table in tables.items():
            file = staging / f"{name}.rank{rank}.rows"
            files[name] = _write_rank_file(table, file, chunk_bytes)
    except Exception as exc:
        problem = f"rank {rank}: writing {file.name}: {type(exc).__name__}: {exc}"
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(
        (problem, files), gathered, dst=dist.get_global_rank(process_group, 0), group=process_group
    )
    outcome = None
    if rank == 0:
        outcome = next((p for p, _ in gathered if p is not None), None)
        try:
            if outcome is None:
                _commit(path, staging, tables, [f for _, f in gathered], world, extra_bytes)
        except Exception as exc:
            outcome = f"rank 0: {type(exc).__name__}: {exc}"
        if outcome is not None:
            shutil.rmtree(staging, ignore_errors=True)
    outcome = _agree(outcome, process_group)
    if outcome is not None:
        raise v1.CheckpointError(f"{method}: the save across ranks failed ({outcome}); {path} is unchanged")
    return path


def _commit(path: Path, staging: Path, tables, files_by_rank: list[dict], world: int, extra_bytes) -> None:
    """Rank 0, once every rank has fsynced its files: extra, manifest last, rename into place."""
    manifest = {
        "format": v1.FORMAT_NAME,
        "version": FORMAT_VERSION,
        "world_size": world,
        "tables": {},
        "extra": None,
    }
    for name, table in tables.items():
        layout = table.store.layout
        files = [dict(files[name], rank=r) for r, files in enumerate(files_by_rank)]
        rows = sum(c["rows"] for f in files for c in f["chunks"])
        manifest["tables"][name] = {
            "dim": layout.dim,
            "optimizer_state_dim": layout.state_dim,
            "dtype": v1.dtype_name(layout.dtype),
            "header_elems": layout.header_elems,
            "width": layout.width,
            "row_bytes": layout.row_bytes,
            "rows": rows,
            "checksum": v1.CHECKSUM,
            "bucketing": {"buckets": table.buckets, "bucket_size": table.bucket_size},
            "files": files,
        }
    if extra_bytes is not None:
        manifest["extra"] = v1.write_extra(staging, extra_bytes)
    previous = path.parent / f".{path.name}.previous-{secrets.token_hex(4)}"
    v1.publish(staging, manifest, path, previous)
    if previous.exists():
        v1.remove_checkpoint(previous)


# -- load ---------------------------------------------------------------------------------


def read_manifest_v2(path: Path) -> dict:
    """A version-1 manifest (checked by the v1 reader) or a version-2 one (checked here)."""
    file = path / v1.MANIFEST
    if not os.path.lexists(file):
        return v1.read_manifest(path)  # raises, naming what is missing
    manifest = v1.parse_manifest(file)
    if not isinstance(manifest, dict) or manifest.get("version") != FORMAT_VERSION:
        return v1.read_manifest(path)
    problem = v1.checked_problem(_manifest_problem, manifest)
    if problem is not None:
        raise v1.CheckpointError(f"{file}: {problem}")
    return manifest


def _manifest_problem(manifest: dict) -> str | None:
    if manifest.get("format") != v1.FORMAT_NAME:
        return f"format is {manifest.get('format')!r}, not {v1.FORMAT_NAME!r}"
    if not isinstance(manifest.get("tables"), dict):
        return "'tables' must be an object"
    for name, table in manifest["tables"].items():
        if not isinstance(table, dict) or not isinstance(table.get("files"), list):
            return f"tables[{name!r}] must be an object with a 'files' list"
        bucketing = table.get("bucketing")
        if not isinstance(bucketing, dict) or not v1.is_count(bucketing.get("buckets")):
            return f"tables[{name!r}].bucketing must hold a bucket count"
        total = 0
        for f in table["files"]:
            if (
                not isinstance(f, dict)
                or not v1.plain_name(f.get("file"))
                or not isinstance(f.get("chunks"), list)
            ):
                return f"tables[{name!r}].files entries must name a plain file and list its chunks"
            offset = 0
            for i, chunk in enumerate(f["chunks"]):
                keys = ("offset", "rows", "min_id", "max_id", "bucket", "crc")
                if not isinstance(chunk, dict) or not all(v1.is_count(chunk.get(k)) for k in keys):
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


def _open_checked(path: Path, name: str, f: dict):
    """A table's data file, opened only if regular and exactly the manifest's size (as the
    version-1 reader requires: no truncation, no trailing bytes)."""
    file = path / f["file"]
    handle = v1.open_regular(file, f"table {name!r}: data file")
    size = os.fstat(handle.fileno()).st_size
    if size != f["bytes"]:
        handle.close()
        raise v1.CheckpointError(
            f"table {name!r}: {file} has {size} bytes, the manifest expects {f['bytes']} "
            f"({'truncated' if size < f['bytes'] else 'trailing bytes'})"
        )
    return handle


def load_sharded(
    path: str | os.PathLike,
    tables: Mapping[str, BucketedTable],
    *,
    process_group: dist.ProcessGroup | None,
    chunk_bytes: int = v1.DEFAULT_CHUNK_BYTES,
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
    empty = all(_gathered(all(len(t.store) == 0 for t in tables.values()), process_group))
    problem, extra, plan = None, {}, []
    try:
        manifest = read_manifest_v2(path)
        missing = [name for name in tables if name not in manifest["tables"]]
        if missing:
            raise v1.CheckpointError(
                f"{path / v1.MANIFEST}: no table {missing[0]!r} (it has {list(manifest['tables'])})"
            )
        for name, table in tables.items():
            _check_table(path, name, manifest["tables"][name], table)
        extra = v1.read_extra(path, manifest)
        plan = [(name, table, manifest["tables"][name]) for name, table in tables.items()]
        if not empty:  # rows already there could not be restored: verify every chunk first
            for name, table, saved in plan:
                _load_table(path, name, table, saved, rank, world, stats, apply=False)
            stats = dict.fromkeys(stats, 0)
    except Exception as exc:
        problem = f"rank {rank}: {exc}"
    _record(stats)  # also when the load fails: what this rank read before it did
    _raise_if_any(_gathered(problem, process_group), method, undo=None, outcome="nothing was applied")
    try:
        for name, table, saved in plan:
            _load_table(path, name, table, saved, rank, world, stats, apply=True)
        problem = None
    except Exception as exc:
        problem = f"rank {rank}: {exc}"
    _record(stats)
    _raise_if_any(
        _gathered(problem, process_group),
        method,
        undo=tables.values() if empty else None,
        outcome="the stores were emptied again" if empty else "verified rows were being applied",
    )
    return extra


def _record(stats: dict[str, int]) -> None:
    last_load_stats.clear()
    last_load_stats.update(stats)


def _gathered(value, group) -> list:
    """``value`` from every rank of ``group``, in rank order."""
    if group is None:
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _raise_if_any(problems: list, method: str, *, undo, outcome: str) -> None:
    """Raise the first rank's problem on every rank, after emptying the ``undo`` stores."""
    failed = [p for p in problems if p is not None]
    if failed:
        for table in undo or ():
            table.store.delete(table.store.keys())
        raise v1.CheckpointError(f"{method}: the load across ranks failed ({outcome}): {failed[0]}")


last_load_stats: dict[str, int] = {}
"""This process's statistics of its last ``load_sharded``, failed or not: bytes and chunks
read, rows loaded (``leanstate.last_load_stats`` is this same dict)."""


def _check_table(path: Path, name: str, saved: dict, table: BucketedTable) -> None:
    v1.check_layout(path / v1.MANIFEST, name, saved, table.store)
    bucketing = saved.get("bucketing")
    if bucketing is not None and (bucketing["buckets"], bucketing["bucket_size"]) != (
        table.buckets,
        table.bucket_size,
    ):
        raise v1.CheckpointError(
            f"table {name!r} in {path / v1.MANIFEST}: saved with "
            f"{describe_bucketing(bucketing['buckets'], bucketing['bucket_size'])}, but this module has "
            f"{describe_bucketing(table.buckets, table.bucket_size)} (build it with the same "
            "total_num_buckets and num_embeddings)"
        )


def _read_chunk(handle, file: Path, index: int, chunk: dict, saved: dict, dtype: torch.dtype) -> torch.Tensor:
    """Chunk ``index`` of ``file`` as rows, its size, CRC and (version 2) bucket checked."""
    layout = RowLayout(saved["dim"], saved["optimizer_state_dim"], dtype)
    where = f"{file} chunk {index}"
    handle.seek(chunk["offset"])
    size = chunk["rows"] * layout.row_bytes
    data = handle.read(size)
    if len(data) != size:
        raise v1.CheckpointError(f"{where}: truncated ({len(data)} of {size} bytes)")
    if v1.CHECKSUMS[saved.get("checksum", "crc32")](data, 0) != chunk["crc"]:
        raise v1.CheckpointError(f"{where}: checksum mismatch")
    rows = torch.frombuffer(bytearray(data), dtype=dtype).view(chunk["rows"], layout.width)
    ids = header_words(rows)[:, 0]
    # the reader rules of every path: ids strictly ascending within a chunk, and the manifest's range
    if bool((ids[1:] <= ids[:-1]).any()) or (int(ids[0]), int(ids[-1])) != (chunk["min_id"], chunk["max_id"]):
        raise v1.CheckpointError(
            f"{where}: its ids do not strictly ascend from {chunk['min_id']} to {chunk['max_id']}; the file is corrupt"
        )
    if "bucket" in chunk:
        bucketing = saved["bucketing"]
        buckets = bucket_of(
            header_words(rows)[:, 0],
            total_num_buckets=bucketing["buckets"],
            bucket_size=bucketing["bucket_size"],
        )
        if not bool((buckets == chunk["bucket"]).all()):
            raise v1.CheckpointError(f"{where}: holds ids outside bucket {chunk['bucket']}")
    return rows


def _load_table(path, name, table: BucketedTable, saved: dict, rank, world, stats, *, apply: bool) -> None:
    for f in _files_of(saved):
        file = path / f["file"]
        with _open_checked(path, name, f) as handle:
            for i, chunk in enumerate(f["chunks"]):
                if "bucket" in chunk and (
                    owner_of_bucket(chunk["bucket"], world_size=world, total_num_buckets=table.buckets)
                    != rank
                ):
                    continue  # another rank's bucket: not even read
                rows = _read_chunk(handle, file, i, chunk, saved, table.store.layout.dtype)
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
        dtype = v1.DTYPES[saved["dtype"]]
        for f in _files_of(saved):
            with _open_checked(path, name, f) as handle:
                for i, chunk in enumerate(f["chunks"]):
                    _read_chunk(handle, path / f["file"], i, chunk, saved, dtype)
                    yield name, f["file"], i
    v1.read_extra(path, manifest)


def load_into_plain(path: str | os.PathLike, tables: Mapping[str, KVStore], **kwargs) -> dict[str, object]:
    """Load a version-2 checkpoint into plain stores (or whole-row KVTensors) in one process:
    every rank's file is read, every row applied, with the same checks and all-or-nothing."""
    manifest = read_manifest_v2(Path(path))
    bucketed = {}
    for target in v1.targets_of(tables, "load_checkpoint"):
        if target.view is not None and target.view.read_only:
            continue  # the optimizer's view: its rows arrive inside the whole rows
        saved = manifest["tables"].get(target.name, {}).get("bucketing") or {
            "buckets": 1,
            "bucket_size": None,
        }
        bucketed[target.name] = BucketedTable(target.store, saved["buckets"], saved["bucket_size"])
    return load_sharded(path, bucketed, process_group=None, **kwargs)
