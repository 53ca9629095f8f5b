"""The streaming merge of a delta chain: the files of every link of one table read side by
side, for each id the newest link deciding (a row: that row; a removal: no row).

Every file is in saving order: ascending ids (version 1), or ascending (bucket, id)
(version 2, bucket-major; ``bucket_of``'s rule). So the merge holds, per file, one slice
at a time (two with the read-ahead): :func:`merged` takes from every file the entries up
to the smallest last key any of them holds now (no file can later hold a key at or
below it), and resolves that window. The delta's removed-id files are here too:
:func:`write_removed` and :func:`removed_slices`, their checks (rule D6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c
import torch

from leanstate._numpy import np
from leanstate.checkpoint._chunks import TableRead, buckets_of, open_data_file, read_chunks
from leanstate.checkpoint._files import write_synced
from leanstate.checkpoint._format import SLICE_BYTES
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.kv_store import SupportsRows
from leanstate.reference.row_format import header_words

Bucketing = tuple[int, int | None]


@dataclass(frozen=True)
class LinkTable:
    """What a load reads of one table in one link of a chain: its rows' chunks (``read``,
    its files in saving order, bucket-major when ``read.bucketing`` is set) and the
    manifest entries of its removed-id files (none for the full checkpoint at the end).
    ``keep_removed(ids)``: which removed ids this load applies (a rank's buckets), as a
    boolean mask; None keeps them all."""

    path: Path
    read: TableRead
    removed: tuple[dict, ...] = ()
    keep_removed: Callable[[np.ndarray], np.ndarray] | None = None


# -- removed ids --------------------------------------------------------------------------


def write_removed(file: Path, ids: np.ndarray) -> dict:
    """Write the removed ids (int64, in saving order) to ``file``, fsynced; its manifest
    entry (``min_id``/``max_id``: the first and last id of the file)."""
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


def _key(ids: np.ndarray, at: int, bucketing: Bucketing | None) -> tuple[int, int]:
    """The saving-order key (bucket, id) of ``ids[at]`` (bucket 0 when not bucketed)."""
    bucket = 0 if bucketing is None else int(buckets_of(ids[at : at + 1], bucketing)[0])
    return bucket, int(ids[at])


def _in_order(ids: np.ndarray, buckets: np.ndarray | None) -> bool:
    """Whether ``ids`` strictly ascend, by (bucket, id) when ``buckets`` are given."""
    ascending = ids[1:] > ids[:-1]
    if buckets is None:
        return bool(ascending.all())
    step = buckets[1:] - buckets[:-1]
    return bool(((step > 0) | ((step == 0) & ascending)).all())


def removed_slices(
    path: Path, name: str, removed: dict, slice_bytes: int, bucketing: Bucketing | None = None
) -> Iterator[np.ndarray]:
    """A delta table's removed ids in slices (each valid until the next is asked for),
    checked (D6): the file regular and ``bytes`` long, ids non-negative and strictly
    ascending (by (bucket, id) with ``bucketing``), the first and last the manifest's;
    after the last, the CRC-32C."""
    file = path / removed["file"]
    count = removed["ids"]
    order = "ascend" if bucketing is None else "ascend bucket-major (by bucket, then id)"
    with open_data_file(path, name, removed["file"], removed["bytes"]) as f:
        buffer = bytearray(8 * max(1, min(count, slice_bytes // 8)))
        crc, done, first, last = 0, 0, None, None
        while done < count:
            view = memoryview(buffer)[: 8 * min(len(buffer) // 8, count - done)]
            if f.readinto(view) != len(view):
                raise CheckpointError(f"table {name!r}: {file} is truncated")
            crc = crc32c.crc32c(view, value=crc)
            ids = np.frombuffer(view, dtype="<i8")
            buckets = None if bucketing is None else buckets_of(ids, bucketing)
            if (
                not bool((ids >= 0).all())
                or not _in_order(ids, buckets)
                or (last is not None and _key(ids, 0, bucketing) <= last)
            ):
                raise CheckpointError(
                    f"table {name!r}: {file}: the removed ids are negative or do not strictly {order}"
                )
            first = int(ids[0]) if first is None else first
            last, done = _key(ids, len(ids) - 1, bucketing), done + len(ids)
            yield ids
    if crc != removed["crc"]:
        raise CheckpointError(f"table {name!r}: {file} fails its crc32c check; the file is corrupt")
    if count and (first, last[1]) != (removed["min_id"], removed["max_id"]):
        raise CheckpointError(
            f"table {name!r}: {file} holds ids {first}..{last[1]}, the manifest says "
            f"{removed['min_id']}..{removed['max_id']}"
        )


# -- the merge ----------------------------------------------------------------------------


class _Stream:
    """One file of one link, in slices: rows (``uint8 [n, row_bytes]``) with their ids, or
    removed ids. ``rank`` orders the links: the higher, the newer."""

    def __init__(
        self,
        rank: int,
        where: str,
        slices: Iterator,
        row_bytes: int | None,
        bucketing: Bucketing | None,
        keep: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.rank, self.where, self.row_bytes, self.bucketing = rank, where, row_bytes, bucketing
        self._slices, self._keep = slices, keep
        self.ids, self.buckets, self.rows = np.empty(0, dtype=np.int64), None, None
        self.exhausted = False

    def refill(self) -> None:
        for item in self._slices:
            if self.row_bytes is None:
                ids, rows = item, None
                if self._keep is not None:
                    ids = ids[self._keep(ids)]
                    if not len(ids):
                        continue
            else:
                view = item[2]
                if view is None:  # the end of a chunk: its checks passed
                    continue
                rows = np.frombuffer(view, dtype=np.uint8).reshape(-1, self.row_bytes)
                ids = np.frombuffer(view, dtype="<i8")[:: self.row_bytes // 8]
            self.ids, self.rows = ids, rows
            self.buckets = None if self.bucketing is None else buckets_of(ids, self.bucketing)
            return
        self.exhausted = True

    def last(self) -> tuple[int, int]:
        """The saving-order key of the last entry held now."""
        return (0 if self.buckets is None else int(self.buckets[-1])), int(self.ids[-1])

    def take(self, bound: tuple[int, int]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The entries held with keys up to ``bound``: (ids, buckets, rows or None)."""
        if self.buckets is None:
            cut = int(np.searchsorted(self.ids, bound[1], side="right"))
        else:
            lo = int(np.searchsorted(self.buckets, bound[0], side="left"))
            hi = int(np.searchsorted(self.buckets, bound[0], side="right"))
            cut = lo + int(np.searchsorted(self.ids[lo:hi], bound[1], side="right"))
        ids, self.ids = self.ids[:cut], self.ids[cut:]
        buckets = None
        if self.buckets is not None:
            buckets, self.buckets = self.buckets[:cut], self.buckets[cut:]
        if self.rows is None:
            return ids, buckets, None
        rows, self.rows = self.rows[:cut], self.rows[cut:]
        return ids, buckets, rows

    def close(self) -> None:
        close = getattr(self._slices, "close", None)
        if close is not None:
            close()


def _streams(parts: list[LinkTable], slice_bytes: int) -> list[_Stream]:
    """A stream per file of every part (oldest link first; a link's rows files before its
    removed files): each rows file (its chosen chunks), each removed file."""
    streams = []
    for rank, part in enumerate(parts):
        read = part.read
        for file in read.files:
            one = dataclasses.replace(read, files=[file])
            # A thread and two buffers ahead only for a file of several slices (a full link):
            # a delta's file is usually one slice, read as fast as the thread would start.
            ahead = one.rows * read.row_bytes > 2 * slice_bytes
            slices = read_chunks(part.path, one, slice_bytes, ahead=ahead)
            streams.append(_Stream(rank, str(part.path / file.file), slices, read.row_bytes, read.bucketing))
        for removed in part.removed:
            if removed["ids"]:
                slices = removed_slices(part.path, read.name, removed, slice_bytes, read.bucketing)
                where = str(part.path / removed["file"])
                streams.append(_Stream(rank, where, slices, None, read.bucketing, part.keep_removed))
    return streams


def merged(
    parts: list[LinkTable], slice_bytes: int = SLICE_BYTES, *, in_order: bool = True
) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
    """The merge of one table's ``parts`` (oldest link first), in saving order, in windows:
    ``(rows, removed)``, where the newest link naming an id decides. ``rows`` is a list
    of ``uint8 [n, row_bytes]`` arrays of distinct ids, valid until the next window: one
    array in saving order (``in_order``), or each file's winning rows apart (no copy of
    a slice whose rows all win: how a load applies them). Every slice is checked as read."""
    streams = _streams(parts, slice_bytes)
    try:
        while True:
            for stream in streams:
                if not len(stream.ids) and not stream.exhausted:
                    stream.refill()
            live = [stream for stream in streams if len(stream.ids)]
            if not live:
                return
            # No file can later hold a key at or below the smallest last key any holds now.
            bound = min(stream.last() for stream in live)
            yield _resolve([(stream, *stream.take(bound)) for stream in live], in_order)
    finally:
        for stream in streams:
            stream.close()


def _resolve(
    parts: list[tuple[_Stream, np.ndarray, np.ndarray | None, np.ndarray | None]], in_order: bool
) -> tuple[list[np.ndarray], np.ndarray]:
    """One window: for each id, the entry of the newest link wins (of two rows files of one
    link, the later file's, as a full load applies them). ``parts`` come in the streams'
    order: oldest link first, a link's rows before its removed ids."""
    parts = [part for part in parts if len(part[1])]
    if len(parts) == 1:
        _, ids, _, rows = parts[0]
        return ([rows], np.empty(0, dtype=np.int64)) if rows is not None else ([], ids)
    sizes = [len(part[1]) for part in parts]
    ids = np.concatenate([part[1] for part in parts])
    source = np.repeat(np.arange(len(parts)), sizes)  # the part of each entry
    # Stable: equal ids keep the parts' order, so the last of each run is the newest link's.
    # Bucket-major parts sort by (bucket, id): an id has one bucket, so equal ids stay together.
    if parts[0][2] is None:
        order = np.argsort(ids, kind="stable")
    else:
        order = np.lexsort((ids, np.concatenate([part[2] for part in parts])))
    sorted_ids = ids[order]
    same = sorted_ids[1:] == sorted_ids[:-1]
    has_rows = np.array([part[3] is not None for part in parts])
    if same.any():
        ranks = np.array([part[0].rank for part in parts])[source[order]]
        rows_at = has_rows[source[order]]
        clash = same & (ranks[1:] == ranks[:-1]) & (rows_at[1:] != rows_at[:-1])
        if clash.any():
            at = int(np.argmax(clash))
            removal = order[at] if not rows_at[at] else order[at + 1]
            raise CheckpointError(
                f"{parts[source[removal]][0].where}: id {int(sorted_ids[at])} is removed and also a row "
                "of the same delta"
            )
    winners = order[np.append(~same, True)]
    is_row = has_rows[source[winners]]
    won = winners[is_row]  # entries whose row is applied, in saving order
    removed = ids[winners[~is_row]]
    first = np.cumsum([0, *sizes])
    row_parts = [(k, part[3]) for k, part in enumerate(parts) if part[3] is not None]
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


def apply_merge(
    store: SupportsRows,
    parts: list[LinkTable],
    *,
    keep: Callable[[torch.Tensor], torch.Tensor] | None,
    delete: bool,
    slice_bytes: int = SLICE_BYTES,
) -> int:
    """Upsert the merge of ``parts`` into ``store`` (``keep(ids)``: the rows and removals
    this load applies); with ``delete``, delete the winning removals too. Rows applied.

    With ``delete`` the store holds exactly the links below ``parts`` (a load into empty
    stores, the full link read first), so each link is applied in turn, oldest first:
    its rows upserted and its removals deleted over what the links below left is the
    merge's result, without merging the links with each other (one file's slices are
    applied as they were read)."""
    applied = 0
    for group in [[part] for part in parts] if delete else [parts]:
        for pieces, removed in merged(group, slice_bytes, in_order=False):
            for piece in pieces:  # distinct ids: the order they are applied in does not matter
                rows = torch.from_numpy(piece).view(store.layout.dtype).view(-1, store.layout.width)
                if keep is not None:
                    rows = rows[keep(header_words(rows)[:, 0])]
                store.set_rows(rows)
                applied += len(rows)
            if delete and len(removed):
                ids = torch.from_numpy(removed)
                store.delete(ids if keep is None else ids[keep(ids)])
    return applied
