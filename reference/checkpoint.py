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

import contextlib
import fcntl
import io
import json
import os
import secrets
import shutil
import signal
import stat
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import crc32c
import torch

from leanstate.reference.kv_store import KVStore
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import RowLayout, header_words

DEVICES = ("cpu", "cuda")
AUTO_PRIORITY = {"cpu": 0, "cuda": 0}
BENCH_TARGETS: dict[str, tuple[str, float]] = {}

FORMAT_NAME = "leanstate-whole-row"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
EXTRA_FILE = "extra.pt"
DEFAULT_CHUNK_BYTES = 64 * 2**20
# Loads read at most this much at a time: the read, the CRC and the upsert of a slice
# stay in cache (measured faster than whole 64 MiB chunks).
SLICE_BYTES = 4 * 2**20
CHECKSUM = "crc32c"
# name -> incremental checksum(data, running value); "crc32" (zlib) is read, not written.
CHECKSUMS: dict[str, Callable[[bytes, int], int]] = {
    "crc32c": lambda data, crc: crc32c.crc32c(data, value=crc),
    "crc32": zlib.crc32,
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Progress = Callable[[str, int, int], None]
_MAX_NAME_BYTES = 200  # a table file is NAME.rows, and file names stop at 255 bytes


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or saved: the message names the file (and chunk or table)."""


@dataclass(frozen=True)
class _Target:
    """What one entry of ``tables`` means: a store, and how its rows are written."""

    name: str
    store: KVStore
    view: KVTensor | None  # None: the store itself


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def targets_of(tables: Mapping[str, KVStore | KVTensor], method: str) -> list[_Target]:
    if not isinstance(tables, Mapping):
        raise TypeError(f"{method}: tables must be a mapping name -> KVStore or KVTensor")
    targets = []
    for name, value in tables.items():
        if isinstance(name, str):
            try:
                name.encode()
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"{method}: table name {name!r} cannot be a file name (not encodable as UTF-8: {exc.reason})"
                ) from None
        if (
            not isinstance(name, str)
            or not plain_name(name)
            or name.startswith(".")
            or "\0" in name
            or len(name.encode()) > _MAX_NAME_BYTES
        ):
            raise ValueError(
                f"{method}: table name {name!r} must be a plain file name: not empty, no '/', not starting "
                f"with '.', at most {_MAX_NAME_BYTES} bytes"
            )
        if isinstance(value, KVTensor):
            targets.append(_Target(name, value.store, value))
        elif hasattr(value, "get_rows") and hasattr(value, "set_rows"):
            targets.append(_Target(name, value, None))
        elif type(value).__name__ == "BucketedTable":
            raise TypeError(
                f"{method}: tables[{name!r}] is a sharded module's table (from checkpoint_tables() of a "
                "ShardedKVEmbeddingBagCollection): pass process_group= (on every rank) as well"
            )
        else:
            raise TypeError(
                f"{method}: tables[{name!r}] must be a KVStore or KVTensor; got {type(value).__name__}"
            )
    return targets


def check_chunk_bytes(method: str, chunk_bytes: object) -> None:
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


def row_bytes_of(rows: torch.Tensor) -> memoryview:
    return memoryview(rows.contiguous().view(torch.uint8).numpy()).cast("B")


# -- save -------------------------------------------------------------------------------


def chunk_entry(rows: torch.Tensor, offset: int, crc: int) -> dict:
    """The manifest entry of one chunk of ``rows`` (id-ascending) written at ``offset``."""
    ids = header_words(rows)[:, 0]
    return {"offset": offset, "rows": len(rows), "min_id": int(ids[0]), "max_id": int(ids[-1]), "crc": crc}


def table_entry(layout: RowLayout, file: Path, chunks: list[dict]) -> dict:
    """The manifest entry of one table written to ``file`` as ``chunks``."""
    return {
        "file": file.name,
        "dim": layout.dim,
        "optimizer_state_dim": layout.state_dim,
        "dtype": dtype_name(layout.dtype),
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


def new_chunk_checksum(data: memoryview) -> int:
    """The checksum written for new chunks (``CHECKSUM``)."""
    return CHECKSUMS[CHECKSUM](data, 0)


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
            data = row_bytes_of(rows)
            f.write(data)
            chunks.append(chunk_entry(rows, offset, new_chunk_checksum(data)))
            offset += len(data)
            if progress is not None:
                progress(name, min(start + rows_per_chunk, len(keys)), len(keys))
        f.flush()
        os.fsync(f.fileno())
    return table_entry(layout, file, chunks)


def _write_table_pipelined(
    store: KVStore, file: Path, chunk_bytes: int, progress: Progress | None, name: str
) -> dict:
    """``_write_table`` with the gather of chunk k+1 overlapped with the checksum and write of
    chunk k (a writer thread; the store's gathers, ``write`` and CRC-32C release the GIL).

    The rows go through two reused host buffers (``get_rows(..., out=)``), so a device
    store streams to the host chunk by chunk: the same bytes as ``_write_table``.
    """
    layout = store.layout
    rows_per_chunk = max(1, chunk_bytes // layout.row_bytes)
    keys = store.keys().cpu()
    size = min(rows_per_chunk, len(keys))
    pin = torch.cuda.is_available() and _store_device(store).type == "cuda"
    buffers = [torch.empty(size, layout.width, dtype=layout.dtype, pin_memory=pin) for _ in range(2)]
    chunks: list[dict] = []
    offset = 0

    def write(f, rows: torch.Tensor) -> int:
        data = row_bytes_of(rows)
        f.write(data)
        return new_chunk_checksum(data)

    with open(file, "wb") as f, ThreadPoolExecutor(max_workers=1) as writer:
        pending = None  # (future of the write in flight, its rows)
        for k, start in enumerate(range(0, len(keys), rows_per_chunk)):
            ids = keys[start : start + rows_per_chunk]
            rows = store.get_rows(ids, out=buffers[k % 2][: len(ids)])
            used = header_words(rows)[:, 1] < 0
            if not used.all():
                rows = rows[used]  # drop ids deleted since keys() listed them (a copy)
            if pending is not None:  # the next gather reuses the buffer this write reads
                chunks.append(chunk_entry(pending[1], offset, pending[0].result()))
                offset += len(pending[1]) * layout.row_bytes
                pending = None
            if len(rows):
                pending = (writer.submit(write, f, rows), rows)
            if progress is not None:
                progress(name, min(start + rows_per_chunk, len(keys)), len(keys))
        if pending is not None:
            chunks.append(chunk_entry(pending[1], offset, pending[0].result()))
        f.flush()
        os.fsync(f.fileno())
    return table_entry(layout, file, chunks)


def _store_device(store: KVStore) -> torch.device:
    """Where a store's rows live (the CPU for stores that do not say)."""
    return torch.device(getattr(store, "device", "cpu"))


def save_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, KVStore | KVTensor],
    *,
    extra: Mapping[str, object] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Progress | None = None,
    pipelined: bool = True,
) -> Path:
    """Save whole-row tables (and optional dense ``extra`` state) atomically to ``path``.

    ``tables`` maps names to stores or whole-row KVTensors (their rows, recomputed from
    the store now) or to other views of a store saved under another name (recorded as
    views: a read-only optimizer view costs no bytes, its rows live in the whole rows).
    ``progress(table, rows_done, rows_total)`` is called after each chunk. A crash never
    leaves a half-written checkpoint at ``path`` and never destroys the previous one.
    ``pipelined``: gather the next chunk while a writer thread checksums and writes this
    one (the same bytes; ``False`` is the plain loop). Returns ``path``.
    """
    writer = _write_table_pipelined if pipelined else _write_table
    return _save(path, tables, extra=extra, chunk_bytes=chunk_bytes, progress=progress, write_table=writer)


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
    check_chunk_bytes(method, chunk_bytes)
    targets = targets_of(tables, method)
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
    extra_bytes = None if extra is None else extra_bytes_of(extra, method)
    path = checked_target(path, method)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(path)
    token = secrets.token_hex(4)
    staging = path.parent / f".{path.name}.saving-{token}"
    lock = open(f"{staging}.lock", "w")  # held while saving: a later save leaves this one alone
    fcntl.flock(lock, fcntl.LOCK_EX)
    staging.mkdir()
    previous = path.parent / f".{path.name}.previous-{token}"
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
        if extra_bytes is not None:
            manifest["extra"] = write_extra(staging, extra_bytes)
        publish(staging, manifest, path, previous)
    except OSError as exc:  # disk full, file too large, I/O error: name what was being saved
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"{method}: saving {path} failed ({exc.strerror or exc}); the previous checkpoint at that path, "
            "if any, is unchanged"
        ) from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.remove(lock.name)
        lock.close()
    # Older copies of path (this save's, or one an interrupted save left) are superseded now.
    for old in path.parent.glob(f".{path.name}.previous-*"):
        remove_checkpoint(old)
    return path


def write_extra(staging: Path, extra_bytes: bytes) -> dict:
    """Write the serialised extra state, fsynced; its manifest entry."""
    with open(staging / EXTRA_FILE, "wb") as f:
        f.write(extra_bytes)
        f.flush()
        os.fsync(f.fileno())
    return {"file": EXTRA_FILE, "bytes": len(extra_bytes), "crc": crc32c.crc32c(extra_bytes)}


def publish(staging: Path, manifest: dict, path: Path, previous: Path) -> None:
    """Write the manifest last (its presence marks a complete save), fsync, and rename
    ``staging`` to ``path``; the old checkpoint waits at ``previous`` until then."""
    with open(staging / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    replace_directory(staging, path, previous)


def replace_directory(staging: Path, path: Path, previous: Path) -> None:
    """fsync the complete ``staging`` directory and rename it to ``path``; an old ``path``
    waits at ``previous`` until the rename is done (and comes back if it fails)."""
    _fsync_dir(staging)
    if path.exists():
        os.rename(path, previous)
    try:
        os.rename(staging, path)
    except BaseException:
        if previous.exists():
            os.rename(previous, path)
        raise
    _fsync_dir(path.parent)


def extra_bytes_of(extra: object, method: str) -> bytes:
    """``extra`` serialised, after checking that it loads back with ``weights_only=True``."""
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"{method}: extra must be a mapping of names to tensors and plain values; got {type(extra).__name__}"
        )
    buffer = io.BytesIO()
    torch.save(dict(extra), buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"{method}: extra must load back with torch.load(weights_only=True) (tensors, numbers, strings, "
            f"lists and dicts of them); it does not: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from exc
    return data


def checked_target(path: object, method: str) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{method}: path must be a str or os.PathLike; got {type(path).__name__}")
    if str(path) == "" or Path(path).name in ("", ".", ".."):
        raise ValueError(f"{method}: path must name a checkpoint directory; got {str(path)!r}")
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise ValueError(f"{method}: {path} is a dangling symlink; pass the directory it should name")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{method}: {path} is under {parent}, which is a file, not a directory")
            break
    if path.exists() and not path.is_dir():
        raise ValueError(f"{method}: {path} exists and is not a directory; refusing to replace it")
    if path.is_dir() and any(path.iterdir()) and not (path / MANIFEST).is_file():
        raise ValueError(
            f"{method}: {path} is a non-empty directory that is not a checkpoint; refusing to replace it"
        )
    return path


def remove_stale_staging(path: Path) -> None:
    """Delete what killed saves of ``path`` left: staging directories and their lock files.

    A save takes the lock file ``.NAME.saving-X.lock`` before it creates the staging
    directory ``.NAME.saving-X`` and drops it after renaming that directory into place:
    a staging directory whose lock no live save holds (or that has none) is stale.
    """
    for staging in path.parent.glob(f".{path.name}.saving-*"):
        if staging.name.endswith(".lock"):
            continue
        try:
            with open(f"{staging}.lock") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live save
        except FileNotFoundError:
            pass
        shutil.rmtree(staging, ignore_errors=True)
    for lock_file in path.parent.glob(f".{path.name}.saving-*.lock"):
        if not Path(str(lock_file).removesuffix(".lock")).exists():
            try:
                with open(lock_file) as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.remove(lock_file)
            except (BlockingIOError, FileNotFoundError):
                continue


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint directory manifest first, so a half-deleted copy never looks complete."""
    try:
        os.remove(path / MANIFEST)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


# -- read -------------------------------------------------------------------------------


def open_regular(file: Path, what: str):
    """``file`` opened for reading if it is a regular file: not a symlink (which could read
    outside the checkpoint), FIFO (which would block), directory or device.

    Raises :class:`CheckpointError` naming ``what`` and the file otherwise, or when it is
    missing.
    """
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{what} {file} is missing") from exc
    except OSError as exc:  # ELOOP: a symlink
        kind = "a symlink" if os.path.islink(file) else f"unreadable ({exc.strerror})"
        raise CheckpointError(
            f"{what} {file} is {kind}; only regular files inside the checkpoint are read"
        ) from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
        raise CheckpointError(f"{what} {file} is {kind}, not a regular file; refusing to read it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def plain_name(value: object) -> bool:
    return isinstance(value, str) and value == Path(value).name and value not in ("", ".", "..")


def _table_problem(key: str, table: object) -> str | None:
    """The first way ``table`` breaks the manifest schema (naming its key), or None."""
    if not isinstance(table, dict):
        return f"{key} must be an object"
    for field in ("dim", "optimizer_state_dim", "header_elems", "width", "row_bytes", "rows", "bytes"):
        if not is_count(table.get(field)):
            return f"{key}.{field} must be an int >= 0; got {table.get(field)!r}"
    if not plain_name(table.get("file")):
        return f"{key}.file must be a plain file name inside the checkpoint; got {table.get('file')!r}"
    if table.get("dtype") not in DTYPES:
        return f"{key}.dtype must be one of {sorted(DTYPES)}; got {table.get('dtype')!r}"
    if table.get("checksum") not in CHECKSUMS:
        return f"{key}.checksum must be one of {sorted(CHECKSUMS)}; got {table.get('checksum')!r}"
    try:
        layout = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
    except ValueError as exc:
        return f"{key}: {exc}"
    derived = {"header_elems": layout.header_elems, "width": layout.width, "row_bytes": layout.row_bytes}
    for field, value in derived.items():
        if table[field] != value:
            return f"{key}.{field} is {table[field]}, but dim, optimizer_state_dim and dtype give {value}"
    if table["bytes"] != table["rows"] * layout.row_bytes:
        return f"{key}.bytes is {table['bytes']}, not rows x row_bytes = {table['rows'] * layout.row_bytes}"
    chunks = table.get("chunks")
    if not isinstance(chunks, list):
        return f"{key}.chunks must be a list"
    offset, rows, last_id = 0, 0, -1
    for i, chunk in enumerate(chunks):
        where = f"{key}.chunks[{i}]"
        if not isinstance(chunk, dict):
            return f"{where} must be an object"
        if not (is_count(chunk.get("rows")) and chunk["rows"] > 0):
            return f"{where}.rows must be an int > 0; got {chunk.get('rows')!r}"
        if chunk.get("offset") != offset:
            return f"{where}.offset is {chunk.get('offset')!r}; the chunks must be contiguous, so it must be {offset}"
        for field in ("min_id", "max_id"):
            if not _is_id(chunk.get(field)):
                return f"{where}.{field} must be an id in [0, 2**63); got {chunk.get(field)!r}"
        if not last_id < chunk["min_id"] <= chunk["max_id"]:
            return (
                f"{where}: ids must ascend across chunks (min_id {chunk['min_id']}, max_id {chunk['max_id']})"
            )
        if not (is_count(chunk.get("crc")) and chunk["crc"] < 2**32):
            return f"{where}.crc must be an unsigned 32-bit int; got {chunk.get('crc')!r}"
        offset += chunk["rows"] * layout.row_bytes
        rows += chunk["rows"]
        last_id = chunk["max_id"]
    if rows != table["rows"]:
        return f"{key}.chunks hold {rows} rows; the table says {table['rows']}"
    first = chunks[0]["min_id"] if chunks else None
    last = chunks[-1]["max_id"] if chunks else None
    if (table.get("min_id"), table.get("max_id")) != (first, last):
        return f"{key}.min_id/max_id must be the first and last chunk's ({first}, {last})"
    return None


def _manifest_problem(manifest: object) -> str | None:
    """The first way ``manifest`` breaks the schema of ``spec/checkpoint_format.md``, or None."""
    if not isinstance(manifest, dict):
        return "the manifest must be a JSON object"
    if manifest.get("format") != FORMAT_NAME:
        return f"format {manifest.get('format')!r} is not {FORMAT_NAME!r}"
    if manifest.get("version") == 2:
        return (
            "format version 2 was saved across ranks (bucket-major, one file per rank): load it with "
            "load_checkpoint(path, module.checkpoint_tables(), process_group=...) on every rank of a "
            "process group (one rank is fine)"
        )
    if manifest.get("version") != FORMAT_VERSION:
        return (
            f"format version {manifest.get('version')!r} is not supported "
            f"(this leanstate reads version {FORMAT_VERSION})"
        )
    tables = manifest.get("tables")
    if not isinstance(tables, dict):
        return "tables must be an object"
    for name, table in tables.items():
        problem = _table_problem(f"tables[{name!r}]", table)
        if problem is not None:
            return problem
    views = manifest.get("views", {})
    if not isinstance(views, dict):
        return "views must be an object"
    for name, view in views.items():
        if not isinstance(view, dict) or view.get("table") not in tables or not is_count(view.get("rows")):
            return f"views[{name!r}] must name a saved table and its rows"
    extra = manifest.get("extra")
    if isinstance(extra, str) and plain_name(extra):  # written before extra had a CRC
        return None
    if extra is not None:
        if not isinstance(extra, dict) or not plain_name(extra.get("file")):
            return f"extra must be null or {{file, bytes, crc}} with a plain file name; got {extra!r}"
        if not (is_count(extra.get("bytes")) and is_count(extra.get("crc")) and extra["crc"] < 2**32):
            return f"extra.bytes and extra.crc must be ints; got {extra!r}"
    return None


def parse_manifest(file: Path) -> object:
    """The JSON in ``file`` (a regular file), or :class:`CheckpointError` naming it for
    anything that is not plain JSON: bad bytes, nesting too deep, numbers too long."""
    with open_regular(file, "manifest") as f:
        text = f.read()
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digits
        message = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{file}: not valid JSON ({type(exc).__name__}: {message})") from exc


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the checkpoint at ``path``, checked against the schema.

    Raises :class:`CheckpointError` naming ``manifest.json`` and the offending key, or
    ``FileNotFoundError`` (with the previous copy an interrupted save left, if complete).
    """
    path = Path(path)
    file = path / MANIFEST
    if not os.path.lexists(file):
        complete = [
            p for p in sorted(path.parent.glob(f".{path.name}.previous-*")) if (p / MANIFEST).is_file()
        ]
        hint = (
            f"; an interrupted save left the previous checkpoint at {complete[0]} (rename it to {path})"
            if complete
            else ""
        )
        raise FileNotFoundError(f"no checkpoint at {path}: {file} does not exist{hint}")
    manifest = parse_manifest(file)
    problem = checked_problem(_manifest_problem, manifest)
    if problem is not None:
        raise CheckpointError(f"{file}: {problem}")
    return manifest


def checked_problem(find_problem: Callable[[object], str | None], manifest: object) -> str | None:
    """``find_problem(manifest)``, where a check that trips over a value of the wrong shape
    (a missing key, a string for a number) is a problem too, not a crash."""
    try:
        return find_problem(manifest)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError, OverflowError) as exc:
        return f"malformed ({type(exc).__name__}: {str(exc)[:200]})"


def read_extra(path: Path, manifest: dict) -> dict[str, object]:
    """The dense ``extra`` state, checked (size, CRC, ``weights_only`` load) before any row moves."""
    extra = manifest["extra"]
    if extra is None:
        if os.path.lexists(path / EXTRA_FILE):
            raise CheckpointError(
                f"{path / MANIFEST} says there is no extra state, but {path / EXTRA_FILE} exists: the "
                "manifest does not describe this checkpoint"
            )
        return {}
    if isinstance(extra, str):  # the form written before extra had a CRC: no size or CRC to check
        extra = {"file": extra}
    file = path / extra["file"]
    with open_regular(file, "extra state file") as f:
        size = os.fstat(f.fileno()).st_size
        if "bytes" in extra and size != extra["bytes"]:  # checked before reading: no allocation
            raise CheckpointError(f"{file} has {size} bytes, the manifest expects {extra['bytes']}")
        data = f.read()
    if "bytes" in extra:  # (the older bare-string form carries no size or CRC)
        if crc32c.crc32c(data) != extra["crc"]:
            raise CheckpointError(f"{file} fails its crc32c check; the file is corrupt")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{file} cannot be loaded with weights_only=True ({type(exc).__name__}: {first_line})"
        ) from exc


def _check_id_range(id_range: object, method: str) -> tuple[int, int] | None:
    """``None`` or ``(lo, hi)``: integers with ``lo <= hi``, half-open, up to 2**63."""
    if id_range is None:
        return None
    if not isinstance(id_range, tuple | list) or len(id_range) != 2:
        raise ValueError(f"{method}: id_range must be None or a pair (lo, hi); got {id_range!r}")
    lo, hi = id_range
    for name, value in (("lo", lo), ("hi", hi)):
        if isinstance(value, bool) or not hasattr(value, "__index__") or not -(2**63) <= int(value) <= 2**63:
            raise ValueError(f"{method}: id_range {name} must be an int in [-2**63, 2**63]; got {value!r}")
    if int(lo) > int(hi):
        raise ValueError(f"{method}: id_range must have lo <= hi; got {id_range!r}")
    return int(lo), int(hi)


def _in_range(keys: torch.Tensor, id_range: tuple[int, int]) -> torch.Tensor:
    """Which ``keys`` lie in the half-open ``id_range`` (bounds may be 2**63, past int64)."""
    lo, hi = id_range
    inside = keys >= max(lo, -(2**63))
    return inside & (keys < hi) if hi < 2**63 else inside


def _chunks_in_range(table: dict, id_range: tuple[int, int] | None) -> list[tuple[int, dict]]:
    chunks = list(enumerate(table["chunks"]))
    if id_range is None:
        return chunks
    lo, hi = id_range
    return [(i, c) for i, c in chunks if c["max_id"] >= lo and c["min_id"] < hi]


def read_chunks(
    path: Path, name: str, table: dict, chunks: list[tuple[int, dict]], slice_bytes: int
) -> Iterator[tuple[int, memoryview | None]]:
    """Yield (chunk index, bytes) in slices of whole rows of at most ``slice_bytes``.

    The checksum of each chunk is accumulated over its slices and checked after its
    last slice, then ``(index, None)`` marks the chunk as verified; the first bad or
    short chunk raises :class:`CheckpointError`. The slices share one buffer: each is
    valid until the next is read.
    """
    file = path / table["file"]
    f = open_regular(file, f"table {name!r}: data file")
    row_bytes = table["row_bytes"]
    slice_rows = max(1, slice_bytes // row_bytes)
    checksum = CHECKSUMS.get(table.get("checksum"))
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
            crc, first_key, last_key = 0, None, -1
            for first in range(0, chunk["rows"], slice_rows):
                view = memoryview(buffer)[: min(slice_rows, chunk["rows"] - first) * row_bytes]
                if f.readinto(view) != len(view):
                    raise CheckpointError(f"table {name!r}: {where} is truncated")
                crc = checksum(view, crc)
                keys = torch.frombuffer(view, dtype=torch.int64).view(-1, row_bytes // 8)[:, 0]
                if bool((keys[1:] <= keys[:-1]).any()) or int(keys[0]) <= last_key:
                    raise CheckpointError(
                        f"table {name!r}: {where}: its row ids do not ascend; the file is corrupt"
                    )
                first_key = int(keys[0]) if first_key is None else first_key
                last_key = int(keys[-1])
                yield index, view
            if crc != chunk["crc"]:
                raise CheckpointError(
                    f"table {name!r}: {where} fails its {table['checksum']} check; the file is corrupt"
                )
            if (first_key, last_key) != (chunk["min_id"], chunk["max_id"]):
                raise CheckpointError(
                    f"table {name!r}: {where} holds ids {first_key}..{last_key}, the manifest says "
                    f"{chunk['min_id']}..{chunk['max_id']}"
                )
            yield index, None


def verify_checkpoint(path: str | os.PathLike) -> Iterator[tuple[str, int, int]]:
    """Check every chunk of every table, then the extra state; yield (table, chunk, rows) as each passes.

    Raises :class:`CheckpointError` naming the file (and chunk) at the first bad one.
    """
    path = Path(path)
    manifest = read_manifest(path)
    for name, table in manifest["tables"].items():
        chunks = _chunks_in_range(table, None)
        for index, buffer in read_chunks(path, name, table, chunks, DEFAULT_CHUNK_BYTES):
            if buffer is None:
                yield name, index, table["chunks"][index]["rows"]
    read_extra(path, manifest)


# -- load -------------------------------------------------------------------------------


def _optimizer_of(state_dim: int, dim: int) -> str:
    """Which of the fused optimizers keeps ``state_dim`` values per row of ``dim`` weights."""
    known = {0: "sgd", 1: "rowwise_adagrad", 2 * dim: "adam"}
    return f"{known[state_dim]}-sized" if state_dim in known else f"{state_dim} state values per row"


def check_layout(where: Path, name: str, table: dict, store: KVStore) -> None:
    layout = store.layout
    saved = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES.get(table["dtype"], torch.float32))
    problems = []
    if table["dtype"] != dtype_name(layout.dtype):
        problems.append(f"dtype {table['dtype']} vs the store's {dtype_name(layout.dtype)}")
    if table["dim"] != layout.dim:
        problems.append(f"dim {table['dim']} vs the store's {layout.dim}")
    if table["optimizer_state_dim"] != layout.state_dim:
        problems.append(
            f"optimizer_state_dim {table['optimizer_state_dim']} vs the store's {layout.state_dim} (saved "
            f"{_optimizer_of(table['optimizer_state_dim'], table['dim'])}, this store "
            f"{_optimizer_of(layout.state_dim, layout.dim)}: build it with the optimizer it was saved with)"
        )
    if not problems and (table["width"], table["row_bytes"]) != (saved.width, saved.row_bytes):
        problems.append(f"width {table['width']} does not match its own dim, state and dtype")
    if problems:
        raise CheckpointError(f"table {name!r} in {where}: " + "; ".join(problems))


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
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{method}: path must be a str or os.PathLike; got {type(path).__name__}")
    path = Path(path)
    check_chunk_bytes(method, chunk_bytes)
    id_range = _check_id_range(id_range, method)
    targets = targets_of(tables, method)
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
        check_layout(path / table["file"], target.name, table, target.store)
        plan.append((target, table, _chunks_in_range(table, id_range)))
    extra = read_extra(path, manifest)  # checked before any row is applied
    # Into stores that hold no row yet, every row is new: verify and apply in one pass,
    # and undo a failure by emptying them again. Rows of a store that already holds some
    # could be overwritten, which cannot be undone: verify every chunk first (pass 1).
    written = [target.store for target, table, _ in plan if table is not None]
    one_pass = all(len(store) == 0 for store in written) and len({id(s) for s in written}) == len(written)
    if not one_pass:
        for target, table, chunks in plan:
            if table is not None:
                for _ in read_chunks(path, target.name, table, chunks, chunk_bytes):
                    pass
    try:
        # Into stores that held rows, every chunk is verified: Ctrl-C waits for the apply to
        # finish (a half-applied store could not be restored), then interrupts.
        with contextlib.nullcontext() if one_pass else _interrupts_deferred():
            _apply(path, manifest, plan, id_range, chunk_bytes, progress)
        return extra
    except BaseException:
        if one_pass:  # rows went into empty stores: empty them again
            for store in written:
                store.delete(store.keys())
        raise


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold SIGINT (Ctrl-C) until the block ends, then raise ``KeyboardInterrupt``."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


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
        reserved = False
        for _, buffer in read_chunks(path, target.name, table, chunks, min(chunk_bytes, SLICE_BYTES)):
            if buffer is None:
                continue
            if not reserved:  # the file's size matched the manifest: grow the store once
                # Rows the store already holds (a resume) need no room: reserving them too
                # would grow a full store by the table's size.
                incoming = sum(chunk["rows"] for _, chunk in chunks)
                target.store.reserve(max(0, incoming - len(target.store)))
                reserved = True
            rows = torch.frombuffer(buffer, dtype=torch.uint8).view(layout.dtype).view(-1, layout.width)
            if id_range is not None:
                rows = rows[_in_range(header_words(rows)[:, 0], id_range)]
            target.store.set_rows(rows)  # keyed by each row's header, for views too
            done += len(rows)
            if progress is not None:
                progress(target.name, done, table["rows"])


def row_wise_id_range(num_embeddings: int, rank: int, world_size: int) -> tuple[int, int]:
    """The ids a rank owns under row-wise sharding (TorchRec's even blocks of ids).

    Rank ``r`` owns ``[r * block, min(num_embeddings, (r + 1) * block))`` with
    ``block = ceil(num_embeddings / world_size)``, except that the last rank's range
    runs to ``2**63``: ids at or above ``num_embeddings`` (hashed ids) are loaded there,
    never dropped, so the ranges of all ranks cover every non-negative id exactly once.
    Pass it as ``id_range``; for hashed ids prefer ``leanstate.bucket_owner``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
    block = -(-num_embeddings // world_size)
    hi = 2**63 if rank == world_size - 1 else min(num_embeddings, (rank + 1) * block)
    return min(num_embeddings, rank * block), hi
