"""``leanstate.KVStore``: the store's front class, one validation layer over any engine.

The front class owns the arguments: it checks them once (a clear error naming the
method and the argument, raised before anything is written), normalises them (ids and
values on the store's device, the clock read once per call, columns counted from the
start of the row) and hands each batch to one method of the engine of the chosen
backend (``spec/backends.md``). Engines never validate and never see Python lists.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch

from leanstate import _backends
from leanstate._host_reads import first_true, host_read
from leanstate._rows import copy_rows
from leanstate._store_gate import Gate
from leanstate.reference.arguments import int_argument, is_int
from leanstate.reference.kv_store import ChangeMark, ReadsInPlace
from leanstate.reference.row_format import COUNT_MAX, TIMESTAMP_MAX, RowLayout, check_dtype, header_words

MAX_SHARDS = 2**16


def _system_clock() -> int:
    return int(time.time())


class KVStore:
    """A sharded id -> row store with FBGEMM DRAM KV semantics (``spec/kv_store.md``).

    Rows are ``[16-byte header | weight (dim, padded to 4) | optimizer state (padded to 4)]``.
    A missing id reads as its deterministic initial row and is not inserted; a negative
    id is padding (zeros on read, skipped on write).

    Args:
        dim: weight elements per row (D).
        optimizer_state_dim: optimizer-state elements per row (S), 0 for none.
        dtype: element type of the rows: float32, float16 or bfloat16.
        num_shards: number of shards, in ``[1, 65536]``; an id's shard is
            ``leanstate.reference.hashing.shard_of``. The reference engine keeps one
            dict and one lock per shard; the accelerated engines record it only (one
            table serves every id, and one call already runs on every core).
        init_range: (low, high) of the uniform initial weights of missing ids.
        seed: seed of the initial weights; with ``init_range`` it fixes every bit.
        clock: callable returning the time in whole seconds (``time.time`` by default);
            stamped into the header by ``set``.
        device: where the rows live (default the backend's first device: the CPU, or
            the GPU for ``numba-cuda``); the backend must run there
            (its module's ``DEVICES``): ``torch`` and ``numba-cuda`` keep rows, ids and
            results on a CUDA device.
        backend: a registered backend name; default the import-time choice
            (``leanstate.backend_info()``).

    Example::

        >>> store = leanstate.KVStore(4, optimizer_state_dim=1)
        >>> store.set(torch.tensor([7, 3]), torch.ones(2, 4))
        >>> store.get(torch.tensor([3, 7, -1]))[:, :4]
        tensor([[1., 1., 1., 1.],
                [1., 1., 1., 1.],
                [0., 0., 0., 0.]])
        >>> store.keys()
        tensor([3, 7])
    """

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
        device: torch.device | str | None = None,
        backend: str | None = None,
    ) -> None:
        check_dtype(dtype)
        layout = RowLayout(dim, optimizer_state_dim, dtype)
        num_shards = int_argument(num_shards, "KVStore: num_shards", low=1, high=MAX_SHARDS)
        try:
            low, high = (float(x) for x in init_range)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"KVStore: init_range must be two floats (low, high); got {init_range!r}"
            ) from exc
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise ValueError(
                f"KVStore: init_range must be finite (low, high) with low <= high; got {init_range!r}"
            )
        seed = int_argument(seed, "KVStore: seed", error=TypeError)
        if clock is not None and not callable(clock):
            raise TypeError(f"KVStore: clock must be a callable returning seconds, or None; got {clock!r}")
        name, module = _backends.resolve("kv_store", backend)
        runs_on = _backends.devices("kv_store", name, module)
        try:
            device = torch.device(runs_on[0] if device is None else device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"KVStore: device={device!r} is not a torch device") from exc
        if device.type not in runs_on:
            raise ValueError(
                f"KVStore: device={str(device)!r}: the {name} engine runs on {', '.join(runs_on)}; "
                f"pass another device or backend"
            )
        if device.type == "cuda" and device.index is None:
            # one spelling per device: results, out= checks and kernel launches all compare it
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.layout = layout
        self.num_shards = num_shards
        self.init_range = (low, high)
        self.seed = seed
        self.clock = clock if clock is not None else _system_clock
        self.backend = name
        self._engine = module.KVStoreEngine(
            layout, num_shards=num_shards, init_range=self.init_range, seed=seed, device=device
        )
        self._mark: ChangeMark | None = None
        self._gate = Gate()

    @property
    def engine(self):
        """The engine of this store's backend: its row-access interface (``spec/backends.md``)
        is how the embedding engines reach the rows."""
        return self._engine

    def rows_in_place(self) -> ReadsInPlace | None:
        """The engine's in-place load interface when it has one (``spec/backends.md``), else
        None: a checkpoint load into this store while it is empty reads rows straight into
        the engine's pool instead of upserting them."""
        return self._engine if isinstance(self._engine, ReadsInPlace) else None

    # -- properties ----------------------------------------------------------------

    @property
    def dim(self) -> int:
        """Weight elements per row (D)."""
        return self.layout.dim

    @property
    def optimizer_state_dim(self) -> int:
        """Optimizer-state elements per row (S)."""
        return self.layout.state_dim

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the rows."""
        return self.layout.dtype

    def __len__(self) -> int:
        with self._gate.shared:
            return len(self._engine)

    def atomic(self) -> contextlib.AbstractContextManager[None]:
        """A block of calls other threads see all at once: while it runs, no other thread's
        call on this store does (theirs wait; this thread's pass), so a reader sees every
        write of the block or none. ``leanstate.Follower`` commits each delta so.

        Example::

            >>> with store.atomic():
            ...     store.set_rows(rows)
            ...     store.delete(gone)
        """
        return self._gate.exclusive

    def __repr__(self) -> str:
        return (
            f"KVStore(dim={self.dim}, optimizer_state_dim={self.optimizer_state_dim}, "
            f"dtype={self.dtype}, num_shards={self.num_shards}, rows={len(self)}, "
            f"width={self.layout.width}, backend={self.backend!r}, device={str(self.device)!r}, "
            f"tracking={self.tracking})"
        )

    def __reduce__(self):
        raise TypeError(
            "KVStore cannot be pickled (it holds locks and may be larger than memory allows twice); "
            "save it with leanstate.save_checkpoint(path, {'name': store})"
        )

    def __deepcopy__(self, memo: dict) -> KVStore:
        """An independent store with a copy of every row, headers included (the clock is
        shared). It tracks changes if this store does, from its own first epoch, with no
        ``mark``: it equals no checkpoint yet."""
        clone = KVStore(
            self.dim,
            optimizer_state_dim=self.optimizer_state_dim,
            dtype=self.dtype,
            num_shards=self.num_shards,
            init_range=self.init_range,
            seed=self.seed,
            clock=self.clock,
            device=self.device,
            backend=self.backend,
        )
        memo[id(self)] = clone
        clone.track_changes(self.tracking)
        copy_rows(self, clone)
        return clone

    def memory_bytes(self) -> int:
        """Bytes the store holds: row pools plus the id maps and free lists."""
        return self._engine.memory_bytes()

    # -- change tracking (spec/kv_store.md) -------------------------------------------

    @property
    def tracking(self) -> bool:
        """Whether the store records which ids are written and removed (on by default)."""
        return self._engine.tracking

    def track_changes(self, enabled: bool = True) -> None:
        """Turn change tracking on or off. Changes made while it is off are not recorded,
        so turning it either way clears :attr:`mark` (the next checkpoint is a full one);
        a call that keeps the setting changes nothing."""
        if not isinstance(enabled, bool):
            raise TypeError(f"KVStore.track_changes: enabled must be a bool; got {enabled!r}")
        if enabled != self.tracking:
            self._engine.tracking = enabled
            self.mark = None

    def next_epoch(self) -> int:
        """End the current epoch of changes and return its number (epochs count from 1);
        what is written or removed afterwards belongs to the next one. A checkpoint calls
        it when a save starts or a load ends, and remembers the number as :attr:`mark`."""
        return self._engine.new_epoch()

    def changes(self, since: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(written, removed)``: the ids changed after epoch ``since``, two ascending 1-D
        int64 CPU tensors. ``written``: ids present now whose last write (``set``,
        ``set_rows``, an embedding update, a load) came in a later epoch; ``removed``: ids
        absent now that were deleted or evicted in a later epoch. ``since=None``: this
        store's mark (``mark.epoch``, or 0 without one: every change since the store was
        made). Taken as one snapshot."""
        if since is None:
            since = 0 if self._mark is None else self._mark.epoch
        else:
            since = int_argument(since, "KVStore.changes: since", low=0, must="an int >= 0 or None")
        with self._gate.shared:
            return self._engine.changes_since(min(since, 2**62))

    @property
    def mark(self) -> ChangeMark | None:
        """The epoch at which this store last equalled a checkpoint, and that checkpoint's
        manifest digest (None: it equals none, or changes since were not all recorded).
        Setting it lets the store forget the removals of that epoch and earlier. While
        tracking is off it stays None (nothing is recorded to build a delta from)."""
        return self._mark

    @mark.setter
    def mark(self, mark: ChangeMark | None) -> None:
        if mark is not None:
            if not isinstance(mark, ChangeMark) or not is_int(mark.epoch) or mark.epoch < 0:
                raise TypeError(
                    f"KVStore.mark must be a ChangeMark(epoch >= 0, checkpoint) or None; got {mark!r}"
                )
            if not self.tracking:
                mark = None
            else:
                self._engine.forget(int(mark.epoch))
        self._mark = mark

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
        if ids.layout != torch.strided or ids.device.type == "meta":
            raise ValueError(
                f"{method}: {argument} must be a dense tensor with data; got {ids.layout} on {ids.device}"
            )
        return ids.to(self.device).contiguous()

    def _check_columns(self, method: str, width_offset: object, width: object) -> tuple[int, int]:
        total = self.layout.value_width
        width_offset = int_argument(width_offset, f"{method}: width_offset", low=0, high=total)
        if width is None:
            return width_offset, total - width_offset
        if not is_int(width) or width < 0 or width_offset + width > total:
            raise ValueError(
                f"{method}: width must be an int with width_offset + width <= {total}; "
                f"got width_offset={width_offset}, width={width!r}"
            )
        return width_offset, int(width)

    def _check_values(
        self, method: str, argument: str, values: object, rows: int | None, width: int, *, exact: bool = False
    ) -> torch.Tensor:
        """``values`` must be a 2-D tensor of the store's dtype, ``rows`` x (<= or ==) ``width``."""
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{method}: {argument} must be a torch.Tensor; got {type(values).__name__}")
        if values.dtype != self.dtype:
            raise TypeError(
                f"{method}: {argument} must have the store's dtype {self.dtype}; got {values.dtype} "
                f"(convert with {argument}.to({self.dtype}))"
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
        if values.layout != torch.strided or values.device.type == "meta":
            raise ValueError(f"{method}: {argument} must be a dense tensor with data")
        # A fresh, aligned copy when needed: engines read rows as int64 words.
        values = values.to(self.device)
        if not values.is_contiguous() or values.storage_offset() % (8 // values.element_size() or 1):
            values = values.clone(memory_format=torch.contiguous_format)
        return values

    def _check_out(self, method: str, out: object, rows: int, width: int) -> torch.Tensor:
        if (
            not isinstance(out, torch.Tensor)
            or out.shape != (rows, width)
            or out.dtype != self.dtype
            or not out.is_contiguous()
            or out.storage_offset() % (8 // out.element_size() or 1)
        ):
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"{method}: out must be a contiguous [{rows}, {width}] tensor of dtype {self.dtype}; got {got}"
            )
        return out

    def now(self) -> int:
        """The store's clock, read once: whole seconds in ``[0, 2**32)`` (stamped by writes)."""
        now = int(self.clock())
        if not 0 <= now <= TIMESTAMP_MAX:
            raise ValueError(f"clock() returned {now}, outside the uint32 seconds range")
        return now

    # -- reads ---------------------------------------------------------------------

    def get(
        self,
        ids: torch.Tensor,
        *,
        width_offset: int = 0,
        width: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Columns ``[width_offset, width_offset + width)`` after the header, one row per id.

        Missing ids give their initial row (not inserted); negative ids give zeros.
        ``out``: a contiguous ``[len(ids), width]`` tensor of the store's dtype to fill and
        return instead of a new one (as torch's ``out=``); it may live on another device.
        """
        ids = self._check_ids(ids, "KVStore.get")
        width_offset, width = self._check_columns("KVStore.get", width_offset, width)
        start = self.layout.header_elems + width_offset
        if out is not None:
            out = self._check_out("KVStore.get", out, len(ids), width)
        return self._gather(ids, start, width, True, out)

    def get_rows(self, ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Whole rows ``[N, width]`` with headers; missing and negative ids give zeros.

        ``out``: as for :meth:`get` (a checkpoint save reuses one host buffer per chunk).
        """
        ids = self._check_ids(ids, "KVStore.get_rows")
        if out is not None:
            out = self._check_out("KVStore.get_rows", out, len(ids), self.layout.width)
        return self._gather(ids, 0, self.layout.width, False, out)

    def _gather(self, ids, start: int, width: int, initial: bool, out: torch.Tensor | None) -> torch.Tensor:
        with self._gate.shared:
            if out is None or out.device == self.device:
                return self._engine.gather(ids, start=start, width=width, initial=initial, out=out)
            return out.copy_(self._engine.gather(ids, start=start, width=width, initial=initial))

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` more rows now (a capacity hint: no result changes).

        A checkpoint load reserves its table's rows first, so the store grows once.
        """
        self._engine.reserve(int_argument(rows, "KVStore.reserve: rows", low=0))

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool tensor: which ids have a row (negative ids never do)."""
        ids = self._check_ids(ids, "KVStore.contains")
        with self._gate.shared:
            return self._engine.contains(ids)

    def metadata(self, ids: torch.Tensor) -> torch.Tensor:
        """Int64 eviction metadata ``timestamp | count << 32 | used << 63`` (0 when missing)."""
        ids = self._check_ids(ids, "KVStore.metadata")
        with self._gate.shared:
            return self._engine.metadata(ids)

    def keys(self) -> torch.Tensor:
        """All ids, sorted ascending, as int64."""
        with self._gate.shared:
            return self._engine.keys()

    def keys_in_range(self, lo: int, hi: int) -> torch.Tensor:
        """Ids in ``[lo, hi)``, sorted ascending, as int64 (bounds are Python ints up to 2**63)."""
        lo, hi = (
            int_argument(
                v, f"KVStore.keys_in_range: {n}", low=-(2**63), high=2**63, must="an int in [-2**63, 2**63]"
            )
            for n, v in (("lo", lo), ("hi", hi))
        )
        keys = self.keys()
        if hi > 2**63 - 1:
            return keys[keys >= lo]
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
        width_offset, _ = self._check_columns(method, width_offset, None)
        values = self._check_values(
            method, "values", values, len(ids), self.layout.value_width - width_offset
        )
        now = self.now()
        with self._gate.shared:
            self._engine.scatter(ids, values, start=self.layout.header_elems + width_offset, now=now)

    def set_rows(self, rows: torch.Tensor) -> None:
        """Write whole rows, each keyed by header bytes 0-7 (the checkpoint path).

        The saved timestamp and count are kept and ``used`` is set. For a key that
        appears twice, the last row wins. A negative key is an error.
        """
        method = "KVStore.set_rows"
        rows = self._check_values(method, "rows", rows, None, self.layout.width, exact=True)
        keys = header_words(rows)[:, 0]
        bad = host_read(int, first_true(keys < 0)) if len(keys) else -1  # the first negative key
        if bad >= 0:
            raise ValueError(f"{method}: rows[{bad}] has a negative key {int(keys[bad])} in its header")
        with self._gate.shared:
            self._engine.write_rows(rows)

    def delete(self, ids: torch.Tensor) -> int:
        """Remove ids (missing and negative ones are ignored); returns the rows removed."""
        ids = self._check_ids(ids, "KVStore.delete")
        with self._gate.shared:
            return self._engine.delete(ids)

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
        first, ties broken by oldest timestamp, then smallest id. Decided and applied
        atomically: a concurrent write lands wholly before or after the eviction.
        """
        for name, value in (("min_count", min_count), ("max_age_s", max_age_s), ("max_rows", max_rows)):
            if value is not None:
                int_argument(value, f"KVStore.evict: {name}", low=0, must="an int >= 0 or None")
        if min_l2_norm is not None and (
            isinstance(min_l2_norm, bool) or not isinstance(min_l2_norm, int | float) or not min_l2_norm >= 0
        ):
            raise ValueError(f"KVStore.evict: min_l2_norm must be a number >= 0 or None; got {min_l2_norm!r}")
        now = self.now() if max_age_s is not None else 0
        # Thresholds past every count, age or size mean the same as those bounds (and fit int64).
        with self._gate.shared:
            return self._engine.evict(
                min_count=None if min_count is None else min(int(min_count), COUNT_MAX + 1),
                max_age_s=None if max_age_s is None else min(int(max_age_s), TIMESTAMP_MAX + 1),
                min_l2_norm=None if min_l2_norm is None else float(min_l2_norm),
                max_rows=None if max_rows is None else min(int(max_rows), 2**62),
                now=now,
            )
