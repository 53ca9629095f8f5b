"""The one load pipeline of every checkpoint format: an all-or-nothing transaction over
the stores, and one chunk-apply step per saved table.

Version 1, version 2 (across ranks) and DCP load through here:

- :func:`load_all_or_nothing` is the transaction. Into stores that hold no row yet (on
  every rank), each once, rows are applied as they are read and verified, and any
  failure empties the stores again: one read of the files. Otherwise every chunk is
  verified first, the ranks agree, and only then are rows applied, with Ctrl-C
  deferred (a half-applied live store could not be restored).
- :func:`apply_table` is the chunk-apply step: the chunks a load reads of one table,
  in slices of whole rows read one ahead on a thread, each checked (checksum, ascending
  ids, the manifest's id range, the chunk's bucket), then either read in place into an
  empty store that offers it (``store.rows_in_place()``) or, filtered to the rows this
  load keeps, upserted through ``set_rows`` into a store grown once by ``reserve``.
- :func:`apply_tables` runs several tables' steps, on up to ``torch.get_num_threads()``
  threads when they read in place into distinct stores (the adopting kernel releases
  the GIL; each store has its own lock, so the rows are the same bits as on one thread).

The in-place load's rules (threads, pages, locks), in one place, for every format: the
engine's write lock is held from ``claim`` to the last ``adopt`` or ``abandon`` (a
version 1 or 2 table's ``read_in_place``; DCP's planner from a table's first chunk to
its ``close()``), so no other call sees claimed blocks; the pool cannot move meanwhile
(``claim`` mapped every block first); whatever reads (the load's reader thread, or
DCP's reader) only ``readinto``s claimed blocks no one else owns, and has stopped
before any of them is zeroed and freed (``abandon``); a slice is adopted once its ids
were checked, its chunk's checksum possibly later (a chunk's last slice, or DCP's CRC
arriving after the chunk): a failure then empties the stores, as a load into empty
stores may; the pages ahead are faulted in by the waiting thread, which changes no byte.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from leanstate.checkpoint._background import in_parallel
from leanstate.checkpoint._chunks import TableRead, read_chunks, read_in_place
from leanstate.checkpoint._files import interrupts_deferred
from leanstate.checkpoint._format import SLICE_BYTES
from leanstate.checkpoint._ranks import from_every_rank
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.kv_store import ReadsInPlace, SupportsRows
from leanstate.reference.row_format import header_words


def load_all_or_nothing(
    stores: Sequence[SupportsRows],
    verify: Callable[[], None],
    apply: Callable[[bool], None],
    *,
    prepare: Callable[[], None] | None = None,
    group: dist.ProcessGroup | None = None,
    gather_errors: bool = False,
    method: str = "load_checkpoint",
) -> bool:
    """Run one load of ``stores`` all or nothing, on every rank of ``group`` (None: this
    process alone); whether the stores were empty (on every rank) before it.

    ``prepare()`` first (the manifest's checks: nothing read into a store). When every
    store is empty on every rank and none appears twice, ``apply(True)`` runs once and a
    failure empties the stores again. Otherwise ``verify()`` reads and checks everything
    first, and ``apply(False)`` runs only if it passed everywhere, with Ctrl-C deferred.
    ``gather_errors``: an ``Exception`` on any rank becomes a :class:`CheckpointError`
    naming that rank, raised on every rank (the formats whose ranks do not already agree
    through DCP); the ranks agree on the prepared load and the empty stores in one
    collective, and on each later step in one more.
    """
    unique = list({id(store): store for store in stores}.values())
    mine = len(unique) == len(stores) and all(len(store) == 0 for store in unique)
    problem = _attempt(prepare, group, gather_errors)
    failed, held = _any_rank((problem is not None, not mine), group)
    if failed:
        _raise_first(problem, group, method, "nothing was applied")
    empty = not held
    if not empty:
        _on_every_rank(verify, group, gather_errors, method, "nothing was applied")
    try:
        with contextlib.nullcontext() if empty else interrupts_deferred():
            outcome = "the stores were emptied again" if empty else "verified rows were being applied"
            _on_every_rank(lambda: apply(empty), group, gather_errors, method, outcome)
    except BaseException:
        if empty:
            for store in unique:
                store.delete(store.keys())
        raise
    return empty


def _on_every_rank(run: Callable[[], None], group, gather_errors: bool, method: str, outcome: str) -> None:
    """``run()``; with ``gather_errors``, an ``Exception`` on any rank of ``group`` is raised
    on every rank as a :class:`CheckpointError` naming the first failed rank and ``outcome``."""
    problem = _attempt(run, group, gather_errors)
    if gather_errors and _any_rank((problem is not None,), group)[0]:
        _raise_first(problem, group, method, outcome)


def _attempt(run: Callable[[], None] | None, group, gather_errors: bool) -> str | None:
    """``run()``; with ``gather_errors``, its ``Exception`` as a problem naming this rank."""
    if run is None:
        return None
    if not gather_errors:
        run()
        return None
    try:
        run()
    except Exception as exc:
        return f"rank {0 if group is None else dist.get_rank(group)}: {exc}"
    return None


def _any_rank(flags: tuple[bool, ...], group) -> list[bool]:
    """Whether each flag holds on any rank of ``group``: one small all-reduce (a message is
    gathered only when something failed)."""
    if group is None:
        return list(flags)
    values = torch.tensor([int(flag) for flag in flags])
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in values.tolist()]


def _raise_first(problem: str | None, group, method: str, outcome: str) -> None:
    """Once some rank failed (every rank calls this): the first failed rank's problem,
    raised on every rank."""
    failed = [p for p in from_every_rank(problem, group) if p is not None]
    if failed:
        raise CheckpointError(f"{method}: the load across ranks failed ({outcome}): {failed[0]}")


def verify_table(
    path: Path,
    read: TableRead,
    slice_bytes: int = SLICE_BYTES,
    progress: Callable[[dict], None] | None = None,
) -> None:
    """Read and check every chunk ``read`` lists; apply nothing. ``progress(chunk)`` after each."""
    for _, chunk, buffer in read_chunks(path, read, slice_bytes, ahead=True):
        if buffer is None and progress is not None:
            progress(chunk)


def apply_table(
    path: Path,
    read: TableRead,
    store: SupportsRows,
    *,
    into_empty: bool,
    keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
    slice_bytes: int = SLICE_BYTES,
    progress: Callable[[dict, int], None] | None = None,
) -> int:
    """Stream the chunks ``read`` lists into ``store``; the number of rows applied.

    ``keep(ids)``: which rows of a slice this load applies (an id range, the rows this
    rank owns); None keeps every row. Into an empty store that reads in place
    (``store.rows_in_place()``), with every row kept, the rows are read straight into
    its pool; otherwise each slice goes through ``set_rows``, the store grown once
    first. ``progress(chunk, rows_applied)`` after each chunk (its manifest entry).
    """
    engine = _in_place(store, into_empty, keep)
    if engine is not None:
        read_in_place(path, read, engine, slice_bytes, progress)
        return read.rows
    layout = store.layout
    applied, reserved = 0, False
    # The files' sizes matched the manifest before the first slice: grow the store once.
    # Rows the store already holds (a resume) need no room: reserving them too would
    # grow a full store by the table's size.
    with contextlib.closing(read_chunks(path, read, slice_bytes, ahead=True)) as slices:
        for _, chunk, buffer in slices:
            if buffer is None:
                if progress is not None:
                    progress(chunk, applied)
                continue
            rows = torch.frombuffer(buffer, dtype=torch.uint8).view(layout.dtype).view(-1, layout.width)
            if not reserved:
                store.reserve(max(0, read.rows - len(store)))
                reserved = True
            if keep is not None:
                rows = rows[keep(header_words(rows)[:, 0])]
            store.set_rows(rows)  # keyed by each row's header
            applied += len(rows)
    return applied


def _in_place(store: SupportsRows, into_empty: bool, keep) -> ReadsInPlace | None:
    """The engine a table's rows are read into, when the load reads in place."""
    rows_in_place = getattr(store, "rows_in_place", None)
    return rows_in_place() if into_empty and keep is None and rows_in_place is not None else None


def apply_tables(
    path: Path,
    tables: Sequence[tuple[TableRead, SupportsRows, Callable | None, Callable | None]],
    *,
    into_empty: bool,
    slice_bytes: int = SLICE_BYTES,
) -> list[int]:
    """:func:`apply_table` of each ``(read, store, keep, progress)``; the rows each applied.
    Every table's apply runs to its end; the first failure, in ``tables`` order, is raised.

    Tables read in place into distinct stores apply on up to ``torch.get_num_threads()``
    threads: the adopting kernel is serial and releases the GIL, and each store has its
    own lock. Upserts run one table after another: ``set_rows`` already spreads over
    the threads (numba's or torch's pool), and a second caller would only oversubscribe
    the cores or, in numba's CUDA simulator, launch from a thread it cannot serve."""
    stores = [store for _, store, _, _ in tables]
    parallel = len({id(store) for store in stores}) == len(stores) and all(
        _in_place(store, into_empty, keep) is not None for _, store, keep, _ in tables
    )
    calls = [
        functools.partial(
            apply_table,
            path,
            read,
            store,
            into_empty=into_empty,
            keep=keep,
            slice_bytes=slice_bytes,
            progress=progress,
        )
        for read, store, keep, progress in tables
    ]
    return in_parallel(calls, torch.get_num_threads() if parallel else 1)
