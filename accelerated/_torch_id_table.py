"""The torch engine's id -> block table: open addressing on ``splitmix64(id)`` in two int64
tensors (keys: ``-1`` empty, ``-2`` a tombstone; blocks), rebuilt larger past half full.

Every operation is a fixed sequence of vectorised ops over a batch; the only loops run
over probe steps, never over ids. A lookup settles most keys in its first step (the table
is at most half full), then the keys still going look at ``_WINDOW`` slots a round. An
insert of distinct new keys bids for slots: among the bidders for a free slot the
smallest key wins (``scatter_reduce(amin)``) and the others go on, so the table is the
same for any thread order. The hash is the reference's SplitMix64 restated in int64
arithmetic (it wraps modulo 2**64 as uint64 does; right shifts are made logical by
masking), shared with the engine's initial weights.
"""

from __future__ import annotations

import torch

from leanstate.reference.hashing import MASK64, SPLITMIX_GOLDEN, SPLITMIX_MIX1, SPLITMIX_MIX2

EMPTY, TOMBSTONE = -1, -2
_INT64_MAX = torch.iinfo(torch.int64).max
_WINDOW = 8  # table slots a lookup or insert round looks at per key, past the first step


def signed(value: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    value &= MASK64
    return value - 2**64 if value >= 2**63 else value


def shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (``>>`` on int64 extends the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 bit patterns (wrapping add and multiply)."""
    z = x + signed(SPLITMIX_GOLDEN)
    z = (z ^ shift_right(z, 30)) * signed(SPLITMIX_MIX1)
    z = (z ^ shift_right(z, 27)) * signed(SPLITMIX_MIX2)
    return z ^ shift_right(z, 31)


class IdTable:
    """Distinct non-negative keys -> blocks, on ``device``; see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.keys = torch.full((1024,), EMPTY, dtype=torch.int64, device=device)
        self.blocks = torch.full((1024,), -1, dtype=torch.int64, device=device)
        self.tombstones = 0

    def nbytes(self) -> int:
        return (self.keys.numel() + self.blocks.numel()) * 8

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, blocks) of every entry, in table order."""
        present = self.keys >= 0
        return self.keys[present], self.blocks[present]

    def remove(self, slots: torch.Tensor) -> None:
        """Tombstone the entries at ``slots`` (from :meth:`probe`)."""
        self.keys[slots] = TOMBSTONE
        self.tombstones += len(slots)

    def _window(self, position: torch.Tensor) -> torch.Tensor:
        """The ``_WINDOW`` slots from each position on, ``[n, _WINDOW]`` (wrapping)."""
        steps = torch.arange(_WINDOW, device=self.device)
        return (position[:, None] + steps[None, :]) & (len(self.keys) - 1)

    def probe(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot or -1, block or -1) of each non-negative key."""
        capacity = len(self.keys)
        position = splitmix64(keys) & (capacity - 1)
        # the first step settles most keys (the table is at most half full): whole-batch ops,
        # no compaction; the keys still going then look at _WINDOW slots a round, so the
        # rounds are bounded by the longest run of slots over _WINDOW, not by its length
        found = self.keys.index_select(0, position)
        hit = found == keys
        slots = torch.where(hit, position, -1)
        blocks = torch.where(hit, self.blocks.index_select(0, position), -1)
        active = torch.nonzero(~hit & (found != EMPTY)).flatten()
        position = (position[active] + 1) & (capacity - 1)
        while len(active):
            window = self._window(position)
            found = torch.take(self.keys, window)
            is_hit = found == keys[active, None]
            settled = is_hit | (found == EMPTY)
            first = settled.to(torch.uint8).argmax(dim=1)  # the first slot that settles the key
            slot = window.gather(1, first[:, None]).flatten()
            done = settled.any(dim=1)
            found_here = done & is_hit.gather(1, first[:, None]).flatten()
            slots[active[found_here]] = slot[found_here]
            blocks[active[found_here]] = self.blocks.index_select(0, slot[found_here])
            going = ~done
            active, position = active[going], (position[going] + _WINDOW) & (capacity - 1)
        return slots, blocks

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Block of each id, -1 when absent or negative."""
        blocks = torch.full_like(ids, -1)
        valid = torch.nonzero(ids >= 0).flatten()
        if len(valid):
            blocks[valid] = self.probe(ids[valid])[1]
        return blocks

    def place(self, keys: torch.Tensor, blocks: torch.Tensor) -> None:
        """Put distinct absent ``keys`` in the table.

        Each key bids for the first free slot (empty or tombstone) in the ``_WINDOW`` slots
        from its position; the smallest key wins each contested slot, and the others go
        on from the slot after the one they lost (every slot they skipped is taken, so no
        empty slot lies between a key's home and its slot, as lookups need).
        """
        capacity = len(self.keys)
        position = splitmix64(keys) & (capacity - 1)
        while len(keys):
            window = self._window(position)
            free = torch.take(self.keys, window) < 0
            first = free.to(torch.uint8).argmax(dim=1)
            has_free = free.any(dim=1)
            slot = window.gather(1, first[:, None]).flatten()
            bidders = torch.nonzero(has_free).flatten()
            contested, bidder = torch.unique(slot[bidders], return_inverse=True)
            best = torch.full((len(contested),), _INT64_MAX, dtype=torch.int64, device=self.device)
            best.scatter_reduce_(0, bidder, keys[bidders], reduce="amin")
            won = torch.zeros(len(keys), dtype=torch.bool, device=self.device)
            won[bidders] = keys[bidders] == best[bidder]
            reused = self.keys[slot[won]] == TOMBSTONE
            self.tombstones -= int(reused.sum())
            self.keys[slot[won]] = keys[won]
            self.blocks[slot[won]] = blocks[won]
            lost = ~won
            # a loser goes on after the slot it lost; a key with no free slot, after its window
            position = torch.where(has_free, slot + 1, position + _WINDOW)[lost] & (capacity - 1)
            keys, blocks = keys[lost], blocks[lost]

    def fit(self, rows: int) -> None:
        """Rebuild the table, larger if needed, when rows and tombstones would pass half of it."""
        capacity = len(self.keys)
        if 2 * (rows + self.tombstones) <= capacity:
            return
        while 2 * rows > capacity:
            capacity *= 2
        keys, blocks = self.live()
        self.keys = torch.full((capacity,), EMPTY, dtype=torch.int64, device=self.device)
        self.blocks = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self.tombstones = 0
        self.place(keys, blocks)
