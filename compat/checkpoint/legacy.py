"""The legacy three-tensor checkpoint, kept to measure what whole rows fix.

The old flow saved, per table, ``weight_id`` (int64 ``[N]``), ``weight`` (``[N, D]``) and
the optimizer state (``[N, S]``) as three separate tensors. Loading read all three into
memory for the whole table and wrote them to the store only at the end, in 10,000-row
chunks: the peak is the table held twice (the loaded tensors plus the store). Row
metadata (timestamp, count) is not carried. Files are raw little-endian arrays with a
JSON index; no pickle.

Example::

    >>> save_legacy_checkpoint("old", {"user": store})
    >>> load_legacy_checkpoint("old", {"user": fresh_store})
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from leanstate._numpy import np
from leanstate.reference.kv_store import SupportsRows

APPLY_CHUNK_ROWS = 10_000
INDEX = "legacy.json"


def _write_tensor(file: Path, tensor: torch.Tensor) -> None:
    with open(file, "wb") as f:
        if tensor.numel():  # an empty tensor (no optimizer state) is an empty file
            f.write(memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def save_legacy_checkpoint(path: str | os.PathLike, tables: Mapping[str, SupportsRows]) -> Path:
    """Save each store as ``<name>.weight_id``, ``<name>.weight``, ``<name>.optimizer``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, store in tables.items():
        layout = store.layout
        ids = store.keys()
        values = store.get(ids)  # the whole table, as the old state dict materialised it
        weight = values[:, : layout.dim]
        state_start = layout.padded_dim
        state = values[:, state_start : state_start + layout.state_dim]
        for part, tensor in (("weight_id", ids), ("weight", weight), ("optimizer", state)):
            _write_tensor(path / f"{name}.{part}", tensor)
        index[name] = {
            "rows": len(ids),
            "dim": layout.dim,
            "state_dim": layout.state_dim,
            "dtype": str(layout.dtype),
        }
    (path / INDEX).write_text(json.dumps(index, indent=1))
    return path


def _read_tensor(file: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = np.fromfile(file, dtype=np.uint8)
    if raw.size == 0:  # an empty tensor (no optimizer state) was saved as an empty file
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def load_legacy_checkpoint(path: str | os.PathLike, tables: Mapping[str, SupportsRows]) -> None:
    """Load the old way: hold all three tensors of a table, then apply in 10,000-row chunks."""
    path = Path(path)
    index = json.loads((path / INDEX).read_text())
    for name, store in tables.items():
        entry = index[name]
        n, layout = entry["rows"], store.layout
        weight_id = _read_tensor(path / f"{name}.weight_id", torch.int64, (n,))
        weight = _read_tensor(path / f"{name}.weight", layout.dtype, (n, entry["dim"]))
        state = _read_tensor(path / f"{name}.optimizer", layout.dtype, (n, entry["state_dim"]))
        for start in range(0, n, APPLY_CHUNK_ROWS):
            ids = weight_id[start : start + APPLY_CHUNK_ROWS]
            store.set(ids, weight[start : start + APPLY_CHUNK_ROWS])
            if layout.state_dim:
                store.set(ids, state[start : start + APPLY_CHUNK_ROWS], width_offset=layout.padded_dim)
        del weight_id, weight, state
