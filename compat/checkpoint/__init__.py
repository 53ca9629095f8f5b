"""``leanstate.save_checkpoint`` / ``load_checkpoint``: the hardened whole-row checkpoint I/O.

The format is ``leanstate.reference.checkpoint`` (``spec/checkpoint_format.md``); this
is its production implementation, held to the reference by differential tests
(byte-identical files, identical loads, the same error classes). Over the reference it
adds: a locked staging directory that a crash never leaves at ``path`` and a later save
cleans up; regular files only, sizes checked before allocation; a pipelined writer
(the gather of the next chunk overlaps the write of this one); a one-pass load into
empty stores (undone on failure) and a verify-first load into live ones with Ctrl-C
deferred while rows are applied; ``progress`` callbacks; and version 2 (sharded, with
``process_group=``, ``leanstate.checkpoint.sharded``).

Every store backend is written and read through the stores' public methods (``keys``,
``get_rows(..., out=)``, ``set_rows``, ``reserve``), so a checkpoint saved from a store
of one backend loads bit for bit into a store of any other, on any device.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

from leanstate._numpy import require
from leanstate.checkpoint._arguments import Target, check_id_range, chunks_in_range, targets_of
from leanstate.checkpoint._chain import (
    delta_base,
    last_load_stats,
    load_chain,
    read_chain,
    record_stats,
)
from leanstate.checkpoint._chunks import TableRead, read_chunks
from leanstate.checkpoint._compaction import compact
from leanstate.checkpoint._files import (
    checked_target,
    extra_bytes_of,
    read_extra,
    read_manifest,
    read_manifest_and_digest,
)
from leanstate.checkpoint._format import (
    DEFAULT_CHUNK_BYTES,
    Progress,
    check_chunk_bytes,
)
from leanstate.checkpoint._module_tables import restore_module_extra, with_module_extra
from leanstate.checkpoint._writer import OneProcess, write_checkpoint
from leanstate.checkpoint.sharded import load_into_plain, load_sharded, save_sharded
from leanstate.reference.kv_store import SupportsRows
from leanstate.reference.kv_tensor import KVTensor

__all__ = ["compact_checkpoint", "last_load_stats", "load_checkpoint", "save_checkpoint", "verify_checkpoint"]


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
    base: str | os.PathLike | None = None,
    backend: str | None = None,
) -> Path:
    """Save whole-row tables (and optional dense ``extra`` state) atomically to ``path``.

    ``tables`` maps names to stores or whole-row KVTensors (their rows, recomputed from
    the store now) or to other views of a store saved under another name (recorded as
    views: a read-only optimizer view costs no bytes, its rows live in the whole rows).
    ``progress(table, rows_done, rows_total)`` is called after each chunk. A module's
    ``checkpoint_tables()`` brings the module's extra state (its optimizer step) along:
    it is saved beside ``extra`` and restored by ``load_checkpoint``. A crash never
    leaves a half-written checkpoint at ``path`` and never destroys the previous one.
    ``pipelined``: overlap the gather of the next chunk with the write of this one (the
    same bytes; ``False`` is the plain loop). Returns ``path``.

    With ``process_group`` (call on every rank) ``tables`` is a sharded module's
    ``checkpoint_tables()``: every rank writes its own rows, bucket-major, and rank 0 the
    manifest last (format version 2, ``spec/sharding.md``). ``backend`` is deprecated
    and ignored.

    ``base``: save a *delta* of that checkpoint (full or itself a delta): only the rows
    written and the ids removed since it (each store tracks its changes since the last
    checkpoint it was saved to or loaded from empty; ``spec/checkpoint_format.md``,
    "Delta checkpoints"). ``load_checkpoint`` of the delta loads the whole chain. With
    ``process_group`` the base is a version-2 checkpoint and each rank writes its own
    changes (``spec/sharding.md``, "Delta checkpoints across ranks").

    Example::

        >>> leanstate.save_checkpoint("ckpt-0", {"user": store}, extra={"step": 10})
        >>> leanstate.save_checkpoint("ckpt-1", {"user": store}, base="ckpt-0")  # the changes only
    """
    require("save_checkpoint")
    _backend_argument(backend, "save_checkpoint")
    extra = with_module_extra(tables, extra, "save_checkpoint")
    if process_group is not None:
        return save_sharded(
            path, tables, process_group=process_group, extra=extra, chunk_bytes=chunk_bytes, base=base
        )
    method = "save_checkpoint"
    check_chunk_bytes(method, chunk_bytes)
    targets = targets_of(tables, method)
    whole = {t.name: t for t in targets if t.whole}
    views = {t.name: _view_entry(t, whole, method) for t in targets if t.name not in whole}
    extra_bytes = None if extra is None else extra_bytes_of(extra, method)
    path = checked_target(path, method)
    stores = {name: target.store for name, target in whole.items()}
    entry = None if base is None else delta_base(path, stores, base, method)
    layout = OneProcess(views, extra_bytes, chunk_bytes=chunk_bytes, pipelined=pipelined, progress=progress)
    return write_checkpoint(path, stores, layout, base=entry, method=method)


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
    deprecated and ignored. A delta loads its whole chain, with or without
    ``process_group`` (a version-2 chain into plain stores: every rank's rows).

    Example::

        >>> extra = leanstate.load_checkpoint("ckpt", {"user": fresh_store})
    """
    require("load_checkpoint")
    _backend_argument(backend, "load_checkpoint")
    extra, _ = _load(path, tables, id_range, progress, chunk_bytes, process_group)
    restore_module_extra(tables, extra)
    return extra


def _load(
    path, tables, id_range, progress, chunk_bytes, process_group
) -> tuple[dict[str, object], dict[str, int]]:
    """``load_checkpoint`` of whatever the checkpoint at ``path`` is: its extra state and the
    load's statistics (every load returns them; ``last_load_stats`` keeps the last's)."""
    record_stats(None)  # a load refused before it reads anything read nothing
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
    version, manifest, digest = read_manifest_and_digest(path)
    if version == 2:  # one process takes every rank's rows (of every link of a delta's chain)
        if id_range is not None:
            raise ValueError(
                "load_checkpoint: id_range applies to version-1 checkpoints; this one is version 2"
            )
        return load_into_plain(path, manifest, digest, targets, chunk_bytes=chunk_bytes)
    links = read_chain(path, head=(manifest, digest))
    return load_chain(links, targets, id_range=id_range, chunk_bytes=chunk_bytes, progress=progress)


def compact_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    overwrite: bool = False,
) -> Path:
    """Merge the delta chain at ``src`` into one full checkpoint at ``dst``, streaming.

    Every link is checked as a load checks it; ``dst`` is written atomically, as a save
    is, and holds exactly the bytes a full save (with the same ``chunk_bytes``) of stores
    holding the chain's rows would: for each id the newest link that names it decides.
    The head's views and extra state are kept. An existing ``dst`` is refused unless
    ``overwrite`` (then it must be a checkpoint, and it is replaced atomically); ``dst`` is
    never a link of the chain, inside one or holding one (``ValueError``). A chain saved across ranks (version 2)
    compacts here too, in one process, into a full version-2 checkpoint at the head's
    world size: byte for byte that save (``spec/sharding.md``). Returns ``dst``.

    Example::

        >>> leanstate.compact_checkpoint("ckpt-10", "ckpt-10-full")
    """
    method = "compact_checkpoint"
    require(method)
    if not isinstance(src, str | os.PathLike):
        raise TypeError(f"{method}: src must be a str or os.PathLike; got {type(src).__name__}")
    check_chunk_bytes(method, chunk_bytes)
    if not isinstance(overwrite, bool):
        raise TypeError(f"{method}: overwrite must be True or False; got {overwrite!r}")
    return compact(Path(src), dst, chunk_bytes=chunk_bytes, overwrite=overwrite, method=method)


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
