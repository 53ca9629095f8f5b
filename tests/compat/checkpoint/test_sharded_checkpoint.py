"""Version 2, the checkpoint saved across ranks (``leanstate.checkpoint.sharded``), on its
own: bucket-major files whose every chunk holds one bucket, loaded at any world size.
Here one gloo rank in this process saves; the loads run with ``process_group=None``
(one process owns every bucket). The scenarios at 2-4 ranks are in
``test_sharded_embedding.py``."""

from __future__ import annotations

import json

import crc32c
import pytest
import torch

from leanstate import CheckpointError, KVStore, load_checkpoint, save_checkpoint
from leanstate.checkpoint._bucketed_table import BucketedTable
from leanstate.checkpoint.sharded import last_load_stats, load_sharded
from tests.harness import FailingRows, one_rank_group

BUCKETS, BUCKET_SIZE = 8, 100  # ids 0..799: bucket = id // 100


@pytest.fixture(scope="module")
def group():
    with one_rank_group() as group:
        yield group


def filled(backend: str = "reference") -> KVStore:
    store = KVStore(4, optimizer_state_dim=1, backend=backend, clock=lambda: 77)
    ids = torch.arange(0, 800, 3)
    store.set(ids, torch.randn(len(ids), 4, generator=torch.Generator().manual_seed(1)))
    return store


@pytest.fixture
def saved(tmp_path, group):
    path = tmp_path / "v2"
    table = BucketedTable(filled(), BUCKETS, BUCKET_SIZE)
    save_checkpoint(path, {"t": table}, process_group=group, chunk_bytes=10 * table.store.layout.row_bytes)
    return path


def table_of(store: KVStore, bucket_size: int | None = BUCKET_SIZE, buckets: int = BUCKETS) -> dict:
    return {"t": BucketedTable(store, buckets, bucket_size)}


def rows_of(store: KVStore) -> tuple[torch.Tensor, torch.Tensor]:
    keys = store.keys()
    return keys, store.get_rows(keys).view(torch.int32)


def test_a_load_into_live_stores_counts_each_byte_once(saved):
    """Into stores that hold rows, every chunk is read twice (verify, then apply), but the
    load's statistics are those of the apply: the file's bytes and rows, once."""
    manifest = json.loads((saved / "manifest.json").read_text())
    (entry,) = manifest["tables"]["t"]["files"]
    for store in (KVStore(4, optimizer_state_dim=1), filled("numba")):  # empty: one pass; live: two
        load_sharded(saved, table_of(store), process_group=None)
        assert last_load_stats == {
            "bytes_read": entry["bytes"],
            "chunks_read": len(entry["chunks"]),
            "rows_loaded": manifest["tables"]["t"]["rows"],
        }
        assert torch.equal(rows_of(store)[0], filled().keys())


@pytest.mark.parametrize("bucket_size", [50, 200, None])
def test_the_same_bucket_count_of_another_bucket_size_is_refused(saved, bucket_size):
    """Buckets of another size (or interleaved ones) put the same ids in other buckets: a
    module built so must be refused, naming both bucketings, though the counts agree."""
    store = KVStore(4, optimizer_state_dim=1)
    with pytest.raises(CheckpointError, match="saved with 8 buckets of 100 consecutive ids"):
        load_sharded(saved, table_of(store, bucket_size), process_group=None)
    assert len(store) == 0


@pytest.mark.parametrize("row", ["first", "last"])
@pytest.mark.parametrize("live", [False, True])
def test_a_chunk_holding_an_id_of_another_bucket_is_refused(saved, row, live):
    """One row of a chunk moved to another bucket's id (its ids still ascending, the chunk's
    id range and CRC made to match): only the check that *every* row lies in the chunk's
    bucket sees it; the load is refused and changes no store."""
    manifest = json.loads((saved / "manifest.json").read_text())
    table = manifest["tables"]["t"]
    (entry,) = table["files"]
    in_bucket_3 = [i for i, c in enumerate(entry["chunks"]) if c["bucket"] == 3 and c["rows"] > 2]
    # the bucket's first chunk for its first row, its last chunk for its last row: the moved
    # id still follows the chunk before and precedes the chunk after, as the manifest asks
    index = in_bucket_3[0] if row == "first" else in_bucket_3[-1]
    chunk, row_bytes = entry["chunks"][index], table["row_bytes"]
    file = saved / entry["file"]
    data = bytearray(file.read_bytes())
    at = chunk["offset"] if row == "first" else chunk["offset"] + (chunk["rows"] - 1) * row_bytes
    moved = 250 if row == "first" else 401  # bucket 2 below the chunk, bucket 4 above it
    data[at : at + 8] = moved.to_bytes(8, "little")
    file.write_bytes(bytes(data))
    chunk["min_id" if row == "first" else "max_id"] = moved
    chunk["crc"] = crc32c.crc32c(bytes(data[chunk["offset"] : chunk["offset"] + chunk["rows"] * row_bytes]))
    (saved / "manifest.json").write_text(json.dumps(manifest, indent=1))
    store = filled("numba") if live else KVStore(4, optimizer_state_dim=1, backend="numba")
    before = rows_of(store)
    with pytest.raises(CheckpointError, match="outside bucket 3"):
        load_checkpoint(saved, {"t": store})  # a plain store: one process takes every rank's rows
    after = rows_of(store)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


@pytest.mark.parametrize("live", [False, True])
def test_a_chunk_starting_at_the_previous_chunks_last_id_is_refused(saved, live):
    """A bucket's rows span several chunks; a chunk whose first row repeats the previous
    chunk's last id (its CRC and min_id made to match) would load one row fewer than the
    manifest says. The manifest's order rule refuses it before a row moves."""
    manifest = json.loads((saved / "manifest.json").read_text())
    table = manifest["tables"]["t"]
    (entry,) = table["files"]
    chunks, row_bytes = entry["chunks"], table["row_bytes"]
    index = next(i for i in range(1, len(chunks)) if chunks[i]["bucket"] == chunks[i - 1]["bucket"])
    chunk, repeated = chunks[index], chunks[index - 1]["max_id"]
    file = saved / entry["file"]
    data = bytearray(file.read_bytes())
    data[chunk["offset"] : chunk["offset"] + 8] = repeated.to_bytes(8, "little")
    file.write_bytes(bytes(data))
    chunk["min_id"] = repeated
    chunk["crc"] = crc32c.crc32c(bytes(data[chunk["offset"] : chunk["offset"] + chunk["rows"] * row_bytes]))
    (saved / "manifest.json").write_text(json.dumps(manifest, indent=1))
    store = filled("numba") if live else KVStore(4, optimizer_state_dim=1, backend="numba")
    before = rows_of(store)
    with pytest.raises(CheckpointError, match=rf"chunk {index}: \(bucket, min_id\)"):
        load_checkpoint(saved, {"t": store})
    after = rows_of(store)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


def test_a_rank_that_fails_to_write_fails_the_save_on_every_rank_and_changes_nothing(tmp_path, group):
    """A rank's write error reaches rank 0's agreement: the save raises, naming the rank and
    the file, the previous checkpoint at the path stays, and no store's mark moves."""
    save_checkpoint(tmp_path / "c", table_of(filled()), process_group=group)
    before = (tmp_path / "c" / "manifest.json").read_bytes()
    failing = FailingRows(4, optimizer_state_dim=1)
    failing.set(torch.arange(10), torch.ones(10, 4))
    mark = failing.mark
    with pytest.raises(
        CheckpointError, match=r"the save across ranks failed \(rank 0: writing t\.rank0\.rows"
    ):
        save_checkpoint(tmp_path / "c", table_of(failing), process_group=group)
    assert (tmp_path / "c" / "manifest.json").read_bytes() == before
    assert failing.mark == mark
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


@pytest.mark.parametrize("across_ranks", [False, True])
def test_a_save_checks_its_extra_state_before_its_path_in_both_versions(tmp_path, group, across_ranks):
    """A call wrong twice (extra state that does not load back, a path that is a file) is
    refused for its extra state by both versions, and writes nothing. Kills: version 2
    checking the path first (one bad call, two different refusals)."""
    (tmp_path / "c").write_text("a file")
    store = filled()
    bad = {"where": tmp_path}  # a Path does not load back with weights_only=True
    options = {"process_group": group} if across_ranks else {}
    tables = table_of(store) if across_ranks else {"t": store}
    with pytest.raises((ValueError, CheckpointError), match="extra must load back") as refused:
        save_checkpoint(tmp_path / "c", tables, extra=bad, **options)
    assert "exists and is not a directory" not in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"] and (tmp_path / "c").read_text() == "a file"


@pytest.mark.parametrize("across_ranks", [False, True])
def test_a_save_checks_chunk_bytes_before_its_base_in_both_versions(tmp_path, group, across_ranks):
    """A bad chunk_bytes and a base that is not a path: both versions refuse chunk_bytes.
    Kills: version 2 checking the base's type first."""
    store = filled()
    options = {"process_group": group} if across_ranks else {}
    tables = table_of(store) if across_ranks else {"t": store}
    with pytest.raises(ValueError, match="chunk_bytes"):
        save_checkpoint(tmp_path / "c", tables, chunk_bytes=0, base=42, **options)
    assert list(tmp_path.iterdir()) == []


def test_with_a_process_group_plain_stores_are_refused_by_save_and_load(saved, group):
    """Across ranks the buckets decide who holds a row: plain stores, without their
    bucketing, are a TypeError saying what to pass, on save and on load alike."""
    store = filled()
    for call in (save_checkpoint, load_checkpoint):
        with pytest.raises(TypeError, match=f"{call.__name__}: with process_group, tables must be"):
            call(saved, {"t": store}, process_group=group)
    assert len(store) == len(filled())


def test_into_plain_stores_a_read_only_view_before_a_table_skips_only_itself(tmp_path, group):
    """One process loading a version-2 checkpoint: a read-only view (its rows arrive inside
    the whole rows) is passed over, and every table after it still loads."""
    from leanstate.reference.kv_tensor import KVTensor

    a, b = filled(), KVStore(4, optimizer_state_dim=1)
    b.set(torch.arange(5, 50, 5), torch.full((9, 4), 2.0))
    save_checkpoint(
        tmp_path / "v2", {"a": BucketedTable(a, 2, None), "b": BucketedTable(b, 2, None)}, process_group=group
    )
    fresh_a, fresh_b = KVStore(4, optimizer_state_dim=1), KVStore(4, optimizer_state_dim=1)
    view = KVTensor(fresh_a, width_offset=fresh_a.layout.padded_dim, width=1, read_only=True)
    load_checkpoint(tmp_path / "v2", {"a.state": view, "a": fresh_a, "b": fresh_b})
    assert torch.equal(rows_of(fresh_a)[1], rows_of(a)[1]) and torch.equal(rows_of(fresh_b)[1], rows_of(b)[1])


def test_a_load_that_fails_before_reading_reports_nothing_read(saved, group):
    """A table the checkpoint lacks is refused before any chunk is read: the statistics of
    that load are all zero, not the previous load's."""
    load_sharded(saved, table_of(KVStore(4, optimizer_state_dim=1)), process_group=group)
    assert last_load_stats["chunks_read"] > 0
    with pytest.raises(CheckpointError, match="no table 'u'"):
        load_sharded(
            saved,
            {"u": BucketedTable(KVStore(4, optimizer_state_dim=1), BUCKETS, BUCKET_SIZE)},
            process_group=group,
        )
    assert last_load_stats == {"bytes_read": 0, "chunks_read": 0, "rows_loaded": 0}


def test_across_ranks_a_bad_table_name_or_base_is_refused_before_any_file(tmp_path, group):
    """Version 2 holds a table's name to the rules version 1 does (a plain file name), and
    refuses a base that is not a path. Kills: the names' rules or the base's type left out."""
    store = filled()
    with pytest.raises(ValueError, match="table name"):
        save_checkpoint(
            tmp_path / "c", {"../t": BucketedTable(store, BUCKETS, BUCKET_SIZE)}, process_group=group
        )
    with pytest.raises(TypeError, match="base must be the path of a checkpoint"):
        save_checkpoint(tmp_path / "c", table_of(store), process_group=group, base=42)
    assert list(tmp_path.iterdir()) == []


def test_verify_across_ranks_yields_each_chunk_once_then_checks_the_extra_state(tmp_path, group, monkeypatch):
    """verify_sharded yields (table, file, chunk) once per chunk, after the chunk passed,
    however many slices it is read in, and checks the extra state after the chunks. Kills:
    a yield per slice (before its chunk's CRC is known), the extra state checked first."""
    from leanstate.checkpoint import sharded

    store = filled()
    path = tmp_path / "v2"
    save_checkpoint(
        path, table_of(store), extra={"step": 3}, process_group=group, chunk_bytes=10 * store.layout.row_bytes
    )
    chunks = [
        (f["file"], i)
        for f in json.loads((path / "manifest.json").read_text())["tables"]["t"]["files"]
        for i in range(len(f["chunks"]))
    ]
    monkeypatch.setattr(sharded, "SLICE_BYTES", 3 * store.layout.row_bytes)  # several slices a chunk
    assert [(file, i) for _, file, i in sharded.verify_sharded(path)] == chunks
    data = bytearray((path / "extra.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "extra.pt").write_bytes(bytes(data))
    seen = []
    with pytest.raises(CheckpointError, match="extra"):
        for _, file, i in sharded.verify_sharded(path):
            seen.append((file, i))
    assert seen == chunks
