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
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import crc32c
import torch

from leanstate.reference.arguments import int_argument
from leanstate.reference.kv_store import ChangeMark, SupportsRows
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import RowLayout, header_words

FORMAT_NAME = "leanstate-whole-row"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
EXTRA_FILE = "extra.pt"
MAX_NAME_BYTES = 200  # a table file is NAME.rows, and file names stop at 255 bytes
DEFAULT_CHUNK_BYTES = 64 * 2**20
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# new chunks are written with CRC-32C; CRC-32 (zlib) is still read
CHECKSUMS = {"crc32c": lambda data: crc32c.crc32c(data), "crc32": zlib.crc32}
MAX_DEPTH = 64  # R2: a writer nests 4 deep; deeper is refused whatever the parser could take
MAX_INT_DIGITS = 4300  # R2: CPython's default limit, stated so that every reader has it
# R3: every key of each object, all required (what a reader does not list it ignores)
TOP_KEYS = ("format", "version", "tables", "views", "extra")
TABLE_KEYS = (
    "file",
    "dim",
    "optimizer_state_dim",
    "dtype",
    "header_elems",
    "width",
    "row_bytes",
    "rows",
    "bytes",
    "min_id",
    "max_id",
    "checksum",
    "chunks",
)
CHUNK_KEYS = ("offset", "rows", "min_id", "max_id", "crc")
VIEW_KEYS = ("table", "whole_rows", "width_offset", "width", "read_only", "rows")
EXTRA_KEYS = ("file", "bytes", "crc")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or saved: the message names the file (and chunk or table)."""


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
        "checksum": "crc32c",
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
    try:
        text = data.decode("utf-8")  # UTF-8 only: json.loads of bytes would take UTF-16 and -32 too
        manifest = json.loads(
            text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants, parse_int=_short_int
        )
    except (ValueError, RecursionError) as exc:  # also bad UTF-8, nesting the parser cannot take
        raise CheckpointError(f"{file}: not plain JSON ({type(exc).__name__}: {str(exc)[:200]})") from exc
    if _depth(manifest) > MAX_DEPTH:
        raise CheckpointError(f"{file}: not plain JSON (nested deeper than {MAX_DEPTH} levels, R2)")
    problem = (rules or manifest_problem)(manifest)
    if problem is not None:
        raise CheckpointError(f"{file}: {problem}")
    return data, manifest


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(
            f"the key {next(k for k in keys if keys.count(k) > 1)!r} appears twice in one object"
        )
    return dict(pairs)


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _short_int(digits: str) -> int:
    """R2: an integer of at most ``MAX_INT_DIGITS`` digits, whatever the interpreter allows."""
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def _depth(value: object) -> int:
    """How deep arrays and objects nest in ``value`` (a scalar is 0, ``[]`` is 1)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def is_json_int(value: object, low: int = 0, high: int = 2**63) -> bool:
    """A JSON integer in ``[low, high)``: not a bool, not a float such as 0.0 (R3)."""
    return type(value) is int and low <= value < high


def missing_key(entry: dict, keys: tuple[str, ...]) -> str | None:
    """R3: the first of ``keys`` that ``entry`` lacks (every listed key is required), or None."""
    return next((key for key in keys if key not in entry), None)


def manifest_problem(manifest: object) -> str | None:
    """The first rule of ``spec/checkpoint_format.md`` that ``manifest`` breaks, in words, or None."""
    if not isinstance(manifest, dict):
        return "the manifest must be a JSON object"
    missing = missing_key(manifest, ("format", "version"))  # R3: these two first
    if missing is not None:
        return f"the key {missing!r} is missing"
    if manifest["format"] != FORMAT_NAME:
        return f"format {manifest['format']!r} is not {FORMAT_NAME!r}"
    if manifest["version"] == 2 and is_json_int(manifest["version"]):
        return "version 2 was saved across ranks: load it with leanstate.load_checkpoint(..., process_group=)"
    if not is_json_int(manifest["version"]) or manifest["version"] != FORMAT_VERSION:
        return f"version must be the JSON integer {FORMAT_VERSION}; got {manifest['version']!r}"
    return body_problem(manifest, delta=False)


def body_problem(manifest: dict, *, delta: bool) -> str | None:
    """The first rule broken by a manifest's keys after ``format`` and ``version`` (R3-R8, R11's
    keys, R12), or None. ``delta``: whether the format is the delta's, whose own keys (``base``,
    each table's ``removed``) a full manifest must not have (R12) and which checks them itself."""
    if not delta and "base" in manifest:
        return "base is a delta's key; a manifest of the full format has none (R12)"
    missing = missing_key(manifest, TOP_KEYS)
    if missing is not None:
        return f"the key {missing!r} is missing"
    tables, views = manifest["tables"], manifest["views"]
    if not isinstance(tables, dict) or not isinstance(views, dict):
        return "tables and views must be objects"
    for name, table in tables.items():
        problem = _name_problem(name) or table_problem(name, table)
        if problem is None and not delta and isinstance(table, dict) and "removed" in table:
            problem = "removed is a delta's key; a table of the full format has none (R12)"
        if problem is not None:
            return f"tables[{name!r}]: {problem}"
    for name, view in views.items():
        problem = _name_problem(name) or _view_problem(name, view, tables)
        if problem is not None:
            return f"views[{name!r}]: {problem}"
    return extra_problem(manifest["extra"])


def table_problem(name: str, table: object) -> str | None:
    """The first rule a table's entry breaks (its keys, layout, size and chunk list), or None."""
    if not isinstance(table, dict):
        return "must be an object"
    missing = missing_key(table, TABLE_KEYS)
    if missing is not None:
        return f"the key {missing!r} is missing"
    fields = ("dim", "optimizer_state_dim", "header_elems", "width", "row_bytes", "rows", "bytes")
    for field in fields:
        if not is_json_int(table[field]):
            return f"{field} must be a JSON integer >= 0; got {table[field]!r}"
    if table["file"] != f"{name}.rows":
        return f"file must be {name + '.rows'!r}; got {table['file']!r}"
    for field, known in (("dtype", DTYPES), ("checksum", CHECKSUMS)):
        if not isinstance(table[field], str) or table[field] not in known:
            return f"{field} {table[field]!r} is unknown (one of {sorted(known)})"
    try:
        layout = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
    except ValueError as exc:
        return str(exc)
    derived = {"header_elems": layout.header_elems, "width": layout.width, "row_bytes": layout.row_bytes}
    if any(table[field] != value for field, value in derived.items()):
        return "header_elems, width and row_bytes are not what dim, optimizer_state_dim and dtype give"
    if table["bytes"] != table["rows"] * layout.row_bytes:
        return f"bytes is {table['bytes']}, not rows x row_bytes = {table['rows'] * layout.row_bytes}"
    chunks = table["chunks"]
    if not isinstance(chunks, list):
        return "chunks must be a list"
    offset, rows, last_id = 0, 0, -1
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict):
            return f"chunks[{i}] must be an object"
        missing = missing_key(chunk, CHUNK_KEYS)
        if missing is not None:
            return f"chunks[{i}]: the key {missing!r} is missing"
        if not (is_json_int(chunk["rows"], 1) and is_json_int(chunk["crc"], 0, 2**32)):
            return f"chunks[{i}]: rows must be an integer > 0 and crc an unsigned 32-bit integer"
        if not (is_json_int(chunk["offset"]) and chunk["offset"] == offset):
            return (
                f"chunks[{i}].offset is {chunk['offset']!r}; the chunks are back to back, so it is {offset}"
            )
        if not (is_json_int(chunk["min_id"]) and is_json_int(chunk["max_id"])):
            return f"chunks[{i}]: min_id and max_id must be ids in [0, 2**63)"
        if not last_id < chunk["min_id"] <= chunk["max_id"]:
            return f"chunks[{i}]: ids must ascend: min_id {chunk['min_id']} after {last_id}"
        offset, rows = offset + chunk["rows"] * layout.row_bytes, rows + chunk["rows"]
        last_id = chunk["max_id"]
    if rows != table["rows"]:
        return f"the chunks hold {rows} rows; rows says {table['rows']}"
    return ends_problem(table, (chunks[0]["min_id"], chunks[-1]["max_id"]) if chunks else None)


def ends_problem(entry: dict, ends: tuple[int, int] | None) -> str | None:
    """R7 (and D5 for removed ids): ``min_id``/``max_id`` are ids equal to ``ends``, or both
    null where there is nothing (``ends`` None); an id typed ``1.0`` or ``true`` is not an id."""
    found = (entry["min_id"], entry["max_id"])
    if ends is None:
        return None if found == (None, None) else f"min_id and max_id must be null; got {found}"
    if not (is_json_int(found[0]) and is_json_int(found[1]) and found == ends):
        return f"min_id and max_id must be the ids {ends}; got {found}"
    return None


def _view_problem(name: str, view: object, tables: dict) -> str | None:
    """R4 and R8: a view's entry."""
    if name in tables:
        return "a view and a table share this name"
    if not isinstance(view, dict):
        return "must be an object"
    missing = missing_key(view, VIEW_KEYS)
    if missing is not None:
        return f"the key {missing!r} is missing"
    if not isinstance(view["table"], str) or view["table"] not in tables:
        return f"table must name a table of this checkpoint; got {view['table']!r}"
    if not all(isinstance(view[flag], bool) for flag in ("whole_rows", "read_only")):
        return "whole_rows and read_only must be true or false"
    if not all(is_json_int(view[field]) for field in ("width_offset", "width", "rows")):
        return "width_offset, width and rows must be JSON integers >= 0"
    if view["width_offset"] + view["width"] > tables[view["table"]]["width"]:
        return "its columns run past the width of its table"
    return None


def extra_problem(extra: object) -> str | None:
    """``null``, the older bare ``"extra.pt"``, or ``{file: "extra.pt", bytes, crc}``."""
    if extra is None or extra == EXTRA_FILE:
        return None
    if (
        not isinstance(extra, dict)
        or missing_key(extra, EXTRA_KEYS) is not None
        or extra["file"] != EXTRA_FILE
    ):
        return f"extra must be null or an object {{file: {EXTRA_FILE!r}, bytes, crc}}; got {extra!r}"
    if not (is_json_int(extra["bytes"]) and is_json_int(extra["crc"], 0, 2**32)):
        return "extra.bytes and extra.crc must be JSON integers (crc unsigned 32-bit)"
    return None


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
    problem = _name_problem(name)
    if problem is not None:
        raise ValueError(f"table name {name!r}: {problem}")


def _name_problem(name: object) -> str | None:
    """R4: a table name becomes ``NAME.rows``: a plain file name, not starting with '.'."""
    if not isinstance(name, str) or name != Path(name).name or name.startswith(".") or "\0" in name:
        return "must be a plain file name (no '/', not starting with '.')"
    try:
        name.encode()
    except UnicodeEncodeError:
        return "must be encodable as UTF-8"
    return None if 0 < len(name.encode()) <= MAX_NAME_BYTES else f"must be 1 to {MAX_NAME_BYTES} bytes"


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
