"""The whole-row format's schema, as the checkpoint I/O checks it: names, manifest entries,
the manifest's rules, and what a ``tables`` argument means.

Every reader (version 1, version 2 across ranks, DCP's index, ``leanstate inspect``)
validates through these functions, so one manifest rule is written once. The format
itself is stated plainly in ``leanstate.reference.checkpoint`` and
``spec/checkpoint_format.md``; this module is its hardened restatement, held to the
reference by the differential tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from leanstate.reference.arguments import int_argument
from leanstate.reference.checkpoint_manifest import (
    ACROSS_RANKS_VERSION,
    CHECKSUM,
    CHECKSUMS,
    CHUNK_KEYS,
    DEFAULT_CHUNK_BYTES,
    DTYPES,
    EXTRA_FILE,
    EXTRA_KEYS,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    MAX_NAME_BYTES,
    TABLE_KEYS,
    TOP_KEYS,
    VIEW_KEYS,
)
from leanstate.reference.delta_checkpoint import (
    DELTA_FORMAT,
    MAX_BASE_PATH_BYTES,
    MAX_CHAIN_LINKS,
    REMOVED_KEYS,
)
from leanstate.reference.row_format import RowLayout, header_words

# the format's facts, defined once in the textbook
__all__ = [
    "ACROSS_RANKS_VERSION",
    "CHECKSUM",
    "CHECKSUMS",
    "DEFAULT_CHUNK_BYTES",
    "DELTA_FORMAT",
    "DTYPES",
    "EXTRA_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST",
    "MAX_BASE_PATH_BYTES",
    "MAX_CHAIN_LINKS",
    "MAX_NAME_BYTES",
]
# Loads read at most this much at a time: the read, the CRC and the upsert of a slice
# stay in cache (measured faster than whole 64 MiB chunks).
SLICE_BYTES = 4 * 2**20


Progress = Callable[[str, int, int], None]


def check_table_name(name: object, method: str) -> None:
    """A table name becomes ``NAME.rows``: a plain, short, UTF-8 file name not starting with '.'."""
    problem = table_name_problem(name)
    if problem is not None:
        raise ValueError(f"{method}: table name {name!r} {problem}")


def table_name_problem(name: object) -> str | None:
    """How ``name`` fails to be a table name (the same rule for arguments and manifests), or None."""
    if isinstance(name, str):
        try:
            name.encode()
        except UnicodeEncodeError as exc:
            return f"cannot be a file name (not encodable as UTF-8: {exc.reason})"
    if (
        not isinstance(name, str)
        or not plain_name(name)
        or name.startswith(".")
        or "\0" in name
        or len(name.encode()) > MAX_NAME_BYTES
    ):
        return f"must be a plain file name: not empty, no '/', not starting with '.', at most {MAX_NAME_BYTES} bytes"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_chunk_bytes(method: str, chunk_bytes: object) -> None:
    int_argument(chunk_bytes, f"{method}: chunk_bytes", low=1, must="a positive int")


def row_bytes_of(rows: torch.Tensor) -> memoryview:
    return memoryview(rows.contiguous().view(torch.uint8).numpy()).cast("B")


def chunk_entry(rows: torch.Tensor, offset: int, crc: int) -> dict:
    """The manifest entry of one chunk of ``rows`` (id-ascending) written at ``offset``."""
    ids = header_words(rows)[:, 0]
    return {"offset": offset, "rows": len(rows), "min_id": int(ids[0]), "max_id": int(ids[-1]), "crc": crc}


def layout_fields(layout: RowLayout) -> dict:
    """How every manifest and schema states a table's row layout."""
    return {
        "dim": layout.dim,
        "optimizer_state_dim": layout.state_dim,
        "dtype": dtype_name(layout.dtype),
        "header_elems": layout.header_elems,
        "width": layout.width,
        "row_bytes": layout.row_bytes,
    }


def table_entry(layout: RowLayout, file: Path, chunks: list[dict]) -> dict:
    """The manifest entry of one table written to ``file`` as ``chunks``."""
    return {
        "file": file.name,
        **layout_fields(layout),
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


def is_count(value: object) -> bool:
    """A JSON integer in [0, 2**63) (``type`` is ``int``: ``true`` and ``0.0`` are not counts)."""
    return type(value) is int and 0 <= value < 2**63


def is_id(value: object) -> bool:
    """An id: the same range as a count, ``[0, 2**63)``."""
    return is_count(value)


def is_crc(value: object) -> bool:
    return is_count(value) and value < 2**32


def plain_name(value: object) -> bool:
    return isinstance(value, str) and value == Path(value).name and value not in ("", ".", "..")


def table_problem(key: str, table: object, file: str) -> str | None:
    """The first way a version-1 ``table`` breaks the manifest schema (naming its key), or
    None. ``file``: the name its ``file`` must have (``NAME.rows``)."""
    if not isinstance(table, dict):
        return f"{key} must be an object"
    problem = absent_key(key, table, TABLE_KEYS)
    if problem is not None:
        return problem
    if not is_count(table["bytes"]):
        return f"{key}.bytes must be an int >= 0; got {table['bytes']!r}"
    if table["file"] != file:
        return f"{key}.file must be {file!r} (a plain name inside the checkpoint); got {table['file']!r}"
    problem = layout_problem(key, table)
    if problem is not None:
        return problem
    layout = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
    if table["bytes"] != table["rows"] * layout.row_bytes:
        return f"{key}.bytes is {table['bytes']}, not rows x row_bytes = {table['rows'] * layout.row_bytes}"
    chunks = table["chunks"]
    if not isinstance(chunks, list):
        return f"{key}.chunks must be a list"
    offset, rows, last_id = 0, 0, -1
    for i, chunk in enumerate(chunks):
        where = f"{key}.chunks[{i}]"
        if not isinstance(chunk, dict):
            return f"{where} must be an object"
        problem = absent_key(where, chunk, CHUNK_KEYS)
        if problem is not None:
            return problem
        if not (is_count(chunk["rows"]) and chunk["rows"] > 0):
            return f"{where}.rows must be an int > 0; got {chunk['rows']!r}"
        if not is_count(chunk["offset"]) or chunk["offset"] != offset:
            return f"{where}.offset is {chunk['offset']!r}; the chunks must be contiguous, so it must be {offset}"
        for field in ("min_id", "max_id"):
            if not is_id(chunk[field]):
                return f"{where}.{field} must be an id in [0, 2**63); got {chunk[field]!r}"
        if not last_id < chunk["min_id"] <= chunk["max_id"]:
            return (
                f"{where}: ids must ascend across chunks (min_id {chunk['min_id']}, max_id {chunk['max_id']})"
            )
        if not is_crc(chunk["crc"]):
            return f"{where}.crc must be an unsigned 32-bit int; got {chunk['crc']!r}"
        offset += chunk["rows"] * layout.row_bytes
        rows += chunk["rows"]
        last_id = chunk["max_id"]
    if rows != table["rows"]:
        return f"{key}.chunks hold {rows} rows; the table says {table['rows']}"
    if not chunks:
        return id_ends_problem(key, table, None)
    return id_ends_problem(key, table, (chunks[0]["min_id"], chunks[-1]["max_id"]))


# a table's layout keys, the same in both versions (version 2 lists its files elsewhere)
LAYOUT_KEYS = tuple(key for key in TABLE_KEYS if key not in ("file", "bytes", "min_id", "max_id", "chunks"))


def layout_problem(key: str, table: dict) -> str | None:
    """R3 and R5 for a table's layout keys (either version): present, typed, and
    ``header_elems``, ``width`` and ``row_bytes`` what ``dim``, the state and ``dtype`` give."""
    problem = absent_key(key, table, LAYOUT_KEYS)
    if problem is not None:
        return problem
    for field in ("dim", "optimizer_state_dim", "header_elems", "width", "row_bytes", "rows"):
        if not is_count(table[field]):
            return f"{key}.{field} must be an int >= 0; got {table[field]!r}"
    for field, known in (("dtype", DTYPES), ("checksum", CHECKSUMS)):
        if not isinstance(table[field], str) or table[field] not in known:
            return f"{key}.{field} must be one of {sorted(known)}; got {table[field]!r}"
    try:
        layout = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
    except ValueError as exc:
        return f"{key}: {exc}"
    derived = {"header_elems": layout.header_elems, "width": layout.width, "row_bytes": layout.row_bytes}
    for field, value in derived.items():
        if table[field] != value:
            return f"{key}.{field} is {table[field]}, but dim, optimizer_state_dim and dtype give {value}"
    return None


def absent_key(key: str, entry: dict, required: tuple[str, ...]) -> str | None:
    """R3: every listed key is present (read with ``[]`` afterwards, never ``.get``)."""
    missing = next((field for field in required if field not in entry), None)
    return None if missing is None else f"{key}: the required key {missing!r} is missing"


def id_ends_problem(key: str, entry: dict, ends: tuple[int, int] | None) -> str | None:
    """R7 and D5: ``min_id``/``max_id`` are the ids ``ends`` (ids: ``1.0`` and ``true`` are
    not, though Python compares them equal), or both null where ``ends`` is None."""
    found = (entry["min_id"], entry["max_id"])
    if ends is None:
        return (
            None
            if found == (None, None)
            else f"{key}.min_id/max_id must be null (nothing listed); got {found}"
        )
    if not (is_id(found[0]) and is_id(found[1]) and found == ends):
        return f"{key}.min_id/max_id must be the first and last chunk's ids {ends}; got {found}"
    return None


def saved_across_ranks(manifest: object) -> bool:
    """Whether a parsed manifest says version 2 (the JSON integer 2): a sharded save."""
    return (
        isinstance(manifest, dict)
        and is_count(manifest.get("version"))
        and manifest["version"] == ACROSS_RANKS_VERSION
    )


def manifest_problem(manifest: object) -> str | None:
    """The first way ``manifest`` breaks the schema of ``spec/checkpoint_format.md``, or None."""
    if not isinstance(manifest, dict):
        return "the manifest must be a JSON object"
    problem = absent_key("manifest", manifest, ("format", "version"))  # R3: these two first
    if problem is not None:
        return problem
    if manifest["format"] != FORMAT_NAME:
        return f"format {manifest['format']!r} is not {FORMAT_NAME!r}"
    if saved_across_ranks(manifest):
        return (
            "format version 2 was saved across ranks (bucket-major, one file per rank): load it with "
            "load_checkpoint(path, module.checkpoint_tables(), process_group=...) on every rank of a "
            "process group (one rank is fine)"
        )
    if not is_count(manifest["version"]) or manifest["version"] != FORMAT_VERSION:
        return (
            f"format version {manifest['version']!r} is not supported "
            f"(this leanstate reads the JSON integer {FORMAT_VERSION})"
        )
    if "base" in manifest:
        return delta_key_problem("base")
    problem = absent_key("manifest", manifest, TOP_KEYS)
    if problem is not None:
        return problem
    tables = manifest["tables"]
    problem = tables_problem(tables, removed=False)
    if problem is not None:
        return problem
    return views_problem(manifest["views"], tables) or extra_problem(manifest["extra"])


def delta_key_problem(key: str) -> str:
    """R12: a delta's own key found in a manifest whose format is the full one."""
    return (
        f"{key} is a delta's key ({DELTA_FORMAT!r}), but the format is {FORMAT_NAME!r}: a full "
        "checkpoint has none (its base's rows would be lost); the manifest was altered (R12)"
    )


def tables_problem(tables: object, *, removed: bool) -> str | None:
    """The first way a version-1 ``tables`` object breaks the schema (with ``removed``: a
    delta's, each table also listing its removed ids), or None."""
    if not isinstance(tables, dict):
        return "tables must be an object"
    for name, table in tables.items():
        key = f"tables[{name!r}]"
        problem = table_name_problem(name)
        problem = f"{key}: the name {problem}" if problem else table_problem(key, table, f"{name}.rows")
        if problem is None and removed:
            problem = absent_key(key, table, ("removed",)) or removed_problem(
                f"{key}.removed", table["removed"], name
            )
        elif problem is None and "removed" in table:
            problem = delta_key_problem(f"{key}.removed")
        if problem is not None:
            return problem
    return None


def manifest_v2_problem(manifest: dict, format_name: str = FORMAT_NAME) -> str | None:
    """The first way a version-2 (across ranks) ``manifest`` breaks its schema
    (``spec/sharding.md``), or None. ``format_name``: of a full checkpoint, or of a delta."""
    missing = [key for key in ("format", "version", "world_size", "tables", "extra") if key not in manifest]
    if missing:
        return f"the required key {missing[0]!r} is missing"
    if manifest["format"] != format_name:
        return f"format is {manifest['format']!r}, not {format_name!r}"
    full = format_name == FORMAT_NAME
    if full and "base" in manifest:
        return delta_key_problem("base")
    if not isinstance(manifest["tables"], dict):
        return "'tables' must be an object"
    problem = extra_problem(manifest["extra"])
    if problem is not None:
        return problem
    for name, table in manifest["tables"].items():
        key = f"tables[{name!r}]"
        if not isinstance(table, dict) or not isinstance(table.get("files"), list):
            return f"{key} must be an object with a 'files' list"
        problem = layout_problem(key, table)
        if problem is not None:
            return problem
        bucketing = table.get("bucketing")
        if not isinstance(bucketing, dict) or not is_count(bucketing.get("buckets")):
            return f"{key}.bucketing must hold a bucket count"
        total = 0
        for j, f in enumerate(table["files"]):
            if (
                not isinstance(f, dict)
                or not plain_name(f.get("file"))
                or not isinstance(f.get("chunks"), list)
            ):
                return f"{key}.files entries must name a plain file and list its chunks"
            if full and "removed" in f:
                return delta_key_problem(f"{key}.files[{j}].removed")
            offset, previous = 0, None
            for i, chunk in enumerate(f["chunks"]):
                keys = ("offset", "rows", "min_id", "max_id", "bucket", "crc")
                if not isinstance(chunk, dict) or not all(is_count(chunk.get(k)) for k in keys):
                    return f"{f['file']} chunk {i}: needs non-negative integers {', '.join(keys)}"
                if chunk["offset"] != offset:
                    return f"{f['file']} chunk {i}: offset {chunk['offset']}, expected {offset} (contiguous)"
                if previous is not None and (chunk["bucket"], chunk["min_id"]) <= previous:
                    return (
                        f"{f['file']} chunk {i}: (bucket, min_id) ({chunk['bucket']}, {chunk['min_id']}) does not "
                        f"follow the previous chunk's (bucket, max_id) {previous} (rows are bucket-major, ids ascending)"
                    )
                previous = (chunk["bucket"], chunk["max_id"])
                offset += chunk["rows"] * table["row_bytes"]
                total += chunk["rows"]
            if not (is_count(f.get("bytes")) and f["bytes"] == offset):
                return (
                    f"{key}.files[{j}] ({f['file']}): bytes {f.get('bytes')!r} but its chunks cover {offset}"
                )
        if table["rows"] != total:
            return f"{key}: rows {table['rows']} but its chunks hold {total}"
    return None


DELTA_KEYS = ("format", "version", "base", "tables", "views", "extra")
REMOVED_SUFFIX = ".removed"


def is_delta(manifest: object) -> bool:
    """Whether a parsed manifest names the delta format (``spec/checkpoint_format.md``)."""
    return isinstance(manifest, dict) and manifest.get("format") == DELTA_FORMAT


def delta_manifest_problem(manifest: dict) -> str | None:
    """The first way a delta's ``manifest`` breaks its schema (rules D1, D2, D5 and a full
    table's R3-R8 for its rows; version 2: a version-2 table's rules, each file with its
    removed ids), or None."""
    if "version" not in manifest:
        return "the required key 'version' is missing"
    if not is_count(manifest["version"]) or manifest["version"] not in (1, 2):
        return f"format version {manifest['version']!r} of a delta is not supported (this leanstate reads 1 and 2)"
    if manifest["version"] == 2:
        return delta_v2_problem(manifest)
    missing = [key for key in DELTA_KEYS if key not in manifest]
    if missing:
        return f"the required key {missing[0]!r} is missing"
    problem = base_problem(manifest["base"])
    if problem is not None:
        return problem
    tables = manifest["tables"]
    problem = tables_problem(tables, removed=True)
    if problem is not None:
        return problem
    return views_problem(manifest["views"], tables) or extra_problem(manifest["extra"])


def delta_v2_problem(manifest: dict) -> str | None:
    """The first way a version-2 delta's ``manifest`` (saved across ranks, ``spec/
    sharding.md``) breaks its schema, or None: a version-2 manifest's rules with the delta
    format's name, ``base`` (D2), plain table names, and per file its ``rank`` and its
    ``removed`` entry (D5; its ids in bucket-major order, so ``min_id``/``max_id`` are the
    file's first and last, not its extremes)."""
    missing = [key for key in (*DELTA_KEYS, "world_size") if key != "views" and key not in manifest]
    if missing:
        return f"the required key {missing[0]!r} is missing"
    if not (is_count(manifest["world_size"]) and manifest["world_size"] >= 1):
        return f"world_size must be an int >= 1; got {manifest['world_size']!r}"
    problem = base_problem(manifest["base"]) or manifest_v2_problem(manifest, DELTA_FORMAT)
    if problem is not None:
        return problem
    for name, table in manifest["tables"].items():
        problem = table_name_problem(name)
        if problem is not None:
            return f"tables[{name!r}]: the name {problem}"
        for i, entry in enumerate(table["files"]):
            key = f"tables[{name!r}].files[{i}]"
            rank = entry.get("rank")
            if not (is_count(rank) and rank < manifest["world_size"]):
                return f"{key}.rank must be an int in [0, world_size); got {rank!r}"
            problem = removed_problem(
                f"{key}.removed", entry.get("removed"), f"{name}.rank{rank}", ordered=False
            )
            if problem is not None:
                return problem
    return None


def base_problem(base: object) -> str | None:
    """D2: ``{path, manifest_sha256}``, the path relative and plain, the digest 64 hex digits."""
    if not isinstance(base, dict):
        return "base must be an object {path, manifest_sha256}"
    path, digest = base.get("path"), base.get("manifest_sha256")
    if not isinstance(path, str) or not path or "\0" in path or path.startswith("/"):
        return f"base.path must be a non-empty relative path; got {path!r}"
    try:
        too_long = len(path.encode()) > MAX_BASE_PATH_BYTES
    except UnicodeEncodeError:
        return "base.path must be encodable as UTF-8"
    if too_long:
        return f"base.path must be at most {MAX_BASE_PATH_BYTES} bytes"
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        return f"base.manifest_sha256 must be 64 lowercase hex digits; got {str(digest)[:80]!r}"
    return None


def removed_problem(key: str, removed: object, name: str, *, ordered: bool = True) -> str | None:
    """D5: a delta table's removed-ids entry (its file ``NAME.removed``). ``ordered``: the
    ids ascend, so ``min_id <= max_id`` (version 2's bucket-major files need not)."""
    if not isinstance(removed, dict):
        return f"{key} must be an object {{file, ids, bytes, min_id, max_id, crc}}"
    problem = absent_key(key, removed, REMOVED_KEYS)
    if problem is not None:
        return problem
    if removed["file"] != name + REMOVED_SUFFIX:
        return f"{key}.file must be {name + REMOVED_SUFFIX!r}; got {removed['file']!r}"
    if not (is_count(removed["ids"]) and is_count(removed["bytes"]) and is_crc(removed["crc"])):
        return f"{key}.ids and .bytes must be ints >= 0 and .crc an unsigned 32-bit int"
    if removed["bytes"] != 8 * removed["ids"]:
        return f"{key}.bytes is {removed['bytes']}, not 8 x ids = {8 * removed['ids']}"
    ends = (removed["min_id"], removed["max_id"])
    if removed["ids"] == 0:
        return id_ends_problem(key, removed, None)
    if not (is_id(ends[0]) and is_id(ends[1]) and (ends[0] <= ends[1] or not ordered)):
        return f"{key}.min_id/max_id must be ids{' with min_id <= max_id' if ordered else ''}; got {ends}"
    if removed["ids"] == 1 and ends[0] != ends[1]:
        return f"{key}: one id, so min_id and max_id are equal"
    return None


def views_problem(views: object, tables: dict) -> str | None:
    """The first way the ``views`` object breaks the schema, or None."""
    if not isinstance(views, dict):
        return "views must be an object"
    for name, view in views.items():
        key = f"views[{name!r}]"
        problem = table_name_problem(name)
        if problem is not None:
            return f"{key}: the name {problem}"
        if name in tables:
            return f"{key}: a view cannot share its name with a table"
        if not isinstance(view, dict):
            return f"{key} must be an object"
        problem = absent_key(key, view, VIEW_KEYS)
        if problem is not None:
            return problem
        if not isinstance(view["table"], str) or view["table"] not in tables:
            return f"{key}.table must name a table of this checkpoint; got {view['table']!r}"
        if not all(type(view[flag]) is bool for flag in ("whole_rows", "read_only")):
            return f"{key}.whole_rows and .read_only must be true or false"
        if not all(is_count(view[field]) for field in ("width_offset", "width", "rows")):
            return f"{key}.width_offset, .width and .rows must be ints >= 0"
        if view["width_offset"] + view["width"] > tables[view["table"]]["width"]:
            return f"{key}: its columns run past the width of table {view['table']!r}"
    return None


def extra_problem(extra: object) -> str | None:
    """The first way ``extra`` breaks the schema (null, the older bare file name, or
    ``{file, bytes, crc}``, the file always ``extra.pt``), or None."""
    if extra is None or extra == EXTRA_FILE:  # the bare name: written before extra had a CRC
        return None
    if not isinstance(extra, dict) or absent_key("extra", extra, EXTRA_KEYS) or extra["file"] != EXTRA_FILE:
        return f"extra must be null or {{file, bytes, crc}} with file {EXTRA_FILE!r}; got {str(extra)[:200]}"
    if not (is_count(extra["bytes"]) and is_crc(extra["crc"])):
        return f"extra.bytes and extra.crc must be ints (crc unsigned 32-bit); got {extra!r}"
    return None


def checked_problem(find_problem: Callable[[object], str | None], manifest: object) -> str | None:
    """``find_problem(manifest)``, where a check that trips over a value of the wrong shape
    (a missing key, a string for a number) is a problem too, not a crash."""
    try:
        return find_problem(manifest)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError, OverflowError) as exc:
        return f"malformed ({type(exc).__name__}: {str(exc)[:200]})"
