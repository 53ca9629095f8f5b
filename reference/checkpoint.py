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
manifest last and renames the directory into place. Loading reads the manifest,
checks every chunk (size, CRC, ids ascending, the manifest's id range) before any row
is applied, then applies the rows chunk by chunk with ``store.set_rows``. This module
is the reference: no threads, locks, signal handling or pipelining; ``leanstate``'s
``save_checkpoint`` / ``load_checkpoint`` are the hardened, faster implementation,
held to this one by differential tests (identical bytes, identical loads, the same
error classes). See ``spec/checkpoint_format.md``.

Example::

    >>> save_checkpoint("ckpt", {"user": store})
    >>> load_checkpoint("ckpt", {"user": fresh_store})
"""

from __future__ import annotations

import io
import json
import os
import shutil
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import crc32c
import torch

from leanstate.reference.kv_store import SupportsRows
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import RowLayout, header_words

FORMAT_NAME = "leanstate-whole-row"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
EXTRA_FILE = "extra.pt"
DEFAULT_CHUNK_BYTES = 64 * 2**20
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# new chunks are written with CRC-32C; CRC-32 (zlib) is still read
CHECKSUMS = {"crc32c": lambda data: crc32c.crc32c(data), "crc32": zlib.crc32}


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
    optimizer view costs no bytes: its rows live in the whole rows).
    """
    path = Path(path)
    _check_chunk_bytes(chunk_bytes)
    whole, views = _split_tables(tables)
    temporary = path.parent / f".{path.name}.reference-saving"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "tables": {}, "views": views, "extra": None}
    for name, store in whole.items():
        manifest["tables"][name] = _write_table(store, temporary / f"{name}.rows", chunk_bytes)
    if extra is not None:
        data = _serialise(extra)
        _write_file(temporary / EXTRA_FILE, data)
        manifest["extra"] = {"file": EXTRA_FILE, "bytes": len(data), "crc": crc32c.crc32c(data)}
    _write_file(temporary / MANIFEST, json.dumps(manifest, indent=1).encode())  # last: marks it complete
    _fsync_directory(temporary)
    old = path.parent / f".{path.name}.reference-old"
    if path.exists():
        os.rename(path, old)
    os.rename(temporary, path)
    _fsync_directory(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    return path


def _split_tables(tables: Mapping) -> tuple[dict[str, SupportsRows], dict[str, dict]]:
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
                raise ValueError(
                    f"save_checkpoint: tables[{name!r}] is a partial view whose store is not saved"
                )
            views[name] = {
                "table": owner,
                "whole_rows": value.whole_rows,
                "width_offset": value.width_offset,
                "width": value.width,
                "read_only": value.read_only,
                "rows": len(value.store),
            }
    return whole, views


def _write_table(store: SupportsRows, file: Path, chunk_bytes: int) -> dict:
    """Write every row of ``store``, ascending by id, in chunks; the table's manifest entry."""
    layout = store.layout
    keys = store.keys()
    rows_per_chunk = max(1, chunk_bytes // layout.row_bytes)
    chunks, offset = [], 0
    with open(file, "wb") as f:
        for start in range(0, len(keys), rows_per_chunk):
            rows = store.get_rows(keys[start : start + rows_per_chunk]).cpu()
            data = rows.contiguous().view(torch.uint8).numpy().tobytes()
            f.write(data)
            ids = header_words(rows)[:, 0]
            chunks.append(
                {
                    "offset": offset,
                    "rows": len(rows),
                    "min_id": int(ids[0]),
                    "max_id": int(ids[-1]),
                    "crc": crc32c.crc32c(data),
                }
            )
            offset += len(data)
        f.flush()
        os.fsync(f.fileno())
    return {
        "file": file.name,
        "dim": layout.dim,
        "optimizer_state_dim": layout.state_dim,
        "dtype": str(layout.dtype).removeprefix("torch."),
        "header_elems": layout.header_elems,
        "width": layout.width,
        "row_bytes": layout.row_bytes,
        "rows": len(keys),
        "bytes": offset,
        "min_id": chunks[0]["min_id"] if chunks else None,
        "max_id": chunks[-1]["max_id"] if chunks else None,
        "checksum": "crc32c",
        "chunks": chunks,
    }


def _serialise(extra: Mapping[str, object]) -> bytes:
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
    _check_chunk_bytes(chunk_bytes)
    if not isinstance(tables, Mapping):
        raise TypeError("load_checkpoint: tables must be a mapping name -> KVStore or KVTensor")
    manifest = _read_manifest(path)
    plan = []  # (store, its table in the manifest, the chunks to read)
    for name, value in tables.items():
        _check_name(name)
        if isinstance(value, KVTensor) and value.read_only:
            value.ignored_writes += manifest.get("views", {}).get(name, {}).get("rows", 0)
            continue
        if isinstance(value, KVTensor) and not _is_whole(value):
            raise ValueError(f"load_checkpoint: tables[{name!r}] is a writable partial view")
        store = value.store if isinstance(value, KVTensor) else _checked_store(name, value)
        if name not in manifest["tables"]:
            raise CheckpointError(f"table {name!r} is not in checkpoint {path}")
        table = manifest["tables"][name]
        _check_layout(path, name, table, store.layout)
        chunks = [(i, c) for i, c in enumerate(table["chunks"]) if id_range is None or _overlaps(c, id_range)]
        plan.append((name, store, table, chunks))
    extra = _read_extra(path, manifest)
    for name, _, table, chunks in plan:  # pass 1: check every chunk
        for _ in _read_chunks(path, name, table, chunks):
            pass
    for name, store, table, chunks in plan:  # pass 2: apply
        for rows in _read_chunks(path, name, table, chunks):
            if id_range is not None:
                ids = header_words(rows)[:, 0]
                rows = rows[(ids >= id_range[0]) & (ids < id_range[1])]
            store.set_rows(rows)
    return extra


def _read_manifest(path: Path) -> dict:
    file = path / MANIFEST
    if not file.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: {file} does not exist")
    try:
        manifest = json.loads(file.read_bytes())
    except ValueError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{file}: not a {FORMAT_NAME} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format version {manifest.get('version')!r} is not {FORMAT_VERSION}")
    if not isinstance(manifest.get("tables"), dict):
        raise CheckpointError(f"{file}: tables must be an object")
    return manifest


def _check_layout(path: Path, name: str, table: dict, layout: RowLayout) -> None:
    """The saved table must have the store's layout, and its own fields must agree."""
    try:
        saved = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
        agrees = (table["header_elems"], table["width"], table["row_bytes"]) == (
            saved.header_elems,
            saved.width,
            saved.row_bytes,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"table {name!r} in {path / MANIFEST} is malformed ({exc!r})") from exc
    if not agrees:
        raise CheckpointError(f"table {name!r} in {path / MANIFEST}: its width does not match its layout")
    if saved != layout:
        raise CheckpointError(
            f"table {name!r} in {path / MANIFEST} was saved as {saved}; the store is {layout}"
        )


def _read_chunks(
    path: Path, name: str, table: dict, chunks: list[tuple[int, dict]]
) -> Iterator[torch.Tensor]:
    """The rows of each listed (index, chunk), checked: the file's size, then per chunk
    its length, CRC, strictly ascending ids and the manifest's id range."""
    file = path / table["file"]
    if not file.is_file() or file.is_symlink():
        raise CheckpointError(f"table {name!r}: data file {file} is missing or not a regular file")
    if file.stat().st_size != table["bytes"]:
        raise CheckpointError(f"table {name!r}: {file} has {file.stat().st_size} bytes, not {table['bytes']}")
    checksum = CHECKSUMS.get(table.get("checksum"))
    layout = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
    last_id = -1
    with open(file, "rb") as f:
        for index, chunk in chunks:
            where = f"table {name!r}: chunk {index} of {file}"
            try:
                offset, count, crc = chunk["offset"], chunk["rows"], chunk["crc"]
                f.seek(offset)
                data = f.read(count * layout.row_bytes)
            except (KeyError, TypeError, ValueError, OSError) as exc:
                raise CheckpointError(f"{where}: malformed entry ({exc!r})") from exc
            if len(data) != count * layout.row_bytes or count == 0:
                raise CheckpointError(f"{where}: has {len(data)} bytes, not {count} rows")
            if checksum is None or checksum(data) != crc:
                raise CheckpointError(f"{where}: fails its {table.get('checksum')} check")
            rows = torch.frombuffer(bytearray(data), dtype=layout.dtype).view(count, layout.width)
            ids = header_words(rows)[:, 0]
            if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) <= last_id:
                raise CheckpointError(f"{where}: its row ids do not ascend")
            if (int(ids[0]), int(ids[-1])) != (chunk.get("min_id"), chunk.get("max_id")):
                raise CheckpointError(f"{where}: its ids are not the manifest's min_id..max_id")
            last_id = int(ids[-1])
            yield rows


def _read_extra(path: Path, manifest: dict) -> dict[str, object]:
    """The dense extra state: size and CRC checked, loaded with ``weights_only=True``."""
    extra = manifest.get("extra")
    if extra is None:
        return {}
    if isinstance(extra, str):  # the form written before extra had a size and CRC
        extra = {"file": extra}
    file = path / extra["file"]
    if not file.is_file():
        raise CheckpointError(f"extra state file {file} is missing")
    data = file.read_bytes()
    if "bytes" in extra and (len(data) != extra["bytes"] or crc32c.crc32c(data) != extra["crc"]):
        raise CheckpointError(f"{file} does not match its size and crc32c in the manifest")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{file} cannot be loaded with weights_only=True ({exc})") from exc


# -- small rules ------------------------------------------------------------------------


def _check_name(name: object) -> None:
    """A table name becomes ``NAME.rows``: a plain file name, not starting with '.'."""
    if (
        not isinstance(name, str)
        or name != Path(name).name
        or name in ("", ".", "..")
        or name.startswith(".")
    ):
        raise ValueError(f"table name {name!r} must be a plain file name")


def _checked_store(name: str, value: object) -> SupportsRows:
    if not isinstance(value, SupportsRows):
        raise TypeError(f"tables[{name!r}] must be a KVStore or KVTensor; got {type(value).__name__}")
    return value


def _check_chunk_bytes(chunk_bytes: object) -> None:
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int; got {chunk_bytes!r}")


def _is_whole(view: KVTensor) -> bool:
    return view.whole_rows and view.width_offset == 0 and view.width == view.store.layout.width


def _overlaps(chunk: dict, id_range: tuple[int, int]) -> bool:
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
