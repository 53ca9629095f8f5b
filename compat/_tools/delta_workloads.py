"""Delta checkpoints beside their peers (``python -m leanstate bench``): a delta after
touching 1% of a table beside a full save of it, a chain of a full checkpoint and ten
such deltas loaded beside a full load of the same final rows, and its compaction beside
a full save of the result."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import leanstate
from leanstate._tools.workloads import filled_store, samples
from leanstate.checkpoint import compact_checkpoint, load_checkpoint, save_checkpoint
from leanstate.checkpoint.core import finish_removals

DELTA_SAVE_TARGET = 20.0  # a delta of 1% of the rows saves in at most 0.05x a full save's time
DELTA_BYTES_TARGET = 1 / 1.05  # its files hold at most 1.05x the changed rows and removed ids
CHAIN_LOAD_TARGET = 1 / 1.3  # a full checkpoint and 10 deltas load in at most 1.3x a full load
COMPACT_TARGET = 0.8  # a compaction runs at 0.8x a full save of its result, or faster


class DeltaChain:
    """A table of ``rows`` rows saved full, then ``links`` deltas, each after touching
    ``share`` of its rows (writes of random ids, a few of them new, and a few deletes);
    the final rows also saved full, as the peer of the chain's load and compaction."""

    def __init__(
        self, rows: int, dim: int, backend: str | None, links: int = 10, share: float = 0.01
    ) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="leanstate-bench-"))
        self.rows, self.dim, self.backend, self.share = rows, dim, backend, share
        self.store = filled_store(rows, dim, backend)
        self.generator = torch.Generator().manual_seed(7)
        self.head = self.folder / "c0"
        save_checkpoint(self.head, {"t": self.store})
        for k in range(1, links + 1):
            self.touch()
            self.changed = [len(ids) for ids in self.store.changes()]
            self._save_delta(self.folder / f"c{k}")
        self.chain = self.head
        self.final = self.folder / "final"
        save_checkpoint(self.final, {"t": self.store})
        self.head = self.final
        self.loaded = self.fresh_store()  # the chain's rows, for the compaction's peer
        load_checkpoint(self.final, {"t": self.loaded})
        self._spare = 0

    def touch(self) -> None:
        """Write ``share`` of the rows (a tenth of them new ids) and delete a twentieth as many."""
        count = max(1, int(self.rows * self.share))
        ids = torch.randint(0, int(self.rows * 1.1), (count,), generator=self.generator)
        self.store.set(ids, torch.randn(count, self.dim, generator=self.generator))
        doomed = torch.randint(0, self.rows, (max(1, count // 20),), generator=self.generator)
        self.store.delete(doomed)

    def _save_delta(self, path: Path) -> None:
        save_checkpoint(path, {"t": self.store}, base=self.head)
        self.head = path

    def delta_bytes(self) -> tuple[int, int]:
        """The bytes of the chain's last delta (every file, the manifest too), and what it
        must hold: its changed rows and its removed ids."""
        written, removed = self.changed
        files = sum(p.stat().st_size for p in self.chain.iterdir())
        return files, written * self.store.layout.row_bytes + 8 * removed

    def delta_save(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """(touch, save a delta of it): the delta goes beside the last save, never over it."""

        def touch() -> None:
            self.touch()
            # the full save's previous copy is deleted on a thread after it returns: not
            # while the delta is timed
            finish_removals()

        def save() -> None:
            self._spare = 1 - self._spare
            self._save_delta(self.folder / f"spare{self._spare}")

        return touch, save

    def full_save(self) -> None:
        save_checkpoint(self.folder / "full", {"t": self.store})
        self.head = self.folder / "full"

    def fresh_store(self) -> leanstate.KVStore:
        return leanstate.KVStore(self.dim, optimizer_state_dim=1, backend=self.backend)

    def chain_load(self) -> None:
        load_checkpoint(self.chain, {"t": self.fresh_store()})

    def full_load(self) -> None:
        load_checkpoint(self.final, {"t": self.fresh_store()})

    def compact(self) -> None:
        compact_checkpoint(self.chain, self.folder / "compacted", overwrite=True)  # each round replaces it

    def save_final(self) -> None:
        """The peer of the compaction: a full save of a store holding the chain's rows."""
        save_checkpoint(self.folder / "final-again", {"t": self.loaded})

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def delta_figures(rows: int, dim: int, backend: str, rounds: int, line: Callable[..., tuple]) -> list[tuple]:
    """The delta checkpoint's rows of the bench table on ``backend``, made by ``line`` (the
    bench's row maker): every figure beside its peer, in the same interleaved rounds."""
    chain = DeltaChain(rows, dim, backend)
    try:
        written, needed = chain.delta_bytes()
        chain.chain_load()  # warm-up
        times = samples(  # each after the deletions of the copies the saves before it replaced
            {
                "chain load": (finish_removals, chain.chain_load),
                "full load": (finish_removals, chain.full_load),
                "compact": (finish_removals, chain.compact),
                "save final": (finish_removals, chain.save_final),
            },
            rounds,
        )
        saves = samples(
            {"delta save": chain.delta_save(), "full save": (finish_removals, chain.full_save)}, rounds
        )
    finally:
        chain.close()
    share = f"{chain.share:.0%} of {rows} rows"
    return [
        line("checkpoint", f"delta save s, {share} touched", backend, saves["delta save"], "full save",
             saves["full save"], DELTA_SAVE_TARGET),
        line("checkpoint", f"delta bytes, {share} touched", backend, written, "changed rows + removed ids",
             needed, DELTA_BYTES_TARGET),
        line("checkpoint", f"load full + 10 deltas of {share} s", backend, times["chain load"],
             "full load of the same rows", times["full load"], CHAIN_LOAD_TARGET),
        line("checkpoint", f"compact full + 10 deltas of {share} s", backend, times["compact"],
             "full save of the result", times["save final"], COMPACT_TARGET),
    ]  # fmt: skip
