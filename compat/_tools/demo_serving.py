"""The demo's serving side: this process follows the training run's checkpoints while its
ranks train, as a serving process would, and says how far behind it was.

A thread waits for the run's first full checkpoint, builds a plain store per table from
its manifest, and then polls a :class:`leanstate.Follower` until the run ends; each link's
lag is the time from its publication (its manifest's mtime) to the end of its apply.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

import torch

import leanstate
from leanstate._tools.follow import newest_full, stores_for
from leanstate.checkpoint.core import MANIFEST


class ServingFollower:
    """Follow ``directory`` on a thread from :meth:`start` to :meth:`stop`."""

    def __init__(self, directory: Path, backend: str | None, interval: float = 0.2) -> None:
        self.directory, self.backend, self.interval = directory, backend, interval
        self.stores: dict[str, leanstate.KVStore] = {}
        self.follower: leanstate.Follower | None = None
        self.lags: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leanstate-demo-serving", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _applied(self, applied) -> None:
        self.lags.append(time.time() - os.stat(applied.path / MANIFEST).st_mtime)

    def _poll(self) -> None:
        if self.follower is None:
            manifest = newest_full(self.directory)
            if manifest is None:
                return
            self.stores = stores_for(manifest, self.backend)
            self.follower = leanstate.Follower(self.directory, self.stores, on_apply=self._applied)
        try:
            self.follower.poll()
        except leanstate.CheckpointError as exc:
            self.errors.append(str(exc))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._poll()

    def stop(self) -> None:
        """Stop the thread, after one last poll (whatever the run published last)."""
        self._stop.set()
        self._thread.join()
        self._poll()

    def proof(self, last: Path) -> tuple[str, bool, str]:
        """The claim: the served tables are the run's last checkpoint, row for row, every link
        applied as it landed."""
        history = [] if self.follower is None else self.follower.history
        fresh = {name: store.__class__(store.dim, optimizer_state_dim=store.optimizer_state_dim,
                                       dtype=store.dtype, backend=store.backend)
                 for name, store in self.stores.items()}  # fmt: skip
        same = bool(fresh) and self.follower.position == last
        if same:
            leanstate.load_checkpoint(last, fresh)
            for name, store in self.stores.items():
                keys = store.keys()
                same = same and torch.equal(keys, fresh[name].keys())
                ours, theirs = store.get_rows(keys), fresh[name].get_rows(keys)
                same = same and torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # bits: headers
        kinds = [a.kind for a in history]
        detail = (
            f"{len(kinds)} links applied while training ({kinds.count('full')} full, {kinds.count('delta')} "
            f"deltas), lag median {statistics.median(self.lags) if self.lags else 0:.2f} s, max "
            f"{max(self.lags, default=0):.2f} s; readers held at most "
            f"{max((a.commit_seconds for a in history if a.kind == 'delta'), default=0) * 1e3:.1f} ms by a delta"
            + (f"; refused: {self.errors[0]}" if self.errors else "")
        )
        return "a serving copy follows the run's checkpoints as they land", same and not self.errors, detail
