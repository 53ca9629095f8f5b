"""Delta checkpoints: the rows that changed since a base, stated in the most obvious terms.

A delta is a directory laid out as a full checkpoint (``reference.checkpoint``) that
holds only what changed since its base::

    PATH/manifest.json     format "leanstate-whole-row-delta"; base: {path, manifest_sha256}
    PATH/<table>.rows      the rows written since the base and present: a full table's rules
    PATH/<table>.removed   the ids removed since the base and absent: int64 little-endian,
                           strictly ascending, nothing else
    PATH/extra.pt          optional dense extra state at this save, whole

A *chain* is a delta, its base, the base's base, and so on down to a full checkpoint.
Its rows are the full checkpoint's, then for each delta from the oldest to the head its
rows replace or add theirs and its removed ids drop theirs.

Saving a delta asks each store what changed since its change mark (``store.mark``, set by
the last save or a load into empty stores), writes those rows and ids, and moves the
marks to the new delta once it is in place. Loading reads and checks every link's
manifest (``link_problem``) and follows the bases (``read_chain``), then reads and checks
every chunk and removed file a load needs, merges the rows in memory (a dict id -> row,
oldest link first, a removal pops) and only then applies them ascending with
``store.set_rows``. Compaction writes a chain's rows as one full checkpoint. This is the
textbook: it leaves out streaming, threads and crash-safety, never a check; the hardened
``leanstate.save_checkpoint(..., base=)``, ``load_checkpoint`` and ``compact_checkpoint``
are held to it. See ``spec/checkpoint_format.md``, "Delta checkpoints".

Example::

    >>> save_checkpoint("ckpt-0", {"user": store})                     # full
    >>> save_checkpoint("ckpt-1", {"user": store}, base="ckpt-0")      # what changed since
    >>> load_checkpoint("ckpt-1", {"user": fresh_store})               # both, merged
    >>> compact_checkpoint("ckpt-1", "ckpt-full")
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import crc32c
import torch

from leanstate.reference.checkpoint import (
    DEFAULT_CHUNK_BYTES,
    check_chunk_bytes,
    check_layout,
    mark_loaded,
    open_regular,
    overlaps,
    publish,
    read_chunks,
    read_extra,
    read_manifest,
    serialise_extra,
    split_tables,
    staging_directory,
    store_to_load,
    write_extra,
    write_table,
)
from leanstate.reference.checkpoint import save_checkpoint as save_full_checkpoint
from leanstate.reference.checkpoint_manifest import (
    DTYPES,
    EXTRA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    body_problem,
    ends_problem,
    is_json_int,
    manifest_problem,
    missing_key,
)
from leanstate.reference.kv_store import ChangeMark, SupportsRows
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import RowLayout, header_words

DELTA_FORMAT = "leanstate-whole-row-delta"
MAX_CHAIN_LINKS = 1000  # the full checkpoint is at most this link, the head being the first
MAX_BASE_PATH_BYTES = 4096  # PATH_MAX on Linux
REMOVED_KEYS = ("file", "ids", "bytes", "min_id", "max_id", "crc")  # D5: all required
_USED = torch.iinfo(torch.int64).min  # bit 63 of the header's metadata word


class Link(NamedTuple):
    """One checkpoint of a chain: its directory, its checked manifest and that manifest's SHA-256."""

    path: Path
    manifest: dict
    digest: str


# -- save -------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, SupportsRows | KVTensor],
    *,
    base: str | os.PathLike | None = None,
    extra: Mapping[str, object] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Path:
    """Save ``tables`` to the directory ``path``: in full without ``base``, else as a delta
    holding only the rows written and the ids removed since the checkpoint ``base``.

    A delta needs each store's change mark at ``base`` (a full save or a load into empty
    stores puts it there); once the delta is in place the marks move to it, so the next
    delta can be saved against this one.
    """
    if base is None:
        return save_full_checkpoint(path, tables, extra=extra, chunk_bytes=chunk_bytes)
    path, base = Path(path), Path(base)
    check_chunk_bytes(chunk_bytes)
    whole, views = split_tables(tables)
    extra_bytes = None if extra is None else serialise_extra(extra)
    links = read_chain(base)  # every link's manifest (D7 needs them all), no data file
    base_digest = links[0].digest
    _check_base(path, base, whole, links)
    temporary = staging_directory(path)
    # each epoch ends before any row is read: a write during the save is in the next delta too
    epochs = {id(store): (store, store.next_epoch()) for store in whole.values()}
    manifest = {
        "format": DELTA_FORMAT,
        "version": FORMAT_VERSION,
        "base": {"path": Path(os.path.relpath(base, path)).as_posix(), "manifest_sha256": base_digest},
        "tables": {},
        "views": views,
        "extra": None,
    }
    for name, store in whole.items():
        written, removed = store.changes(since=store.mark.epoch)
        file = temporary / f"{name}.rows"
        entry, dropped = write_table(store.get_rows, store.layout, written, file, chunk_bytes)
        # a row deleted while saving is not in the rows: it is removed
        entry["removed"] = _write_removed(
            temporary / f"{name}.removed", sorted({*removed.tolist(), *dropped})
        )
        manifest["tables"][name] = entry
    manifest["extra"] = write_extra(temporary, extra_bytes)
    digest = publish(temporary, path, manifest)
    for store, epoch in epochs.values():  # only now: a failed save leaves the marks where they were
        store.mark = ChangeMark(epoch, digest)
    return path


def _check_base(path: Path, base: Path, whole: dict[str, SupportsRows], links: list[Link]) -> None:
    """A delta of ``whole`` against ``base`` (the first of ``links``, its chain) describes the
    stores only if they are exactly ``base``'s tables and each store's change mark is at
    ``base``; ``path`` lies outside the chain (D7)."""
    manifest, digest = links[0].manifest, links[0].digest
    for name, store in whole.items():
        if name not in manifest["tables"]:
            raise ValueError(
                f"save_checkpoint: table {name!r} is not in the base {base}; save a full checkpoint"
            )
        check_layout(base, name, manifest["tables"][name], store.layout)
        mark = store.mark
        if mark is None or mark.checkpoint != digest:
            raise ValueError(
                f"save_checkpoint: tables[{name!r}]: the store's change mark ({mark}) is not at the base"
                f" {base} (manifest SHA-256 {digest}): save a full checkpoint first"
            )
    unsaved = [name for name in manifest["tables"] if name not in whole]
    if unsaved:
        raise ValueError(f"save_checkpoint: the base {base} has tables {unsaved} that are not saved")
    check_outside_chain(path, links, "save_checkpoint: path")


def check_outside_chain(path: Path, links: list[Link], what: str) -> None:
    """D7: ``path`` (a save's or a compaction's destination) is not a link of the chain
    ``links``, inside one or holding one, since replacing it would delete that link."""
    target = os.path.realpath(path)
    for link in links:
        held = os.path.realpath(link.path)
        if os.path.commonpath([target, held]) in (target, held):
            role = "the base," if link is links[0] else f"{link.path}, a link of the base's chain,"
            raise ValueError(
                f"{what} {path} is {role} lies inside it or holds it (replacing it would destroy"
                " that link): save to another directory, or save a full checkpoint to start a new chain"
            )


def _write_removed(file: Path, ids: list[int]) -> dict:
    """Write the removed ids (ascending) as int64 little-endian; the table's ``removed`` entry."""
    data = struct.pack(f"<{len(ids)}q", *ids)
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {
        "file": file.name,
        "ids": len(ids),
        "bytes": len(data),
        "min_id": ids[0] if ids else None,
        "max_id": ids[-1] if ids else None,
        "crc": crc32c.crc32c(data),
    }


# -- load -------------------------------------------------------------------------------


def load_checkpoint(
    path: str | os.PathLike,
    tables: Mapping[str, SupportsRows | KVTensor],
    *,
    id_range: tuple[int, int] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict[str, object]:
    """Load the named tables from the full checkpoint or chain at ``path``; return the
    head's ``extra`` state.

    Entries are as for a full load (stores, whole-row KVTensors, read-only views). Every
    link's manifest, extra state, chunks and removed ids are checked before any row is
    applied, so a bad chain leaves the stores as they were.
    """
    path = Path(path)
    check_chunk_bytes(chunk_bytes)
    if not isinstance(tables, Mapping):
        raise TypeError("load_checkpoint: tables must be a mapping name -> KVStore or KVTensor")
    links = read_chain(path)
    stores = {}
    for name, value in tables.items():
        store = store_to_load(name, value, links[0].manifest["views"])
        if store is not None:
            stores[name] = store
    for name, store in stores.items():
        _check_table_in_chain(links, name, store.layout)
    extras = [read_extra(link.path, link.manifest) for link in links]  # every link's is checked
    merged = {name: _merged_rows(links, name, id_range) for name in stores}  # pass 1: check, merge
    was_empty = [len(store) == 0 for store in stores.values()]
    for name, store in stores.items():  # pass 2: apply, ascending
        ids = sorted(merged[name])
        per_slice = max(1, chunk_bytes // store.layout.row_bytes)
        for start in range(0, len(ids), per_slice):
            store.set_rows(torch.stack([merged[name][i] for i in ids[start : start + per_slice]]))
    mark_loaded(list(stores.values()), was_empty, links[0].digest, id_range)
    return extras[0]


def read_chain(path: str | os.PathLike) -> list[Link]:
    """The links of the chain at ``path``, head first, down to its full checkpoint: each
    manifest read and checked (``link_problem``), each base found where its delta says, with
    the digest the delta names, within ``MAX_CHAIN_LINKS`` and without a cycle."""
    path = Path(path)
    data, manifest = read_manifest(path, link_problem)
    links = [Link(path, manifest, hashlib.sha256(data).hexdigest())]
    visited = {os.path.realpath(path)}
    while manifest["format"] == DELTA_FORMAT:
        delta, base = links[-1], manifest["base"]
        where = f"{delta.path / MANIFEST}: base.path {base['path']!r}"
        if len(links) == MAX_CHAIN_LINKS:
            raise CheckpointError(
                f"{where}: the chain reaches no full checkpoint within {MAX_CHAIN_LINKS} links"
            )
        # resolved as the system resolves it (symlinks, then ".."), and named so in errors
        try:
            path = Path(os.path.realpath(delta.path / base["path"]))
        except OSError as exc:  # a path the system cannot resolve (too long, a loop of links)
            raise CheckpointError(f"{where}: cannot be resolved ({exc.strerror})") from exc
        if str(path) in visited:
            raise CheckpointError(f"{where}: {path} is already a link of this chain (a cycle)")
        visited.add(str(path))
        try:
            data, manifest = read_manifest(path, link_problem)
        except FileNotFoundError as exc:  # the head may be missing; a base named by a delta may not
            raise CheckpointError(f"{where}: there is no checkpoint at {path}") from exc
        except OSError as exc:  # a name too long to look up, say
            raise CheckpointError(f"{where}: cannot be read ({exc.strerror})") from exc
        digest = hashlib.sha256(data).hexdigest()
        if digest != base["manifest_sha256"]:
            raise CheckpointError(
                f"{where}: {path / MANIFEST} has SHA-256 {digest}, not base.manifest_sha256"
                f" {base['manifest_sha256']}: the base was replaced after this delta was saved"
            )
        if any(link.digest == digest for link in links):
            raise CheckpointError(f"{where}: {path / MANIFEST} is already a link of this chain (a cycle)")
        links.append(Link(path, manifest, digest))
    return links


def _check_table_in_chain(links: list[Link], name: str, layout: RowLayout) -> None:
    """D4: the table is in every link, each with ``layout`` (the store's, or the head's)."""
    for link in links:
        if name not in link.manifest["tables"]:
            raise CheckpointError(
                f"table {name!r} is not in checkpoint {link.path} (tables: {sorted(link.manifest['tables'])})"
            )
        check_layout(link.path, name, link.manifest["tables"][name], layout)


def _merged_rows(links: list[Link], name: str, id_range: tuple[int, int] | None) -> dict[int, torch.Tensor]:
    """id -> row of table ``name`` in the chain (only ids in ``id_range`` when given): every
    chunk the range needs and every removed file read and checked, oldest link first, a
    newer link's row replacing an older one and a removal dropping it."""
    rows_by_id: dict[int, torch.Tensor] = {}
    for link in reversed(links):
        table = link.manifest["tables"][name]
        chunks = [(i, c) for i, c in enumerate(table["chunks"]) if id_range is None or overlaps(c, id_range)]
        row_ids = set()
        for rows in read_chunks(link.path, name, table, chunks):
            for key, row in zip(header_words(rows)[:, 0].tolist(), rows):
                row_ids.add(key)
                if id_range is None or id_range[0] <= key < id_range[1]:
                    rows_by_id[key] = row
        if link.manifest["format"] == DELTA_FORMAT:
            for key in read_removed(link.path, name, table["removed"], row_ids):
                rows_by_id.pop(key, None)
    return rows_by_id


def read_removed(path: Path, name: str, removed: dict, row_ids: set[int]) -> list[int]:
    """The removed ids of table ``name`` in the delta at ``path``, checked (D5 size, D6): the
    CRC-32C, non-negative, strictly ascending, the manifest's min_id and max_id, and none
    also a row of this delta (of the rows read, ``row_ids``)."""
    file = path / removed["file"]
    with open_regular(file, removed["bytes"]) as f:
        data = f.read()
    if crc32c.crc32c(data) != removed["crc"]:
        raise CheckpointError(f"table {name!r}: {file} fails its crc32c check")
    ids = list(struct.unpack(f"<{len(data) // 8}q", data))
    if any(key < 0 for key in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
        raise CheckpointError(
            f"table {name!r}: the ids of {file} are not non-negative and strictly ascending"
        )
    if ((ids[0], ids[-1]) if ids else (None, None)) != (removed["min_id"], removed["max_id"]):
        raise CheckpointError(f"table {name!r}: the ids of {file} are not the manifest's min_id..max_id")
    both = row_ids.intersection(ids)
    if both:
        raise CheckpointError(f"table {name!r}: id {min(both)} of {file} is also a row of {name}.rows")
    return ids


# -- compaction -------------------------------------------------------------------------


def compact_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write the rows of the chain at ``src`` as one full checkpoint at ``dst``, byte for byte
    what a full save of stores holding those rows writes, with the head's views and its
    ``extra.pt`` copied as they are. Every link is checked as a load checks it. ``dst`` may
    not exist unless ``overwrite``, and is never a link of the chain (D7)."""
    src, dst = Path(src), Path(dst)
    check_chunk_bytes(chunk_bytes)
    links = read_chain(src)
    check_outside_chain(dst, links, "compact_checkpoint: dst")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"compact_checkpoint: dst {dst} exists; pass overwrite=True to replace it")
    head = links[0].manifest
    layouts = {}
    for name, table in head["tables"].items():
        layouts[name] = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
        _check_table_in_chain(links, name, layouts[name])
    for link in links:
        read_extra(link.path, link.manifest)
    merged = {name: _merged_rows(links, name, None) for name in head["tables"]}
    extra_bytes = None
    if head["extra"] is not None:  # copied as it is, not saved again: torch.save need not repeat its bytes
        with open_regular(src / EXTRA_FILE) as f:
            extra_bytes = f.read()
    temporary = staging_directory(dst)
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tables": {},
        "views": head["views"],
        "extra": None,
    }
    for name, rows_by_id in merged.items():

        def get_rows(ids: torch.Tensor, rows_by_id: dict = rows_by_id) -> torch.Tensor:
            rows = torch.stack([rows_by_id[i] for i in ids.tolist()])
            header_words(rows)[:, 1] |= _USED  # as a store's set_rows would hold them
            return rows

        keys = torch.tensor(sorted(rows_by_id), dtype=torch.int64)
        file = temporary / f"{name}.rows"
        manifest["tables"][name], _ = write_table(get_rows, layouts[name], keys, file, chunk_bytes)
    manifest["extra"] = write_extra(temporary, extra_bytes)
    publish(temporary, dst, manifest)
    return dst


# -- the rules of a link's manifest -----------------------------------------------------


def link_problem(manifest: object) -> str | None:
    """The first rule a chain link's manifest breaks, in words, or None: a full checkpoint's
    rules (``manifest_problem``) when its format is the full one, else a delta's."""
    if isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME:
        return manifest_problem(manifest)
    return delta_manifest_problem(manifest)


def delta_manifest_problem(manifest: object) -> str | None:
    """The first rule of a delta's manifest that ``manifest`` breaks (D1 first, then D2, a full
    manifest's R3-R8 for its tables, views and extra, and D5), in words, or None."""
    if not isinstance(manifest, dict):
        return "the manifest must be a JSON object"
    missing = missing_key(manifest, ("format", "version"))  # D1: these two before any other key
    if missing is not None:
        return f"the key {missing!r} is missing"
    if manifest["format"] != DELTA_FORMAT:
        return f"format {manifest['format']!r} is neither {DELTA_FORMAT!r} nor {FORMAT_NAME!r}"
    if not is_json_int(manifest["version"]) or manifest["version"] != FORMAT_VERSION:
        return f"version must be the JSON integer {FORMAT_VERSION}; got {manifest['version']!r}"
    if "base" not in manifest:
        return "the key 'base' is missing"
    problem = _base_problem(manifest["base"]) or body_problem(manifest, delta=True)
    if problem is not None:
        return problem
    for name, table in manifest["tables"].items():
        if "removed" not in table:
            return f"tables[{name!r}].removed is missing (each table of a delta lists its removed ids, D5)"
        problem = _removed_problem(name, table["removed"])
        if problem is not None:
            return f"tables[{name!r}].removed: {problem}"
    return None


def _base_problem(base: object) -> str | None:
    """D2, in the manifest: ``base`` is ``{path: a relative path, manifest_sha256: 64 lowercase hex}``."""
    if not isinstance(base, dict):
        return "base must be an object with path and manifest_sha256"
    path = base.get("path")
    if not isinstance(path, str) or not path or "\0" in path or path.startswith("/"):
        return f"base.path must be a non-empty relative path without NUL; got {path!r}"
    try:
        size = len(path.encode())
    except UnicodeEncodeError:  # a lone surrogate, which JSON's \\ud800 can spell
        return "base.path must be encodable as UTF-8"
    if size > MAX_BASE_PATH_BYTES:
        return f"base.path is {size} bytes of UTF-8; at most {MAX_BASE_PATH_BYTES}"
    digest = base.get("manifest_sha256")
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        return f"base.manifest_sha256 must be 64 lowercase hex digits; got {digest!r}"
    return None


def _removed_problem(name: str, removed: object) -> str | None:
    """D5, in the manifest: the entry of table ``name``'s removed ids, every key required."""
    if not isinstance(removed, dict):
        return "must be an object"
    missing = missing_key(removed, REMOVED_KEYS)
    if missing is not None:
        return f"the key {missing!r} is missing"
    if removed["file"] != f"{name}.removed":
        return f"file must be {name + '.removed'!r}; got {removed['file']!r}"
    if not (is_json_int(removed["ids"]) and is_json_int(removed["bytes"])):
        return "ids and bytes must be JSON integers >= 0"
    if removed["bytes"] != 8 * removed["ids"]:
        return f"bytes is {removed['bytes']}, not 8 x ids = {8 * removed['ids']}"
    if not is_json_int(removed["crc"], 0, 2**32):
        return "crc must be an unsigned 32-bit JSON integer"
    if removed["ids"] == 0:
        return ends_problem(removed, None)
    if not (is_json_int(removed["min_id"]) and is_json_int(removed["max_id"])):
        return "min_id and max_id must be ids in [0, 2**63)"
    return None
