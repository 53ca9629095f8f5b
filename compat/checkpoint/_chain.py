"""Delta checkpoints: a chain of links (a full checkpoint, then deltas holding the rows
written and the ids removed since their base) read as one streaming merge.

The format is ``spec/checkpoint_format.md``, "Delta checkpoints" (version 1, one
process; version 2 across ranks is ``spec/sharding.md``, loaded by
``leanstate.checkpoint.sharded`` over the same chain and merge); this is its hardened
form, over the same checkpoint core as a full checkpoint: the same manifest read, chunk
checks, load transaction and staged publish. Every file of every link is in saving
order, so the links load as one streaming merge (``leanstate.checkpoint._merge``): for
each id the newest link decides.

- :func:`read_chain`: every link from the head to its full checkpoint, each base found
  by its relative path and its manifest's SHA-256, all of one version (rules D2, D3);
- :func:`load_chain`: the load of a chain (a full checkpoint is a chain of one link).
  Into empty stores the full link is read in place, as a full load would, and then the
  deltas' merge is applied (upserts and deletes); into stores that hold rows every link
  is verified first and the merge of the whole chain upserted (a removal then leaves
  the store's own row of that id alone: the chain loads as its compaction would);
- compaction, the merge written as one full checkpoint, is ``_compaction``'s;
- :func:`delta_base` checks what a version-1 delta needs of its base; the one writer of
  both versions, full or delta, is ``_writer``'s.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from leanstate.checkpoint._arguments import Target, check_layout, chunks_in_range, in_range
from leanstate.checkpoint._chunks import (
    TableRead,
)
from leanstate.checkpoint._files import (
    read_extra,
    read_manifest_and_digest,
)
from leanstate.checkpoint._format import (
    DTYPES,
    MANIFEST,
    MAX_CHAIN_LINKS,
    SLICE_BYTES,
    Progress,
    is_delta,
)
from leanstate.checkpoint._load import apply_tables, load_all_or_nothing, verify_table
from leanstate.checkpoint._merge import LinkTable, apply_merge, merged
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.kv_store import ChangeMark, SupportsRows
from leanstate.reference.row_format import RowLayout


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

    @property
    def version(self) -> int:
        """1: saved by one process; 2: saved across ranks (``spec/sharding.md``)."""
        return self.manifest["version"]


def read_chain(
    path: Path, method: str = "load_checkpoint", head: tuple[dict, str] | None = None
) -> list[Link]:
    """Every link from the checkpoint at ``path`` down to its full checkpoint, head first
    (one link for a full checkpoint).

    Each manifest is read once (the head's not at all when ``head``, its manifest and digest,
    is given: the caller read it to learn the version) and checked against its schema; a base
    must exist, have the digest its delta names, be of the head's version (1 or 2: a chain
    is saved by one process, or across ranks, throughout) and not lead back into the chain;
    at most ``MAX_CHAIN_LINKS`` links."""
    manifest, digest = read_manifest_and_digest(path)[1:] if head is None else head
    links = [Link(Path(path), manifest, digest)]
    visited = {os.path.realpath(path)}
    while links[-1].delta:
        link = links[-1]
        if len(links) >= MAX_CHAIN_LINKS:
            raise CheckpointError(
                f"{link.file}: the chain from {path} has more than {MAX_CHAIN_LINKS} links; compact it "
                "(leanstate.compact_checkpoint) and save deltas against the compacted checkpoint"
            )
        base = link.manifest["base"]
        # as the system resolves it (symlinks, then ..): a delta opened through a link finds its base
        try:
            base_path = Path(os.path.realpath(link.path / base["path"]))
        except OSError as exc:  # a path the system cannot resolve (too long, a loop of links)
            raise CheckpointError(
                f"{link.file}: base.path {base['path'][:80]!r}... cannot be resolved ({exc.strerror})"
            ) from exc
        if str(base_path) in visited:
            raise CheckpointError(
                f"{link.file}: base.path {base['path']!r} leads back to a link of the chain from {path} (a cycle)"
            )
        visited.add(str(base_path))
        try:
            version, manifest, digest = read_manifest_and_digest(base_path)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{link.file}: its base {base['path']!r} is missing ({exc})") from exc
        except OSError as exc:  # a name too long to look up, say
            raise CheckpointError(f"{link.file}: its base cannot be read ({exc.strerror})") from exc
        if version != links[0].version:
            across = {1: "by one process (version 1)", 2: "across ranks (version 2)"}
            raise CheckpointError(
                f"{link.file}: its base {base_path} was saved {across[version]}, the chain from {path} "
                f"{across[links[0].version]}: every link of a chain is of one version"
            )
        if digest != base["manifest_sha256"]:
            raise CheckpointError(
                f"{link.file}: base.manifest_sha256 does not match {base_path / MANIFEST}: the base was "
                "replaced or changed after this delta was saved"
            )
        links.append(Link(base_path, manifest, digest))
    return links


def chain_parts(links: list[Link], name: str, store: SupportsRows | None, id_range=None) -> list[LinkTable]:
    """One table's parts, oldest link first (of a version-2 chain: every rank's files, every
    chunk); the table must be in every link with one layout (D4)."""
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
            check_layout(link.path / table.get("file", MANIFEST), name, table, store)
        if link.version == 2:
            read = TableRead.of_saved(name, table)
            removed = tuple(f["removed"] for f in table["files"]) if link.delta else ()
        else:
            read = TableRead.of_v1(name, table, chunks_in_range(table, id_range))
            removed = (table["removed"],) if link.delta else ()
        parts.append(LinkTable(link.path, read, removed))
    return parts


# -- load ---------------------------------------------------------------------------------


@dataclass
class ChainTable:
    """One table of a chain load: its store, what each link gives it (oldest link first),
    which rows of a slice the load applies (``keep``: an id range, the rows a rank owns;
    None: all) and ``progress(chunk, done)`` after each chunk of the full link applied."""

    store: SupportsRows
    parts: list[LinkTable]
    keep: Callable[[torch.Tensor], torch.Tensor] | None = None
    progress: Callable[[dict, int], None] | None = None


class ChainLoad:
    """The load of one chain (head first; a full checkpoint is a chain of one link) into
    one owner's tables, for :func:`load_all_or_nothing` to run: :meth:`verify` reads and
    checks everything, :meth:`apply` applies it. Version 1 is the one-owner case
    (:func:`load_chain`); the version-2 load (``sharded.load_sharded``) builds each rank's
    tables (the chunks and removals of the buckets it owns) and runs it across ranks.

    ``stats``: bytes and chunks read (by the verify pass of a single link, then by the
    pass that applies) and rows loaded; what the load returns (:func:`record_stats`)."""

    def __init__(self, links: list[Link], tables: list[ChainTable], slice_bytes: int) -> None:
        self.links, self.tables, self.slice_bytes = links, tables, slice_bytes
        self.stats = dict.fromkeys(STATS, 0)
        self._counting = threading.Lock()

    def _counted(self, read: TableRead, progress: Callable | None = None) -> Callable:
        def counted(chunk: dict, *done) -> None:
            with self._counting:  # the chunks of tables read in place arrive from threads
                self.stats["chunks_read"] += 1
                self.stats["bytes_read"] += chunk["rows"] * read.row_bytes
            if progress is not None:
                progress(chunk, *done)

        return counted

    def verify(self) -> None:
        """Read and check every chunk and removed-id file the load would apply; apply nothing."""
        for table in self.tables:
            if len(table.parts) == 1:
                full = table.parts[0]
                verify_table(full.path, full.read, self.slice_bytes, self._counted(full.read))
            else:
                for _ in merged(table.parts, self.slice_bytes, in_order=False):  # checked, not kept
                    pass

    def apply(self, into_empty: bool) -> None:
        """Into empty stores (or with no deltas) the full link loads as a full load reads it
        (in place where the store can), and the deltas' merge goes on top, removals deleted;
        into live stores the whole chain's rows are upserted and its removals leave the
        store's own rows alone (the chain loads as its compaction would)."""
        self.stats.update(dict.fromkeys(self.stats, 0))  # the figures of the pass that applies
        chain = len(self.links) > 1
        if into_empty or not chain:
            full = [
                (t.parts[0].read, t.store, t.keep, self._counted(t.parts[0].read, t.progress))
                for t in self.tables
            ]
            rows = apply_tables(
                self.links[-1].path, full, into_empty=into_empty, slice_bytes=self.slice_bytes
            )
            self.stats["rows_loaded"] = sum(rows)
        if chain:
            for table in self.tables:
                merging = table.parts[1:] if into_empty else table.parts
                for part in merging:  # counted as planned: the merge reads every chunk listed
                    counted = self._counted(part.read)
                    for _, chunk in (c for piece in part.read.files for c in piece.chunks):
                        counted(chunk)
                self.stats["rows_loaded"] += apply_merge(
                    table.store, merging, keep=table.keep, delete=into_empty, slice_bytes=self.slice_bytes
                )


STATS = ("bytes_read", "chunks_read", "rows_loaded")

last_load_stats: dict[str, int] = {}
"""This process's statistics of its last load, of either version, failed or not: bytes and
chunks read, rows loaded (``leanstate.last_load_stats`` is this same dict). Every load
returns its own; this record of the last is kept for the name users know."""


def record_stats(load: ChainLoad | None) -> dict[str, int]:
    """The statistics of a load that ran ``load`` (None: nothing read yet, as a load starts or
    when it is refused before it is planned), recorded as :data:`last_load_stats`; a copy,
    for the load to return."""
    stats = dict.fromkeys(STATS, 0) if load is None else dict(load.stats)
    last_load_stats.clear()
    last_load_stats.update(stats)
    return stats


def load_chain(
    links: list[Link],
    targets: list[Target],
    *,
    id_range,
    chunk_bytes: int,
    progress: Progress | None,
    method: str = "load_checkpoint",
) -> tuple[dict[str, object], dict[str, int]]:
    """Load the chain ``links`` (head first) into ``targets``; the head's extra state and
    the load's statistics (:class:`ChainLoad`), recorded also when it fails."""
    head = links[0]
    tables: list[ChainTable] = []
    views = []
    keep = None if id_range is None else (lambda ids: in_range(ids, id_range))
    for target in targets:
        if target.view is not None and target.view.read_only:
            views.append(target)
            continue
        if not target.whole:
            raise ValueError(
                f"{method}: tables[{target.name!r}] is a writable partial view; load whole rows into "
                "the store, a whole-row KVTensor, or pass the view read-only"
            )
        parts = chain_parts(links, target.name, target.store, id_range)
        report = None if progress is None else _reporter(progress, target.name, parts)
        tables.append(ChainTable(target.store, parts, keep, report))
    extra = chain_extra(links)  # every link's checked before any row is applied
    load = ChainLoad(links, tables, min(chunk_bytes, SLICE_BYTES))

    def apply(into_empty: bool) -> None:
        load.apply(into_empty)
        for target in views:  # a read-only view: its rows arrived with the whole rows
            target.view.ignored_writes += head.manifest["views"].get(target.name, {}).get("rows", 0)

    try:
        empty = load_all_or_nothing([table.store for table in tables], load.verify, apply)
    finally:  # also when the load fails: what it read before it did
        stats = record_stats(load)
    if empty and id_range is None:  # each store now is the head checkpoint: deltas can follow it
        set_marks([table.store for table in tables], head.digest)
    return extra, stats


def chain_extra(links: list[Link]) -> dict[str, object]:
    """R11 on every link (a base's or middle link's extra state is checked as the head's is,
    though only the head's is returned); the head's extra state."""
    for link in links[1:]:
        read_extra(link.path, link.manifest)
    return read_extra(links[0].path, links[0].manifest)


def check_outside_chain(path: Path, links: list[Link], what: str, head: str = "the base") -> None:
    """D7: ``path``, where a save or compaction will publish, is not a link of ``links``, inside
    one or holding one (publishing replaces ``path``, which would delete that link). ``head``:
    what ``links[0]`` is to the caller (a delta's base, or the chain being compacted)."""
    target = os.path.realpath(path)
    for link in links:
        taken = os.path.realpath(link.path)
        common = os.path.commonpath([target, taken])
        if common in (target, taken):
            relation = "is" if target == taken else "lies inside" if common == taken else "holds"
            role = head if link is links[0] else f"{link.path}, a link of the chain from {head}"
            raise ValueError(
                f"{what} {path} {relation} {role}: publishing there would destroy the chain from "
                f"{links[0].path}; choose another directory (to reuse slots, save a full checkpoint into "
                "the slot, or compact the chain first)"
            )


def set_marks(stores: list[SupportsRows], digest: str, epochs: list[int] | None = None) -> None:
    """The one place a checkpoint sets the stores' change marks (``spec/kv_store.md``).

    After a save is published, ``epochs`` (the epoch each store's save captured): every
    store's changes are tracked since the checkpoint of ``digest``. After a load into
    stores that were all empty (none named twice), no ``epochs``: each store now is that
    checkpoint (its share of it, across ranks), so deltas can follow it. Any other load
    leaves the marks where they were: every row it wrote is a tracked change since the
    store's own mark."""
    for store, epoch in zip(stores, epochs or [None] * len(stores), strict=True):
        store.mark = ChangeMark(store.next_epoch() if epoch is None else epoch, digest)


def _reporter(progress: Progress, name: str, parts: list[LinkTable]):
    total = parts[0].read.rows
    return lambda chunk, done: progress(name, done, total)


def verify_chain(links: list[Link]) -> Iterator[Link]:
    """Check every table of every link (every chunk and removed file, each table in the
    links below with one layout, D6) and each link's extra state; yield each link, head
    first, once it passed."""
    for depth, link in enumerate(links):
        for name in link.manifest["tables"]:
            for _ in merged(chain_parts(links[depth:], name, None)[-1:], in_order=False):  # its own files
                pass
        read_extra(link.path, link.manifest)
        yield link


# -- save ---------------------------------------------------------------------------------


def delta_base(path: Path, stores: Mapping[str, SupportsRows], base: object, method: str) -> dict:
    """A version-1 delta's ``base`` entry (``{path, manifest_sha256}``), once ``base`` is a
    version-1 checkpoint that a delta of ``stores`` at ``path`` may extend (``spec/
    checkpoint_format.md``, "Delta checkpoints", Save); else a ``ValueError`` (a
    ``TypeError`` for a ``base`` that is not a path)."""
    if not isinstance(base, str | os.PathLike):
        raise TypeError(f"{method}: base must be the path of a checkpoint (str or os.PathLike); got {base!r}")
    base = Path(base)
    links = base_chain(base, method)
    if links[0].version == 2:
        raise ValueError(f"{method}: base {base} was saved across ranks; save its delta with process_group=")
    saved = links[0].manifest["tables"]

    def matches(name: str) -> None:
        check_layout(base / saved[name]["file"], name, saved[name], stores[name])

    check_delta_base(path, links, stores, matches, f"{method}: ")
    return {"path": Path(os.path.relpath(base, path)).as_posix(), "manifest_sha256": links[0].digest}


def base_chain(base: Path, method: str) -> list[Link]:
    """The chain a delta saved against ``base`` extends, head (``base``) first: the manifests
    alone (D7 needs every link), each checked; a missing ``base`` is a ``ValueError``."""
    try:
        return read_chain(base, method)
    except FileNotFoundError as exc:
        raise ValueError(f"{method}: base={str(base)!r} is not a checkpoint ({exc})") from exc


def check_delta_base(
    path: Path,
    links: list[Link],
    stores: Mapping[str, SupportsRows],
    matches: Callable[[str], None],
    prefix: str = "",
) -> None:
    """What a delta of ``stores`` at ``path`` needs of its base (``links[0]``, whose chain is
    ``links``): a path outside that chain (D7), the base's tables, each matching
    (``matches(name)`` raises :class:`CheckpointError` if not) and each store's change mark
    at the base. A ``ValueError`` (after ``prefix``) names the first table that fails."""
    base, digest, saved = links[0].path, links[0].digest, links[0].manifest["tables"]
    check_outside_chain(path, links, f"{prefix}path")
    if set(stores) != set(saved):
        raise ValueError(
            f"{prefix}a delta saves the tables of its base; base {base} has {sorted(saved)}, "
            f"tables has {sorted(stores)}; save a full checkpoint first (base=None)"
        )
    for name, store in stores.items():
        try:
            matches(name)
        except CheckpointError as exc:
            raise ValueError(
                f"{prefix}tables[{name!r}] does not match its base ({exc}); save a full checkpoint first (base=None)"
            ) from exc
        mark = getattr(store, "mark", None)
        if mark is None or mark.checkpoint != digest:
            raise ValueError(
                f"{prefix}tables[{name!r}]: the store's changes are not tracked since base {base} "
                f"({'it has no change mark' if mark is None else 'its change mark is at another checkpoint'}); "
                "save a full checkpoint first (base=None), then deltas against it"
            )
