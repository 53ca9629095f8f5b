"""Delta checkpoints: a chain of links (a full checkpoint, then deltas holding the rows
written and the ids removed since their base) read as one streaming merge.

The format is ``leanstate.reference.delta_checkpoint`` (``spec/checkpoint_format.md``,
"Delta checkpoints"); this is its hardened form, over the same checkpoint core as a
full checkpoint: the same manifest read, chunk checks, load transaction and staged
publish. Every file of every link is ascending by id, so the merge holds, per file, one
slice at a time (two with the read-ahead): :func:`merged` takes from every file the ids
up to the smallest last id any of them holds, and for each id the newest link decides.

- :func:`read_chain`: every link from the head to its full checkpoint, each base found
  by its relative path and its manifest's SHA-256 (rules D2, D3);
- :func:`load_chain`: the load of a chain (a full checkpoint is a chain of one link).
  Into empty stores the full link is read in place, as a full load would, and then the
  deltas' merge is applied (upserts and deletes); into stores that hold rows every link
  is verified first and the merge of the whole chain upserted (a removal then leaves
  the store's own row of that id alone: the chain loads as its compaction would);
- :func:`compact` writes the merge as one full checkpoint, byte for byte a full save;
- :func:`save_delta` writes the rows a store changed since its change mark.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np
import torch

from leanstate._checkpoint_chunks import (
    ChunkFile,
    TableRead,
    open_data_file,
    read_chunks,
    rows_per_chunk,
    write_store,
)
from leanstate._checkpoint_files import (
    checked_target,
    publish,
    read_extra,
    read_extra_bytes,
    read_manifest_and_digest,
    staged,
    write_extra,
    write_synced,
)
from leanstate._checkpoint_format import (
    DELTA_FORMAT,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    REMOVED_SUFFIX,
    SLICE_BYTES,
    CheckpointError,
    Progress,
    Target,
    check_layout,
    chunks_in_range,
    in_range,
    is_delta,
    table_entry,
)
from leanstate._checkpoint_load import apply_tables, load_all_or_nothing
from leanstate.reference.kv_store import ChangeMark, SupportsRows
from leanstate.reference.row_format import RowLayout

MAX_LINKS = 1000
_NO_IDS = np.empty(0, dtype=np.int64)
_NO_ROWS = np.empty((0, 0), dtype=np.uint8)


@dataclass(frozen=True)
class Link:
    """One checkpoint of a chain: its directory, checked manifest and the manifest's SHA-256."""

    path: Path
    manifest: dict
    digest: str

    @property
    def delta(self) -> bool:
        return is_delta(self.manifest)

    @property
    def file(self) -> Path:
        return self.path / MANIFEST


def read_chain(path: Path, method: str = "load_checkpoint") -> list[Link]:
    """Every link from the checkpoint at ``path`` down to its full checkpoint, head first.

    Each manifest is checked against its schema; a base must exist, have the digest its
    delta names, and not lead back into the chain; at most ``MAX_LINKS`` links."""
    version, manifest, digest = read_manifest_and_digest(path)
    if version == 2 and not is_delta(manifest):
        raise CheckpointError(
            f"{method}: {path / MANIFEST} was saved across ranks (version 2): pass process_group"
        )
    links = [Link(Path(path), manifest, digest)]
    visited = {os.path.realpath(path)}
    while links[-1].delta:
        link = links[-1]
        if len(links) >= MAX_LINKS:
            raise CheckpointError(
                f"{link.file}: the chain from {path} has more than {MAX_LINKS} links; compact it "
                "(leanstate.compact_checkpoint) and save deltas against the compacted checkpoint"
            )
        base = link.manifest["base"]
        # as the system resolves it (symlinks, then ..): a delta opened through a link finds its base
        base_path = Path(os.path.realpath(link.path / base["path"]))
        if str(base_path) in visited:
            raise CheckpointError(
                f"{link.file}: base.path {base['path']!r} leads back to a link of the chain from {path} (a cycle)"
            )
        visited.add(str(base_path))
        try:
            version, manifest, digest = read_manifest_and_digest(base_path)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{link.file}: its base {base['path']!r} is missing ({exc})") from exc
        if version == 2 and not is_delta(manifest):
            raise CheckpointError(
                f"{link.file}: its base {base_path} was saved across ranks (version 2); a chain of one "
                "process holds version-1 checkpoints"
            )
        if digest != base["manifest_sha256"]:
            raise CheckpointError(
                f"{link.file}: base.manifest_sha256 does not match {base_path / MANIFEST}: the base was "
                "replaced or changed after this delta was saved"
            )
        links.append(Link(base_path, manifest, digest))
    return links


@dataclass(frozen=True)
class _Part:
    """What a load reads of one table in one link: its rows' chunks and its removed ids."""

    link: Link
    read: TableRead
    removed: dict | None  # None: the full checkpoint at the chain's end


def chain_parts(links: list[Link], name: str, store: SupportsRows | None, id_range=None) -> list[_Part]:
    """One table's parts, oldest link first; the table must be in every link with one layout (D4)."""
    parts, layout = [], None if store is None else store.layout
    for link in reversed(links):
        table = link.manifest["tables"].get(name)
        if table is None:
            have = ", ".join(sorted(link.manifest["tables"])) or "none"
            if len(links) == 1:
                raise CheckpointError(f"table {name!r} is not in checkpoint {link.path} (it has: {have})")
            raise CheckpointError(
                f"table {name!r} is not in {link.file} (a link of the chain from {links[0].path}; it has: {have})"
            )
        saved = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
        if layout is None:
            layout = saved
        elif store is None and saved != layout:
            raise CheckpointError(f"table {name!r} in {link.file} was saved as {saved}; its base as {layout}")
        if store is not None:
            check_layout(link.path / table["file"], name, table, store)
        read = TableRead.of_v1(name, table, chunks_in_range(table, id_range))
        parts.append(_Part(link, read, table.get("removed") if link.delta else None))
    return parts


# -- removed ids --------------------------------------------------------------------------


def write_removed(file: Path, ids: np.ndarray) -> dict:
    """Write the removed ids (ascending int64) to ``file``, fsynced; its manifest entry."""
    data = np.ascontiguousarray(ids, dtype="<i8").tobytes()
    write_synced(file, data)
    ends = (int(ids[0]), int(ids[-1])) if len(ids) else (None, None)
    return {
        "file": file.name,
        "ids": len(ids),
        "bytes": len(data),
        "min_id": ends[0],
        "max_id": ends[1],
        "crc": crc32c.crc32c(data),
    }


def removed_slices(path: Path, name: str, removed: dict, slice_bytes: int) -> Iterator[np.ndarray]:
    """A delta table's removed ids in slices (each valid until the next is asked for),
    checked (D6): the file regular and ``bytes`` long, ids non-negative and strictly
    ascending, the first and last the manifest's; after the last, the CRC-32C."""
    file = path / removed["file"]
    count = removed["ids"]
    with open_data_file(path, name, removed["file"], removed["bytes"]) as f:
        buffer = bytearray(8 * max(1, min(count, slice_bytes // 8)))
        crc, done, first, last = 0, 0, None, -1
        while done < count:
            view = memoryview(buffer)[: 8 * min(len(buffer) // 8, count - done)]
            if f.readinto(view) != len(view):
                raise CheckpointError(f"table {name!r}: {file} is truncated")
            crc = crc32c.crc32c(view, value=crc)
            ids = np.frombuffer(view, dtype="<i8")
            if int(ids[0]) <= last or not bool((ids[1:] > ids[:-1]).all()):
                raise CheckpointError(
                    f"table {name!r}: {file}: the removed ids do not strictly ascend from 0"
                )
            first = int(ids[0]) if first is None else first
            last, done = int(ids[-1]), done + len(ids)
            yield ids
    if crc != removed["crc"]:
        raise CheckpointError(f"table {name!r}: {file} fails its crc32c check; the file is corrupt")
    if count and (first, last) != (removed["min_id"], removed["max_id"]):
        raise CheckpointError(
            f"table {name!r}: {file} holds ids {first}..{last}, the manifest says "
            f"{removed['min_id']}..{removed['max_id']}"
        )


# -- the merge ----------------------------------------------------------------------------


class _Stream:
    """One file of one link, in slices: rows (``uint8 [n, row_bytes]``) with their ids, or
    removed ids. ``rank`` orders the links: the higher, the newer."""

    def __init__(self, rank: int, where: str, slices: Iterator, row_bytes: int | None) -> None:
        self.rank, self.where, self.row_bytes = rank, where, row_bytes
        self._slices = slices
        self.ids, self.rows = _NO_IDS, None
        self.exhausted = False

    def refill(self) -> None:
        for item in self._slices:
            if self.row_bytes is None:
                self.ids = item
                return
            view = item[2]
            if view is None:  # the end of a chunk: its checks passed
                continue
            self.rows = np.frombuffer(view, dtype=np.uint8).reshape(-1, self.row_bytes)
            self.ids = np.frombuffer(view, dtype="<i8")[:: self.row_bytes // 8]
            return
        self.exhausted = True

    def take(self, bound: int) -> tuple[np.ndarray, np.ndarray | None]:
        cut = int(np.searchsorted(self.ids, bound, side="right"))
        ids, self.ids = self.ids[:cut], self.ids[cut:]
        if self.rows is None:
            return ids, None
        rows, self.rows = self.rows[:cut], self.rows[cut:]
        return ids, rows

    def close(self) -> None:
        close = getattr(self._slices, "close", None)
        if close is not None:
            close()


def _streams(parts: list[_Part], first_rank: int, slice_bytes: int) -> list[_Stream]:
    streams = []
    for rank, part in enumerate(parts, start=first_rank):
        read = part.read
        # A thread and two buffers ahead only for a file of several slices (a full link):
        # a delta's file is usually one slice, read as fast as the thread would start.
        ahead = read.rows * read.row_bytes > 2 * slice_bytes
        slices = read_chunks(part.link.path, read, slice_bytes, ahead=ahead)
        streams.append(_Stream(rank, f"{part.link.path / read.files[0].file}", slices, read.row_bytes))
        if part.removed is not None and part.removed["ids"]:
            removed = removed_slices(part.link.path, read.name, part.removed, slice_bytes)
            streams.append(_Stream(rank, f"{part.link.path / part.removed['file']}", removed, None))
    return streams


def merged(
    parts: list[_Part], slice_bytes: int = SLICE_BYTES, *, in_order: bool = True
) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
    """The merge of one table's ``parts`` (oldest first), ascending, in windows: ``(rows,
    removed)``, where the newest link naming an id decides. ``rows`` is a list of
    ``uint8 [n, row_bytes]`` arrays of distinct ids, valid until the next window: one
    ascending array (``in_order``), or each file's winning rows apart (no copy of a
    slice whose rows all win: how a load applies them). Every slice is checked as read."""
    streams = _streams(parts, 0, slice_bytes)
    try:
        while True:
            for stream in streams:
                if not len(stream.ids) and not stream.exhausted:
                    stream.refill()
            live = [stream for stream in streams if len(stream.ids)]
            if not live:
                return
            # No file can later hold an id at or below the smallest last id any holds now.
            bound = min(int(stream.ids[-1]) for stream in live)
            yield _resolve([(stream, *stream.take(bound)) for stream in live], in_order)
    finally:
        for stream in streams:
            stream.close()


def _resolve(
    parts: list[tuple[_Stream, np.ndarray, np.ndarray | None]], in_order: bool
) -> tuple[list[np.ndarray], np.ndarray]:
    """One window: for each id, the entry of the newest link wins. ``parts`` come in the
    streams' order: oldest link first, a link's rows before its removed ids."""
    parts = [part for part in parts if len(part[1])]
    if len(parts) == 1:
        _, ids, rows = parts[0]
        return ([rows], _NO_IDS) if rows is not None else ([], ids)
    sizes = [len(part[1]) for part in parts]
    ids = np.concatenate([part[1] for part in parts])
    source = np.repeat(np.arange(len(parts)), sizes)  # the part of each entry
    # Stable: equal ids keep the parts' order, so the last of each run is the newest link's.
    # (The parts are sorted runs: the sort merges them.)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    same = sorted_ids[1:] == sorted_ids[:-1]
    if same.any():
        ranks = np.array([part[0].rank for part in parts])[source[order]]
        clash = same & (ranks[1:] == ranks[:-1])
        if clash.any():
            at = int(np.argmax(clash))
            where = next(part[0].where for part in parts if part[0].rank == ranks[at] and part[2] is None)
            raise CheckpointError(
                f"{where}: id {int(sorted_ids[at])} is removed and also a row of the same delta"
            )
    winners = order[np.append(~same, True)]
    is_row = np.array([part[2] is not None for part in parts])[source[winners]]
    won = winners[is_row]  # entries whose row is applied, ascending by id
    removed = ids[winners[~is_row]]
    first = np.cumsum([0, *sizes])
    row_parts = [(k, part[2]) for k, part in enumerate(parts) if part[2] is not None]
    if not row_parts:
        return [], removed
    won_part = source[won]
    if not in_order:
        pieces = []
        for k, part_rows in row_parts:
            chosen = won[won_part == k] - first[k]
            if len(chosen):
                pieces.append(part_rows if len(chosen) == len(part_rows) else part_rows[chosen])
        return pieces, removed
    rows = np.empty((len(won), row_parts[0][1].shape[1]), dtype=np.uint8)
    for k, part_rows in row_parts:  # one copy of each winning row, straight from its slice
        chosen = won_part == k
        rows[chosen] = part_rows[won[chosen] - first[k]]
    return [rows], removed


# -- load ---------------------------------------------------------------------------------


def load_chain(
    links: list[Link],
    targets: list[Target],
    *,
    id_range,
    chunk_bytes: int,
    progress: Progress | None,
    method: str = "load_checkpoint",
) -> dict[str, object]:
    """Load the chain ``links`` (head first) into ``targets``; the head's extra state."""
    head = links[0]
    plan: list[tuple[Target, list[_Part]]] = []
    views = []
    for target in targets:
        if target.view is not None and target.view.read_only:
            views.append(target)
            continue
        if not target.whole:
            raise ValueError(
                f"{method}: tables[{target.name!r}] is a writable partial view; load whole rows into "
                "the store, a whole-row KVTensor, or pass the view read-only"
            )
        plan.append((target, chain_parts(links, target.name, target.store, id_range)))
    extra = read_extra(head.path, head.manifest)  # checked before any row is applied
    slice_bytes = min(chunk_bytes, SLICE_BYTES)
    keep = None if id_range is None else (lambda ids: in_range(ids, id_range))

    def verify() -> None:
        for _, parts in plan:
            for _ in merged(parts, slice_bytes):
                pass

    def apply(into_empty: bool) -> None:
        chain = len(links) > 1
        if into_empty or not chain:  # the full link as a full load reads it (in place when empty)
            tables = []
            for target, parts in plan:
                report = None if progress is None else _reporter(progress, target.name, parts)
                tables.append((parts[0].read, target.store, keep, report))
            apply_tables(links[-1].path, tables, into_empty=into_empty, slice_bytes=slice_bytes)
        if chain:
            for target, parts in plan:
                # Into empty stores the full link is in already: the deltas' merge goes on top.
                # Into live ones the whole chain's rows are upserted, its removals left alone.
                _apply_merge(target, parts[1:] if into_empty else parts, keep, into_empty, slice_bytes)
        for target in views:  # a read-only view: its rows arrived with the whole rows
            target.view.ignored_writes += head.manifest["views"].get(target.name, {}).get("rows", 0)

    empty = load_all_or_nothing([target.store for target, _ in plan], verify, apply)
    if empty and id_range is None:  # each store now is the head checkpoint: deltas can follow it
        for target, _ in plan:
            target.store.mark = ChangeMark(target.store.next_epoch(), head.digest)
    return extra


def _apply_merge(target: Target, parts: list[_Part], keep, delete: bool, slice_bytes: int) -> None:
    store, layout = target.store, target.store.layout
    for pieces, removed in merged(parts, slice_bytes, in_order=False):
        for piece in pieces:  # distinct ids: the order they are applied in does not matter
            rows = torch.from_numpy(piece).view(layout.dtype).view(-1, layout.width)
            if keep is not None:
                rows = rows[keep(rows.view(torch.int64)[:, 0])]
            store.set_rows(rows)
        if delete and len(removed):
            ids = torch.from_numpy(removed)
            store.delete(ids if keep is None else ids[keep(ids)])


def _reporter(progress: Progress, name: str, parts: list[_Part]):
    total = parts[0].read.rows
    return lambda chunk, done: progress(name, done, total)


def verify_chain(links: list[Link]) -> Iterator[Link]:
    """Check every table of every link (every chunk and removed file, each table in the
    links below with one layout, D6) and each link's extra state; yield each link, head
    first, once it passed."""
    for depth, link in enumerate(links):
        for name in link.manifest["tables"]:
            for _ in merged(chain_parts(links[depth:], name, None)[-1:]):  # this link's own files
                pass
        read_extra(link.path, link.manifest)
        yield link


# -- compaction ---------------------------------------------------------------------------


def compact(src: Path, dst: Path, *, chunk_bytes: int, method: str) -> Path:
    """Merge the chain at ``src`` into one full checkpoint at ``dst`` (see
    ``leanstate.compact_checkpoint``)."""
    links = read_chain(src, method)
    dst = checked_target(dst, method)
    taken = {os.path.realpath(link.path) for link in links}
    if os.path.realpath(dst) in taken or any(os.path.realpath(dst).startswith(t + os.sep) for t in taken):
        raise ValueError(f"{method}: dst {dst} is a link of the chain being compacted (or inside one)")
    head = links[0]
    parts = {name: chain_parts(links, name, None) for name in head.manifest["tables"]}
    read_extra(head.path, head.manifest)  # checked as a load checks it
    extra_bytes = read_extra_bytes(head.path, head.manifest)
    with staged(dst, method) as staging:
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "tables": {},
            "views": head.manifest["views"],
            "extra": None,
        }
        for name, table_parts in parts.items():
            table = head.manifest["tables"][name]
            layout = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
            file = staging / f"{name}.rows"
            chunks = _write_merge(file, layout, table_parts, chunk_bytes)
            manifest["tables"][name] = table_entry(layout, file, chunks)
        if extra_bytes is not None:
            manifest["extra"] = write_extra(staging, extra_bytes)
        publish(staging, dst, manifest=manifest)
    return dst


def _write_merge(file: Path, layout: RowLayout, parts: list[_Part], chunk_bytes: int) -> list[dict]:
    """The merge of ``parts`` written to ``file`` in chunks of a full save's size."""
    per_chunk = rows_per_chunk(layout, chunk_bytes)
    buffers = [np.empty((per_chunk, layout.row_bytes), dtype=np.uint8) for _ in range(2)]
    sink = ChunkFile(file, pipelined=True)
    filled, turn = 0, 0
    try:
        for pieces, _ in merged(parts):
            rows = pieces[0] if pieces else _NO_ROWS
            at = 0
            while at < len(rows):
                take = min(per_chunk - filled, len(rows) - at)
                buffers[turn][filled : filled + take] = rows[at : at + take]
                filled, at = filled + take, at + take
                if filled == per_chunk:
                    # append waits for the write before it: the other buffer is free again
                    sink.append(_as_rows(buffers[turn], layout))
                    filled, turn = 0, 1 - turn
        if filled:
            sink.append(_as_rows(buffers[turn][:filled], layout))
        return sink.close()
    except BaseException:
        sink.abort()
        raise


def _as_rows(data: np.ndarray, layout: RowLayout) -> torch.Tensor:
    return torch.from_numpy(data).view(layout.dtype).view(-1, layout.width)


# -- save ---------------------------------------------------------------------------------


def save_delta(
    path: Path,
    whole: Mapping[str, Target],
    views: dict,
    base: object,
    extra_bytes: bytes | None,
    *,
    chunk_bytes: int,
    pipelined: bool,
    progress: Progress | None,
    method: str,
) -> Path:
    """Write the rows each store changed since its change mark at ``base`` (``spec/
    checkpoint_format.md``, "Delta checkpoints", Save); move the marks once published."""
    if not isinstance(base, str | os.PathLike):
        raise TypeError(f"{method}: base must be the path of a checkpoint (str or os.PathLike); got {base!r}")
    base = Path(base)
    try:
        version, base_manifest, digest = read_manifest_and_digest(base)
    except FileNotFoundError as exc:
        raise ValueError(f"{method}: base={str(base)!r} is not a checkpoint ({exc})") from exc
    if version == 2 and not is_delta(base_manifest):
        raise ValueError(f"{method}: base {base} was saved across ranks; save its delta with process_group=")
    resolved, base_resolved = os.path.realpath(path), os.path.realpath(base)
    if resolved == base_resolved or resolved.startswith(base_resolved + os.sep):
        raise ValueError(
            f"{method}: path {path} is the base checkpoint (or inside it): save the delta beside it"
        )
    saved = base_manifest["tables"]
    if set(whole) != set(saved):
        raise ValueError(
            f"{method}: a delta saves the tables of its base; base {base} has {sorted(saved)}, "
            f"tables has {sorted(whole)}"
        )
    for name, target in whole.items():
        try:
            check_layout(base / saved[name]["file"], name, saved[name], target.store)
        except CheckpointError as exc:
            raise ValueError(f"{method}: tables[{name!r}] does not match its base: {exc}") from exc
        mark = getattr(target.store, "mark", None)
        if mark is None or mark.checkpoint != digest:
            raise ValueError(
                f"{method}: tables[{name!r}]: the store's changes are not tracked since base {base} "
                f"({'it has no change mark' if mark is None else 'its change mark is at another checkpoint'}); "
                "save a full checkpoint first (base=None), then deltas against it"
            )
    epochs, changes = {}, {}
    for name, target in whole.items():  # before any row is read: later writes go to the next delta
        epochs[name] = target.store.next_epoch()
        changes[name] = target.store.changes(since=target.store.mark.epoch)
    with staged(path, method) as staging:
        manifest = {
            "format": DELTA_FORMAT,
            "version": 1,
            "base": {"path": Path(os.path.relpath(base, path)).as_posix(), "manifest_sha256": digest},
            "tables": {},
            "views": views,
            "extra": None,
        }
        for name, target in whole.items():
            written, removed = changes[name]
            file = staging / f"{name}.rows"
            dropped: list[torch.Tensor] = []
            report = None if progress is None else (lambda done, total, n=name: progress(n, done, total))
            chunks = write_store(
                target.store,
                file,
                chunk_bytes,
                keys=written,
                dropped=dropped,
                pipelined=pipelined,
                progress=report,
            )
            entry = table_entry(target.store.layout, file, chunks)
            gone = torch.cat([removed.cpu(), *dropped]).numpy() if dropped else removed.cpu().numpy()
            entry["removed"] = write_removed(staging / f"{name}{REMOVED_SUFFIX}", np.unique(gone))
            manifest["tables"][name] = entry
        if extra_bytes is not None:
            manifest["extra"] = write_extra(staging, extra_bytes)
        data = json.dumps(manifest, indent=1).encode()
        publish(staging, path, manifest=data)
    set_marks(whole, epochs, data)
    return path


def set_marks(whole: Mapping[str, Target], epochs: dict[str, int], manifest: bytes) -> None:
    """Once a save is published: each store's changes are tracked since it."""
    digest = hashlib.sha256(manifest).hexdigest()
    for name, target in whole.items():
        target.store.mark = ChangeMark(epochs[name], digest)
