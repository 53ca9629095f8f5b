"""Following a chain, stated in the most obvious terms: each poll applies the links a
trainer published since the last one, one whole link at a time.

The rules are ``spec/follower.md`` (F1-F8); this is their textbook for checkpoints
saved by one process (version 1). It leaves out threads, the stores' ``atomic()``
blocks and ranks (the hardened ``leanstate.Follower`` has them), never a check: every
candidate's manifest, every chunk and removed file of a link is read and checked
before any of its rows is applied.

Example::

    >>> state = FollowState()
    >>> poll("ckpts", {"user": store}, state)      # the newest full checkpoint, then its deltas
    [PosixPath('ckpts/step-0'), PosixPath('ckpts/step-10')]
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leanstate.reference.checkpoint import check_layout, read_chunks, read_extra, read_manifest
from leanstate.reference.checkpoint_manifest import DTYPES, MANIFEST, CheckpointError
from leanstate.reference.delta_checkpoint import DELTA_FORMAT, link_problem, read_removed
from leanstate.reference.kv_store import ChangeMark, SupportsRows
from leanstate.reference.row_format import RowLayout, header_words


@dataclass(frozen=True)
class Candidate:
    """A complete checkpoint under the directory (F1): path, manifest, its SHA-256, and its
    place in publishing order (F2: manifest mtime in nanoseconds, then name)."""

    path: Path
    manifest: dict
    digest: str
    order: tuple[int, str]

    @property
    def base_digest(self) -> str | None:
        is_delta = self.manifest["format"] == DELTA_FORMAT
        return self.manifest["base"]["manifest_sha256"] if is_delta else None


@dataclass
class FollowState:
    """Where a follower is: the last applied link (F3), the digests of the links its
    state is made of, and the links refused (digest, or path and time for a bad
    manifest -> why)."""

    position: Candidate | None = None
    chain: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)


def candidates(directory: Path) -> tuple[list[Candidate], dict[str, str]]:
    """F1, F2: the complete checkpoints under ``directory`` in publishing order, and the
    ones whose manifest fails its checks (key -> why)."""
    found, bad = [], {}
    if not os.path.isdir(directory):
        return [], {}
    for name in sorted(os.listdir(directory)):
        path = Path(directory) / name
        if name.startswith(".") or not os.path.isfile(path / MANIFEST):
            continue
        mtime = os.stat(path / MANIFEST).st_mtime_ns
        try:
            data, manifest = read_manifest(path, link_problem)
        except CheckpointError as exc:
            bad[f"{path}@{mtime}"] = str(exc)
            continue
        found.append(Candidate(path, manifest, hashlib.sha256(data).hexdigest(), (mtime, name)))
    return sorted(found, key=lambda c: c.order), bad


def poll(directory: str | os.PathLike, stores: dict[str, SupportsRows], state: FollowState) -> list[Path]:
    """F4: apply every link that extends ``state`` (the newest full checkpoint newer than
    the position, else the oldest delta on the position), one at a time; the paths
    applied. Refusals (F5) are kept in ``state.refused``; the first of this poll is
    raised once nothing more applies."""
    applied, refusals = [], []
    while True:
        found, bad = candidates(Path(directory))
        fresh_bad = [key for key in bad if key not in state.refused]
        if fresh_bad:
            state.refused[fresh_bad[0]] = bad[fresh_bad[0]]
            refusals.append(bad[fresh_bad[0]])
            continue
        at = state.position
        newer = [
            c
            for c in found
            if c.digest not in state.refused
            and c.digest not in state.chain
            and (at is None or c.order > at.order)
        ]
        fulls = [c for c in newer if c.base_digest is None]
        extending = [  # published after its base, whatever the clock says
            c
            for c in found
            if at is not None
            and c.base_digest == at.digest
            and c.digest not in state.refused
            and c.digest not in state.chain
        ]
        if fulls:
            link = fulls[-1]
        elif extending:
            link = extending[0]
        elif at is not None and newer:
            link = newer[0]
            why = (
                f"delta {link.path} does not extend the last applied link {at.path}: its base is "
                f"{link.base_digest}, not {at.digest}"
            )
            state.refused[link.digest] = why
            refusals.append(why)
            continue
        else:
            break
        try:
            apply_link(link, stores)
        except CheckpointError as exc:
            state.refused[link.digest] = str(exc)
            refusals.append(str(exc))
            continue
        state.chain = {link.digest} | (state.chain if link.base_digest is not None else set())
        state.position = link
        applied.append(link.path)
    if refusals:
        raise CheckpointError(refusals[0])
    return applied


def apply_link(link: Candidate, stores: dict[str, SupportsRows]) -> None:
    """F6, F7: read and check everything the link holds for ``stores``; then a delta's rows
    are upserted and its removed ids deleted, or a full link replaces every row; each
    store's mark moves to the link."""
    rows, removed = {}, {}
    for name, store in stores.items():
        table = link.manifest["tables"].get(name)
        if table is None:
            raise CheckpointError(f"table {name!r} is not in checkpoint {link.path}")
        check_layout(link.path, name, table, store.layout)
        layout = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
        read = list(read_chunks(link.path, name, table, list(enumerate(table["chunks"]))))
        rows[name] = torch.cat(read) if read else torch.empty(0, layout.width, dtype=layout.dtype)
        row_ids = set(header_words(rows[name])[:, 0].tolist())
        gone = [] if link.base_digest is None else read_removed(link.path, name, table["removed"], row_ids)
        removed[name] = torch.tensor(gone, dtype=torch.int64)
    read_extra(link.path, link.manifest)
    for name, store in stores.items():
        if link.base_digest is None:
            store.delete(store.keys())
        store.set_rows(rows[name])
        store.delete(removed[name])
    for store in stores.values():
        store.mark = ChangeMark(store.next_epoch(), link.digest)
