"""What a save's or load's arguments mean, checked once at the front: the entries of
``tables`` (a store, or a KVTensor of one), a saved table's layout against its store's,
and an ``id_range`` with the chunks that can hold it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from leanstate.checkpoint._bucketed_table import BucketedTable
from leanstate.checkpoint._format import check_table_name, dtype_name
from leanstate.reference.arguments import int_argument
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.kv_store import SupportsRows
from leanstate.reference.kv_tensor import KVTensor


@dataclass(frozen=True)
class Target:
    """What one entry of ``tables`` means: a store, and how its rows are written."""

    name: str
    store: SupportsRows
    view: KVTensor | None  # None: the store itself

    @property
    def whole(self) -> bool:
        """Whether this entry is the store's whole rows (a store, or a whole-row view of it)."""
        view = self.view
        return view is None or (
            view.whole_rows and view.width_offset == 0 and view.width == self.store.layout.width
        )


def targets_of(tables: Mapping[str, object], method: str) -> list[Target]:
    """``tables`` checked: plain file names, each a store or a KVTensor of one."""
    if not isinstance(tables, Mapping):
        raise TypeError(f"{method}: tables must be a mapping name -> KVStore or KVTensor")
    targets = []
    for name, value in tables.items():
        check_table_name(name, method)
        if isinstance(value, KVTensor):
            targets.append(Target(name, value.store, value))
        elif isinstance(value, SupportsRows):
            targets.append(Target(name, value, None))
        elif isinstance(value, BucketedTable):
            raise TypeError(
                f"{method}: tables[{name!r}] is a sharded module's table (from checkpoint_tables() of a "
                "ShardedKVEmbeddingBagCollection): pass process_group= (on every rank) as well"
            )
        else:
            raise TypeError(
                f"{method}: tables[{name!r}] must be a KVStore or KVTensor; got {type(value).__name__}"
            )
    return targets


def optimizer_of(state_dim: int, dim: int) -> str:
    """Which of the fused optimizers keeps ``state_dim`` values per row of ``dim`` weights."""
    known = {0: "sgd", 1: "rowwise_adagrad", 2 * dim: "adam"}
    return f"{known[state_dim]}-sized" if state_dim in known else f"{state_dim} state values per row"


def check_layout(where: Path, name: str, table: dict, store: SupportsRows) -> None:
    """A saved table (its own layout fields already agree, ``layout_problem``) has the store's layout."""
    layout = store.layout
    problems = []
    if table["dtype"] != dtype_name(layout.dtype):
        problems.append(f"dtype {table['dtype']} vs the store's {dtype_name(layout.dtype)}")
    if table["dim"] != layout.dim:
        problems.append(f"dim {table['dim']} vs the store's {layout.dim}")
    if table["optimizer_state_dim"] != layout.state_dim:
        problems.append(
            f"optimizer_state_dim {table['optimizer_state_dim']} vs the store's {layout.state_dim} (saved "
            f"{optimizer_of(table['optimizer_state_dim'], table['dim'])}, this store "
            f"{optimizer_of(layout.state_dim, layout.dim)}: build it with the optimizer it was saved with)"
        )
    if problems:
        raise CheckpointError(f"table {name!r} in {where}: " + "; ".join(problems))


INT64_BOUNDS = "an int in [-2**63, 2**63]"


def check_id_range(id_range: object, method: str) -> tuple[int, int] | None:
    """``None`` or ``(lo, hi)``: integers with ``lo <= hi``, half-open, up to 2**63."""
    if id_range is None:
        return None
    if not isinstance(id_range, tuple | list) or len(id_range) != 2:
        raise ValueError(f"{method}: id_range must be None or a pair (lo, hi); got {id_range!r}")
    lo, hi = id_range
    lo, hi = (
        int_argument(v, f"{method}: id_range {n}", low=-(2**63), high=2**63, must=INT64_BOUNDS)
        for n, v in (("lo", lo), ("hi", hi))
    )
    if lo > hi:
        raise ValueError(f"{method}: id_range must have lo <= hi; got {id_range!r}")
    return lo, hi


def in_range(keys: torch.Tensor, id_range: tuple[int, int]) -> torch.Tensor:
    """Which ``keys`` lie in the half-open ``id_range`` (bounds may be 2**63, past int64)."""
    lo, hi = id_range
    inside = keys >= max(lo, -(2**63))
    return inside & (keys < hi) if hi < 2**63 else inside


def chunks_in_range(table: dict, id_range: tuple[int, int] | None) -> list[tuple[int, dict]]:
    chunks = list(enumerate(table["chunks"]))
    if id_range is None:
        return chunks
    lo, hi = id_range
    return [(i, c) for i, c in chunks if c["max_id"] >= lo and c["min_id"] < hi]
