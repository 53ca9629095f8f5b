"""The ``torch`` KV store engine: torch tensor ops only, on whatever device holds its tensors.

Same interface and bits as ``leanstate.reference.kv_store.KVStoreEngine``
(``spec/backends.md``), written independently of it: one open-addressing id -> block
table (``_torch_id_table.IdTable``: linear probing from ``splitmix64(id)``, rebuilt past
half full, batches inserted by bidding so the table is the same for any thread order)
and one pool tensor of rows that grows by an eighth when full, with a last-in-first-out
free list. Every batch is a fixed sequence of vectorised ops; the only loops run over
probe steps, never over ids. Gather and scatter are ``index_select`` / ``index_copy_`` on
the pool.

The initial rows are computed with the reference's hash restated in int64 arithmetic
(it wraps modulo 2**64 as uint64 does; right shifts are made logical by masking).
A lock makes each call atomic, so concurrent threads are safe. Change tracking and
eviction are the shared ``ChangeTracking`` and ``Eviction`` over this engine's hooks:
each written block's epoch is stamped in the pool's ``stamps`` (one ``index_fill_`` a
batch) and the removed ids are logged by epoch.
"""

from __future__ import annotations

import threading

import torch

from leanstate.accelerated._change_log import ChangeTracking
from leanstate.accelerated._eviction import Eviction
from leanstate.accelerated._row_pool import RowPool, TensorRows, last_occurrences
from leanstate.accelerated._torch_id_table import IdTable, shift_right, signed, splitmix64
from leanstate.reference.hashing import INIT_BITS
from leanstate.reference.row_format import COUNT_MAX, RowLayout, header_words, pack_metadata, unpack_metadata

DEVICES = ("cpu", "cuda")
AUTO_PRIORITY = {"cpu": 10, "cuda": 30}  # on a GPU: first until the GPU bench says otherwise
# torch ops on the CPU, no compiled kernels: the fallback without numba
BENCH_TARGETS = {"get": (">=", 0.5), "set": (">=", 0.4), "insert": (">=", 0.2)}
_USED = torch.iinfo(torch.int64).min


def stamp(rows: torch.Tensor, writes: torch.Tensor | int, now: int) -> None:
    """Headers of ``rows`` after ``writes`` more writes each: count += writes (saturating),
    timestamp ``now``, ``used`` set."""
    stamp_words(header_words(rows), writes, now)


def stamp_words(header: torch.Tensor, writes: torch.Tensor | int, now: int) -> None:
    """``stamp`` on the header words ``[N, 2]`` (key, metadata) themselves."""
    _, count, _ = unpack_metadata(header[:, 1])
    count = torch.clamp(count + writes, max=COUNT_MAX)
    header[:, 1] = pack_metadata(torch.full_like(count, now), count, torch.ones_like(count, dtype=torch.bool))


class KVStoreEngine(ChangeTracking, Eviction, TensorRows):
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
        self._table = IdTable(self.device)
        self._pool = RowPool(layout, self.device)
        self._rows = 0
        self._seeded = splitmix64(torch.tensor([signed(seed)], dtype=torch.int64, device=self.device))
        self._start_tracking()  # each block's epoch of last write in the pool's stamps; removals logged

    def __len__(self) -> int:
        return self._rows

    def memory_bytes(self) -> int:
        """The pool, the table and the free list, in bytes."""
        return self._pool.nbytes() + self._table.nbytes() + self._log.nbytes()

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more rows in the pool and the table now."""
        with self.lock:
            self._pool.reserve(rows)
            self._table.fit(self._rows + rows)

    # -- the pool --------------------------------------------------------------------

    def _insert(self, keys: torch.Tensor, *, initial: bool = True) -> torch.Tensor:
        """Blocks for distinct absent keys, holding their initial rows and header (key, used);
        ``initial=False``: the caller overwrites the whole rows at once (``set_rows``), so the
        initial weights (a dozen ``[n, dim]`` int64 temporaries) are not computed."""
        self._table.fit(self._rows + len(keys))
        blocks = self._pool.allocate(len(keys))
        self._table.place(keys, blocks)
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
        per_key = splitmix64(ids ^ self._seeded)
        columns = torch.arange(layout.dim, dtype=torch.int64, device=self.device)
        bits = splitmix64(per_key[:, None] ^ columns[None, :])
        u = shift_right(bits, 64 - INIT_BITS).to(torch.float32) / 2**INIT_BITS
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
        blocks = self._table.lookup(ids)
        if insert:
            missing = torch.nonzero((blocks < 0) & (ids >= 0)).flatten()
            if len(missing):
                blocks[missing] = self._insert(ids[missing])
            if self.tracking:  # the caller writes every row it locates so (the embedding updates)
                self._pool.mark(blocks, self._log.epoch)
        return blocks

    # -- reads -----------------------------------------------------------------------

    def gather(
        self, ids: torch.Tensor, *, start: int, width: int, initial: bool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Columns ``[start, start + width)``; a missing id its initial row or zeros, a negative one zeros."""
        ids = ids.to(self.device)
        result = out if out is not None and out.device == self.device else None
        with self.lock:
            blocks = self._table.lookup(ids)
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
            return self._table.lookup(ids.to(self.device)) >= 0

    def metadata(self, ids: torch.Tensor) -> torch.Tensor:
        """Eviction metadata word of each id (0 when missing)."""
        with self.lock:
            blocks = self._table.lookup(ids.to(self.device))
            out = torch.zeros(len(ids), dtype=torch.int64, device=self.device)
            present = torch.nonzero(blocks >= 0).flatten()
            out[present] = header_words(self.rows.index_select(0, blocks[present]))[:, 1]
            return out

    def keys(self) -> torch.Tensor:
        """Every id, ascending."""
        with self.lock:
            return torch.sort(self._table.live()[0]).values

    # -- writes ----------------------------------------------------------------------

    def _blocks_for(self, unique: torch.Tensor, *, initial: bool = True) -> torch.Tensor:
        """Blocks of distinct non-negative ids, inserting the absent ones (``_insert``'s ``initial``)."""
        blocks = self._table.lookup(unique)
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
        slots, blocks = self._table.probe(keys)
        present = torch.nonzero(blocks >= 0).flatten()
        slots, blocks = slots[present], blocks[present]
        self.rows.index_fill_(0, blocks, 0)
        self._table.remove(slots)
        self._rows -= len(slots)
        self._pool.release(blocks)
        self._removed(keys[present])
        return keys[present]

    # -- the hooks of change tracking and eviction (call them with the lock held) -----

    def _live_sorted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ascending, their blocks)."""
        keys, blocks = self._table.live()
        keys, order = torch.sort(keys)
        return keys, blocks[order]

    def _written_since(self, mark: int) -> torch.Tensor:
        """Present ids whose block was stamped after epoch ``mark``, ascending."""
        keys, blocks = self._live_sorted()
        return keys[self._pool.stamps.index_select(0, blocks) > mark]

    def delete(self, ids: torch.Tensor) -> int:
        """Remove ids (missing and negative ones ignored); the count removed."""
        unique = torch.unique(ids.to(self.device))
        with self.lock:
            return len(self._remove(unique[unique >= 0]))
