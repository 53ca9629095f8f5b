"""``leanstate.save_checkpoint`` / ``load_checkpoint``: the checkpoint I/O of the chosen backend.

Every backend writes and reads the same format (``spec/checkpoint_format.md``) through
the stores' public methods (``keys``, ``get_rows(..., out=)``, ``set_rows``,
``reserve``), so a checkpoint saved from a store of one backend loads bit for bit into
a store of any other, on any device. The writer is pipelined by default (the gather of
the next chunk overlaps the write of this one); ``pipelined=False`` is the plain loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from leanstate import _backends
from leanstate.reference.checkpoint import (
    DEFAULT_CHUNK_BYTES,
    MANIFEST,
    CheckpointError,
    Progress,
    parse_manifest,
)
from leanstate.reference.kv_store import KVStore
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.sharded_checkpoint import load_into_plain, load_sharded, save_sharded


def _saved_across_ranks(path) -> bool:
    """Whether ``path`` holds a version-2 checkpoint (any doubt: the plain loader decides)."""
    try:
        manifest = parse_manifest(Path(path) / MANIFEST)
    except (CheckpointError, OSError, TypeError):
        return False
    return isinstance(manifest, dict) and manifest.get("version") == 2


def _module(backend: str | None):
    return _backends.resolve("checkpoint", backend)[1]


def save_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, KVStore | KVTensor],
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
    ``pipelined``: overlap the gather of the next chunk with the write of this one.
    Returns ``path``.

    With ``process_group`` (call on every rank) ``tables`` is a sharded module's
    ``checkpoint_tables()``: every rank writes its own rows, bucket-major, and rank 0 the
    manifest last (format version 2, ``spec/sharding.md``).

    Example::

        >>> leanstate.save_checkpoint("ckpt", {"user": store}, extra={"step": 10})
    """
    if process_group is not None:
        return save_sharded(path, tables, process_group=process_group, extra=extra, chunk_bytes=chunk_bytes)
    return _module(backend).save_checkpoint(
        path, tables, extra=extra, chunk_bytes=chunk_bytes, progress=progress, pipelined=pipelined
    )


def load_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, KVStore | KVTensor],
    *,
    id_range: tuple[int, int] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Progress | None = None,
    process_group=None,
    backend: str | None = None,
) -> dict[str, object]:
    """Stream the named tables from ``path`` into their stores; return the ``extra`` state.

    Each entry of ``tables`` is a store or a whole-row KVTensor (rows are written by the
    key in their header) or a read-only view (a no-op, counted in its
    ``ignored_writes``). ``id_range=(lo, hi)`` loads only ids in ``[lo, hi)`` and reads
    only the chunks that hold them. A bad checkpoint raises ``CheckpointError`` naming the
    file and chunk and leaves the stores as they were. Memory beyond the stores is a few
    slices of ``chunk_bytes``, whatever the table size.

    With ``process_group`` (call on every rank) ``tables`` is a sharded module's
    ``checkpoint_tables()``, and a checkpoint saved at any world size (or by one process)
    loads: each rank reads only the chunks of the buckets it owns.

    Example::

        >>> extra = leanstate.load_checkpoint("ckpt", {"user": fresh_store})
    """
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
    return _module(backend).load_checkpoint(
        path, tables, id_range=id_range, chunk_bytes=chunk_bytes, progress=progress
    )
