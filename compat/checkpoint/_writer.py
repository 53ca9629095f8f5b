"""The one writer of a checkpoint: full or delta, saved by one process (version 1) or
across ranks (version 2).

:func:`write_checkpoint` does what every save does in one order: each store's epoch (and,
for a delta, its changes since its mark) captured before any row is read, so that later
writes belong to the next save; the files staged; the manifest published last; the
marks moved once it is published (``set_marks``). What the versions write differently
is a *layout*:

- :class:`OneProcess` (version 1): a file per table in ascending ids, a delta's removed
  ids ascending; staged and published by this process;
- :class:`AcrossRanks` (version 2, ``spec/sharding.md``): a file per table per rank,
  bucket-major, a delta's removed ids too; rank 0 stages, every rank writes and fsyncs
  its files, rank 0 gathers their entries and publishes, and every rank learns the
  outcome (a failure anywhere fails the save everywhere).

The callers check their arguments and a delta's base first (``save_checkpoint``,
``_chain.delta_base``, ``sharded.save_sharded``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from leanstate.checkpoint._bucketed_table import BucketedTable
from leanstate.checkpoint._chain import set_marks
from leanstate.checkpoint._chunks import bucket_major, write_store
from leanstate.checkpoint._files import extra_bytes_of, publish, staged, write_extra
from leanstate.checkpoint._format import (
    ACROSS_RANKS_VERSION,
    CHECKSUM,
    DELTA_FORMAT,
    FORMAT_NAME,
    FORMAT_VERSION,
    REMOVED_SUFFIX,
    Progress,
    layout_fields,
    table_entry,
)
from leanstate.checkpoint._merge import write_removed
from leanstate.checkpoint._ranks import broadcast, staged_by_rank_0
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.kv_store import SupportsRows

Changes = Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # per table: (written ids, removed ids)


class Layout(Protocol):
    """How one version stages, writes and publishes a checkpoint."""

    def staged(self, path: Path, method: str) -> AbstractContextManager[Path]: ...

    def write_tables(self, staging: Path, stores: Mapping[str, SupportsRows], changes: Changes | None): ...

    def publish(self, path: Path, staging: Path, written, base: dict | None, method: str) -> str: ...


def write_checkpoint(
    path: Path, stores: Mapping[str, SupportsRows], layout: Layout, *, base: dict | None, method: str
) -> Path:
    """The one writer: a full checkpoint of ``stores`` (``base`` None: every row) or a delta
    (``base``, the delta's ``{path, manifest_sha256}`` entry, checked by the caller: each
    store's rows written and ids removed since its mark), written as ``layout`` writes
    it, published atomically; then every store's mark is at it."""
    epochs, changes = {}, None if base is None else {}
    for name, store in stores.items():  # before any row is read: later writes go to the next save
        epochs[name] = store.next_epoch()
        if changes is not None:
            changes[name] = store.changes(since=store.mark.epoch)
    with layout.staged(path, method) as staging:
        digest = layout.publish(path, staging, layout.write_tables(staging, stores, changes), base, method)
    set_marks(list(stores.values()), digest, [epochs[name] for name in stores])
    return path


def publish_manifest(staging: Path, path: Path, manifest: dict, extra_bytes: bytes | None) -> str:
    """The extra state (if any) into ``staging``, then ``manifest`` last and the rename to
    ``path``; the SHA-256 of the manifest's bytes (what a save's change marks name)."""
    if extra_bytes is not None:
        manifest["extra"] = write_extra(staging, extra_bytes)
    data = json.dumps(manifest, indent=1).encode()
    publish(staging, path, manifest=data)
    return hashlib.sha256(data).hexdigest()


def _gone(removed: torch.Tensor, dropped: list[torch.Tensor]) -> torch.Tensor:
    """A delta's removed ids: those removed since the mark and those deleted while saving,
    each once, ascending."""
    return torch.unique(torch.cat([removed.cpu(), *dropped]))


class OneProcess:
    """Version 1: ``<table>.rows`` per table, ascending ids (``spec/checkpoint_format.md``);
    ``views`` and ``extra_bytes`` as the caller checked them."""

    def __init__(
        self,
        views: dict,
        extra_bytes: bytes | None,
        *,
        chunk_bytes: int,
        pipelined: bool,
        progress: Progress | None,
    ) -> None:
        self.views, self.extra_bytes, self.chunk_bytes = views, extra_bytes, chunk_bytes
        self.pipelined, self.progress = pipelined, progress

    def staged(self, path: Path, method: str) -> AbstractContextManager[Path]:
        return staged(path, method)

    def write_tables(
        self, staging: Path, stores: Mapping[str, SupportsRows], changes: Changes | None
    ) -> dict:
        """Each table's manifest entry, its file (and a delta's removed ids) written."""
        entries = {}
        for name, store in stores.items():
            file = staging / f"{name}.rows"
            dropped: list[torch.Tensor] | None = None if changes is None else []
            report = (
                None if self.progress is None else (lambda done, total, n=name: self.progress(n, done, total))
            )
            chunks = write_store(
                store,
                file,
                self.chunk_bytes,
                keys=None if changes is None else changes[name][0],
                dropped=dropped,
                pipelined=self.pipelined,
                progress=report,
            )
            entries[name] = table_entry(store.layout, file, chunks)
            if changes is not None:
                gone = _gone(changes[name][1], dropped).numpy()
                entries[name]["removed"] = write_removed(staging / f"{name}{REMOVED_SUFFIX}", gone)
        return entries

    def publish(self, path: Path, staging: Path, written: dict, base: dict | None, method: str) -> str:
        manifest = {
            "format": FORMAT_NAME if base is None else DELTA_FORMAT,
            "version": FORMAT_VERSION,
            **({} if base is None else {"base": base}),
            "tables": written,
            "views": self.views,
            "extra": None,
        }
        return publish_manifest(staging, path, manifest, self.extra_bytes)


class AcrossRanks:
    """Version 2: ``<table>.rank<r>.rows`` per table on each rank of ``group``, bucket-major
    in chunks within one bucket (``spec/sharding.md``); ``extra`` is rank 0's, serialised
    (and checked) by rank 0, with ``checked_target(path)``, before any rank writes."""

    def __init__(
        self,
        tables: Mapping[str, BucketedTable],
        group: dist.ProcessGroup,
        extra: Mapping[str, object] | None,
        *,
        chunk_bytes: int,
        checked_target: Callable[[], Path],
    ) -> None:
        self.tables, self.group, self.extra, self.chunk_bytes = tables, group, extra, chunk_bytes
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._checked_target, self._extra_bytes = checked_target, None

    def _prepare(self) -> Path:
        # rank 0, before the staging directory is made; as in version 1, extra before the path
        if self.extra is not None:
            self._extra_bytes = extra_bytes_of(self.extra, "save_checkpoint")
        return self._checked_target()

    def staged(self, path: Path, method: str) -> AbstractContextManager[Path]:
        return staged_by_rank_0(path, method, self.group, self._prepare)

    def write_tables(
        self, staging: Path, stores: Mapping[str, SupportsRows], changes: Changes | None
    ) -> tuple[str | None, dict]:
        """This rank's file entry of each table, and what went wrong writing them (None)."""
        written, problem = {}, None
        try:
            for name in stores:
                file = staging / f"{name}.rank{self.rank}.rows"
                written[name] = self._write_file(name, file, None if changes is None else changes[name])
        except Exception as exc:  # every rank must reach the gather: the save fails on all of them
            problem = f"rank {self.rank}: writing {file.name}: {type(exc).__name__}: {exc}"
        return problem, written

    def _write_file(self, name: str, file: Path, changes: tuple[torch.Tensor, torch.Tensor] | None) -> dict:
        table = self.tables[name]
        bucketing = (table.buckets, table.bucket_size)
        keys, dropped = (None, None) if changes is None else (changes[0], [])
        chunks = write_store(
            table.store, file, self.chunk_bytes, keys=keys, dropped=dropped, bucketing=bucketing
        )
        row_bytes = table.store.layout.row_bytes
        entry = {"file": file.name, "bytes": sum(c["rows"] for c in chunks) * row_bytes, "chunks": chunks}
        if changes is not None:
            removed = file.with_name(file.name.removesuffix(".rows") + REMOVED_SUFFIX)
            entry["removed"] = write_removed(
                removed, bucket_major(_gone(changes[1], dropped), bucketing)[0].numpy()
            )
        return entry

    def publish(
        self, path: Path, staging: Path, written: tuple[str | None, dict], base: dict | None, method: str
    ) -> str:
        """Every rank's entries gathered on rank 0, which publishes (extra, manifest last,
        the rename); the manifest's SHA-256 on every rank, or the first failure on all."""
        gathered = [None] * self.world if self.rank == 0 else None
        root = dist.get_global_rank(self.group, 0)
        dist.gather_object(written, gathered, dst=root, group=self.group)
        outcome, digest = None, None
        if self.rank == 0:
            outcome = next((problem for problem, _ in gathered if problem is not None), None)
            try:
                if outcome is None:
                    digest = self._commit(path, staging, [entries for _, entries in gathered], base)
            except Exception as exc:
                outcome = f"rank 0: {type(exc).__name__}: {exc}"
        outcome, digest = broadcast((outcome, digest), self.group)
        if outcome is not None:  # (on rank 0, leaving the block removes the staging directory)
            raise CheckpointError(f"{method}: the save across ranks failed ({outcome}); {path} is unchanged")
        return digest

    def _commit(self, path: Path, staging: Path, by_rank: list[dict], base: dict | None) -> str:
        manifest = new_manifest(self.world, base)
        for name, table in self.tables.items():
            bucketing = (table.buckets, table.bucket_size)
            manifest["tables"][name] = sharded_table_entry(
                table.store.layout, bucketing, [entries[name] for entries in by_rank]
            )
        return publish_manifest(staging, path, manifest, self._extra_bytes)


def new_manifest(world: int, delta: dict | None = None) -> dict:
    """A version-2 manifest of ``world`` ranks (a delta's with its ``base`` entry), its
    tables and extra still to fill in: the keys in the order every save writes them."""
    return {
        "format": FORMAT_NAME if delta is None else DELTA_FORMAT,
        "version": ACROSS_RANKS_VERSION,
        "world_size": world,
        **({} if delta is None else {"base": delta}),
        "tables": {},
        "extra": None,
    }


def _file_entry(written: dict, rank: int) -> dict:
    """A rank's file entry in the manifest: file, bytes, chunks, rank (and a delta's removed)."""
    entry = {key: written[key] for key in ("file", "bytes", "chunks")}
    entry["rank"] = rank
    if "removed" in written:
        entry["removed"] = written["removed"]
    return entry


def sharded_table_entry(layout, bucketing: tuple[int, int | None], written_by_rank: list[dict]) -> dict:
    """A table's version-2 manifest entry from each rank's file entry (rank order)."""
    per_rank = [_file_entry(written, r) for r, written in enumerate(written_by_rank)]
    return {
        **layout_fields(layout),
        "rows": sum(c["rows"] for f in per_rank for c in f["chunks"]),
        "checksum": CHECKSUM,
        "bucketing": {"buckets": bucketing[0], "bucket_size": bucketing[1]},
        "files": per_rank,
    }
