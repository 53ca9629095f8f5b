"""``leanstate.dcp.load`` of tables saved as plain ``[N, D]`` tensors: a TorchRec
``EmbeddingBagCollection`` (or ``nn.EmbeddingBag``) checkpointed by stock ``dcp.save``
migrates into KV tables as rows ``0..N-1``.

A KV value of the state dict whose key holds a plain 2-D tensor in the checkpoint is
such a table. DCP loads it into a dense tensor with everything else (the table passes
through memory once, as it did in TorchRec); only when that whole load has succeeded
are the rows written into the store. The table's siblings the checkpoint lacks (the
optimizer's fields and ``_extra_state``, the step) are left out of the load: they start
fresh, as ``load_state_dict`` of a plain table leaves them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from leanstate.checkpoint.core import group_rank
from leanstate.dcp import _transaction
from leanstate.dcp._reader import SafeFileSystemReader
from leanstate.dcp._state import Entry, split_state
from leanstate.reference.checkpoint_manifest import CheckpointError

_EXTRA_STATE = "_extra_state"  # nn.Module's state-dict key for get_extra_state()
_CHUNK_ROWS = 65536  # a migrated table is written this many rows at a time
_LEFT_OUT = object()  # a key the load skips


def load(
    state_dict: Mapping,
    *,
    checkpoint_id: str | os.PathLike,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, dict[str, int]]:
    """``dcp.load`` into ``state_dict`` with :class:`KVLoadPlanner` and :class:`SafeFileSystemReader`,
    all or nothing for the KV tables on every rank; returns the planner's ``stats``.

    The one load transaction of every format (``leanstate.checkpoint._load``): when every
    store is empty (on every rank) rows are applied as they are read (in place where the
    store offers it) and a failure anywhere empties them again; otherwise every rank first
    verifies all its chunks, the ranks agree, and only then does any rank apply, with
    Ctrl-C deferred. Call on every rank.

    A KV table saved as a plain ``[N, D]`` tensor (TorchRec's ``EmbeddingBagCollection``
    through stock ``dcp.save``) loads as rows ``0..N-1``, once everything else has loaded;
    its optimizer fields and step, which such a checkpoint lacks, start fresh.
    """
    method = "leanstate.dcp.load"
    _, entries = split_state(state_dict, method)
    metadata = SafeFileSystemReader(checkpoint_id).read_metadata()
    plain = _plain_tables(entries, metadata, method, process_group)
    if not plain:
        return _transaction.load(state_dict, checkpoint_id=checkpoint_id, process_group=process_group)
    stored = metadata.state_dict_metadata
    parents = {fqn.rpartition(".")[0] for fqn in plain}
    replace: dict[str, object] = {
        fqn: torch.empty(stored[fqn].size, dtype=stored[fqn].properties.dtype) for fqn in plain
    }
    for fqn in [*entries, *_dense_keys(state_dict)]:
        parent, _, name = fqn.rpartition(".")
        if parent in parents and fqn not in stored and (fqn in entries or name == _EXTRA_STATE):
            replace[fqn] = _LEFT_OUT
    loading = _replaced(state_dict, "", replace)
    stats = _transaction.load(loading, checkpoint_id=checkpoint_id, process_group=process_group)
    _write_back(state_dict, loading, "", replace)
    for fqn, entry in plain.items():
        stats[fqn] = _write_rows(fqn, entry, replace[fqn], method)
        stats[fqn]["chunks"] = stats[fqn]["of"] = len(stored[fqn].chunks)
    return stats


def _plain_tables(
    entries: dict[str, Entry], metadata: Metadata, method: str, process_group
) -> dict[str, Entry]:
    """The writable KV values whose key holds a plain tensor in the checkpoint, each checked:
    ``[N, width]`` floating rows for the columns the value writes, a plain store, one rank."""
    plain = {}
    for fqn, entry in entries.items():
        saved = metadata.state_dict_metadata.get(fqn)
        if not isinstance(saved, TensorStorageMetadata) or (entry.view is not None and entry.view.read_only):
            continue
        _, width = _columns(entry)
        shape, dtype = list(saved.size), saved.properties.dtype
        if len(shape) != 2 or shape[1] != width or not dtype.is_floating_point:
            raise CheckpointError(
                f"{method}: {fqn!r} is a {dtype} tensor of shape {shape} in the checkpoint; a KV table "
                f"of {width} columns loads a plain table of [N, {width}] floating rows (as rows 0..N-1)"
            )
        if entry.bucketing is not None or group_rank(process_group)[1] > 1:
            raise CheckpointError(
                f"{method}: {fqn!r} is a plain [N, {width}] table in the checkpoint; it loads into a plain "
                "KV table in a one-rank group (then leanstate.dcp.save it, and load that into the sharded "
                "module)"
            )
        plain[fqn] = entry
    return plain


def _columns(entry: Entry) -> tuple[int, int]:
    """(first value column, columns) that rows of a plain table fill: the view's, else the weights."""
    view = entry.view
    if view is not None and not view.whole_rows:
        return view.width_offset, view.width
    return 0, entry.store.layout.dim


def _dense_keys(node: Mapping, prefix: str = "") -> list[str]:
    """Every key of a (nested) state dict, joined with ``"."`` as DCP flattens them."""
    keys = []
    for key, value in node.items():
        if isinstance(value, Mapping):
            keys.extend(_dense_keys(value, f"{prefix}{key}."))
        else:
            keys.append(f"{prefix}{key}")
    return keys


def _replaced(node: Mapping, prefix: str, replace: dict[str, object]) -> dict:
    """``node`` with the values of ``replace`` put in (or left out), new dicts only on their paths."""
    out = {}
    for key, value in node.items():
        fqn = f"{prefix}{key}"
        if fqn in replace:
            if replace[fqn] is not _LEFT_OUT:
                out[key] = replace[fqn]
        elif isinstance(value, Mapping) and any(f.startswith(f"{fqn}.") for f in replace):
            out[key] = _replaced(value, f"{fqn}.", replace)
        else:
            out[key] = value
    return out


def _write_back(node: dict, loaded: Mapping, prefix: str, replace: dict[str, object]) -> None:
    """Values DCP put in place of ``node``'s (bytes entries: ints, strings) back into ``node``."""
    for key, value in loaded.items():
        fqn = f"{prefix}{key}"
        if fqn in replace or value is node[key]:
            continue
        if isinstance(value, Mapping) and isinstance(node[key], Mapping):
            _write_back(node[key], value, f"{fqn}.", replace)
        else:
            node[key] = value


def _write_rows(fqn: str, entry: Entry, rows: torch.Tensor, method: str) -> dict[str, int]:
    """Rows ``0..N-1`` of the store, a chunk at a time: an upsert (a row already there keeps
    its other columns); into an empty store, a failure empties it again."""
    store = entry.store
    offset, _ = _columns(entry)
    device = getattr(store, "device", "cpu")
    empty = len(store) == 0
    try:
        for start in range(0, len(rows), _CHUNK_ROWS):
            chunk = rows[start : start + _CHUNK_ROWS]
            ids = torch.arange(start, start + len(chunk), dtype=torch.int64, device=device)
            store.set(ids, chunk.to(device, store.layout.dtype), width_offset=offset)
    except Exception as exc:
        if empty:
            store.delete(store.keys())
        raise CheckpointError(
            f"{method}: {fqn!r}: writing its rows failed: {type(exc).__name__}: {exc}"
        ) from exc
    return {"rows": len(rows)}
