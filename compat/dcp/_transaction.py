"""``leanstate.dcp.save`` and ``load``: DCP's save and load made all or nothing.

A save goes into a locked staging directory that rank 0 renames into place once every
rank has written and fsynced; a failure on any rank leaves the checkpoint as it was. A
load into empty stores applies rows as they are read and empties them again on any
failure; into live stores, every rank first verifies all its chunks, the ranks agree,
and only then does any rank apply.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

from leanstate.checkpoint.core import (
    all_true,
    distributed,
    group_rank,
    load_all_or_nothing,
    publish,
    staged_by_rank_0,
)
from leanstate.dcp._load_planner import KVLoadPlanner
from leanstate.dcp._reader import SafeFileSystemReader
from leanstate.dcp._save_planner import KVSavePlanner
from leanstate.dcp._state import DEFAULT_CHUNK_BYTES, as_value, split_state
from leanstate.reference.checkpoint_manifest import CheckpointError

METADATA = ".metadata"  # DCP's marker of a complete checkpoint, written last


class _Writer(FileSystemWriter):
    """``FileSystemWriter`` that keeps the machine's path out of ``.metadata``."""

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None:
            meta.checkpoint_id = None
        return meta


def unwrap(exc: CheckpointException, method: str, path) -> CheckpointError:
    """The first rank's real error, as a CheckpointError naming the rank."""
    parts = []
    for rank, (error, _) in sorted(exc.failures.items()):
        parts.append(f"rank {rank}: {type(error).__name__}: {error}")
    return CheckpointError(f"{method} {path}: " + "; ".join(parts))


def save(
    state_dict: Mapping,
    *,
    checkpoint_id: str | os.PathLike,
    process_group: dist.ProcessGroup | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Path:
    """``dcp.save`` of ``state_dict`` (dense tensors and KV tables) with :class:`KVSavePlanner`,
    atomically: into a staging directory that rank 0 renames into place when every rank
    has written and fsynced. A failure on any rank raises :class:`CheckpointError` naming
    the rank on every rank and leaves ``checkpoint_id`` as it was. Call on every rank.
    """
    method = "leanstate.dcp.save"
    path = Path(checkpoint_id)
    rank, _ = group_rank(process_group)

    def prepare() -> Path:
        if path.exists() and not (path / METADATA).is_file() and (not path.is_dir() or any(path.iterdir())):
            raise ValueError(f"{path} exists and is not a DCP checkpoint; refusing to replace it")
        return path

    with staged_by_rank_0(path, method, process_group, prepare) as staging:
        try:
            with _quiet():
                dcp.save(
                    state_dict,
                    storage_writer=_Writer(staging),
                    planner=KVSavePlanner(chunk_bytes=chunk_bytes),
                    process_group=process_group,
                    no_dist=not distributed(),
                )
        except CheckpointException as exc:  # (leaving the block removes rank 0's staging directory)
            raise unwrap(exc, method, path) from None
        if rank == 0:
            publish(staging, path, marker=METADATA)
    all_true(True, process_group)  # every rank returns once the checkpoint is in place
    return path


def load(
    state_dict: Mapping,
    *,
    checkpoint_id: str | os.PathLike,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, dict[str, int]]:
    """The KV checkpoint's part of ``leanstate.dcp.load`` (``_migrate.load``, which adds
    plain tables): ``dcp.load`` with :class:`KVLoadPlanner` inside the one load
    transaction; the planner's ``stats``."""
    method = "leanstate.dcp.load"
    _, entries = split_state(state_dict, method)
    SafeFileSystemReader(checkpoint_id).read_metadata()  # a bad .metadata is named, not wrapped
    stores = list(
        {id(e.store): e.store for e in entries.values() if not (e.view and e.view.read_only)}.values()
    )
    planners = []

    def verify() -> None:
        kv_only = {
            fqn: entry.view if entry.view is not None else as_value(entry) for fqn, entry in entries.items()
        }
        _load_with(
            kv_only,
            KVLoadPlanner(process_group=process_group, verify_only=True),
            checkpoint_id,
            process_group,
        )

    def apply(into_empty: bool) -> None:
        planners.append(KVLoadPlanner(process_group=process_group, in_place=into_empty))
        _load_with(state_dict, planners[-1], checkpoint_id, process_group)

    group = process_group if process_group is not None or not distributed() else dist.group.WORLD
    load_all_or_nothing(stores, verify, apply, group=group, method=method)
    return planners[-1].stats


@contextlib.contextmanager
def _quiet():
    """Silence DCP's warning that one process without a process group means one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _load_with(state_dict, planner: KVLoadPlanner, checkpoint_id, process_group) -> None:
    """``dcp.load`` with ``planner``; DCP's wrapped failure unwrapped to the first rank's error."""
    try:
        with _quiet():
            dcp.load(
                state_dict,
                storage_reader=SafeFileSystemReader(checkpoint_id),
                planner=planner,
                process_group=process_group,
                no_dist=not distributed(),
            )
    except CheckpointException as exc:
        mine = exc.failures.get(group_rank(process_group)[0])
        if mine is not None and isinstance(mine[0], KeyboardInterrupt):
            raise KeyboardInterrupt from None  # Ctrl-C here, not a damaged checkpoint
        raise unwrap(exc, "leanstate.dcp.load", checkpoint_id) from None
    finally:
        planner.close()
