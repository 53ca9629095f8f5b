"""The ``torch`` KV store engine: torch tensor ops only, on whatever device holds its tensors.

Same interface and bits as ``leanstate.reference.kv_store.KVStoreEngine``
(``spec/backends.md``), written independently of it: one open-addressing table (linear
probing from ``splitmix64(id)``, int64 keys and blocks, ``-1`` empty, ``-2`` a
tombstone, rebuilt past half full) and one pool tensor of rows that grows by an eighth when full,
with a last-in-first-out free list. Every batch is a fixed sequence of vectorised ops;
the only loops run over probe steps, never over ids:

- lookup: all ids probe together, one step per iteration, until each meets its key or
  an empty slot;
- insert of a batch of distinct new ids: all ids bid for their current slot; among the
  bidders for a free slot the smallest id wins (``scatter_reduce(amin)``), the others
  move one slot on and bid again, so the table is the same for any thread order;
- gather and scatter are ``index_select`` / ``index_copy_`` on the pool.

The initial rows are computed with the reference's hash restated in int64 arithmetic
(it wraps modulo 2**64 as uint64 does; right shifts are made logical by masking).
A lock makes each call atomic, so concurrent threads are safe. For change tracking each
written block's epoch is stamped in the pool's ``stamps`` (one ``index_fill_`` a batch)
and the removed ids are logged by epoch.
"""

from __future__ import annotations

import threading

import torch

from leanstate.accelerated._change_log import ChangeLog
from leanstate.accelerated._row_pool import RowPool, last_occurrences
from leanstate.reference.hashing import INIT_BITS, MASK64, SPLITMIX_GOLDEN, SPLITMIX_MIX1, SPLITMIX_MIX2
from leanstate.reference.row_format import COUNT_MAX, RowLayout, header_words, pack_metadata, unpack_metadata

_EMPTY, _TOMBSTONE = -1, -2
DEVICES = ("cpu", "cuda")
AUTO_PRIORITY = {"cpu": 10, "cuda": 30}  # on a GPU: first until the GPU bench says otherwise
# torch ops on the CPU, no compiled kernels: the fallback without numba
BENCH_TARGETS = {"get": (">=", 0.5), "set": (">=", 0.4), "insert": (">=", 0.2)}
_USED = torch.iinfo(torch.int64).min
_INT64_MAX = torch.iinfo(torch.int64).max
_WINDOW = 8  # table slots a lookup or insert round looks at per key, past the first step


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    value &= MASK64
    return value - 2**64 if value >= 2**63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (``>>`` on int64 extends the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 bit patterns (wrapping add and multiply)."""
    z = x + _signed(SPLITMIX_GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _signed(SPLITMIX_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(SPLITMIX_MIX2)
    return z ^ _shift_right(z, 31)


def stamp(rows: torch.Tensor, writes: torch.Tensor | int, now: int) -> None:
    """Headers of ``rows`` after ``writes`` more writes each: count += writes (saturating),
    timestamp ``now``, ``used`` set."""
    stamp_words(header_words(rows), writes, now)


def stamp_words(header: torch.Tensor, writes: torch.Tensor | int, now: int) -> None:
    """``stamp`` on the header words ``[N, 2]`` (key, metadata) themselves."""
    _, count, _ = unpack_metadata(header[:, 1])
    count = torch.clamp(count + writes, max=COUNT_MAX)
    header[:, 1] = pack_metadata(torch.full_like(count, now), count, torch.ones_like(count, dtype=torch.bool))


class KVStoreEngine:
    """The torch store engine (``spec/backends.md``): one hash table and one row pool.

    Args:
        layout: the row layout.
        num_shards: recorded only: one vectorised call already covers every id.
        init_range: (low, high) of the initial weights.
        seed: seed of the initial weights.
        device: where the table and the rows live (default the CPU).
    """

    backend = "torch"

    def __init__(
        self,
        layout: RowLayout,
        *,
        num_shards: int,
        init_range: tuple[float, float],
        seed: int,
        device: torch.device | str | None = None,
    ) -> None:
        self.layout, self.num_shards, self.init_range, self.seed = layout, num_shards, init_range, seed
        self.device = torch.device(device or "cpu")
        self.lock = threading.RLock()
        self._table_keys = torch.full((1024,), _EMPTY, dtype=torch.int64, device=self.device)
        self._table_blocks = torch.full((1024,), -1, dtype=torch.int64, device=self.device)
        self._tombstones = 0
        self._pool = RowPool(layout, self.device)
        self._rows = 0
        self._seeded = _splitmix64(torch.tensor([_signed(seed)], dtype=torch.int64, device=self.device))
        self.tracking = True  # each block's epoch of last write in the pool's stamps; removals logged
        self._log = ChangeLog()

    def __len__(self) -> int:
        return self._rows

    def memory_bytes(self) -> int:
        """The pool, the table and the free list, in bytes."""
        tables = (self._table_keys, self._table_blocks)
        return self._pool.nbytes() + sum(t.numel() * t.element_size() for t in tables) + self._log.nbytes()

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more rows in the pool and the table now."""
        with self.lock:
            self._pool.reserve(rows)
            self._fit_table(self._rows + rows)

    # -- the table ---------------------------------------------------------------------

    def _home(self, keys: torch.Tensor, capacity: int) -> torch.Tensor:
        return _splitmix64(keys) & (capacity - 1)

    def _window(self, position: torch.Tensor) -> torch.Tensor:
        """The ``_WINDOW`` slots from each position on, ``[n, _WINDOW]`` (wrapping)."""
        steps = torch.arange(_WINDOW, device=self.device)
        return (position[:, None] + steps[None, :]) & (len(self._table_keys) - 1)

    def _probe(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot or -1, block or -1) of each non-negative key."""
        capacity = len(self._table_keys)
        position = self._home(keys, capacity)
        # the first step settles most keys (the table is at most half full): whole-batch ops,
        # no compaction; the keys still going then look at _WINDOW slots a round, so the
        # rounds are bounded by the longest run of slots over _WINDOW, not by its length
        found = self._table_keys.index_select(0, position)
        hit = found == keys
        slots = torch.where(hit, position, -1)
        blocks = torch.where(hit, self._table_blocks.index_select(0, position), -1)
        active = torch.nonzero(~hit & (found != _EMPTY)).flatten()
        position = (position[active] + 1) & (capacity - 1)
        while len(active):
            window = self._window(position)
            found = torch.take(self._table_keys, window)
            is_hit = found == keys[active, None]
            settled = is_hit | (found == _EMPTY)
            first = settled.to(torch.uint8).argmax(dim=1)  # the first slot that settles the key
            slot = window.gather(1, first[:, None]).flatten()
            done = settled.any(dim=1)
            found_here = done & is_hit.gather(1, first[:, None]).flatten()
            slots[active[found_here]] = slot[found_here]
            blocks[active[found_here]] = self._table_blocks.index_select(0, slot[found_here])
            going = ~done
            active, position = active[going], (position[going] + _WINDOW) & (capacity - 1)
        return slots, blocks

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Block of each id, -1 when absent or negative."""
        blocks = torch.full_like(ids, -1)
        valid = torch.nonzero(ids >= 0).flatten()
        if len(valid):
            blocks[valid] = self._probe(ids[valid])[1]
        return blocks

    def _place(self, keys: torch.Tensor, blocks: torch.Tensor) -> None:
        """Put distinct absent ``keys`` in the table.

        Each key bids for the first free slot (empty or tombstone) in the ``_WINDOW`` slots
        from its position; the smallest key wins each contested slot, and the others go
        on from the slot after the one they lost (every slot they skipped is taken, so no
        empty slot lies between a key's home and its slot, as lookups need).
        """
        capacity = len(self._table_keys)
        position = self._home(keys, capacity)
        while len(keys):
            window = self._window(position)
            free = torch.take(self._table_keys, window) < 0
            first = free.to(torch.uint8).argmax(dim=1)
            has_free = free.any(dim=1)
            slot = window.gather(1, first[:, None]).flatten()
            bidders = torch.nonzero(has_free).flatten()
            contested, bidder = torch.unique(slot[bidders], return_inverse=True)
            best = torch.full((len(contested),), _INT64_MAX, dtype=torch.int64, device=self.device)
            best.scatter_reduce_(0, bidder, keys[bidders], reduce="amin")
            won = torch.zeros(len(keys), dtype=torch.bool, device=self.device)
            won[bidders] = keys[bidders] == best[bidder]
            reused = self._table_keys[slot[won]] == _TOMBSTONE
            self._tombstones -= int(reused.sum())
            self._table_keys[slot[won]] = keys[won]
            self._table_blocks[slot[won]] = blocks[won]
            lost = ~won
            # a loser goes on after the slot it lost; a key with no free slot, after its window
            position = torch.where(has_free, slot + 1, position + _WINDOW)[lost] & (capacity - 1)
            keys, blocks = keys[lost], blocks[lost]

    def _fit_table(self, rows: int) -> None:
        """Rebuild the table, larger if needed, when rows and tombstones would pass half of it."""
        capacity = len(self._table_keys)
        if 2 * (rows + self._tombstones) <= capacity:
            return
        while 2 * rows > capacity:
            capacity *= 2
        live = self._table_keys >= 0
        keys, blocks = self._table_keys[live], self._table_blocks[live]
        self._table_keys = torch.full((capacity,), _EMPTY, dtype=torch.int64, device=self.device)
        self._table_blocks = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self._tombstones = 0
        self._place(keys, blocks)

    # -- the pool --------------------------------------------------------------------

    def _insert(self, keys: torch.Tensor, *, initial: bool = True) -> torch.Tensor:
        """Blocks for distinct absent keys, holding their initial rows and header (key, used);
        ``initial=False``: the caller overwrites the whole rows at once (``set_rows``), so the
        initial weights (a dozen ``[n, dim]`` int64 temporaries) are not computed."""
        self._fit_table(self._rows + len(keys))
        blocks = self._pool.allocate(len(keys))
        self._place(keys, blocks)
        self._rows += len(keys)
        if initial:
            rows = self.initial_rows(keys)
            header_words(rows)[:, 1] = _USED
            self.rows.index_copy_(0, blocks, rows)
        return blocks

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole rows of missing ids: header (key, metadata 0), initial weights, zero state."""
        layout = self.layout
        low, high = (torch.tensor(x, dtype=torch.float32) for x in self.init_range)
        per_key = _splitmix64(ids ^ self._seeded)
        columns = torch.arange(layout.dim, dtype=torch.int64, device=self.device)
        bits = _splitmix64(per_key[:, None] ^ columns[None, :])
        u = _shift_right(bits, 64 - INIT_BITS).to(torch.float32) / 2**INIT_BITS
        rows = torch.zeros(len(ids), layout.width, dtype=layout.dtype, device=self.device)
        weights = u * (high - low).to(self.device) + low.to(self.device)
        rows[:, layout.weight_offset : layout.weight_offset + layout.dim] = weights.to(layout.dtype)
        header_words(rows)[:, 0] = ids
        return rows

    # -- row access (spec/backends.md) ------------------------------------------------

    def reading(self) -> threading.RLock:
        """The engine's lock (one for readers and writers): hold it around row access."""
        return self.lock

    writing = reading

    @property
    def rows(self) -> torch.Tensor:
        """The row pool ``[capacity, width]`` on the engine's device; valid until the next insert."""
        return self._pool.rows

    def locate(self, ids: torch.Tensor, *, insert: bool = False) -> torch.Tensor:
        """Block of each id, -1 when missing or negative; ``insert=True`` inserts the missing
        (distinct, non-negative) ids with their initial rows, header ``(key, used)``."""
        ids = ids.to(self.device)
        blocks = self._lookup(ids)
        if insert:
            missing = torch.nonzero((blocks < 0) & (ids >= 0)).flatten()
            if len(missing):
                blocks[missing] = self._insert(ids[missing])
            if self.tracking:  # the caller writes every row it locates so (the embedding updates)
                self._pool.mark(blocks, self._log.epoch)
        return blocks

    def read_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Whole rows (a copy) of present blocks."""
        return self.rows.index_select(0, blocks)

    def write_blocks(self, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole rows written at present, distinct blocks."""
        self.rows.index_copy_(0, blocks, rows)

    # -- reads -----------------------------------------------------------------------

    def gather(
        self, ids: torch.Tensor, *, start: int, width: int, initial: bool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Columns ``[start, start + width)``; a missing id its initial row or zeros, a negative one zeros."""
        ids = ids.to(self.device)
        result = out if out is not None and out.device == self.device else None
        with self.lock:
            blocks = self._lookup(ids)
            columns = self.rows[:, start : start + width]
            # one gather of every row (block 0 stands in for absent ids), then the absent fixed
            result = torch.index_select(columns, 0, blocks.clamp(min=0), out=result)
        absent = torch.nonzero(blocks < 0).flatten()
        if len(absent):
            result[absent] = 0
            missing = absent[ids[absent] >= 0]
            if initial and len(missing):
                result[missing] = self.initial_rows(ids[missing])[:, start : start + width]
        return result if out is None or result is out else out.copy_(result)

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Which ids have a row."""
        with self.lock:
            return self._lookup(ids.to(self.device)) >= 0

    def metadata(self, ids: torch.Tensor) -> torch.Tensor:
        """Eviction metadata word of each id (0 when missing)."""
        with self.lock:
            blocks = self._lookup(ids.to(self.device))
            out = torch.zeros(len(ids), dtype=torch.int64, device=self.device)
            present = torch.nonzero(blocks >= 0).flatten()
            out[present] = header_words(self.rows.index_select(0, blocks[present]))[:, 1]
            return out

    def keys(self) -> torch.Tensor:
        """Every id, ascending."""
        with self.lock:
            return torch.sort(self._table_keys[self._table_keys >= 0]).values

    # -- writes ----------------------------------------------------------------------

    def _blocks_for(self, unique: torch.Tensor, *, initial: bool = True) -> torch.Tensor:
        """Blocks of distinct non-negative ids, inserting the absent ones (``_insert``'s ``initial``)."""
        blocks = self._lookup(unique)
        missing = torch.nonzero(blocks < 0).flatten()
        if len(missing):
            blocks[missing] = self._insert(unique[missing], initial=initial)
        return blocks

    def scatter(self, ids: torch.Tensor, values: torch.Tensor, *, start: int, now: int) -> None:
        """``set``: last occurrence wins; count += occurrences (saturating), stamped ``now``."""
        ids, values = ids.to(self.device), values.to(self.device)
        every = bool((ids >= 0).all())
        kept = None if every else torch.nonzero(ids >= 0).flatten()
        unique, last, occurrences, inverse = last_occurrences(ids if every else ids[kept])
        layout, end = self.layout, start + values.shape[1]
        covers_weights = start <= layout.weight_offset and end >= layout.weight_offset + layout.dim
        with self.lock:
            # rows inserted here keep their initial weights only where the values leave them
            blocks = self._blocks_for(unique, initial=not covers_weights)
            columns = self.rows[:, start:end]
            if every:
                # every value where it is (no [N, w] copy of the values), then the ids that
                # occur more than once rewritten from their last occurrence, which wins
                columns.index_copy_(0, blocks[inverse], values)
                repeated = torch.nonzero(occurrences > 1).flatten()
                if len(repeated):
                    columns.index_copy_(0, blocks[repeated], values[last[repeated]])
            else:  # the last occurrence of each id wins
                columns.index_copy_(0, blocks, values[kept[last]])
            header = header_words(self.rows)
            rows = header.index_select(0, blocks)  # only the headers are read back
            rows[:, 0] = unique  # a row inserted without its initial row has no key yet
            stamp_words(rows, occurrences, now)
            header.index_copy_(0, blocks, rows)
            if self.tracking:
                self._pool.stamps.index_fill_(0, blocks, self._log.epoch)

    def write_rows(self, rows: torch.Tensor) -> None:
        """``set_rows``: keys from the headers, timestamp and count kept, ``used`` set; last row wins."""
        rows = rows.to(self.device)
        keys = header_words(rows)[:, 0]
        # A checkpoint's rows arrive sorted by key, so distinct: then no sort and no copy of
        # the rows (a load's peak stays near its slice, not several times it)
        if len(keys) < 2 or bool((keys[1:] > keys[:-1]).all()):
            unique, chosen = keys, rows
        else:
            unique, last, _, _ = last_occurrences(keys)
            chosen = rows.index_select(0, last)
        with self.lock:
            blocks = self._blocks_for(unique, initial=False)  # every inserted row is written below
            self.rows.index_copy_(0, blocks, chosen)
            flags = header_words(self.rows)[:, 1]  # set here: the caller's rows stay as they were
            flags.index_copy_(0, blocks, flags.index_select(0, blocks) | _USED)
            if self.tracking:
                self._pool.stamps.index_fill_(0, blocks, self._log.epoch)

    def _remove(self, keys: torch.Tensor) -> torch.Tensor:
        """Delete distinct non-negative keys: zero and free their blocks; the keys removed."""
        slots, blocks = self._probe(keys)
        present = torch.nonzero(blocks >= 0).flatten()
        slots, blocks = slots[present], blocks[present]
        self.rows.index_fill_(0, blocks, 0)
        self._table_keys[slots] = _TOMBSTONE
        self._tombstones += len(slots)
        self._rows -= len(slots)
        self._pool.release(blocks)
        if self.tracking:
            self._log.record(keys[present])
        return keys[present]

    def delete(self, ids: torch.Tensor) -> int:
        """Remove ids (missing and negative ones ignored); the count removed."""
        unique = torch.unique(ids.to(self.device))
        with self.lock:
            return len(self._remove(unique[unique >= 0]))

    def evict(
        self,
        *,
        min_count: int | None,
        max_age_s: int | None,
        min_l2_norm: float | None,
        max_rows: int | None,
        now: int,
    ) -> torch.Tensor:
        """Decide and delete under the lock; the evicted ids, ascending."""
        layout = self.layout
        with self.lock:
            keys = torch.sort(self._table_keys[self._table_keys >= 0]).values
            rows = self.rows.index_select(0, self._probe(keys)[1])
            stamped, count, _ = unpack_metadata(header_words(rows)[:, 1])
            doomed = torch.zeros(len(keys), dtype=torch.bool, device=self.device)
            if min_count is not None:
                doomed |= count < min_count
            if max_age_s is not None:
                doomed |= (now - stamped) > max_age_s
            if min_l2_norm is not None:
                weights = rows[:, layout.weight_offset : layout.weight_offset + layout.dim]
                doomed |= torch.linalg.vector_norm(weights.float(), dim=1) < min_l2_norm
            if max_rows is not None:
                survivors = torch.nonzero(~doomed).flatten()
                excess = len(survivors) - max_rows
                if excess > 0:  # fewest writes, then oldest, then smallest id (keys ascend)
                    by_stamp = survivors[torch.argsort(stamped[survivors], stable=True)]
                    ranked = by_stamp[torch.argsort(count[by_stamp], stable=True)]
                    doomed[ranked[:excess]] = True
            victims = keys[doomed]
            self._remove(victims)
            return victims

    # -- change tracking (spec/kv_store.md) ---------------------------------------------

    def new_epoch(self) -> int:
        """End the current epoch; its number. Later changes belong to the next one."""
        with self.lock:
            return self._log.new_epoch()

    def changes_since(self, mark: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(written, removed)`` after epoch ``mark``, ascending, on the CPU: present ids whose
        block was stamped later, and absent ids removed later. One snapshot under the lock."""
        with self.lock:
            live = self._table_keys >= 0
            keys, blocks = self._table_keys[live], self._table_blocks[live]
            written = torch.sort(keys[self._pool.stamps.index_select(0, blocks) > mark]).values
            removed = self._log.removed_since(mark, self.device)
            removed = removed[self._lookup(removed) < 0]
        return written.cpu(), removed.cpu()

    def forget(self, mark: int) -> None:
        """Drop the removals of epochs ``<= mark``."""
        with self.lock:
            self._log.forget(mark)
