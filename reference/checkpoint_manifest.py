"""The whole-row manifest's rules, stated in the most obvious terms: the format's names and
keys, plain JSON (R2), and every rule a manifest must keep (R3-R8, R11's keys, R12), each a
function that returns the first rule broken, in words, or None. The textbook's loads
(``reference.checkpoint``, ``reference.delta_checkpoint``) check every manifest with
them; see ``spec/checkpoint_format.md``.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import crc32c
import torch

from leanstate.reference.row_format import RowLayout

FORMAT_NAME = "leanstate-whole-row"
FORMAT_VERSION = 1
ACROSS_RANKS_VERSION = 2  # a checkpoint saved across ranks (spec/sharding.md)
MANIFEST = "manifest.json"
EXTRA_FILE = "extra.pt"
DEFAULT_CHUNK_BYTES = 64 * 2**20  # a save cuts its files into chunks of at most this
MAX_NAME_BYTES = 200  # a table file is NAME.rows, and file names stop at 255 bytes
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CHECKSUM = "crc32c"  # new chunks are written with CRC-32C; CRC-32 (zlib) is still read
# name -> checksum(data, running value=0): a chunk's checksum, or one continued over more bytes
CHECKSUMS = {"crc32c": lambda data, crc=0: crc32c.crc32c(data, value=crc), "crc32": zlib.crc32}
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


def parse_manifest(file: Path, data: bytes) -> object:
    """R2: ``data`` (the bytes of ``file``) parsed as plain JSON, or :class:`CheckpointError`."""
    try:
        text = data.decode("utf-8")  # UTF-8 only: json.loads of bytes would take UTF-16 and -32 too
        manifest = json.loads(
            text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants, parse_int=_short_int
        )
    except (ValueError, RecursionError) as exc:  # also bad UTF-8, nesting the parser cannot take
        raise CheckpointError(f"{file}: not plain JSON ({type(exc).__name__}: {str(exc)[:200]})") from exc
    if _depth(manifest) > MAX_DEPTH:
        raise CheckpointError(f"{file}: not plain JSON (nested deeper than {MAX_DEPTH} levels, R2)")
    return manifest


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
    if manifest["version"] == ACROSS_RANKS_VERSION and is_json_int(manifest["version"]):
        return f"version {ACROSS_RANKS_VERSION} was saved across ranks: load it with leanstate.load_checkpoint(..., process_group=)"
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
        problem = name_problem(name) or table_problem(name, table)
        if problem is None and not delta and isinstance(table, dict) and "removed" in table:
            problem = "removed is a delta's key; a table of the full format has none (R12)"
        if problem is not None:
            return f"tables[{name!r}]: {problem}"
    for name, view in views.items():
        problem = name_problem(name) or _view_problem(name, view, tables)
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


def name_problem(name: object) -> str | None:
    """R4: a table name becomes ``NAME.rows``: a plain file name, not starting with '.'."""
    if not isinstance(name, str) or name != Path(name).name or name.startswith(".") or "\0" in name:
        return "must be a plain file name (no '/', not starting with '.')"
    try:
        name.encode()
    except UnicodeEncodeError:
        return "must be encodable as UTF-8"
    return None if 0 < len(name.encode()) <= MAX_NAME_BYTES else f"must be 1 to {MAX_NAME_BYTES} bytes"
