"""What a state dict holds for ``leanstate.dcp``: its KV values found and named, the
schema each table is saved with, and the names of the saved items.

A KV value is a store, a ``KVTensor`` of one, a sharded module's ``BucketedTable`` or a
native checkpoint's table (``convert``); everything else is dense and goes through
DCP's default planners untouched. Keys join nested dict keys with ``"."``, as DCP's
flattening does. Each table is saved as ``<key>/rows``, ``<key>/crc`` and
``<key>/schema``; its chunk index lives in ``Metadata.planner_data[INDEX_KEY]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import crc32c
import torch

from leanstate.checkpoint.core import CHECKSUM, DTYPES, BucketedTable, layout_fields
from leanstate.reference.kv_store import SupportsRows
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import RowLayout

FORMAT_NAME = "leanstate-dcp-kv"
FORMAT_VERSION = 1
INDEX_KEY = "leanstate_kv"  # in Metadata.planner_data: the schema and chunk index of every table
ROWS, CRC, SCHEMA = "/rows", "/crc", "/schema"
DEFAULT_CHUNK_BYTES = 16 * 2**20
# index entry of a chunk: [global row offset, rows, min id, max id, first bucket, last bucket]
OFFSET, NROWS, MIN_ID, MAX_ID, FIRST_BUCKET, LAST_BUCKET = range(6)


@dataclasses.dataclass
class Entry:
    """One KV value of a state dict: its key, its store and how the store is shared."""

    fqn: str
    store: object
    bucketing: tuple[int, int | None] | None  # (buckets, bucket_size) of a sharded table
    view: KVTensor | None


class NativeTable:
    """A table of a whole-row (version 1) checkpoint directory, read chunk by chunk: what
    ``convert`` saves to DCP, its chunks unchanged."""

    def __init__(self, path: Path, name: str, table: dict) -> None:
        self.path, self.name, self.table = path, name, table
        self.layout = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])


def split_state(state_dict: Mapping, method: str) -> tuple[dict, dict[str, Entry]]:
    """The state dict without its KV values (same nesting, tensors shared) and those values by key.

    Keys join nested dict keys with ``"."``, as DCP's flattening does.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{method}: state_dict must be a dict; got {type(state_dict).__name__}")
    entries: dict[str, Entry] = {}

    def walk(node: Mapping, prefix: str) -> dict:
        dense = {}
        for key, value in node.items():
            fqn = f"{prefix}{key}"
            if isinstance(value, BucketedTable):
                entries[fqn] = Entry(fqn, value.store, (value.buckets, value.bucket_size), None)
            elif isinstance(value, KVTensor):
                entries[fqn] = Entry(fqn, value.store, None, value)
            elif isinstance(value, NativeTable | SupportsRows):
                entries[fqn] = Entry(fqn, value, None, None)
            elif isinstance(value, Mapping):
                dense[key] = walk(value, f"{fqn}.")
            else:
                dense[key] = value
        return dense

    dense = walk(state_dict, "")
    for fqn in entries:
        if any(fqn.endswith(suffix) for suffix in (ROWS, CRC, SCHEMA)):
            raise ValueError(f"{method}: key {fqn!r} ends in a suffix leanstate.dcp reserves")
    return dense, entries


def tables_and_views(entries: dict[str, Entry], method: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """Which key saves each store's whole rows (the first writable one) and which keys alias it."""
    tables: dict[str, Entry] = {}
    by_store: dict[int, str] = {}
    for fqn, entry in entries.items():
        if entry.view is not None and entry.view.read_only:
            continue
        if id(entry.store) not in by_store:
            by_store[id(entry.store)] = fqn
            tables[fqn] = entry
    views = {}
    for fqn, entry in entries.items():
        if fqn in tables:
            continue
        if id(entry.store) not in by_store:
            raise ValueError(
                f"{method}: {fqn!r} is a read-only view whose store no other key saves; add the store "
                "(or a writable KVTensor of it) to the state dict"
            )
        views[fqn] = by_store[id(entry.store)]
    return tables, views


def schema_of(layout, bucketing: tuple[int, int | None] | None) -> dict:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        **layout_fields(layout),
        "checksum": CHECKSUM,
        # rows are ascending by (bucket, id) under this bucketing, or by id when None
        "bucketing": None if bucketing is None else list(bucketing),
    }


def crc_of(data: torch.Tensor) -> int:
    return crc32c.crc32c(memoryview(data.numpy()).cast("B"))


def split_key(key: str) -> tuple[str, str]:
    """``"t/rows"`` -> ``("t", "/rows")``; a key without a leanstate suffix -> ``(key, "")``."""
    for suffix in (ROWS, CRC, SCHEMA):
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    return key, ""


def as_value(entry: Entry):
    if entry.bucketing is not None:
        return BucketedTable(entry.store, *entry.bucketing)
    return entry.store
