"""``leanstate.save_checkpoint`` / ``load_checkpoint``: the hardened whole-row checkpoint I/O.

The format is ``leanstate.reference.checkpoint`` (``spec/checkpoint_format.md``); this
is its production implementation, held to the reference by differential tests
(byte-identical files, identical loads, the same error classes). Over the reference it
adds: a locked staging directory that a crash never leaves at ``path`` and a later save
cleans up; regular files only, sizes checked before allocation; a pipelined writer
(the gather of the next chunk overlaps the write of this one); a one-pass load into
empty stores (undone on failure) and a verify-first load into live ones with Ctrl-C
deferred while rows are applied; ``progress`` callbacks; and version 2 (sharded, with
``process_group=``, ``leanstate.sharded_checkpoint``).

Every store backend is written and read through the stores' public methods (``keys``,
``get_rows(..., out=)``, ``set_rows``, ``reserve``), so a checkpoint saved from a store
of one backend loads bit for bit into a store of any other, on any device.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

from leanstate._checkpoint_chunks import TableRead, read_chunks, write_store
from leanstate._checkpoint_files import (
    checked_target,
    extra_bytes_of,
    publish,
    read_extra,
    read_manifest,
    staged,
    write_extra,
)
from leanstate._checkpoint_format import (
    DEFAULT_CHUNK_BYTES,
    SLICE_BYTES,
    Progress,
    Target,
    check_chunk_bytes,
    check_id_range,
    check_layout,
    chunks_in_range,
    in_range,
    table_entry,
    targets_of,
)
from leanstate._checkpoint_load import apply_tables, load_all_or_nothing, verify_table
from leanstate.reference.checkpoint import FORMAT_NAME, FORMAT_VERSION, CheckpointError
from leanstate.reference.kv_store import SupportsRows
from leanstate.reference.kv_tensor import KVTensor
from leanstate.sharded_checkpoint import load_into_plain, load_sharded, save_sharded


def _backend_argument(backend: str | None, method: str) -> None:
    """``backend=`` meant nothing here: every store backend uses this one I/O path."""
    if backend is not None:
        warnings.warn(
            f"{method}(backend=...) is deprecated and ignored: checkpoint I/O is one implementation "
            "for every store backend (each store keeps the backend it was built with)",
            DeprecationWarning,
            stacklevel=3,
        )


def save_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, SupportsRows | KVTensor],
    *,
    extra: Mapping[str, object] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Progress | None = None,
    pipelined: bool = True,
    process_group=None,
    backend: str | None = None,
) -> Path:
    """Save whole-row tables (and optional dense ``extra`` state) atomically to ``path``.

    ``tables`` maps names to stores or whole-row KVTensors (their rows, recomputed from
    the store now) or to other views of a store saved under another name (recorded as
    views: a read-only optimizer view costs no bytes, its rows live in the whole rows).
    ``progress(table, rows_done, rows_total)`` is called after each chunk. A crash never
    leaves a half-written checkpoint at ``path`` and never destroys the previous one.
    ``pipelined``: overlap the gather of the next chunk with the write of this one (the
    same bytes; ``False`` is the plain loop). Returns ``path``.

    With ``process_group`` (call on every rank) ``tables`` is a sharded module's
    ``checkpoint_tables()``: every rank writes its own rows, bucket-major, and rank 0 the
    manifest last (format version 2, ``spec/sharding.md``). ``backend`` is deprecated
    and ignored.

    Example::

        >>> leanstate.save_checkpoint("ckpt", {"user": store}, extra={"step": 10})
    """
    _backend_argument(backend, "save_checkpoint")
    if process_group is not None:
        return save_sharded(path, tables, process_group=process_group, extra=extra, chunk_bytes=chunk_bytes)
    method = "save_checkpoint"
    check_chunk_bytes(method, chunk_bytes)
    targets = targets_of(tables, method)
    whole = {t.name: t for t in targets if t.whole}
    views = {t.name: _view_entry(t, whole, method) for t in targets if t.name not in whole}
    extra_bytes = None if extra is None else extra_bytes_of(extra, method)
    path = checked_target(path, method)
    with staged(path, method) as staging:
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "tables": {},
            "views": views,
            "extra": None,
        }
        for name, target in whole.items():
            file = staging / f"{name}.rows"
            report = None if progress is None else (lambda done, total, n=name: progress(n, done, total))
            chunks = write_store(target.store, file, chunk_bytes, pipelined=pipelined, progress=report)
            manifest["tables"][name] = table_entry(target.store.layout, file, chunks)
        if extra_bytes is not None:
            manifest["extra"] = write_extra(staging, extra_bytes)
        publish(staging, path, manifest=manifest)
    return path


def _view_entry(target: Target, whole: dict[str, Target], method: str) -> dict:
    """How a partial view of a store saved whole under another name is recorded."""
    owner = next((w.name for w in whole.values() if w.store is target.store), None)
    if owner is None:
        raise ValueError(
            f"{method}: tables[{target.name!r}] is a partial view whose store is not saved as a whole-row "
            "table; add the store (or a whole-row KVTensor of it) under another name"
        )
    view = target.view
    return {
        "table": owner,
        "whole_rows": view.whole_rows,
        "width_offset": view.width_offset,
        "width": view.width,
        "read_only": view.read_only,
        "rows": len(target.store),  # the shape as of now, not as of the view's creation
    }


def load_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, SupportsRows | KVTensor],
    *,
    id_range: tuple[int, int] | None = None,
    progress: Progress | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    process_group=None,
    backend: str | None = None,
) -> dict[str, object]:
    """Stream the named tables from ``path`` into their stores; return the ``extra`` state.

    Each entry of ``tables`` is a store or a whole-row KVTensor (rows are written by the
    key in their header) or a read-only view (a no-op, counted in its
    ``ignored_writes``). ``id_range=(lo, hi)`` loads only ids in ``[lo, hi)`` and reads
    only the chunks that hold them. A bad checkpoint raises ``CheckpointError`` naming the
    file and chunk and leaves the stores as they were: into stores that already hold
    rows, every chunk's CRC is checked before any row is applied; into empty stores, rows
    are applied as they are read and a failure empties the stores again (one read of the
    file instead of two). Memory beyond the stores is about a slice of ``chunk_bytes``,
    whatever the table size.

    With ``process_group`` (call on every rank) ``tables`` is a sharded module's
    ``checkpoint_tables()``, and a checkpoint saved at any world size (or by one process)
    loads: each rank reads only the chunks of the buckets it owns. ``backend`` is
    deprecated and ignored.

    Example::

        >>> extra = leanstate.load_checkpoint("ckpt", {"user": fresh_store})
    """
    _backend_argument(backend, "load_checkpoint")
    if process_group is not None:
        if id_range is not None:
            raise ValueError(
                "load_checkpoint: id_range and process_group exclude each other (buckets decide)"
            )
        return load_sharded(path, tables, process_group=process_group, chunk_bytes=chunk_bytes)
    method = "load_checkpoint"
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{method}: path must be a str or os.PathLike; got {type(path).__name__}")
    path = Path(path)
    check_chunk_bytes(method, chunk_bytes)
    id_range = check_id_range(id_range, method)
    targets = targets_of(tables, method)
    version, manifest = read_manifest(path)
    if version == 2:  # one process takes every rank's rows
        if id_range is not None:
            raise ValueError(
                "load_checkpoint: id_range applies to version-1 checkpoints; this one is version 2"
            )
        return load_into_plain(path, manifest, targets, chunk_bytes=chunk_bytes)
    return _load(path, manifest, targets, id_range=id_range, chunk_bytes=chunk_bytes, progress=progress)


def _load(
    path: Path,
    manifest: dict,
    targets: list[Target],
    *,
    id_range,
    chunk_bytes: int,
    progress: Progress | None,
) -> dict[str, object]:
    method = "load_checkpoint"
    plan: list[tuple[Target, TableRead]] = []
    views = []
    for target in targets:
        if target.view is not None and target.view.read_only:
            views.append(target)
            continue
        if not target.whole:
            raise ValueError(
                f"{method}: tables[{target.name!r}] is a writable partial view; load whole rows into "
                "the store, a whole-row KVTensor, or pass the view read-only"
            )
        if target.name not in manifest["tables"]:
            have = ", ".join(sorted(manifest["tables"])) or "none"
            raise CheckpointError(f"table {target.name!r} is not in checkpoint {path} (it has: {have})")
        table = manifest["tables"][target.name]
        check_layout(path / table["file"], target.name, table, target.store)
        plan.append((target, TableRead.of_v1(target.name, table, chunks_in_range(table, id_range))))
    extra = read_extra(path, manifest)  # checked before any row is applied
    slice_bytes = min(chunk_bytes, SLICE_BYTES)
    keep = None if id_range is None else (lambda ids: in_range(ids, id_range))

    def verify() -> None:
        for _, read in plan:
            verify_table(path, read, slice_bytes)

    def apply(into_empty: bool) -> None:
        tables = []
        for target, read in plan:
            total = manifest["tables"][target.name]["rows"]
            report = None if progress is None else _reporter(progress, target.name, total)
            tables.append((read, target.store, keep, report))
        apply_tables(path, tables, into_empty=into_empty, slice_bytes=slice_bytes)
        for target in views:  # a read-only view: its rows arrived with the whole rows
            target.view.ignored_writes += manifest["views"].get(target.name, {}).get("rows", 0)

    load_all_or_nothing([target.store for target, _ in plan], verify, apply)
    return extra


def _reporter(progress: Progress, name: str, total: int):
    """``progress(table, rows_done, rows_total)`` as the chunk-apply step calls it."""
    return lambda chunk, done: progress(name, done, total)


def verify_checkpoint(path: str | os.PathLike) -> Iterator[tuple[str, int, int]]:
    """Check every chunk of every table, then the extra state; yield (table, chunk, rows) as each passes.

    Raises :class:`CheckpointError` naming the file (and chunk) at the first bad one.
    """
    path = Path(path)
    _, manifest = read_manifest(path)
    for name, table in manifest["tables"].items():
        read = TableRead.of_v1(name, table, chunks_in_range(table, None))
        for index, chunk, buffer in read_chunks(path, read, DEFAULT_CHUNK_BYTES):
            if buffer is None:
                yield name, index, chunk["rows"]
    read_extra(path, manifest)
