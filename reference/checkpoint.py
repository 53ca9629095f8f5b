"""Whole-row checkpoints: save each row as one record, load by streaming chunks.

A checkpoint is a directory::

    PATH/manifest.json        format, version, and per table: layout, rows, chunk list
    PATH/<table>.rows         the table's whole rows, ascending by id, no gaps
    PATH/extra.pt             optional dense extra state (torch.save; loaded weights_only)

Rows are stored exactly as ``spec/row_format.md`` lays them out, ascending by id, so an
id range is a contiguous byte range and any rank of any world size reads its share
alone. Loading checks every chunk's CRC-32 before a single row is applied, then streams
chunk by chunk into the store by the key in each row's header: the extra memory is
about one chunk, whatever the table size. Saving writes a temporary sibling directory,
fsyncs it, writes the manifest last and renames it into place. See
``spec/checkpoint_format.md``.

Example::

    >>> save_checkpoint("ckpt", {"user": store})
    >>> load_checkpoint("ckpt", {"user": fresh_store})
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import crc32c
import torch

from leanstate.reference.kv_store import KVStore
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import RowLayout, header_words

FORMAT_NAME = "leanstate-whole-row"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
EXTRA_FILE = "extra.pt"
DEFAULT_CHUNK_BYTES = 64 * 2**20
CHECKSUM = "crc32c"
# name -> incremental checksum(data, running value); "crc32" (zlib) is read, not written.
_CHECKSUMS: dict[str, Callable[[bytes, int], int]] = {
    "crc32c": lambda data, crc: crc32c.crc32c(data, value=crc),
    "crc32": zlib.crc32,
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Progress = Callable[[str, int, int], None]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and the chunk."""


@dataclass(frozen=True)
class _Target:
    """What one entry of ``tables`` means: a store, and how its rows are written."""

    name: str
    store: KVStore
    view: KVTensor | None  # None: the store itself


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _targets(tables: Mapping[str, KVStore | KVTensor], method: str) -> list[_Target]:
    if not isinstance(tables, Mapping):
        raise TypeError(f"{method}: tables must be a mapping name -> KVStore or KVTensor")
    targets = []
    for name, value in tables.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise ValueError(f"{method}: table name {name!r} must be a non-empty plain file name")
        if isinstance(value, KVTensor):
            targets.append(_Target(name, value.store, value))
        elif hasattr(value, "get_rows") and hasattr(value, "set_rows"):
            targets.append(_Target(name, value, None))
        else:
            raise TypeError(
                f"{method}: tables[{name!r}] must be a KVStore or KVTensor; got {type(value).__name__}"
            )
    return targets


def _check_chunk_bytes(method: str, chunk_bytes: object) -> None:
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"{method}: chunk_bytes must be a positive int; got {chunk_bytes!r}")


def _is_whole(target: _Target) -> bool:
    view = target.view
    return view is None or (
        view.whole_rows and view.width_offset == 0 and view.width == target.store.layout.width
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _row_bytes(rows: torch.Tensor) -> memoryview:
    return memoryview(rows.contiguous().view(torch.uint8).numpy()).cast("B")


# -- save -------------------------------------------------------------------------------


def _chunk_entry(rows: torch.Tensor, offset: int, crc: int) -> dict:
    """The manifest entry of one chunk of ``rows`` (id-ascending) written at ``offset``."""
    ids = header_words(rows)[:, 0]
    return {"offset": offset, "rows": len(rows), "min_id": int(ids[0]), "max_id": int(ids[-1]), "crc": crc}


def _table_entry(layout: RowLayout, file: Path, chunks: list[dict]) -> dict:
    """The manifest entry of one table written to ``file`` as ``chunks``."""
    return {
        "file": file.name,
        "dim": layout.dim,
        "optimizer_state_dim": layout.state_dim,
        "dtype": _dtype_name(layout.dtype),
        "header_elems": layout.header_elems,
        "width": layout.width,
        "row_bytes": layout.row_bytes,
        "rows": sum(c["rows"] for c in chunks),
        "bytes": sum(c["rows"] for c in chunks) * layout.row_bytes,
        "min_id": chunks[0]["min_id"] if chunks else None,
        "max_id": chunks[-1]["max_id"] if chunks else None,
        "checksum": CHECKSUM,
        "chunks": chunks,
    }


def _checksum(data: memoryview) -> int:
    """The checksum written for new chunks (``CHECKSUM``)."""
    return _CHECKSUMS[CHECKSUM](data, 0)


def _write_table(store: KVStore, file: Path, chunk_bytes: int, progress: Progress | None, name: str) -> dict:
    """Stream one store's rows to ``file`` in ascending id order; return its manifest entry."""
    layout = store.layout
    rows_per_chunk = max(1, chunk_bytes // layout.row_bytes)
    keys = store.keys()  # recomputed now: the store may have grown since any view was made
    chunks, offset = [], 0
    with open(file, "wb") as f:
        for start in range(0, len(keys), rows_per_chunk):
            rows = store.get_rows(keys[start : start + rows_per_chunk])
            used = header_words(rows)[:, 1] < 0
            if not used.all():
                rows = rows[used]  # drop ids deleted since keys() listed them
            if len(rows) == 0:
                continue
            data = _row_bytes(rows)
            f.write(data)
            chunks.append(_chunk_entry(rows, offset, _checksum(data)))
            offset += len(data)
            if progress is not None:
                progress(name, min(start + rows_per_chunk, len(keys)), len(keys))
        f.flush()
        os.fsync(f.fileno())
    return _table_entry(layout, file, chunks)


def save_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, KVStore | KVTensor],
    *,
    extra: Mapping[str, object] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Progress | None = None,
) -> Path:
    """Save whole-row tables (and optional dense ``extra`` state) atomically to ``path``.

    ``tables`` maps names to stores or whole-row KVTensors (their rows, recomputed from
    the store now) or to other views of a store saved under another name (recorded as
    views: a read-only optimizer view costs no bytes, its rows live in the whole rows).
    ``progress(table, rows_done, rows_total)`` is called after each chunk. A crash never
    leaves a half-written checkpoint at ``path`` and never destroys the previous one.
    Returns ``path``.
    """
    return _save(
        path, tables, extra=extra, chunk_bytes=chunk_bytes, progress=progress, write_table=_write_table
    )


_WriteTable = Callable[[KVStore, Path, int, "Progress | None", str], dict]


def _save(
    path: str | os.PathLike,
    tables: Mapping[str, KVStore | KVTensor],
    *,
    extra: Mapping[str, object] | None,
    chunk_bytes: int,
    progress: Progress | None,
    write_table: _WriteTable,
) -> Path:
    """``save_checkpoint`` with the table writer given: an accelerated writer plugs in here."""
    method = "save_checkpoint"
    _check_chunk_bytes(method, chunk_bytes)
    targets = _targets(tables, method)
    whole = {t.name: t for t in targets if _is_whole(t)}
    views = {}
    for t in targets:
        if t.name in whole:
            continue
        owner = next((w.name for w in whole.values() if w.store is t.store), None)
        if owner is None:
            raise ValueError(
                f"{method}: tables[{t.name!r}] is a partial view whose store is not saved as a whole-row "
                "table; add the store (or a whole-row KVTensor of it) under another name"
            )
        views[t.name] = {
            "table": owner,
            "whole_rows": t.view.whole_rows,
            "width_offset": t.view.width_offset,
            "width": t.view.width,
            "read_only": t.view.read_only,
            "rows": len(t.store),  # the shape as of now, not as of the view's creation
        }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    staging = path.parent / f".{path.name}.saving-{token}"
    staging.mkdir()
    try:
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "tables": {},
            "views": views,
            "extra": None,
        }
        for name, target in whole.items():
            manifest["tables"][name] = write_table(
                target.store, staging / f"{name}.rows", chunk_bytes, progress, name
            )
        if extra is not None:
            with open(staging / EXTRA_FILE, "wb") as f:
                torch.save(dict(extra), f)
                f.flush()
                os.fsync(f.fileno())
            manifest["extra"] = EXTRA_FILE
        with open(staging / MANIFEST, "w") as f:  # last: its presence marks a complete save
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(staging)
        previous = path.parent / f".{path.name}.previous-{token}"
        if path.exists():
            os.rename(path, previous)
        try:
            os.rename(staging, path)
        except BaseException:
            if previous.exists():
                os.rename(previous, path)
            raise
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(previous, ignore_errors=True)
    return path


# -- read -------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the checkpoint at ``path``, checked for format, version and files."""
    path = Path(path)
    file = path / MANIFEST
    if not file.exists():
        stale = sorted(path.parent.glob(f".{path.name}.previous-*"))
        hint = (
            f"; an interrupted save left the previous checkpoint at {stale[0]} (rename it to {path})"
            if stale
            else ""
        )
        raise FileNotFoundError(f"no checkpoint at {path}: {file} does not exist{hint}")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc
    if manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{file}: format {manifest.get('format')!r} is not {FORMAT_NAME!r}")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: format version {manifest.get('version')!r} is not supported "
            f"(this leanstate reads version {FORMAT_VERSION})"
        )
    root = path.resolve()
    for name, table in manifest["tables"].items():
        data = (path / table["file"]).resolve()
        if data.parent != root or Path(table["file"]).name != table["file"]:
            raise CheckpointError(
                f"{file}: table {name!r} names file {table['file']!r} outside the checkpoint directory"
            )
    return manifest


def _chunks_in_range(table: dict, id_range: tuple[int, int] | None) -> list[tuple[int, dict]]:
    chunks = list(enumerate(table["chunks"]))
    if id_range is None:
        return chunks
    lo, hi = id_range
    return [(i, c) for i, c in chunks if c["max_id"] >= lo and c["min_id"] < hi]


def _read_chunks(
    path: Path, name: str, table: dict, chunks: list[tuple[int, dict]], slice_bytes: int
) -> Iterator[tuple[int, memoryview | None]]:
    """Yield (chunk index, bytes) in slices of whole rows of at most ``slice_bytes``.

    The checksum of each chunk is accumulated over its slices and checked after its
    last slice, then ``(index, None)`` marks the chunk as verified; the first bad or
    short chunk raises :class:`CheckpointError`. The slices share one buffer: each is
    valid until the next is read.
    """
    file = path / table["file"]
    try:
        f = open(file, "rb")
    except FileNotFoundError as exc:
        raise CheckpointError(f"table {name!r}: data file {file} is missing") from exc
    row_bytes = table["row_bytes"]
    slice_rows = max(1, slice_bytes // row_bytes)
    checksum = _CHECKSUMS.get(table.get("checksum"))
    if checksum is None:
        f.close()
        raise CheckpointError(f"table {name!r}: unknown checksum {table.get('checksum')!r} in the manifest")
    buffer = bytearray(min(slice_rows, max((c["rows"] for _, c in chunks), default=0)) * row_bytes)
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != table["bytes"]:
            raise CheckpointError(
                f"table {name!r}: {file} has {size} bytes, the manifest expects {table['bytes']} "
                f"({'truncated' if size < table['bytes'] else 'trailing bytes'})"
            )
        for index, chunk in chunks:
            where = f"chunk {index} of {file} (bytes {chunk['offset']}..{chunk['offset'] + chunk['rows'] * row_bytes})"
            f.seek(chunk["offset"])
            crc = 0
            for first in range(0, chunk["rows"], slice_rows):
                view = memoryview(buffer)[: min(slice_rows, chunk["rows"] - first) * row_bytes]
                if f.readinto(view) != len(view):
                    raise CheckpointError(f"table {name!r}: {where} is truncated")
                crc = checksum(view, crc)
                yield index, view
            if crc != chunk["crc"]:
                raise CheckpointError(
                    f"table {name!r}: {where} fails its {table['checksum']} check; the file is corrupt"
                )
            yield index, None


def verify_checkpoint(path: str | os.PathLike) -> Iterator[tuple[str, int, int]]:
    """Check every chunk of every table; yield (table, chunk index, rows) as each passes.

    Raises :class:`CheckpointError` naming the file and chunk at the first bad one.
    """
    path = Path(path)
    manifest = read_manifest(path)
    for name, table in manifest["tables"].items():
        chunks = _chunks_in_range(table, None)
        for index, buffer in _read_chunks(path, name, table, chunks, DEFAULT_CHUNK_BYTES):
            if buffer is None:
                yield name, index, table["chunks"][index]["rows"]


# -- load -------------------------------------------------------------------------------


def _check_layout(path: Path, name: str, table: dict, store: KVStore) -> None:
    layout = store.layout
    saved = RowLayout(table["dim"], table["optimizer_state_dim"], _DTYPES.get(table["dtype"], torch.float32))
    problems = []
    if table["dtype"] != _dtype_name(layout.dtype):
        problems.append(f"dtype {table['dtype']} vs the store's {_dtype_name(layout.dtype)}")
    if table["dim"] != layout.dim:
        problems.append(f"dim {table['dim']} vs the store's {layout.dim}")
    if table["optimizer_state_dim"] != layout.state_dim:
        problems.append(
            f"optimizer_state_dim {table['optimizer_state_dim']} vs the store's {layout.state_dim}"
        )
    if not problems and (table["width"], table["row_bytes"]) != (saved.width, saved.row_bytes):
        problems.append(f"width {table['width']} does not match its own dim, state and dtype")
    if problems:
        raise CheckpointError(f"table {name!r} in {path / table['file']}: " + "; ".join(problems))


def load_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, KVStore | KVTensor],
    *,
    id_range: tuple[int, int] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Progress | None = None,
) -> dict[str, object]:
    """Stream the named tables from ``path`` into their stores; return the ``extra`` state.

    Each entry of ``tables`` is a store or a whole-row KVTensor (rows are written by
    the key in their header) or a read-only view (a no-op, counted in its
    ``ignored_writes``). ``id_range=(lo, hi)`` loads only ids in ``[lo, hi)`` and reads
    only the chunks that hold them. A bad checkpoint leaves the stores as they were:
    into stores that already hold rows, every chunk's CRC is checked before any row is
    applied; into empty stores, rows are applied as they are read and a failure empties
    the stores again (one read of the file instead of two). Memory beyond the
    stores is bounded by about ``chunk_bytes``: chunks are read in slices of at most
    ``chunk_bytes``, whatever the chunk size at save time.
    """
    method = "load_checkpoint"
    path = Path(path)
    _check_chunk_bytes(method, chunk_bytes)
    if id_range is not None and (len(id_range) != 2 or id_range[0] > id_range[1]):
        raise ValueError(f"{method}: id_range must be (lo, hi) with lo <= hi; got {id_range!r}")
    targets = _targets(tables, method)
    manifest = read_manifest(path)
    plan = []
    for target in targets:
        if target.view is not None and target.view.read_only:
            plan.append((target, None, []))
            continue
        if not _is_whole(target):
            raise ValueError(
                f"{method}: tables[{target.name!r}] is a writable partial view; load whole rows into "
                "the store, a whole-row KVTensor, or pass the view read-only"
            )
        if target.name not in manifest["tables"]:
            have = ", ".join(sorted(manifest["tables"])) or "none"
            raise CheckpointError(f"table {target.name!r} is not in checkpoint {path} (it has: {have})")
        table = manifest["tables"][target.name]
        _check_layout(path, target.name, table, target.store)
        plan.append((target, table, _chunks_in_range(table, id_range)))
    # Into stores that hold no row yet, every row is new: verify and apply in one pass,
    # and undo a failure by emptying them again. Rows of a store that already holds some
    # could be overwritten, which cannot be undone: verify every chunk first (pass 1).
    written = [target.store for target, table, _ in plan if table is not None]
    one_pass = all(len(store) == 0 for store in written) and len({id(s) for s in written}) == len(written)
    if not one_pass:
        for target, table, chunks in plan:
            if table is not None:
                for _ in _read_chunks(path, target.name, table, chunks, chunk_bytes):
                    pass
    try:
        _apply(path, manifest, plan, id_range, chunk_bytes, progress)
        if manifest["extra"] is None:
            return {}
        return torch.load(path / manifest["extra"], weights_only=True)
    except BaseException:
        if one_pass:
            for store in written:
                store.delete(store.keys())
        raise


def _apply(
    path: Path, manifest: dict, plan: list, id_range, chunk_bytes: int, progress: Progress | None
) -> None:
    """Stream each planned table's rows into its store; every chunk's CRC is checked as it is read."""
    for target, table, chunks in plan:
        if table is None:  # a read-only view: its rows arrived with the whole rows
            target.view.ignored_writes += manifest["views"].get(target.name, {}).get("rows", 0)
            continue
        layout = target.store.layout
        done = 0
        for _, buffer in _read_chunks(path, target.name, table, chunks, chunk_bytes):
            if buffer is None:
                continue
            rows = torch.frombuffer(buffer, dtype=torch.uint8).view(layout.dtype).view(-1, layout.width)
            if id_range is not None:
                keys = header_words(rows)[:, 0]
                rows = rows[(keys >= id_range[0]) & (keys < id_range[1])]
            target.store.set_rows(rows)  # keyed by each row's header, for views too
            done += len(rows)
            if progress is not None:
                progress(target.name, done, table["rows"])


def row_wise_id_range(num_embeddings: int, rank: int, world_size: int) -> tuple[int, int]:
    """The ids a rank owns under row-wise sharding (TorchRec's even blocks of ids).

    Rank ``r`` owns ``[r * block, min(num_embeddings, (r + 1) * block))`` with
    ``block = ceil(num_embeddings / world_size)``; pass it as ``id_range``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
    block = -(-num_embeddings // world_size)
    return min(num_embeddings, rank * block), min(num_embeddings, (rank + 1) * block)
