"""leanstate.dcp checkpoints crafted to pass the checks around the one under test: rows out
of id order inside a chunk whose stored CRC was recomputed to match, and a ``.metadata``
whose storage paths lead out of the checkpoint to a sound copy of a file.

The rule (``spec/dcp.md``): each chunk's ids ascend strictly (by (bucket, id) for sharded
saves), and only regular files inside the checkpoint are opened. Either failure is a
``CheckpointError``, and the load changes no store, empty or live.
"""

from __future__ import annotations

import pickle
import shutil

import crc32c
import pytest
import torch

import leanstate.dcp as kvdcp
from leanstate import CheckpointError, KVStore
from leanstate.checkpoint._bucketed_table import BucketedTable
from tests.harness import rewrite_dcp_item

CHUNK_ROWS = 40


def filled(n: int, seed: int = 0) -> KVStore:
    store = KVStore(4, optimizer_state_dim=1, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randperm(4 * n + 1, generator=generator)[:n].to(torch.int64) * 7 + 3
    store.set(ids, torch.randn(n, 4, generator=generator))
    return store


def snapshot(store: KVStore) -> tuple[torch.Tensor, torch.Tensor]:
    keys = store.keys()
    return keys, store.get_rows(keys).view(torch.uint8).clone()


def assert_unchanged(store: KVStore, before: tuple[torch.Tensor, torch.Tensor], what) -> None:
    keys, rows = snapshot(store)
    assert torch.equal(keys, before[0]), f"{what}: the store's ids changed"
    assert torch.equal(rows, before[1]), f"{what}: the store's rows changed"


# (buckets, bucket_size) of a sharded save, or None for a plain store
BUCKETINGS = [None, (6, None), (8, 64)]


def as_saved(store: KVStore, bucketing):
    return store if bucketing is None else BucketedTable(store, *bucketing)


@pytest.mark.parametrize("bucketing", BUCKETINGS, ids=["plain", "interleaved", "chunk-mode"])
def test_rows_out_of_id_order_inside_a_chunk_are_refused_and_change_no_store(tmp_path, bucketing):
    """Two neighbouring rows of one saved chunk swapped, and the chunk's stored CRC-32C
    recomputed to match: the CRC, the chunk's id range (min and max) and every row's own
    bytes are sound, so only the order check can refuse it. The load names the table and
    chunk and changes no store, empty or live."""
    source = filled(130)
    path = tmp_path / "c"
    kvdcp.save({"t": as_saved(source, bucketing)}, checkpoint_id=path, chunk_bytes=CHUNK_ROWS * 48)
    index = kvdcp.SafeFileSystemReader(path).read_metadata().planner_data[kvdcp.INDEX_KEY]["tables"]["t"]
    k = 1
    offset, n = index["chunks"][k][:2]
    assert n == CHUNK_ROWS and len(index["chunks"]) > 2
    swapped = {}

    def swap(rows: torch.Tensor) -> torch.Tensor:
        rows[[5, 6]] = rows[[6, 5]]
        swapped["crc"] = crc32c.crc32c(rows.numpy().tobytes())
        return rows

    rewrite_dcp_item(path, "t/rows", offset, swap)

    def fix_crc(crcs: torch.Tensor) -> torch.Tensor:
        crcs[k] = swapped["crc"]
        return crcs

    rewrite_dcp_item(path, "t/crc", 0, fix_crc)
    for live in (False, True):
        store = filled(15, seed=5) if live else KVStore(4, optimizer_state_dim=1)
        before = snapshot(store)
        with pytest.raises(CheckpointError, match=rf"table 't': chunk {k} .*out of order"):
            kvdcp.load({"t": as_saved(store, bucketing)}, checkpoint_id=path)
        assert_unchanged(store, before, "live" if live else "empty")


# how a crafted .metadata names a file outside the checkpoint ``c`` (beside it, in ``tmp_path``)
OUTSIDE = {
    "parent": lambda tmp_path, name: f"../{name}",
    "through-a-folder": lambda tmp_path, name: f"d/../../{name}",
    "absolute": lambda tmp_path, name: str(tmp_path / name),
}


@pytest.mark.parametrize("form", list(OUTSIDE))
@pytest.mark.parametrize("item", ["t/rows", "t/crc", "dense.w"])
def test_a_storage_path_out_of_the_checkpoint_is_refused_and_changes_no_store(tmp_path, item, form):
    """A ``.metadata`` whose storage entry for ``item`` (a KV chunk, a table's CRCs, a dense
    tensor) names a file outside the checkpoint, by ``..``, through a folder of the
    checkpoint, or by an absolute path: the file there is a sound copy, so only the place
    is wrong, and the load refuses it before reading anything; no store changes (empty or
    live) and the dense entry keeps its value."""
    source = filled(100)
    path = tmp_path / "c"
    kvdcp.save(
        {"dense": {"w": torch.arange(3.0)}, "t": source}, checkpoint_id=path, chunk_bytes=CHUNK_ROWS * 48
    )
    (path / "d").mkdir()
    metadata = kvdcp.SafeFileSystemReader(path).read_metadata()
    key = next(k for k in metadata.storage_data if k.fqn == item)
    info = metadata.storage_data[key]
    outside = tmp_path / "outside.distcp"
    shutil.copyfile(path / info.relative_path, outside)
    info.relative_path = OUTSIDE[form](tmp_path, outside.name)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    for live in (False, True):
        store = filled(15, seed=5) if live else KVStore(4, optimizer_state_dim=1)
        before = snapshot(store)
        state = {"dense": {"w": torch.zeros(3)}, "t": store}
        with pytest.raises(CheckpointError, match="not a regular file inside the checkpoint"):
            kvdcp.load(state, checkpoint_id=path)
        assert_unchanged(store, before, "live" if live else "empty")
        assert torch.equal(state["dense"]["w"], torch.zeros(3))
