"""The reference KV store engine: a sharded map id -> row, in plain Python and torch.

Each shard holds a dict from id to block number, a pool of blocks allocated in chunks
of rows, a free list of released blocks and a lock. Every row is one block laid out as
``reference.row_format`` says. Missing ids read as their *initial row* and are not
inserted; negative ids are padding and read as zeros. See ``spec/kv_store.md``.

This is the engine behind ``leanstate.KVStore(..., backend="reference")``: the front
class validates and normalises every argument, then calls one engine method per batch
(``spec/backends.md`` states the interface). Here every method is written in the most
obvious terms; the accelerated engines are held to it bit for bit.

Example::

    >>> engine = KVStoreEngine(RowLayout(4, 1, torch.float32), num_shards=2, init_range=(-0.01, 0.01), seed=0)
    >>> engine.scatter(torch.tensor([7, 3]), torch.ones(2, 4), start=4, now=0)
    >>> engine.gather(torch.tensor([3, 7, -1]), start=4, width=4, initial=True)
    tensor([[1., 1., 1., 1.],
            [1., 1., 1., 1.],
            [0., 0., 0., 0.]])
    >>> engine.keys()
    tensor([3, 7])
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from leanstate.reference.hashing import initial_weights, shards_of
from leanstate.reference.row_format import (
    COUNT_MAX,
    RowLayout,
    header_words,
    pack_metadata,
    unpack_metadata,
)

ROWS_PER_CHUNK = 1024
_USED = torch.iinfo(torch.int64).min  # bit 63 of the metadata word


class _Shard:
    """One shard: id -> block map, chunked block pool with a free list, and its lock.

    Its methods are called with ``lock`` held by the engine.
    """

    def __init__(self, width: int, dtype: torch.dtype, rows_per_chunk: int) -> None:
        self.lock = threading.Lock()
        self.index: dict[int, int] = {}
        # change tracking: the epoch of each present id's last write, of each absent id's removal
        self.written: dict[int, int] = {}
        self.removed: dict[int, int] = {}
        self.chunks: list[torch.Tensor] = []
        self.free: list[int] = []
        self.handed_out = 0  # blocks ever taken from chunks (free ones included)
        self.width = width
        self.dtype = dtype
        self.rows_per_chunk = rows_per_chunk

    def __len__(self) -> int:
        return len(self.index)

    def keys(self) -> torch.Tensor:
        return torch.tensor(list(self.index), dtype=torch.int64)

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Block number of each key, -1 where the key is absent."""
        return torch.tensor([self.index.get(k, -1) for k in keys.tolist()], dtype=torch.int64)

    def _allocate(self) -> int:
        if self.free:
            return self.free.pop()
        if self.handed_out == len(self.chunks) * self.rows_per_chunk:
            self.chunks.append(torch.zeros(self.rows_per_chunk, self.width, dtype=self.dtype))
        self.handed_out += 1
        return self.handed_out - 1

    def _by_chunk(self, blocks: torch.Tensor):
        """Yield (chunk, positions in ``blocks``, rows inside the chunk), chunk by chunk."""
        chunk_of = blocks // self.rows_per_chunk
        order = torch.argsort(chunk_of, stable=True)
        chunks, counts = torch.unique_consecutive(chunk_of[order], return_counts=True)
        for c, positions in zip(chunks.tolist(), torch.split(order, counts.tolist())):
            yield self.chunks[c], positions, blocks[positions] % self.rows_per_chunk

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        """The whole rows of ``blocks`` (all present), as a new [len(blocks), width] tensor."""
        out = torch.empty(len(blocks), self.width, dtype=self.dtype)
        for chunk, positions, within in self._by_chunk(blocks):
            out[positions] = chunk[within]
        return out

    def write(self, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        for chunk, positions, within in self._by_chunk(blocks):
            chunk[within] = rows[positions]

    def wrote(self, keys: torch.Tensor, epoch: int | None) -> None:
        """Record a write of each key in ``epoch`` (None: tracking is off, nothing recorded)."""
        if epoch is None:
            return
        for key in keys.tolist():
            self.written[key] = epoch
            self.removed.pop(key, None)

    def insert(self, keys: torch.Tensor) -> torch.Tensor:
        """Give each distinct absent key a block (free list first, last in first out)."""
        blocks = []
        for key in keys.tolist():
            self.index[key] = self._allocate()
            blocks.append(self.index[key])
        return torch.tensor(blocks, dtype=torch.int64)

    def remove(self, keys: torch.Tensor, epoch: int | None) -> int:
        """Delete distinct keys: zero their blocks and free them, and record each present
        key's removal in ``epoch`` (None: tracking is off). Returns how many were present."""
        present = [k for k in keys.tolist() if k in self.index]
        freed = [self.index.pop(k) for k in present]
        if freed:
            self.write(torch.tensor(freed), torch.zeros(len(freed), self.width, dtype=self.dtype))
            self.free.extend(freed)
        if epoch is not None:
            for key in present:
                self.written.pop(key, None)
                self.removed[key] = epoch
        return len(freed)

    def memory_bytes(self) -> int:
        chunk_bytes = sum(c.numel() * c.element_size() for c in self.chunks)
        # The map's own table plus one int object per key and per block number.
        objects = sum(sys.getsizeof(k) + sys.getsizeof(b) for k, b in self.index.items())
        records = sum(  # the change records, counted as the map is
            sys.getsizeof(d) + sum(sys.getsizeof(k) + sys.getsizeof(e) for k, e in d.items())
            for d in (self.written, self.removed)
        )
        return chunk_bytes + sys.getsizeof(self.index) + objects + sys.getsizeof(self.free) + records


def _last_occurrences(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct keys (ascending), the position of each one's last occurrence, its occurrence count."""
    unique, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    last = torch.full((len(unique),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, torch.arange(len(keys)), reduce="amax")
    return unique, last, counts


class KVStoreEngine:
    """The reference store engine (``spec/backends.md``): dict shards, one lock each.

    Args:
        layout: the row layout (dim, optimizer state, dtype).
        num_shards: number of shards; an id's shard is ``hashing.shard_of``.
        init_range: (low, high) of the initial weights of missing ids.
        seed: seed of the initial weights.
        device: the CPU (rows live in host memory).

    Every method takes already-validated tensors on the CPU: ids 1-D int64, values of
    the layout's dtype. Column ``start`` counts from the start of the row (header included).
    """

    backend = "reference"

    def __init__(
        self,
        layout: RowLayout,
        *,
        num_shards: int,
        init_range: tuple[float, float],
        seed: int,
        device: torch.device | None = None,
    ) -> None:
        self.layout = layout
        self.num_shards = num_shards
        self.init_range = init_range
        self.seed = seed
        self._shards = [_Shard(layout.width, layout.dtype, ROWS_PER_CHUNK) for _ in range(num_shards)]
        self.tracking = True  # record every write and removal by epoch (spec/kv_store.md)
        self._epoch = 1  # the current epoch: changes made now belong to it

    def _stamp(self) -> int | None:
        """The epoch a change made now is recorded in, None when tracking is off."""
        return self._epoch if self.tracking else None

    def __len__(self) -> int:
        return sum(len(s) for s in self._shards)

    def memory_bytes(self) -> int:
        """Block chunks plus the id maps, their int objects and the free lists."""
        total = 0
        for shard in self._shards:
            with shard.lock:
                total += shard.memory_bytes()
        return total

    def reserve(self, rows: int) -> None:
        """A capacity hint: dict shards grow by themselves, so nothing to do."""

    # -- helpers ---------------------------------------------------------------------

    def _by_shard(self, ids: torch.Tensor):
        """Yield (shard, positions, ids at those positions) for the non-negative ids."""
        positions = torch.nonzero(ids >= 0).flatten()
        if len(positions) == 0:
            return
        shard_of = shards_of(ids[positions], self.num_shards)
        order = torch.argsort(shard_of, stable=True)
        shards, counts = torch.unique_consecutive(shard_of[order], return_counts=True)
        for s, chosen in zip(shards.tolist(), torch.split(positions[order], counts.tolist())):
            yield self._shards[s], chosen, ids[chosen]

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole rows of missing ids: header (key, metadata 0), initial weights, zero state."""
        layout = self.layout
        low, high = self.init_range
        rows = torch.zeros(len(ids), layout.width, dtype=layout.dtype)
        rows[:, layout.weight_offset : layout.weight_offset + layout.dim] = initial_weights(
            ids, layout.dim, seed=self.seed, low=low, high=high, dtype=layout.dtype
        )
        header_words(rows)[:, 0] = ids
        return rows

    # -- row access (spec/backends.md): blocks are handles ``block * num_shards + shard`` --

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold every shard's lock (in shard order) for a sequence of row-access calls."""
        with ExitStack() as locks:
            for shard in self._shards:
                locks.enter_context(shard.lock)
            yield

    writing = reading  # a dict shard has one lock for readers and writers

    def locate(self, ids: torch.Tensor, *, insert: bool = False) -> torch.Tensor:
        """The block handle of each id, -1 where missing (or negative); call under the lock.

        ``insert=True`` inserts the missing non-negative ids (distinct) with their initial
        rows and header ``(key, used)``.
        """
        handles = torch.full((len(ids),), -1, dtype=torch.int64)
        for shard, positions, keys in self._by_shard(ids):
            blocks = shard.lookup(keys)
            missing = blocks < 0
            if insert and missing.any():
                blocks[missing] = shard.insert(keys[missing])
                rows = self.initial_rows(keys[missing])
                header_words(rows)[:, 1] = _USED
                shard.write(blocks[missing], rows)
            if insert:  # the caller writes every row it locates so (the embedding updates)
                shard.wrote(keys, self._stamp())
            index = self._shards.index(shard)
            handles[positions] = torch.where(blocks >= 0, blocks * self.num_shards + index, -1)
        return handles

    def read_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Whole rows ``[N, width]`` (a copy) of present block handles; call under the lock."""
        out = torch.empty(len(blocks), self.layout.width, dtype=self.layout.dtype)
        for s, shard in enumerate(self._shards):
            mine = torch.nonzero(blocks % self.num_shards == s).flatten()
            if len(mine):
                out[mine] = shard.read(blocks[mine] // self.num_shards)
        return out

    def write_blocks(self, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        """Write whole rows at present block handles (distinct); call under the lock."""
        for s, shard in enumerate(self._shards):
            mine = torch.nonzero(blocks % self.num_shards == s).flatten()
            if len(mine):
                shard.write(blocks[mine] // self.num_shards, rows[mine])

    # -- reads ---------------------------------------------------------------------

    def gather(
        self, ids: torch.Tensor, *, start: int, width: int, initial: bool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Columns ``[start, start + width)`` of each id's row, as a new ``[N, width]`` tensor.

        A missing id gives its initial row (``initial=True``) or zeros; a negative id zeros.
        ``out``: a contiguous ``[N, width]`` tensor to fill and return instead.
        """
        whole = torch.zeros(len(ids), self.layout.width, dtype=self.layout.dtype)
        for shard, positions, keys in self._by_shard(ids):
            with shard.lock:
                blocks = shard.lookup(keys)
                present = blocks >= 0
                whole[positions[present]] = shard.read(blocks[present])
            if initial and not present.all():
                whole[positions[~present]] = self.initial_rows(keys[~present])
        if out is not None:
            return out.copy_(whole[:, start : start + width])
        return whole[:, start : start + width].clone()

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool tensor: which ids have a row (negative ids never do)."""
        out = torch.zeros(len(ids), dtype=torch.bool)
        for shard, positions, keys in self._by_shard(ids):
            with shard.lock:
                out[positions] = shard.lookup(keys) >= 0
        return out

    def metadata(self, ids: torch.Tensor) -> torch.Tensor:
        """Int64 eviction metadata of each id (0 when missing or negative)."""
        out = torch.zeros(len(ids), dtype=torch.int64)
        for shard, positions, keys in self._by_shard(ids):
            with shard.lock:
                blocks = shard.lookup(keys)
                present = blocks >= 0
                out[positions[present]] = header_words(shard.read(blocks[present]))[:, 1]
        return out

    def keys(self) -> torch.Tensor:
        """All ids, sorted ascending, as int64."""
        found = []
        for shard in self._shards:
            with shard.lock:
                found.append(shard.keys())
        return torch.sort(torch.cat(found)).values

    # -- writes --------------------------------------------------------------------

    def scatter(self, ids: torch.Tensor, values: torch.Tensor, *, start: int, now: int) -> None:
        """``set``: write ``values`` ([N, w]) to columns ``[start, start + w)``.

        A missing id is inserted with its initial row; every occurrence of an id bumps its
        count (saturating) and stamps ``now``; the last occurrence's values win; negative
        ids are skipped.
        """
        kept = torch.nonzero(ids >= 0).flatten()
        unique, last, occurrences = _last_occurrences(ids[kept])
        source = kept[last]
        for shard, positions, keys in self._by_shard(unique):
            with shard.lock:
                blocks = shard.lookup(keys)
                present = blocks >= 0
                rows = torch.empty(len(keys), self.layout.width, dtype=self.layout.dtype)
                rows[present] = shard.read(blocks[present])
                rows[~present] = self.initial_rows(keys[~present])
                blocks[~present] = shard.insert(keys[~present])
                rows[:, start : start + values.shape[1]] = values[source[positions]]
                header = header_words(rows)
                _, count, _ = unpack_metadata(header[:, 1])
                count = torch.clamp(count + occurrences[positions], max=COUNT_MAX)
                header[:, 1] = pack_metadata(torch.full_like(count, now), count, torch.ones_like(present))
                shard.write(blocks, rows)
                shard.wrote(keys, self._stamp())

    def write_rows(self, rows: torch.Tensor) -> None:
        """``set_rows``: whole rows keyed by header bytes 0-7 (non-negative), ``used`` set.

        The saved timestamp and count are kept; for a key that appears twice the last row wins.
        """
        unique, last, _ = _last_occurrences(header_words(rows)[:, 0])
        for shard, positions, keys in self._by_shard(unique):
            with shard.lock:
                blocks = shard.lookup(keys)
                missing = blocks < 0
                blocks[missing] = shard.insert(keys[missing])
                chosen = rows[last[positions]]  # a copy: the caller's rows stay as they were
                header_words(chosen)[:, 1] |= _USED
                shard.write(blocks, chosen)
                shard.wrote(keys, self._stamp())

    def delete(self, ids: torch.Tensor) -> int:
        """Remove ids (missing and negative ones are ignored); returns the rows removed."""
        removed = 0
        for shard, _, keys in self._by_shard(torch.unique(ids)):
            with shard.lock:
                removed += shard.remove(keys, self._stamp())
        return removed

    # -- eviction ------------------------------------------------------------------

    def evict(
        self,
        *,
        min_count: int | None,
        max_age_s: int | None,
        min_l2_norm: float | None,
        max_rows: int | None,
        now: int,
    ) -> torch.Tensor:
        """Delete rows by policy (``spec/kv_store.md``); returns the evicted ids, ascending.

        Decided and deleted with every shard's lock held (taken in shard order), so a
        row written concurrently is judged either wholly before or wholly after that write.
        """
        layout = self.layout
        with ExitStack() as locks:
            for shard in self._shards:
                locks.enter_context(shard.lock)
            keys, rows = [], []
            for shard in self._shards:
                shard_keys = shard.keys()
                keys.append(shard_keys)
                rows.append(shard.read(shard.lookup(shard_keys)))
            keys = torch.cat(keys)
            rows = torch.cat(rows)
            order = torch.argsort(keys)
            keys, rows = keys[order], rows[order]
            stamp, count, _ = unpack_metadata(header_words(rows)[:, 1])
            doomed = torch.zeros(len(keys), dtype=torch.bool)
            if min_count is not None:
                doomed |= count < min_count
            if max_age_s is not None:
                doomed |= (now - stamp) > max_age_s
            if min_l2_norm is not None:
                weights = rows[:, layout.weight_offset : layout.weight_offset + layout.dim]
                doomed |= torch.linalg.vector_norm(weights.float(), dim=1) < min_l2_norm
            if max_rows is not None:
                survivors = torch.nonzero(~doomed).flatten().tolist()
                excess = len(survivors) - max_rows
                if excess > 0:
                    ranked = sorted(survivors, key=lambda i: (int(count[i]), int(stamp[i]), int(keys[i])))
                    doomed[ranked[:excess]] = True
            victims = keys[doomed]
            for shard, _, shard_keys in self._by_shard(victims):
                shard.remove(shard_keys, self._stamp())
        return victims

    # -- change tracking -----------------------------------------------------------

    def new_epoch(self) -> int:
        """End the current epoch and return its number; later changes belong to the next one.

        Taken with every shard's lock, so each call's changes to a shard fall in one epoch.
        """
        with self.writing():
            ended = self._epoch
            self._epoch += 1
            return ended

    def changes_since(self, mark: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(written, removed)`` since epoch ``mark`` (its changes excluded), ascending int64:
        the ids present now whose last write came in a later epoch, and the ids absent now
        that were removed (deleted or evicted) in a later epoch. One snapshot: every shard's
        lock held."""
        written, removed = [], []
        with self.reading():
            for shard in self._shards:
                written += [k for k, e in shard.written.items() if e > mark and k in shard.index]
                removed += [k for k, e in shard.removed.items() if e > mark and k not in shard.index]
        return (
            torch.tensor(sorted(written), dtype=torch.int64),
            torch.tensor(sorted(removed), dtype=torch.int64),
        )

    def forget(self, mark: int) -> None:
        """Drop the removals of epochs ``<= mark``: no one will ask for changes since an
        earlier epoch again."""
        with self.writing():
            for shard in self._shards:
                shard.removed = {k: e for k, e in shard.removed.items() if e > mark}


class ChangeMark(NamedTuple):
    """Where a store stood when it last equalled a checkpoint: the epoch that ended then
    (``KVStore.next_epoch()``'s number) and that checkpoint. ``store.changes()`` is then
    what a delta checkpoint on top of ``checkpoint`` must write."""

    epoch: int
    checkpoint: str  # the SHA-256 hex digest of the checkpoint's manifest


@runtime_checkable
class SupportsRows(Protocol):
    """What a store offers the code that moves its rows: checkpoints, KVTensor, copies.

    ``leanstate.KVStore`` (the front class over any engine) is the implementation; the
    reference names only this surface, so it imports nothing outside itself. Being
    runtime-checkable, ``isinstance(x, SupportsRows)`` is the one test of "is this a
    store" everywhere (it checks that the members exist, not their signatures).
    """

    layout: RowLayout

    def __len__(self) -> int: ...
    def get(self, ids: torch.Tensor, *, width_offset: int = 0, width: int | None = None) -> torch.Tensor: ...
    def set(self, ids: torch.Tensor, values: torch.Tensor, *, width_offset: int = 0) -> None: ...
    def get_rows(self, ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor: ...
    def set_rows(self, rows: torch.Tensor) -> None: ...
    def delete(self, ids: torch.Tensor) -> None: ...
    def keys(self) -> torch.Tensor: ...
    def reserve(self, rows: int) -> None: ...

    # change tracking (spec/kv_store.md): what changed since the checkpoint the store equals
    mark: ChangeMark | None

    def changes(self, since: int | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...
    def next_epoch(self) -> int: ...


@runtime_checkable
class ReadsInPlace(Protocol):
    """What an engine offers a bulk load that reads rows straight into its pool (the numba
    engine): blocks claimed, written through ``rows``, then adopted by their header keys
    or abandoned (zeroed and freed), all with ``writing()`` held. A store hands it out
    through ``rows_in_place()`` (``spec/backends.md``); a store without it is loaded
    through ``set_rows``."""

    rows: torch.Tensor

    def writing(self): ...
    def claim(self, rows: int) -> int: ...
    def adopt(self, first: int, count: int) -> None: ...
    def abandon(self, first: int, count: int) -> None: ...
    def fault_in(self, first: int, count: int) -> None: ...
