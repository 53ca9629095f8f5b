"""Whole-row checkpoints across ranks (format version 2): bucket-major, one file per rank.

Every rank writes the rows it owns, per table, to ``<table>.rank<r>.rows`` in one
checkpoint directory, bucket-major (ascending bucket, then id), in chunks that never
span two buckets; rank 0 writes the manifest last, after every rank has fsynced, then
renames the directory into place (``spec/sharding.md``). Loading at any world size,
each rank reads only the chunks of the buckets it owns there, each one CRC-checked
before its rows are applied. A version-1 checkpoint (one process, ascending ids) loads
too: each rank then reads every chunk and keeps the rows it owns.

A *delta* (``base=``) holds, per rank, only the rows its stores wrote and the ids they
removed since their change marks (at ``base``), bucket-major too; a load of a delta
loads its whole chain, each rank reading from every link only the chunks and removed
ids of the buckets it owns (``spec/sharding.md``, "Delta checkpoints across ranks").
``_compaction.compact_sharded`` (``leanstate.compact_checkpoint`` of such a chain) merges it in
one process into the full checkpoint a save at the head's world size would write.

Example (on every rank)::

    >>> save_checkpoint("ckpt", ebc.checkpoint_tables(), extra=ebc.extra_state(), process_group=group)
    >>> save_checkpoint("ckpt-1", ebc.checkpoint_tables(), process_group=group, base="ckpt")
    >>> load_checkpoint("ckpt-1", fresh.checkpoint_tables(), process_group=group)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from leanstate.checkpoint import _files as files
from leanstate.checkpoint._arguments import Target, check_layout, targets_of
from leanstate.checkpoint._bucketed_table import BucketedTable, describe_bucketing
from leanstate.checkpoint._chain import (
    ChainLoad,
    ChainTable,
    base_chain,
    chain_extra,
    check_delta_base,
    last_load_stats,  # noqa: F401 - the same dict, by the name users import from here
    read_chain,
    record_stats,
    set_marks,
)
from leanstate.checkpoint._chunks import TableRead, buckets_of, read_chunks
from leanstate.checkpoint._files import read_manifest
from leanstate.checkpoint._format import (
    ACROSS_RANKS_VERSION,
    DEFAULT_CHUNK_BYTES,
    MANIFEST,
    SLICE_BYTES,
    check_chunk_bytes,
)
from leanstate.checkpoint._load import load_all_or_nothing
from leanstate.checkpoint._merge import LinkTable
from leanstate.checkpoint._ranks import from_every_rank
from leanstate.checkpoint._writer import AcrossRanks, write_checkpoint
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.sharding import bucket_range, owner_of_bucket

FORMAT_VERSION = ACROSS_RANKS_VERSION


def check_sharded_tables(tables: Mapping[str, BucketedTable], method: str) -> None:
    if not isinstance(tables, Mapping) or not all(isinstance(t, BucketedTable) for t in tables.values()):
        raise TypeError(
            f"{method}: with process_group, tables must be a sharded module's checkpoint_tables() "
            "(name -> BucketedTable)"
        )
    targets_of({name: t.store for name, t in tables.items()}, method)  # the names' rules


def _delta_base(path: Path, base: Path, tables: Mapping[str, BucketedTable]) -> dict:
    """A delta's ``base`` entry (``{path, manifest_sha256}``), once ``base`` is a version-2
    checkpoint with ``tables``' names, layouts and bucketing, and every store's change mark
    is at it; else a ``ValueError`` naming the table (as this rank sees it)."""
    links = base_chain(Path(base), "save_checkpoint")
    version, manifest, digest = links[0].version, links[0].manifest, links[0].digest
    if version != 2:
        raise ValueError(
            f"base {base} was saved by one process (version 1); a delta across ranks needs a version-2 "
            "base: save a full checkpoint with process_group first"
        )
    stores = {name: table.store for name, table in tables.items()}

    def matches(name: str) -> None:
        check_table(Path(base), name, manifest["tables"][name], tables[name])

    check_delta_base(Path(path), links, stores, matches)
    return {"path": Path(os.path.relpath(base, path)).as_posix(), "manifest_sha256": digest}


def save_sharded(
    path: str | os.PathLike,
    tables: Mapping[str, BucketedTable],
    *,
    process_group: dist.ProcessGroup,
    extra: Mapping[str, object] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    base: str | os.PathLike | None = None,
) -> Path:
    """Save every rank's share of ``tables`` into one checkpoint at ``path``. Call on every rank.

    ``extra`` is taken from rank 0. A failure on any rank fails the save on every rank
    and leaves ``path`` as it was. ``base``: save a delta of that version-2 checkpoint
    (the rows written and ids removed since each store's change mark, which must be at
    ``base``; checked on every rank, refused on every rank if any fails). Once the save
    is published, every store's mark is at it.
    """
    method = "save_checkpoint"
    check_sharded_tables(tables, method)
    check_chunk_bytes(method, chunk_bytes)
    if base is not None and not isinstance(base, str | os.PathLike):
        raise TypeError(f"{method}: base must be the path of a checkpoint (str or os.PathLike); got {base!r}")
    rank = dist.get_rank(process_group)
    path = Path(path)
    delta, problem = None, None
    if base is not None:
        try:
            delta = _delta_base(path, Path(base), tables)
        except ValueError as exc:
            problem = f"rank {rank}: {exc}"
        except Exception as exc:  # (an unreadable base, say): every rank must reach the agreement
            problem = f"rank {rank}: base {base}: {type(exc).__name__}: {exc}"
        failed = [p for p in from_every_rank(problem, process_group) if p is not None]
        if failed:  # every rank refuses, naming the first rank that found a problem
            raise ValueError(f"{method}: the delta cannot be saved: {failed[0]}")
    stores = {name: table.store for name, table in tables.items()}
    layout = AcrossRanks(
        tables,
        process_group,
        extra,
        chunk_bytes=chunk_bytes,
        checked_target=lambda: files.checked_target(path, method),
    )
    return write_checkpoint(path, stores, layout, base=delta, method=method)


# -- load ---------------------------------------------------------------------------------


def load_sharded(
    path: str | os.PathLike,
    tables: Mapping[str, BucketedTable],
    *,
    process_group: dist.ProcessGroup | None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    head: tuple[dict, str] | None = None,
) -> tuple[dict[str, object], dict[str, int]]:
    """Load this rank's share of ``tables`` from a checkpoint of any world size. Call on every
    rank (``process_group=None``: one process, which owns every id and reads every chunk).

    Version 2: only the chunks of buckets this rank owns are read. Version 1: every chunk
    is read and only owned rows are applied. A delta loads its whole chain: from every
    link the same chunks, and the removed ids of the buckets this rank owns. ``head``:
    the checkpoint's manifest and its digest, when the caller has read them already.
    Returns the extra state and the statistics of the load (this rank's bytes and chunks
    read, rows loaded; also in ``last_load_stats``, failed or not). If any rank fails, every rank raises and rows
    loaded into empty stores are removed. After a load into stores empty on every rank,
    each store's change mark is at the loaded checkpoint; any other load leaves the marks
    where they were (every row it wrote is a change tracked since them).
    """
    method = "load_checkpoint"
    check_sharded_tables(tables, method)
    check_chunk_bytes(method, chunk_bytes)
    path = Path(path)
    if process_group is None:  # one process: it owns every id and reads every chunk
        rank, world = 0, 1
    else:
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    links: list = []  # head first
    loads: list = []  # the chain load this rank runs, once prepared
    extra: dict[str, object] = {}

    def prepare() -> None:
        nonlocal extra
        links.extend(read_chain(path, head=head))  # head first
        for link in links:
            missing = [name for name in tables if name not in link.manifest["tables"]]
            if missing:
                raise CheckpointError(
                    f"{link.file}: no table {missing[0]!r} (it has {list(link.manifest['tables'])})"
                )
            for name, table in tables.items():
                check_table(link.path, name, link.manifest["tables"][name], table)
        extra = chain_extra(links)
        plan = []
        for name, table in tables.items():
            parts = [link_table(link, name, table, rank, world) for link in reversed(links)]
            plan.append(ChainTable(table.store, parts, rows_kept(table, parts[0].read, rank, world)))
        loads.append(ChainLoad(links, plan, min(chunk_bytes, SLICE_BYTES)))

    try:
        stores = [table.store for table in tables.values()]
        empty = load_all_or_nothing(
            stores,
            lambda: loads[0].verify(),
            lambda into_empty: loads[0].apply(into_empty),
            prepare=prepare,
            group=process_group,
            gather_errors=True,
            method=method,
        )
    finally:  # also when the load fails: what this rank read before it did
        stats = record_stats(loads[0] if loads else None)
    if empty:  # each rank's stores now are its share of the head: deltas can follow it
        set_marks(stores, links[0].digest)
    return extra, stats


def link_table(link, name: str, table: BucketedTable, rank: int, world: int):
    """What this rank reads of one table in one link: the chunks of the buckets it owns
    (every chunk of version 1), and a delta's removed-id files that may hold ids of its
    buckets (a file is bucket-major: its buckets run from its first id's to its last's)."""
    saved = link.manifest["tables"][name]
    read = TableRead.of_saved(name, saved, rank, world)
    if not link.delta:
        return LinkTable(link.path, read)
    if link.version == 1:
        removed = (saved["removed"],)
    else:
        first, end = bucket_range(rank, world, table.buckets)
        removed = []
        for entry in saved["files"]:
            ends = entry["removed"]
            if ends["ids"]:
                buckets = table.bucket(torch.tensor([ends["min_id"], ends["max_id"]])).tolist()
                if min(buckets) < end and max(buckets) >= first:
                    removed.append(ends)
        removed = tuple(removed)
    keep = None if world == 1 else _owned_ids(table, rank, world)
    return LinkTable(link.path, read, removed, keep)


def _owned_ids(table: BucketedTable, rank: int, world: int):
    """Which ids (a numpy array) of ``table`` this rank owns, as a numpy mask."""
    bucketing = (table.buckets, table.bucket_size)

    def owned(ids):
        buckets = buckets_of(ids, bucketing)
        return owner_of_bucket(buckets, world_size=world, total_num_buckets=table.buckets) == rank

    return owned


def rows_kept(table: BucketedTable, read: TableRead, rank: int, world: int):
    """Which rows of a slice this rank applies: all of a version-2 chunk of a bucket it owns;
    of a version-1 file (every rank's rows), the ones it owns."""
    return None if world == 1 or read.bucketing is not None else _owned_by(table, rank, world)


def _owned_by(table: BucketedTable, rank: int, world: int):
    return lambda ids: table.owner(ids, world) == rank


def check_table(path: Path, name: str, saved: dict, table: BucketedTable) -> None:
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
        read = TableRead.of_saved(name, saved)  # one rank: every chunk
        for part in read.files:
            one_file = dataclasses.replace(read, files=[part])
            for i, _, buffer in read_chunks(path, one_file, SLICE_BYTES):
                if buffer is None:
                    yield name, part.file, i
    files.read_extra(path, manifest)


def load_into_plain(
    path: Path,
    manifest: dict,
    digest: str,
    targets: list[Target],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[dict[str, object], dict[str, int]]:
    """Load a version-2 checkpoint or chain (its head's ``manifest`` and ``digest`` already
    read) into plain stores (or whole-row KVTensors) in one process: every rank's file of
    every link is read, every row applied, with the same checks and all-or-nothing. The
    extra state and the load's statistics."""
    bucketed = {}
    for target in targets:
        if target.view is not None and target.view.read_only:
            continue  # the optimizer's view: its rows arrive inside the whole rows
        saved = manifest["tables"].get(target.name, {}).get("bucketing") or {
            "buckets": 1,
            "bucket_size": None,
        }
        bucketed[target.name] = BucketedTable(target.store, saved["buckets"], saved["bucket_size"])
    return load_sharded(path, bucketed, process_group=None, chunk_bytes=chunk_bytes, head=(manifest, digest))
