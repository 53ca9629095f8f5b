"""``leanstate.Follower``: a serving store that follows the checkpoints a trainer publishes.

The rules are ``spec/follower.md`` (F1-F8); the textbook is
``leanstate.reference.follower``. A trainer saves a full checkpoint, then deltas, into
one directory; a follower keeps its tables at the newest link it can reach from what
they hold:

- each :meth:`Follower.poll` lists the complete checkpoints in the directory (a
  manifest in place: a save in progress or killed has none yet), newest last by the
  time their manifest was published, and takes one step at a time: the newest full
  checkpoint published after the last applied link (or, at the start, the newest of
  all) replaces the tables' state; otherwise the oldest delta whose base is the last
  applied link extends it; a delta published after that link on another base (stale,
  a fork, a gap) is refused, naming both links;
- a delta is applied in two steps: every file this rank needs is read and checked
  into memory (readers go on meanwhile), then committed at once inside each store's
  ``atomic()`` block (upserts and deletes of rows already in memory), so a reader sees
  all of a delta or none of it; a full checkpoint is verified first, then loaded
  inside the block;
- each store's change mark moves to the applied link, so a follower made again over
  the same stores resumes there (F3).

With ``process_group`` (every rank calls), rank 0 lists the directory and decides each
step; every rank applies its own buckets' share, at its own world size, and the ranks
agree before anything is committed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from leanstate._numpy import np
from leanstate.checkpoint._arguments import targets_of
from leanstate.checkpoint._bucketed_table import BucketedTable
from leanstate.checkpoint._chain import set_marks
from leanstate.checkpoint._chunks import TableRead
from leanstate.checkpoint._files import read_extra, read_manifest_and_digest
from leanstate.checkpoint._format import (
    DEFAULT_CHUNK_BYTES,
    MANIFEST,
    SLICE_BYTES,
    check_chunk_bytes,
    is_delta,
)
from leanstate.checkpoint._load import verify_table
from leanstate.checkpoint._merge import merged
from leanstate.checkpoint._module_tables import restore_module_extra
from leanstate.checkpoint._ranks import broadcast, from_every_rank
from leanstate.checkpoint.sharded import (
    check_sharded_tables,
    check_table,
    link_table,
    load_sharded,
    rows_kept,
)
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.row_format import header_words

STAGING_SLICE_BYTES = 2**20  # a delta is read in slices of this size while it is staged


@dataclass(frozen=True)
class Candidate:
    """A complete checkpoint in the followed directory: its path, checked manifest, the
    manifest's SHA-256, and its place in publishing order (manifest mtime, then name)."""

    path: Path
    manifest: dict
    digest: str
    order: tuple[int, str]

    @property
    def delta(self) -> bool:
        return is_delta(self.manifest)

    @property
    def version(self) -> int:
        """1: saved by one process; 2: saved across ranks."""
        return self.manifest["version"]

    @property
    def base_digest(self) -> str | None:
        return self.manifest["base"]["manifest_sha256"] if self.delta else None


@dataclass(frozen=True)
class AppliedLink:
    """One link a follower applied: where, what (``"full"`` or ``"delta"``), this rank's
    rows written and ids removed, the seconds the whole apply took and the seconds
    readers were held out (the commit)."""

    path: Path
    digest: str
    kind: str
    rows: int
    removed: int
    seconds: float
    commit_seconds: float


class Follower:
    """Keep ``tables`` at the newest checkpoint a trainer published under ``directory``.

    Args:
        directory: where the trainer saves its checkpoints, one sub-directory each
            (a full checkpoint, then deltas with ``base=``); it may not exist yet.
        tables: what ``load_checkpoint`` takes: name -> store or whole-row KVTensor
            (read-only views are left alone), or with ``process_group`` a sharded
            module's ``checkpoint_tables()``. Stores that are empty start the follower
            at the newest full checkpoint; stores whose change marks name a checkpoint
            under ``directory`` (a follower that ran before) resume there.
        process_group: follow a chain across ranks: call everything on every rank;
            each rank takes the rows its buckets own at this group's size.
        chunk_bytes: the slice size reads use, as for ``load_checkpoint``.
        on_apply: called with each :class:`AppliedLink` as soon as it is applied (progress
            of a poll that applies several).

    ``poll()`` applies what is new and returns the paths it applied; ``follow(interval)``
    polls on a thread until ``close()``. Reads of the stores from other threads see each
    applied link whole (``KVStore.atomic``); a link is never applied twice, and a delta
    that does not extend the last applied link is refused with ``CheckpointError``,
    leaving the tables as they were.

    Example::

        >>> follower = leanstate.Follower("ckpts", {"user": serving_store})
        >>> follower.poll()
        [PosixPath('ckpts/step-100'), PosixPath('ckpts/step-110')]
        >>> follower.follow(interval=5.0)   # ... serve ...; follower.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        tables: Mapping,
        *,
        process_group: dist.ProcessGroup | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        on_apply: Callable[[AppliedLink], None] | None = None,
    ) -> None:
        method = "Follower"
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(
                f"{method}: directory must be a str or os.PathLike; got {type(directory).__name__}"
            )
        check_chunk_bytes(method, chunk_bytes)
        self.directory = Path(directory)
        self.process_group = process_group
        if on_apply is not None and not callable(on_apply):
            raise TypeError(f"{method}: on_apply must be a callable or None; got {on_apply!r}")
        self._on_apply = on_apply
        self._module_tables = tables
        self._slice_bytes = min(chunk_bytes, SLICE_BYTES)
        if process_group is None:
            targets = targets_of(tables, method)
            writable = [t for t in targets if not (t.view is not None and t.view.read_only)]
            for target in writable:
                if not target.whole:
                    raise ValueError(
                        f"{method}: tables[{target.name!r}] is a writable partial view; follow whole rows "
                        "(the store or a whole-row KVTensor), or pass the view read-only"
                    )
            self._stores = {t.name: t.store for t in writable}
            self._bucketed: dict[str, BucketedTable] | None = None
            self._rank, self._world = 0, 1
        else:
            check_sharded_tables(tables, method)
            self._stores = {name: table.store for name, table in tables.items()}
            self._bucketed = dict(tables)
            self._rank = dist.get_rank(process_group)
            self._world = dist.get_world_size(process_group)
        if not self._stores:
            raise ValueError(f"{method}: tables holds no store to follow into")
        for name, store in self._stores.items():
            if not callable(getattr(store, "atomic", None)):
                raise TypeError(
                    f"{method}: tables[{name!r}] is a {type(store).__name__}, which has no atomic() block; "
                    "follow into a leanstate.KVStore"
                )
        self.history: list[AppliedLink] = []
        self.refused: dict[str, str] = {}  # a refused link's digest -> why
        self.extra: dict[str, object] = {}
        self.errors: list[Exception] = []  # what follow()'s polls raised
        self._position: Candidate | None = None
        self._chain: set[str] = set()  # digests of the links the tables' state is made of
        self._lock = threading.Lock()  # one poll at a time
        self._seen: dict[str, tuple[tuple[int, int, int], Candidate]] = {}  # name -> (stat, candidate)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._resume()

    def __repr__(self) -> str:
        at = "nothing yet" if self._position is None else str(self._position.path)
        ranks = "" if self.process_group is None else f", rank={self._rank} of {self._world}"
        return (
            f"Follower({str(self.directory)!r}, tables={sorted(self._stores)}{ranks}, at={at}, "
            f"applied={len(self.history)}, refused={len(self.refused)}, following={self.following})"
        )

    @property
    def position(self) -> Path | None:
        """The last applied link (None before the first)."""
        return None if self._position is None else self._position.path

    @property
    def following(self) -> bool:
        """Whether :meth:`follow`'s thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # -- the directory --------------------------------------------------------------

    def _scan(self) -> tuple[list[Candidate], dict[str, str]]:
        """The complete checkpoints under the directory in publishing order (F1, F2), and the
        ones whose manifest fails its checks (path -> why)."""
        found, bad = [], {}
        try:
            entries = sorted(os.scandir(self.directory), key=lambda e: e.name)
        except FileNotFoundError:
            return [], {}
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir():
                continue  # a save in progress (.NAME.saving-*) or a replaced one (.NAME.previous-*)
            path = Path(entry.path)
            try:
                status = os.stat(path / MANIFEST)
            except (FileNotFoundError, NotADirectoryError):
                continue  # not complete yet
            # A save publishes by renaming a new directory into place: a manifest with the same
            # inode, size and time is the one read before (a poll reads only what is new).
            seen = (status.st_ino, status.st_size, status.st_mtime_ns)
            known = self._seen.get(entry.name)
            if known is not None and known[0] == seen:
                found.append(known[1])
                continue
            try:
                _, manifest, digest = read_manifest_and_digest(path)
            except FileNotFoundError:
                continue  # replaced between the two looks: the next poll sees the new one
            except (CheckpointError, OSError) as exc:
                bad[f"{path}@{status.st_mtime_ns}"] = f"{path / MANIFEST}: {exc}"
                continue
            candidate = Candidate(path, manifest, digest, (status.st_mtime_ns, entry.name))
            self._seen[entry.name] = (seen, candidate)
            found.append(candidate)
        found.sort(key=lambda c: c.order)
        return found, bad

    def _resume(self) -> None:
        """F3: where the stores are (on every rank: the ranks agree). Empty and unmarked:
        nowhere yet; all marked at one checkpoint under the directory: there; anything else
        is refused."""
        marks = {name: getattr(store, "mark", None) for name, store in self._stores.items()}
        empty = all(len(store) == 0 for store in self._stores.values())
        digests = {None if mark is None else mark.checkpoint for mark in marks.values()}
        if empty and digests == {None}:
            mine = "fresh"
        else:
            mine = next(iter(digests)) if len(digests) == 1 and None not in digests else None
        held = from_every_rank(mine, self.process_group)
        if all(value == "fresh" for value in held):
            return
        problem, found = None, None
        if len(set(held)) != 1 or held[0] in (None, "fresh"):
            shown = {n: None if m is None else m.checkpoint[:12] for n, m in marks.items()}
            problem = (
                "the stores hold rows but their change marks do not name one checkpoint "
                f"(this rank's: {shown}{'' if len(held) == 1 else f'; every rank holds {held}'})"
            )
        elif self._rank == 0:
            found = next((c for c in self._scan()[0] if c.digest == held[0]), None)
            if found is None:
                problem = f"the stores hold checkpoint {held[0][:12]}..., which is not under {self.directory}"
        problem, found = self._agreed((problem, found))
        if problem is not None:
            raise ValueError(
                f"Follower: {problem}; pass empty stores (the follower loads the newest full checkpoint), or "
                "stores loaded from a checkpoint of this directory"
            )
        self._position = found
        self._chain = self._chain_of(found)

    def _chain_of(self, link: Candidate) -> set[str]:
        """The digests of ``link`` and every link below it that the directory still holds."""
        by_digest = {c.digest: c for c in self._scan()[0]} if self._rank == 0 else {}
        chain, at = {link.digest}, link
        while at.delta and at.base_digest in by_digest and at.base_digest not in chain:
            at = by_digest[at.base_digest]
            chain.add(at.digest)
        return self._agreed(chain)

    def _agreed(self, value):
        """Rank 0's ``value`` on every rank (itself without a process group)."""
        return value if self.process_group is None else broadcast(value, self.process_group)

    def _next_step(self) -> _Step:
        """Rank 0's decision (F4), the same on every rank."""
        return self._agreed(self._decide() if self._rank == 0 else None)

    def _decide(self) -> _Step:
        candidates, bad = self._scan()
        for key, why in bad.items():
            if key not in self.refused:
                return _Step("refuse", None, key, why)
        position = self._position
        newer = [
            c
            for c in candidates
            if c.digest not in self.refused
            and c.digest not in self._chain
            and (position is None or c.order > position.order)
        ]
        fulls = [c for c in newer if not c.delta]
        if fulls:  # a newer full checkpoint replaces the state: the deltas before it are not needed
            return _Step("full", fulls[-1], fulls[-1].digest)
        if position is None:
            return _Step("none")
        # Published after its base by causality, whatever the clock says (F4 (b)).
        extending = [
            c
            for c in candidates
            if c.base_digest == position.digest
            and c.digest not in self.refused
            and c.digest not in self._chain
        ]
        if extending:
            return _Step("delta", extending[0], extending[0].digest)
        if newer:
            other = newer[0]
            base = next((c for c in candidates if c.digest == other.base_digest), None)
            where = "a checkpoint no longer under the directory" if base is None else str(base.path)
            return _Step(
                "refuse",
                other,
                other.digest,
                f"delta {other.path} extends {where} (manifest {other.base_digest[:12]}...), but the last "
                f"applied link is {position.path} (manifest {position.digest[:12]}...): it is stale, a fork "
                "or after a gap, and is not applied; the tables stay at the last applied link",
            )
        return _Step("none")

    # -- applying -------------------------------------------------------------------

    def poll(self) -> list[Path]:
        """Apply, in chain order, every complete checkpoint under the directory that extends
        what the tables hold (F4); the paths applied. Call on every rank with a process
        group. A link refused (F5) is remembered and never tried again; once the others
        are applied, the first refusal of this poll is raised as :class:`CheckpointError`
        (``refused`` holds them all)."""
        with self._lock:
            applied, refusals = [], []
            while True:
                step = self._next_step()
                if step.kind == "none":
                    break
                if step.kind == "refuse":
                    self.refused[step.key] = step.why
                    refusals.append(step.why)
                    continue
                try:
                    self._apply(step)
                except CheckpointError as exc:
                    self.refused[step.key] = str(exc)
                    refusals.append(str(exc))
                    continue
                applied.append(step.link.path)
            if refusals:
                more = (
                    f" ({len(refusals) - 1} more refused: see Follower.refused)" if len(refusals) > 1 else ""
                )
                raise CheckpointError(f"Follower.poll: {refusals[0]}{more}")
            return applied

    def _apply(self, step: _Step) -> None:
        """Apply one link on every rank, all of it or nothing (F6, F7)."""
        link, start = step.link, time.perf_counter()
        problem, staged, extra = None, {}, {}
        try:
            tables = self._tables_for(link)
            if step.kind == "delta":
                staged = {name: self._stage(link, name, table) for name, table in tables.items()}
            else:
                for name, table in tables.items():
                    self._verify_full(link, name, table)
            extra = read_extra(link.path, link.manifest)
        except (CheckpointError, OSError) as exc:
            problem = f"{link.path}: {exc}"
        except Exception as exc:  # every rank must reach the agreement, whatever failed here
            problem = f"{link.path}: {type(exc).__name__}: {exc}"
        failed = [
            (rank, p) for rank, p in enumerate(from_every_rank(problem, self.process_group)) if p is not None
        ]
        if failed:
            rank, why = failed[0]
            where = "" if self.process_group is None else f" (rank {rank})"
            raise CheckpointError(f"{why}{where}; nothing of it was applied")
        committed = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for store in {id(s): s for s in self._stores.values()}.values():
                stack.enter_context(store.atomic())
            committed = time.perf_counter()
            if step.kind == "delta":
                rows, removed = self._commit(staged, link.digest)
            else:
                rows, removed = self._load_full(link, tables), 0
        done = time.perf_counter()
        restore_module_extra(self._module_tables, extra)
        self.extra = extra
        self._position = link
        self._chain = {link.digest} | (self._chain if step.kind == "delta" else set())
        applied = AppliedLink(
            link.path, link.digest, step.kind, rows, removed, done - start, done - committed
        )
        self.history.append(applied)
        if self._on_apply is not None:
            self._on_apply(applied)

    def _tables_for(self, link: Candidate) -> dict[str, BucketedTable]:
        """Each followed table as ``link`` is read into it (the saved bucketing for plain
        stores), its layout and bucketing checked against the link's (D4)."""
        tables = {}
        for name, store in self._stores.items():
            saved = link.manifest["tables"].get(name)
            if saved is None:
                raise CheckpointError(
                    f"{link.path / MANIFEST} has no table {name!r} (it has {sorted(link.manifest['tables'])})"
                )
            if self._bucketed is not None:
                table = self._bucketed[name]
            else:
                bucketing = saved.get("bucketing") or {"buckets": 1, "bucket_size": None}
                table = BucketedTable(store, bucketing["buckets"], bucketing["bucket_size"])
            check_table(link.path, name, saved, table)
            tables[name] = table
        return tables

    def _stage(
        self, link: Candidate, name: str, table: BucketedTable
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """This rank's rows and removed ids of one table of the delta ``link``, every file
        read and checked, held in memory (F6: nothing is applied yet)."""
        part = link_table(link, name, table, self._rank, self._world)
        keep = rows_kept(table, part.read, self._rank, self._world)
        layout = table.store.layout
        # One buffer of the rows this rank reads (their count is the manifest's), filled slice
        # by slice: an apply holds the delta's rows and one small slice, and commits in one call.
        staged = np.empty((part.read.rows, layout.row_bytes), dtype=np.uint8)
        filled, removed = 0, []
        for pieces, gone in merged([part], min(self._slice_bytes, STAGING_SLICE_BYTES)):
            for piece in pieces:
                staged[filled : filled + len(piece)] = piece
                filled += len(piece)
            if len(gone):
                removed.append(torch.from_numpy(np.array(gone, dtype=np.int64)))
        if filled:
            data = torch.from_numpy(staged[:filled]).view(layout.dtype).view(-1, layout.width)
        else:  # (a view of no bytes cannot be reinterpreted)
            data = torch.empty(0, layout.width, dtype=layout.dtype)
        if keep is not None:  # a version-1 link across ranks: every rank read every row
            data = data[keep(header_words(data)[:, 0])]
        rows = [data]
        return rows, torch.cat(removed) if removed else torch.empty(0, dtype=torch.int64)

    def _verify_full(self, link: Candidate, name: str, table: BucketedTable) -> None:
        """Every chunk this rank will read of a full link's table, checked (nothing applied)."""
        read = TableRead.of_saved(name, link.manifest["tables"][name], self._rank, self._world)
        verify_table(link.path, read, self._slice_bytes)

    def _commit(self, staged: dict, digest: str) -> tuple[int, int]:
        """Inside every store's atomic block: the staged rows upserted, the removed ids
        deleted, each store's mark moved to the delta. Rows written and ids removed."""
        rows = removed = 0
        for name, (pieces, gone) in staged.items():
            store = self._stores[name]
            for piece in pieces:
                if len(piece):
                    store.set_rows(piece)
                    rows += len(piece)
            if len(gone):
                removed += store.delete(gone)
        set_marks(list(self._stores.values()), digest)
        return rows, removed

    def _load_full(self, link: Candidate, tables: dict[str, BucketedTable]) -> int:
        """Inside every store's atomic block: the stores emptied, then loaded from the full
        ``link`` (this rank's share), their marks at it. Rows loaded."""
        for store in self._stores.values():
            store.delete(store.keys())
        load_sharded(
            link.path,
            tables,
            process_group=self.process_group,
            head=(link.manifest, link.digest),
        )
        return sum(len(store) for store in {id(s): s for s in self._stores.values()}.values())

    # -- following ------------------------------------------------------------------

    def follow(self, interval: float = 1.0, *, on_error: Callable[[Exception], None] | None = None) -> None:
        """Poll every ``interval`` seconds on a thread until :meth:`close`. An error of a
        poll (a refused link, say) goes to ``on_error`` (default: kept in ``errors``) and
        the thread goes on. With a process group, every rank must follow, and the group
        is not used by anything else meanwhile."""
        if not isinstance(interval, int | float) or isinstance(interval, bool) or not interval > 0:
            raise ValueError(f"Follower.follow: interval must be seconds > 0; got {interval!r}")
        if self.following:
            raise RuntimeError("Follower.follow: already following; close() first")
        self._stop.clear()
        report = on_error if on_error is not None else self.errors.append

        def run() -> None:
            while True:
                try:
                    self.poll()
                except Exception as exc:  # the thread goes on: the next link may apply
                    report(exc)
                if self._stop.wait(interval):
                    return

        self._thread = threading.Thread(target=run, name="leanstate-follower", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop :meth:`follow`'s thread (after the poll it is in)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class _Step:
    """What a poll does next: ``kind`` ``"full"``, ``"delta"``, ``"refuse"`` or ``"none"``;
    the link; the key it is remembered by (its digest); why it is refused."""

    kind: str
    link: Candidate | None = None
    key: str | None = None
    why: str | None = None
