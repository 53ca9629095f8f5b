"""``python -m leanstate follow DIRECTORY``: a serving copy that follows a trainer's checkpoints.

The tables are built from the newest full checkpoint under the directory (its names,
dims, state dims and dtypes), then a :class:`leanstate.Follower` applies each new link
as it lands; each one is printed as it is applied (its kind, rows, removed ids, time,
the time readers were held out, and its lag: how long after its publication it was
applied). ``--into CHECKPOINT`` also writes the followed state there as one full
checkpoint after each poll that applied something (atomically: a reader of it always
finds a whole one); ``--print`` only prints. ``--once``: one poll, then exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import leanstate
from leanstate.checkpoint.core import DTYPES, MANIFEST, is_delta, read_manifest_and_digest


def newest_full(directory: Path) -> dict | None:
    """The manifest of the newest complete full checkpoint under ``directory`` (None if none)."""
    found = []
    for entry in os.scandir(directory) if directory.is_dir() else ():
        if entry.name.startswith(".") or not os.path.isfile(Path(entry.path) / MANIFEST):
            continue
        try:
            _, manifest, _ = read_manifest_and_digest(Path(entry.path))
        except (leanstate.CheckpointError, OSError):
            continue  # the follower refuses it, saying why
        if not is_delta(manifest):
            found.append((os.stat(Path(entry.path) / MANIFEST).st_mtime_ns, entry.name, manifest))
    return max(found, key=lambda f: f[:2])[2] if found else None


def stores_for(manifest: dict, backend: str | None) -> dict[str, leanstate.KVStore]:
    """An empty store per table of ``manifest``, with its layout."""
    return {
        name: leanstate.KVStore(
            table["dim"],
            optimizer_state_dim=table["optimizer_state_dim"],
            dtype=DTYPES[table["dtype"]],
            backend=backend,
        )
        for name, table in manifest["tables"].items()
    }


def _report(applied) -> None:
    lag = time.time() - os.stat(applied.path / MANIFEST).st_mtime
    print(
        f"applied {applied.path.name} ({applied.kind}): {applied.rows:,} rows, {applied.removed:,} removed, "
        f"{applied.seconds * 1e3:.1f} ms (readers held {applied.commit_seconds * 1e3:.2f} ms), lag {lag:.1f} s",
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    manifest = newest_full(directory)
    while manifest is None:
        if args.once:
            print(f"follow: no complete full checkpoint under {directory} yet", file=sys.stderr)
            return 1
        print(f"follow: waiting for a full checkpoint under {directory} ...", flush=True)
        time.sleep(args.interval)
        manifest = newest_full(directory)
    stores = stores_for(manifest, args.backend)
    follower = leanstate.Follower(directory, stores, on_apply=_report)
    print(f"follow: {directory} into {', '.join(sorted(stores))} ({next(iter(stores.values())).backend})")
    status = 0
    try:
        while True:
            before = len(follower.history)
            try:
                follower.poll()
            except leanstate.CheckpointError as exc:  # the others were applied; the next poll goes on
                print(f"follow: refused: {exc}", file=sys.stderr, flush=True)
                status = 1
            if len(follower.history) > before and args.into is not None:
                leanstate.save_checkpoint(args.into, stores)
                print(f"follow: {args.into} now holds {follower.position.name}", flush=True)
            if args.once:
                return status
            time.sleep(args.interval)
    except KeyboardInterrupt:
        print(f"follow: stopped at {follower.position}")
        return 0
