"""The whole-row checkpoint format, stated in the most obvious terms.

A checkpoint is a directory::

    PATH/manifest.json        format, version, and per table: layout, rows, chunk list
    PATH/<table>.rows         the table's whole rows, ascending by id, no gaps
    PATH/extra.pt             optional dense extra state (torch.save; loaded weights_only)

Each row is stored exactly as ``spec/row_format.md`` lays it out (16-byte header,
weight, optimizer state), so one record holds everything the row needs and a load
writes it back by the key in its header. Rows ascend by id, so an id range is a
contiguous byte range. The file is cut into chunks of whole rows; the manifest lists
each chunk's byte offset, row count, smallest and largest id and CRC-32C.

Saving writes every file into a temporary sibling directory, fsyncs it, writes the
manifest last and renames the directory into place. Loading checks the whole manifest
against every rule of the format (``manifest_problem``), opens only regular files of
the expected size, checks every chunk (CRC, ids ascending, the manifest's id range),
and only then applies the rows with ``store.set_rows``. A save, and a load into empty
stores, sets each store's change mark (``store.mark``) to the checkpoint's manifest
digest, which a delta (``reference.delta_checkpoint``) is saved against. This is the
textbook: it leaves out speed and crash-safety (threads, locks, signals, pipelining),
never a check; the hardened ``leanstate.save_checkpoint`` / ``load_checkpoint`` are held
to it by differential tests (identical bytes, loads and error classes). See
``spec/checkpoint_format.md``.

Example::

    >>> save_checkpoint("ckpt", {"user": store})
    >>> load_checkpoint("ckpt", {"user": fresh_store})
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import crc32c
import torch

from leanstate.reference.arguments import int_argument
from leanstate.reference.checkpoint_manifest import (
    CHECKSUM,
    CHECKSUMS,
    DEFAULT_CHUNK_BYTES,
    DTYPES,
    EXTRA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    manifest_problem,
    name_problem,
    parse_manifest,
)
from leanstate.reference.kv_store import ChangeMark, SupportsRows
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import RowLayout, header_words

# -- save -------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, SupportsRows | KVTensor],
    *,
    extra: Mapping[str, object] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Path:
    """Save whole-row tables (and optional dense ``extra`` state) to the directory ``path``.

    ``tables`` maps names to stores or whole-row KVTensors, whose rows are saved, or to
    other views of a store saved under another name, which are recorded (a read-only
    optimizer view costs no bytes: its rows live in the whole rows). Once the checkpoint
    is in place, each saved store's ``mark`` names it, so a delta can be saved against it.
    """
    path = Path(path)
    check_chunk_bytes(chunk_bytes)
    whole, views = split_tables(tables)
    extra_bytes = None if extra is None else serialise_extra(extra)
    temporary = staging_directory(path)
    # the epoch ends before any row is read: a write during the save is in the next delta too
    epochs = {id(store): (store, store.next_epoch()) for store in whole.values()}
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "tables": {}, "views": views, "extra": None}
    for name, store in whole.items():
        file = temporary / f"{name}.rows"
        manifest["tables"][name], _ = write_table(
            store.get_rows, store.layout, store.keys(), file, chunk_bytes
        )
    manifest["extra"] = write_extra(temporary, extra_bytes)
    digest = publish(temporary, path, manifest)
    for store, epoch in epochs.values():  # only now: a failed save leaves the marks where they were
        store.mark = ChangeMark(epoch, digest)
    return path


def staging_directory(path: Path) -> Path:
    """A fresh, empty sibling of ``path`` to write a checkpoint into before it is renamed."""
    temporary = path.parent / f".{path.name}.reference-saving"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    return temporary


def write_extra(temporary: Path, data: bytes | None) -> dict | None:
    """Write ``extra.pt`` (when there is extra state); its manifest entry."""
    if data is None:
        return None
    _write_file(temporary / EXTRA_FILE, data)
    return {"file": EXTRA_FILE, "bytes": len(data), "crc": crc32c.crc32c(data)}


def publish(temporary: Path, path: Path, manifest: dict) -> str:
    """Write the manifest last (it marks the directory complete), then rename the directory
    to ``path``, replacing what was there; the SHA-256 of the manifest bytes written."""
    data = json.dumps(manifest, indent=1).encode()
    _write_file(temporary / MANIFEST, data)
    _fsync_directory(temporary)
    old = path.parent / f".{path.name}.reference-old"
    if path.exists():
        os.rename(path, old)
    os.rename(temporary, path)
    _fsync_directory(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    return hashlib.sha256(data).hexdigest()


def split_tables(tables: Mapping) -> tuple[dict[str, SupportsRows], dict[str, dict]]:
    """(name -> store saved whole, name -> view recorded), checking names and values."""
    if not isinstance(tables, Mapping):
        raise TypeError("save_checkpoint: tables must be a mapping name -> KVStore or KVTensor")
    whole, views = {}, {}
    for name, value in tables.items():
        _check_name(name)
        if isinstance(value, KVTensor) and not _is_whole(value):
            continue
        whole[name] = value.store if isinstance(value, KVTensor) else _checked_store(name, value)
    for name, value in tables.items():
        if isinstance(value, KVTensor) and not _is_whole(value):
            owner = next((n for n, store in whole.items() if store is value.store), None)
            if owner is None:
                raise ValueError(f"save_checkpoint: tables[{name!r}] is a partial view of a store not saved")
            views[name] = dict(table=owner, whole_rows=value.whole_rows, width_offset=value.width_offset)
            views[name].update(width=value.width, read_only=value.read_only, rows=len(value.store))
    return whole, views


def write_table(
    get_rows: Callable[[torch.Tensor], torch.Tensor],
    layout: RowLayout,
    keys: torch.Tensor,
    file: Path,
    chunk_bytes: int,
) -> tuple[dict, list[int]]:
    """Write the rows of ``keys`` (ascending; ``get_rows`` reads them, a store's or the rows of
    a chain) in chunks: the table's manifest entry, and the ids dropped because their row was
    deleted after ``keys`` was listed (their ``used`` bit is clear)."""
    rows_per_chunk = max(1, chunk_bytes // layout.row_bytes)
    chunks, offset, dropped = [], 0, []
    with open(file, "wb") as f:
        for start in range(0, len(keys), rows_per_chunk):
            asked = keys[start : start + rows_per_chunk]
            rows = get_rows(asked).cpu()
            used = header_words(rows)[:, 1] < 0  # bit 63; a missing id reads as zeros
            dropped += asked[~used].tolist()
            rows = rows[used]
            if len(rows) == 0:
                continue
            data = rows.contiguous().view(torch.uint8).numpy().tobytes()
            f.write(data)
            ids = header_words(rows)[:, 0]
            crc = crc32c.crc32c(data)
            chunks.append(
                dict(offset=offset, rows=len(rows), min_id=int(ids[0]), max_id=int(ids[-1]), crc=crc)
            )
            offset += len(data)
        f.flush()
        os.fsync(f.fileno())
    entry = {
        "file": file.name,
        "dim": layout.dim,
        "optimizer_state_dim": layout.state_dim,
        "dtype": str(layout.dtype).removeprefix("torch."),
        "header_elems": layout.header_elems,
        "width": layout.width,
        "row_bytes": layout.row_bytes,
        "rows": offset // layout.row_bytes,
        "bytes": offset,
        "min_id": chunks[0]["min_id"] if chunks else None,
        "max_id": chunks[-1]["max_id"] if chunks else None,
        "checksum": CHECKSUM,
        "chunks": chunks,
    }
    return entry, dropped


def serialise_extra(extra: Mapping[str, object]) -> bytes:
    """``extra`` as ``torch.save`` bytes, refused unless it loads back with ``weights_only=True``."""
    if not isinstance(extra, Mapping):
        raise TypeError("save_checkpoint: extra must be a mapping of names to tensors and plain values")
    file = io.BytesIO()
    torch.save(dict(extra), file)
    try:  # what every load will do with it
        torch.load(io.BytesIO(file.getvalue()), weights_only=True)
    except Exception as exc:
        raise ValueError(f"save_checkpoint: extra must load back with weights_only=True ({exc})") from exc
    return file.getvalue()


# -- load -------------------------------------------------------------------------------


def load_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, SupportsRows | KVTensor],
    *,
    id_range: tuple[int, int] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict[str, object]:
    """Load the named tables from ``path`` into their stores; return the ``extra`` state.

    Each entry of ``tables`` is a store or a whole-row KVTensor (rows are written by the
    key in their header) or a read-only view (a no-op, counted in ``ignored_writes``).
    ``id_range=(lo, hi)`` loads only ids in ``[lo, hi)`` from the chunks that can hold
    them. Every chunk to be read is checked before any row is applied, so a bad
    checkpoint leaves the stores as they were.
    """
    path = Path(path)
    check_chunk_bytes(chunk_bytes)
    if not isinstance(tables, Mapping):
        raise TypeError("load_checkpoint: tables must be a mapping name -> KVStore or KVTensor")
    manifest_bytes, manifest = read_manifest(path)
    plan = []  # (name, store, its table in the manifest, the chunks to read)
    for name, value in tables.items():
        store = store_to_load(name, value, manifest["views"])
        if store is None:
            continue
        if name not in manifest["tables"]:
            raise CheckpointError(f"table {name!r} is not in checkpoint {path}")
        table = manifest["tables"][name]
        check_layout(path, name, table, store.layout)
        chunks = [(i, c) for i, c in enumerate(table["chunks"]) if id_range is None or overlaps(c, id_range)]
        plan.append((name, store, table, chunks))
    extra = read_extra(path, manifest)
    for name, _, table, chunks in plan:  # pass 1: check every chunk
        for _ in read_chunks(path, name, table, chunks):
            pass
    stores = [store for _, store, _, _ in plan]
    was_empty = [len(store) == 0 for store in stores]
    for name, store, table, chunks in plan:  # pass 2: apply
        for rows in read_chunks(path, name, table, chunks):
            if id_range is not None:
                ids = header_words(rows)[:, 0]
                rows = rows[(ids >= id_range[0]) & (ids < id_range[1])]
            store.set_rows(rows)
    mark_loaded(stores, was_empty, hashlib.sha256(manifest_bytes).hexdigest(), id_range)
    return extra


def store_to_load(name: object, value: object, views: dict) -> SupportsRows | None:
    """The store a load writes for the entry ``tables[name] = value``, or None for a
    read-only view, whose ``ignored_writes`` grows by the saved view's ``rows`` instead."""
    _check_name(name)
    if isinstance(value, KVTensor) and value.read_only:
        value.ignored_writes += views.get(name, {}).get("rows", 0)
        return None
    if isinstance(value, KVTensor) and not _is_whole(value):
        raise ValueError(f"load_checkpoint: tables[{name!r}] is a writable partial view")
    return value.store if isinstance(value, KVTensor) else _checked_store(name, value)


def mark_loaded(
    stores: list[SupportsRows], was_empty: list[bool], digest: str, id_range: tuple | None
) -> None:
    """After a load: each store equals the checkpoint only if every store was empty, none
    was loaded twice and every id was loaded; then its mark names the checkpoint, taken
    after the last row. Otherwise the marks stay: every row the load wrote is a tracked
    change since each store's own mark."""
    whole = all(was_empty) and len({id(store) for store in stores}) == len(stores) and id_range is None
    if whole:
        for store in stores:
            store.mark = ChangeMark(store.next_epoch(), digest)


def read_manifest(path: Path, rules: Callable[[object], str | None] | None = None) -> tuple[bytes, dict]:
    """The manifest's bytes, and the manifest parsed as plain JSON (R2) and checked by
    ``rules`` (by default every rule of the full format)."""
    file = path / MANIFEST
    if not os.path.lexists(file):
        raise FileNotFoundError(f"no checkpoint at {path}: {file} does not exist")
    with open_regular(file) as f:
        data = f.read()
    manifest = parse_manifest(file, data)
    problem = (rules or manifest_problem)(manifest)
    if problem is not None:
        raise CheckpointError(f"{file}: {problem}")
    return data, manifest


def check_layout(path: Path, name: str, table: dict, layout: RowLayout) -> None:
    """Load step 2 (and D4 for every link): the saved table (its own fields already agree)
    must have the store's layout."""
    saved = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
    if saved != layout:
        raise CheckpointError(
            f"table {name!r} in {path / MANIFEST} was saved as {saved}; the store is {layout}"
        )


def open_regular(file: Path, size: int | None = None):
    """R1 and R9: ``file`` opened for reading only if it is a regular file of ``size`` bytes (when given).

    ``O_NOFOLLOW`` refuses a symlink (it could point outside the checkpoint, or at
    ``/dev/zero``); ``O_NONBLOCK`` keeps a FIFO from blocking the ``open``, and ``fstat``
    then refuses it, a directory or a device. Comparing the size before any read means
    nothing is read or allocated past what the file really holds.
    """
    try:
        descriptor = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(f"{file} is missing, a symlink or unreadable ({exc.strerror})") from exc
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode) or (size is not None and status.st_size != size):
        os.close(descriptor)
        raise CheckpointError(
            f"{file} is not a regular file of {size} bytes (mode {status.st_mode:o}, {status.st_size} bytes)"
        )
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def read_chunks(path: Path, name: str, table: dict, chunks: list[tuple[int, dict]]) -> Iterator[torch.Tensor]:
    """The rows of each listed (index, chunk), checked: the file is regular and ``bytes``
    long (R1, R9; an empty table's file too, R13), then per chunk (R10) its CRC, strictly ascending ids and the manifest's id range.
    (The manifest's rules already hold: the chunks lie back to back inside ``bytes``.)"""
    file = path / table["file"]
    checksum = CHECKSUMS[table["checksum"]]
    layout = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
    last_id = -1
    with open_regular(file, table["bytes"]) as f:
        for index, chunk in chunks:
            where = f"table {name!r}: chunk {index} of {file}"
            f.seek(chunk["offset"])
            data = f.read(chunk["rows"] * layout.row_bytes)
            if checksum(data) != chunk["crc"]:
                raise CheckpointError(f"{where}: fails its {table['checksum']} check")
            rows = torch.frombuffer(bytearray(data), dtype=layout.dtype).view(chunk["rows"], layout.width)
            ids = header_words(rows)[:, 0]
            if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) <= last_id:
                raise CheckpointError(f"{where}: its row ids do not ascend")
            if (int(ids[0]), int(ids[-1])) != (chunk["min_id"], chunk["max_id"]):
                raise CheckpointError(f"{where}: its ids are not the manifest's min_id..max_id")
            last_id = int(ids[-1])
            yield rows


def read_extra(path: Path, manifest: dict) -> dict[str, object]:
    """R11: the dense extra state, size and CRC checked, loaded with ``weights_only=True``; or
    ``{}`` when the manifest says there is none and nothing named ``extra.pt`` exists."""
    extra = manifest["extra"]
    if extra is None:
        if os.path.lexists(path / EXTRA_FILE):  # the manifest does not describe this directory
            raise CheckpointError(f"{path / MANIFEST} says there is no extra state, but {EXTRA_FILE} exists")
        return {}
    file = path / EXTRA_FILE
    # the form written before extra had a size and CRC (a bare "extra.pt") carries neither
    size, crc = (None, None) if isinstance(extra, str) else (extra["bytes"], extra["crc"])
    with open_regular(file, size) as f:
        data = f.read()
    if crc is not None and crc32c.crc32c(data) != crc:
        raise CheckpointError(f"{file} does not match its crc32c in the manifest")
    try:
        extra = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{file} cannot be loaded with weights_only=True ({exc})") from exc
    if not isinstance(extra, dict):
        raise CheckpointError(f"{file} holds a {type(extra).__name__}, not the dict a save writes")
    return extra


# -- small rules ------------------------------------------------------------------------


def _check_name(name: object) -> None:
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(f"table name {name!r}: {problem}")


def _checked_store(name: str, value: object) -> SupportsRows:
    if not isinstance(value, SupportsRows):
        raise TypeError(f"tables[{name!r}] must be a KVStore or KVTensor; got {type(value).__name__}")
    return value


def check_chunk_bytes(chunk_bytes: object) -> None:
    int_argument(chunk_bytes, "chunk_bytes", low=1, must="a positive int")


def _is_whole(view: KVTensor) -> bool:
    return view.whole_rows and view.width_offset == 0 and view.width == view.store.layout.width


def overlaps(chunk: dict, id_range: tuple[int, int]) -> bool:
    return chunk["max_id"] >= id_range[0] and chunk["min_id"] < id_range[1]


def _write_file(file: Path, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    descriptor = os.open(path, os.O_RDONLY)
    os.fsync(descriptor)
    os.close(descriptor)
