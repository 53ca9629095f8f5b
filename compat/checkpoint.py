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

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from leanstate._checkpoint_chunks import ReadsInPlace, read_chunks, read_in_place, write_store
from leanstate._checkpoint_files import (
    checked_target,
    extra_bytes_of,
    interrupts_deferred,
    parse_manifest,
    publish,
    read_extra,
    read_manifest,
    staged,
    write_extra,
)
from leanstate._checkpoint_format import (
    DEFAULT_CHUNK_BYTES,
    MANIFEST,
    SLICE_BYTES,
    Progress,
    Target,
    check_chunk_bytes,
    check_id_range,
    check_layout,
    chunks_in_range,
    in_range,
    saved_across_ranks,
    table_entry,
    targets_of,
)
from leanstate.kv_store import KVStore
from leanstate.reference.checkpoint import FORMAT_NAME, FORMAT_VERSION, CheckpointError
from leanstate.reference.kv_store import SupportsRows
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import header_words
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
    if _saved_across_ranks(path):  # one process takes every rank's rows
        if id_range is not None:
            raise ValueError(
                "load_checkpoint: id_range applies to version-1 checkpoints; this one is version 2"
            )
        return load_into_plain(path, tables, chunk_bytes=chunk_bytes)
    return _load(path, tables, id_range=id_range, chunk_bytes=chunk_bytes, progress=progress)


def _saved_across_ranks(path) -> bool:
    """Whether ``path`` holds a version-2 checkpoint (any doubt: the plain loader decides)."""
    try:
        manifest = parse_manifest(Path(path) / MANIFEST)
    except (CheckpointError, OSError, TypeError):
        return False
    return saved_across_ranks(manifest)


def _load(path, tables, *, id_range, chunk_bytes: int, progress: Progress | None) -> dict[str, object]:
    method = "load_checkpoint"
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{method}: path must be a str or os.PathLike; got {type(path).__name__}")
    path = Path(path)
    check_chunk_bytes(method, chunk_bytes)
    id_range = check_id_range(id_range, method)
    targets = targets_of(tables, method)
    manifest = read_manifest(path)
    plan = []
    for target in targets:
        if target.view is not None and target.view.read_only:
            plan.append((target, None, []))
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
        plan.append((target, table, chunks_in_range(table, id_range)))
    extra = read_extra(path, manifest)  # checked before any row is applied
    # Into stores that hold no row yet, every row is new: verify and apply in one pass,
    # and undo a failure by emptying them again. Rows of a store that already holds some
    # could be overwritten, which cannot be undone: verify every chunk first (pass 1).
    written = [target.store for target, table, _ in plan if table is not None]
    one_pass = all(len(store) == 0 for store in written) and len({id(s) for s in written}) == len(written)
    if not one_pass:
        for target, table, chunks in plan:
            if table is not None:
                for _ in read_chunks(path, target.name, table, chunks, chunk_bytes, ahead=True):
                    pass
    try:
        # Into stores that held rows, every chunk is verified: Ctrl-C waits for the apply to
        # finish (a half-applied store could not be restored), then interrupts.
        with contextlib.nullcontext() if one_pass else interrupts_deferred():
            for target, table, chunks in plan:
                _apply(path, manifest, target, table, chunks, id_range, chunk_bytes, progress, one_pass)
        return extra
    except BaseException:
        if one_pass:  # rows went into empty stores: empty them again
            for store in written:
                store.delete(store.keys())
        raise


def _apply(
    path: Path,
    manifest: dict,
    target: Target,
    table,
    chunks,
    id_range,
    chunk_bytes,
    progress,
    into_empty: bool,
) -> None:
    """Stream one planned table's rows into its store; every chunk's CRC is checked as it is read.

    Into an empty store whose engine reads in place (the numba engine), with no
    ``id_range``, the rows are read straight into its pool and indexed there; otherwise
    each slice, read one ahead on a thread, goes through ``set_rows``."""
    if table is None:  # a read-only view: its rows arrived with the whole rows
        target.view.ignored_writes += manifest["views"].get(target.name, {}).get("rows", 0)
        return
    store = target.store
    engine = store.engine if isinstance(store, KVStore) else None
    if into_empty and id_range is None and isinstance(engine, ReadsInPlace):
        report = None if progress is None else (lambda done: progress(target.name, done, table["rows"]))
        read_in_place(path, target.name, table, chunks, engine, min(chunk_bytes, SLICE_BYTES), report)
        return
    layout = store.layout
    done, reserved = 0, False
    # The file's size matched the manifest before the first slice: grow the store once.
    # Rows the store already holds (a resume) need no room: reserving them too would
    # grow a full store by the table's size.
    incoming = sum(chunk["rows"] for _, chunk in chunks)
    with contextlib.closing(
        read_chunks(path, target.name, table, chunks, min(chunk_bytes, SLICE_BYTES), ahead=True)
    ) as slices:
        for _, buffer in slices:
            if buffer is None:
                continue
            rows = torch.frombuffer(buffer, dtype=torch.uint8).view(layout.dtype).view(-1, layout.width)
            if not reserved:
                store.reserve(max(0, incoming - len(store)))
                reserved = True
            if id_range is not None:
                rows = rows[in_range(header_words(rows)[:, 0], id_range)]
            store.set_rows(rows)  # keyed by each row's header, for views too
            done += len(rows)
            if progress is not None:
                progress(target.name, done, table["rows"])


def verify_checkpoint(path: str | os.PathLike) -> Iterator[tuple[str, int, int]]:
    """Check every chunk of every table, then the extra state; yield (table, chunk, rows) as each passes.

    Raises :class:`CheckpointError` naming the file (and chunk) at the first bad one.
    """
    path = Path(path)
    manifest = read_manifest(path)
    for name, table in manifest["tables"].items():
        chunks = chunks_in_range(table, None)
        for index, buffer in read_chunks(path, name, table, chunks, DEFAULT_CHUNK_BYTES):
            if buffer is None:
                yield name, index, table["chunks"][index]["rows"]
    read_extra(path, manifest)
