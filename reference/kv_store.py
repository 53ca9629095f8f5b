"""The reference KV embedding store: a sharded map id -> row, in plain Python and torch.

Each shard holds a dict from id to block number, a pool of blocks allocated in chunks
of rows, a free list of released blocks and a lock. Every row is one block laid out as
``reference.row_format`` says. Missing ids read as their *initial row* and are not
inserted; negative ids are padding and read as zeros. See ``spec/kv_store.md``.

Example::

    >>> store = KVStore(4, optimizer_state_dim=1, num_shards=2)
    >>> store.set(torch.tensor([7, 3]), torch.ones(2, 4))
    >>> store.get(torch.tensor([3, 7, -1]))[:, :4]
    tensor([[1., 1., 1., 1.],
            [1., 1., 1., 1.],
            [0., 0., 0., 0.]])
    >>> store.keys()
    tensor([3, 7])
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable

import torch

from leanstate.reference.hashing import initial_weights, shards_of
from leanstate.reference.row_format import (
    COUNT_MAX,
    TIMESTAMP_MAX,
    RowLayout,
    check_dtype,
    header_words,
    pack_metadata,
    unpack_metadata,
)

ROWS_PER_CHUNK = 1024
_USED = torch.iinfo(torch.int64).min  # bit 63 of the metadata word


def _system_clock() -> int:
    return int(time.time())


class _Shard:
    """One shard: id -> block map, chunked block pool with a free list, and its lock.

    Accelerated backends replace this class and keep its methods: ``lookup``,
    ``read_into``, ``read_metadata``, ``store``, ``remove``, ``keys``, ``__len__`` and
    ``memory_bytes`` (all called with
    ``lock`` held by the store).
    """

    def __init__(self, width: int, dtype: torch.dtype, rows_per_chunk: int) -> None:
        self.lock = threading.Lock()
        self.index: dict[int, int] = {}
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

    def read_into(self, blocks: torch.Tensor, out: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy the whole row of ``blocks[i]`` to ``out[positions[i]]``."""
        for chunk, selected, within in self._by_chunk(blocks):
            out[positions[selected]] = chunk[within]

    def read_metadata(self, blocks: torch.Tensor) -> torch.Tensor:
        """The int64 eviction-metadata word (header bytes 8-15) of ``blocks``."""
        rows = torch.empty(len(blocks), self.width, dtype=self.dtype)
        self.read_into(blocks, rows, torch.arange(len(blocks)))
        return header_words(rows)[:, 1].clone()

    def _write(self, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        for chunk, positions, within in self._by_chunk(blocks):
            chunk[within] = rows[positions]

    def store(
        self, keys: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Write ``rows[positions[i]]`` as the row of distinct ``keys[i]``, with ``used`` set.

        ``blocks`` comes from ``lookup``; a -1 gets a new block. Every stored row is used.
        """
        block_list = blocks.tolist()
        for i, key in enumerate(keys.tolist()):
            if block_list[i] < 0:
                block_list[i] = self.index[key] = self._allocate()
        selected = rows[positions]
        header_words(selected)[:, 1] |= _USED
        self._write(torch.tensor(block_list, dtype=torch.int64), selected)

    def remove(self, keys: torch.Tensor) -> int:
        """Delete distinct keys: zero their blocks and free them. Returns how many were present."""
        freed = [b for b in (self.index.pop(k, None) for k in keys.tolist()) if b is not None]
        if freed:
            self._write(torch.tensor(freed), torch.zeros(len(freed), self.width, dtype=self.dtype))
            self.free.extend(freed)
        return len(freed)

    def memory_bytes(self) -> int:
        chunk_bytes = sum(c.numel() * c.element_size() for c in self.chunks)
        # The map's own table plus one int object per key and per block number.
        objects = sum(sys.getsizeof(k) + sys.getsizeof(b) for k, b in self.index.items())
        return chunk_bytes + sys.getsizeof(self.index) + objects + sys.getsizeof(self.free)


class KVStore:
    """A sharded id -> row store with FBGEMM DRAM KV semantics (reference backend).

    Args:
        dim: weight elements per row (D).
        optimizer_state_dim: optimizer-state elements per row (S), 0 for none.
        dtype: element type of the rows: float32, float16 or bfloat16.
        num_shards: number of shards; an id's shard is ``hashing.shard_of``.
        init_range: (low, high) of the uniform initial weights of missing ids.
        seed: seed of the initial weights; with ``init_range`` it fixes every bit.
        clock: callable returning the time in whole seconds (``time.time`` by default);
            stamped into the header by ``set``.
        backend: accepted for API symmetry; this class is the ``reference`` backend.

    Example::

        >>> store = KVStore(8, num_shards=4)
        >>> rows = store.get(torch.tensor([5]))   # initial row, not inserted
        >>> len(store)
        0
    """

    backend = "reference"

    def __init__(
        self,
        dim: int,
        *,
        optimizer_state_dim: int = 0,
        dtype: torch.dtype = torch.float32,
        num_shards: int = 8,
        init_range: tuple[float, float] = (-0.01, 0.01),
        seed: int = 0,
        clock: Callable[[], int] | None = None,
        backend: str | None = None,
    ) -> None:
        check_dtype(dtype)
        self.layout = RowLayout(dim, optimizer_state_dim, dtype)
        if not isinstance(num_shards, int) or not 1 <= num_shards < 2**32:
            raise ValueError(f"num_shards must be an int in [1, 2**32); got {num_shards!r}")
        low, high = (float(x) for x in init_range)
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise ValueError(f"init_range must be finite (low, high) with low <= high; got {init_range!r}")
        if backend not in (None, self.backend):
            raise ValueError(f"backend={backend!r}: this class is the {self.backend!r} backend")
        self.num_shards = num_shards
        self.init_range = (low, high)
        self.seed = int(seed)
        self.clock = clock if clock is not None else _system_clock
        self._shards = [self._new_shard() for _ in range(num_shards)]

    # -- properties ----------------------------------------------------------------

    @property
    def dim(self) -> int:
        return self.layout.dim

    @property
    def optimizer_state_dim(self) -> int:
        return self.layout.state_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype

    def __len__(self) -> int:
        return sum(len(s) for s in self._shards)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dim={self.dim}, optimizer_state_dim={self.optimizer_state_dim}, "
            f"dtype={self.dtype}, num_shards={self.num_shards}, rows={len(self)}, "
            f"width={self.layout.width}, backend={self.backend!r})"
        )

    def memory_bytes(self) -> int:
        """Bytes the store holds: block chunks plus the id maps and their objects."""
        total = 0
        for shard in self._shards:
            with shard.lock:
                total += shard.memory_bytes()
        return total

    # -- validation ----------------------------------------------------------------

    def _check_ids(self, ids: object, method: str, argument: str = "ids") -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{method}: {argument} must be a torch.Tensor; got {type(ids).__name__}")
        if ids.dtype != torch.int64:
            raise TypeError(
                f"{method}: {argument} must have dtype torch.int64; got {ids.dtype} "
                f"(convert with {argument}.to(torch.int64))"
            )
        if ids.dim() != 1:
            raise ValueError(f"{method}: {argument} must be 1-D; got shape {tuple(ids.shape)}")
        return ids.cpu()

    def _check_columns(self, method: str, width_offset: int, width: int | None) -> int:
        total = self.layout.value_width
        if not isinstance(width_offset, int) or not 0 <= width_offset <= total:
            raise ValueError(f"{method}: width_offset must be an int in [0, {total}]; got {width_offset!r}")
        if width is None:
            return total - width_offset
        if not isinstance(width, int) or width < 0 or width_offset + width > total:
            raise ValueError(
                f"{method}: width must be an int with width_offset + width <= {total}; "
                f"got width_offset={width_offset}, width={width!r}"
            )
        return width

    def _check_values(
        self,
        method: str,
        argument: str,
        values: object,
        rows: int | None,
        width: int,
        *,
        exact: bool = False,
    ) -> None:
        """``values`` must be a 2-D tensor of the store's dtype, ``rows`` x (<= or ==) ``width``."""
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{method}: {argument} must be a torch.Tensor; got {type(values).__name__}")
        if values.dtype != self.dtype:
            raise TypeError(
                f"{method}: {argument} must have the store's dtype {self.dtype}; got {values.dtype}"
            )
        want_rows = "N" if rows is None else str(rows)
        want_width = str(width) if exact else f"<= {width}"
        if (
            values.dim() != 2
            or (rows is not None and values.shape[0] != rows)
            or values.shape[1] > width
            or (exact and values.shape[1] != width)
        ):
            raise ValueError(
                f"{method}: {argument} must have shape [{want_rows}, {want_width}]; got {tuple(values.shape)}"
            )

    # -- helpers (the hooks an accelerated backend overrides) ------------------------

    def _new_shard(self) -> _Shard:
        return _Shard(self.layout.width, self.dtype, ROWS_PER_CHUNK)

    def _shard_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Shard of each non-negative id (``hashing.shard_of``)."""
        return shards_of(ids, self.num_shards)

    def _initial_weights(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), dim] initial weights (``hashing.init_value``), in the store's dtype."""
        low, high = self.init_range
        return initial_weights(ids, self.dim, seed=self.seed, low=low, high=high, dtype=self.dtype)

    # -- helpers ---------------------------------------------------------------------

    def _by_shard(self, ids: torch.Tensor):
        """Yield (shard, positions, ids at those positions) for the non-negative ids."""
        positions = torch.nonzero(ids >= 0).flatten()
        if len(positions) == 0:
            return
        shard_of = self._shard_ids(ids[positions])
        order = torch.argsort(shard_of, stable=True)
        shards, counts = torch.unique_consecutive(shard_of[order], return_counts=True)
        for s, chosen in zip(shards.tolist(), torch.split(positions[order], counts.tolist())):
            yield self._shards[s], chosen, ids[chosen]

    @staticmethod
    def _last_occurrences(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Distinct keys, the position of each one's last occurrence, and its occurrence count."""
        if len(keys) < 2 or bool((keys[1:] > keys[:-1]).all()):  # already distinct (sorted)
            return keys, torch.arange(len(keys)), torch.ones(len(keys), dtype=torch.int64)
        unique, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        last = torch.full((len(unique),), -1, dtype=torch.int64)
        last.scatter_reduce_(0, inverse, torch.arange(len(keys)), reduce="amax")
        return unique, last, counts

    def _initial_rows(self, ids: torch.Tensor, *, weights: bool = True) -> torch.Tensor:
        """Whole rows of missing ids: header key and used=0, initial weights, zero state.

        ``weights=False`` leaves the weights zero, for a caller about to overwrite them all.
        """
        layout = self.layout
        rows = torch.zeros(len(ids), layout.width, dtype=self.dtype)
        if weights:
            rows[:, layout.weight_offset : layout.weight_offset + layout.dim] = self._initial_weights(ids)
        header_words(rows)[:, 0] = ids
        return rows

    def _now(self) -> int:
        now = int(self.clock())
        if not 0 <= now <= TIMESTAMP_MAX:
            raise ValueError(f"clock() returned {now}, outside the uint32 seconds range")
        return now

    # -- reads ---------------------------------------------------------------------

    def get(self, ids: torch.Tensor, *, width_offset: int = 0, width: int | None = None) -> torch.Tensor:
        """Columns ``[width_offset, width_offset + width)`` after the header, one row per id.

        Missing ids give their initial row (not inserted); negative ids give zeros.
        """
        ids = self._check_ids(ids, "KVStore.get")
        width = self._check_columns("KVStore.get", width_offset, width)
        full = self._read_whole(ids, initial_for_missing=True)
        start = self.layout.header_elems + width_offset
        return full[:, start : start + width].clone()

    def get_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole rows ``[N, width]`` with headers; missing and negative ids give zeros."""
        ids = self._check_ids(ids, "KVStore.get_rows")
        return self._read_whole(ids, initial_for_missing=False)

    def _read_whole(self, ids: torch.Tensor, *, initial_for_missing: bool) -> torch.Tensor:
        out = torch.empty(len(ids), self.layout.width, dtype=self.dtype)
        out[ids < 0] = 0
        for shard, positions, keys in self._by_shard(ids):
            with shard.lock:
                blocks = shard.lookup(keys)
                present = blocks >= 0
                shard.read_into(blocks[present], out, positions[present])
            if not present.all():
                missing = keys[~present]
                out[positions[~present]] = self._initial_rows(missing) if initial_for_missing else 0
        return out

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool tensor: which ids have a row (negative ids never do)."""
        ids = self._check_ids(ids, "KVStore.contains")
        out = torch.zeros(len(ids), dtype=torch.bool)
        for shard, positions, keys in self._by_shard(ids):
            with shard.lock:
                out[positions] = shard.lookup(keys) >= 0
        return out

    def metadata(self, ids: torch.Tensor) -> torch.Tensor:
        """Int64 eviction metadata ``timestamp | count << 32 | used << 63`` (0 when missing)."""
        ids = self._check_ids(ids, "KVStore.metadata")
        out = torch.zeros(len(ids), dtype=torch.int64)
        for shard, positions, keys in self._by_shard(ids):
            with shard.lock:
                blocks = shard.lookup(keys)
                present = blocks >= 0
                out[positions[present]] = shard.read_metadata(blocks[present])
        return out

    def keys(self) -> torch.Tensor:
        """All ids, sorted ascending, as int64."""
        found = []
        for shard in self._shards:
            with shard.lock:
                found.append(shard.keys())
        return torch.sort(torch.cat(found)).values

    def keys_in_range(self, lo: int, hi: int) -> torch.Tensor:
        """Ids in ``[lo, hi)``, sorted ascending, as int64."""
        keys = self.keys()
        return keys[(keys >= lo) & (keys < hi)]

    # -- writes --------------------------------------------------------------------

    def set(self, ids: torch.Tensor, values: torch.Tensor, *, width_offset: int = 0) -> None:
        """Write ``values`` ([N, w]) to columns ``[width_offset, width_offset + w)`` after the header.

        Missing ids are inserted (their other columns start from the initial row);
        every occurrence stamps the timestamp from ``clock`` and bumps ``count``; for a
        duplicated id the last occurrence's values win; negative ids are skipped.
        """
        method = "KVStore.set"
        ids = self._check_ids(ids, method)
        self._check_columns(method, width_offset, None)
        self._check_values(method, "values", values, len(ids), self.layout.value_width - width_offset)
        now = self._now()
        values = values.cpu()
        kept = torch.nonzero(ids >= 0).flatten()
        unique, last, occurrences = self._last_occurrences(ids[kept])
        source = kept[last]
        start = self.layout.header_elems + width_offset
        weight_start = self.layout.weight_offset
        overwrites_weights = start <= weight_start and start + values.shape[1] >= weight_start + self.dim
        overwrites_all = width_offset == 0 and values.shape[1] == self.layout.value_width
        for shard, positions, keys in self._by_shard(unique):
            with shard.lock:
                blocks = shard.lookup(keys)
                present = blocks >= 0
                if overwrites_all:  # only the headers of present rows are needed
                    rows = torch.zeros(len(keys), self.layout.width, dtype=self.dtype)
                    header = header_words(rows)
                    header[:, 0] = keys
                    header[present, 1] = shard.read_metadata(blocks[present])
                else:
                    rows = torch.empty(len(keys), self.layout.width, dtype=self.dtype)
                    shard.read_into(blocks[present], rows, torch.nonzero(present).flatten())
                    if not present.all():
                        rows[~present] = self._initial_rows(keys[~present], weights=not overwrites_weights)
                    header = header_words(rows)
                rows[:, start : start + values.shape[1]] = values[source[positions]]
                stamp, count, _ = unpack_metadata(header[:, 1])
                stamp.fill_(now)
                count = torch.clamp(count + occurrences[positions], max=COUNT_MAX)
                header[:, 1] = pack_metadata(stamp, count, torch.ones_like(present))
                shard.store(keys, blocks, rows, torch.arange(len(keys)))

    def set_rows(self, rows: torch.Tensor) -> None:
        """Write whole rows, each keyed by header bytes 0-7 (the checkpoint path).

        The saved timestamp and count are kept and ``used`` is set. For a key that
        appears twice, the last row wins.
        """
        method = "KVStore.set_rows"
        self._check_values(method, "rows", rows, None, self.layout.width, exact=True)
        rows = rows.cpu()
        keys = header_words(rows.contiguous())[:, 0]
        if (keys < 0).any():
            bad = int(torch.nonzero(keys < 0)[0])
            raise ValueError(f"{method}: rows[{bad}] has a negative key {int(keys[bad])} in its header")
        unique, last, _ = self._last_occurrences(keys)
        for shard, positions, shard_keys in self._by_shard(unique):
            with shard.lock:
                shard.store(shard_keys, shard.lookup(shard_keys), rows, last[positions])

    def delete(self, ids: torch.Tensor) -> int:
        """Remove ids (missing and negative ones are ignored); returns the rows removed."""
        ids = self._check_ids(ids, "KVStore.delete")
        removed = 0
        for shard, _, keys in self._by_shard(torch.unique(ids)):
            with shard.lock:
                removed += shard.remove(keys)
        return removed

    # -- eviction ------------------------------------------------------------------

    def evict(
        self,
        *,
        min_count: int | None = None,
        max_age_s: int | None = None,
        min_l2_norm: float | None = None,
        max_rows: int | None = None,
    ) -> torch.Tensor:
        """Delete rows by policy; returns the evicted ids, sorted.

        A row goes when ``count < min_count``, or it is older than ``max_age_s`` seconds
        by ``clock``, or its weight L2 norm is below ``min_l2_norm`` (any one suffices).
        Then, while more than ``max_rows`` rows remain, the rows with the lowest count go
        first, ties broken by oldest timestamp, then smallest id.
        """
        for name, value in (
            ("min_count", min_count),
            ("max_age_s", max_age_s),
            ("max_rows", max_rows),
        ):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"KVStore.evict: {name} must be an int >= 0 or None; got {value!r}")
        if min_l2_norm is not None and not min_l2_norm >= 0:
            raise ValueError(f"KVStore.evict: min_l2_norm must be >= 0 or None; got {min_l2_norm!r}")
        keys = self.keys()
        rows = self.get_rows(keys)
        header = header_words(rows)
        stamp, count, _ = unpack_metadata(header[:, 1])
        doomed = torch.zeros(len(keys), dtype=torch.bool)
        if min_count is not None:
            doomed |= count < min_count
        if max_age_s is not None:
            doomed |= (self._now() - stamp) > max_age_s
        if min_l2_norm is not None:
            weights = rows[:, self.layout.weight_offset : self.layout.weight_offset + self.dim]
            doomed |= torch.linalg.vector_norm(weights.float(), dim=1) < min_l2_norm
        if max_rows is not None:
            survivors = torch.nonzero(~doomed).flatten().tolist()
            excess = len(survivors) - max_rows
            if excess > 0:
                order = sorted(survivors, key=lambda i: (int(count[i]), int(stamp[i]), int(keys[i])))
                doomed[order[:excess]] = True
        victims = keys[doomed]
        self.delete(victims)
        return victims
