"""The chunk loop's readers: a load into an empty numba store reads in place (straight into
the pool, indexed slice by slice), the others read one slice ahead on a thread; both
check every chunk as the reference does, and a bad file changes no store."""

from __future__ import annotations

import json
import threading
import time

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import leanstate
from leanstate.accelerated.numba_kv_store import KVStoreEngine
from leanstate.checkpoint import _chunks as _checkpoint_chunks
from leanstate.checkpoint import load_checkpoint, save_checkpoint
from leanstate.checkpoint._chunks import TableRead, bucket_major, in_bucket, read_chunks
from leanstate.reference import checkpoint as reference_checkpoint
from leanstate.reference.checkpoint import CheckpointError
from leanstate.reference.sharding import bucket_of
from tests.harness import FakeClock

CHUNK = 4096  # bytes: several chunks, each of several slices below


def filled(backend: str, n: int = 300) -> leanstate.KVStore:
    store = leanstate.KVStore(6, optimizer_state_dim=2, clock=FakeClock(9), backend=backend)
    ids = torch.randperm(10_000, generator=torch.Generator().manual_seed(3))[:n]
    store.set(ids, torch.randn(n, 8, generator=torch.Generator().manual_seed(4)))
    return store


def same_rows(a: leanstate.KVStore, b: leanstate.KVStore) -> bool:
    keys = a.keys()
    return torch.equal(keys, b.keys()) and torch.equal(
        a.get_rows(keys).view(torch.int32), b.get_rows(keys).view(torch.int32)
    )


def test_a_load_into_an_empty_numba_store_reads_in_place_and_equals_the_references(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / "ck", {"t": filled("reference")}, chunk_bytes=CHUNK)
    store = leanstate.KVStore(6, optimizer_state_dim=2, backend="numba")
    assert store.rows_in_place() is not None

    def no_staging(self, rows):
        raise AssertionError("an empty store's load went through set_rows")

    monkeypatch.setattr(KVStoreEngine, "write_rows", no_staging)
    seen = []
    load_checkpoint(tmp_path / "ck", {"t": store}, chunk_bytes=CHUNK, progress=lambda *a: seen.append(a))
    expected = leanstate.KVStore(6, optimizer_state_dim=2, backend="reference")
    load_checkpoint(tmp_path / "ck", {"t": expected}, chunk_bytes=CHUNK)
    assert same_rows(store, expected) and len(store) == 300
    assert seen[-1] == ("t", 300, 300) and len(seen) > 3  # one report per chunk


def damage(path, how: str) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    chunks = manifest["tables"]["t"]["chunks"]
    rows = path / "t.rows"
    data = bytearray(rows.read_bytes())
    row_bytes = manifest["tables"]["t"]["row_bytes"]
    last = chunks[-1]
    if how == "a flipped byte in the last chunk":
        data[last["offset"] + 20] ^= 0xFF
    elif how == "ids out of order in the last chunk":
        first, second = last["offset"], last["offset"] + row_bytes
        data[first : first + 8], data[second : second + 8] = (
            data[second : second + 8],
            data[first : first + 8],
        )
    elif how == "an id of an earlier chunk again":
        data[last["offset"] : last["offset"] + 8] = data[chunks[0]["offset"] : chunks[0]["offset"] + 8]
    rows.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how",
    [
        "a flipped byte in the last chunk",
        "ids out of order in the last chunk",
        "an id of an earlier chunk again",
    ],
)
def test_a_bad_chunk_read_in_place_leaves_the_store_empty_and_its_pool_clean(tmp_path, how):
    save_checkpoint(tmp_path / "ck", {"t": filled("reference")}, chunk_bytes=CHUNK)
    damage(tmp_path / "ck", how)
    store = leanstate.KVStore(6, optimizer_state_dim=2, clock=FakeClock(5), backend="numba")
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "ck", {"t": store}, chunk_bytes=CHUNK)
    assert len(store) == 0 and len(store.keys()) == 0
    # the blocks read but never adopted were zeroed: new ids start from clean rows
    reference = leanstate.KVStore(6, optimizer_state_dim=2, clock=FakeClock(5), backend="reference")
    ids = torch.arange(0, 3000, 7)
    for target in (store, reference):
        target.set(ids, torch.ones(len(ids), 3), width_offset=2)
    assert same_rows(store, reference)


def test_reading_one_slice_ahead_yields_what_reading_in_turn_yields_and_stops_its_thread(tmp_path):
    save_checkpoint(tmp_path / "ck", {"t": filled("reference")}, chunk_bytes=CHUNK)
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    table = manifest["tables"]["t"]
    chunks = list(enumerate(table["chunks"]))
    plain = [
        (i, None if v is None else bytes(v))
        for i, _, v in read_chunks(tmp_path / "ck", TableRead.of_v1("t", table, chunks), 1000)
    ]
    ahead = [
        (i, None if v is None else bytes(v))
        for i, _, v in read_chunks(tmp_path / "ck", TableRead.of_v1("t", table, chunks), 1000, ahead=True)
    ]
    assert ahead == plain and len(plain) > 2 * len(chunks)
    partial = read_chunks(tmp_path / "ck", TableRead.of_v1("t", table, chunks), 1000, ahead=True)
    next(partial)
    partial.close()  # stopping early ends the reader thread
    assert not any(t.name == "leanstate-checkpoint-reader" for t in threading.enumerate())


def test_a_flipped_byte_read_ahead_is_raised_after_the_slices_before_it(tmp_path):
    save_checkpoint(tmp_path / "ck", {"t": filled("reference")}, chunk_bytes=CHUNK)
    damage(tmp_path / "ck", "a flipped byte in the last chunk")
    table = json.loads((tmp_path / "ck" / "manifest.json").read_text())["tables"]["t"]
    chunks = list(enumerate(table["chunks"]))
    verified = []
    with pytest.raises(CheckpointError, match=f"chunk {len(chunks) - 1} of"):
        for index, _, view in read_chunks(
            tmp_path / "ck", TableRead.of_v1("t", table, chunks), 1000, ahead=True
        ):
            if view is None:
                verified.append(index)
    assert verified == list(range(len(chunks) - 1))


def _flip_chunk(folder, index: int) -> None:
    chunks = json.loads((folder / "manifest.json").read_text())["tables"]["t"]["chunks"]
    rows = folder / "t.rows"
    data = bytearray(rows.read_bytes())
    data[chunks[index]["offset"] + 40] ^= 0x08
    rows.write_bytes(bytes(data))


@pytest.mark.parametrize("before", ["a new store", "a store whose rows were all deleted"])
@pytest.mark.parametrize("where", ["second", "middle", "last"])
def test_a_failed_in_place_load_gives_back_exactly_its_own_blocks(tmp_path, monkeypatch, before, where):
    """A bad chunk part way through an in-place load: the blocks it claimed are zeroed and
    given back (and only those: in a store that held rows before, its blocks start past
    the old ones, whose free list must survive), the reader stops writing before they are
    zeroed, and every later insert, load and delete agrees with the reference.

    The reader is held a moment inside each read past the bad chunk, so it is still
    writing a slice when the caller finds the bad chunk: only a caller that stops it
    before zeroing leaves clean blocks."""
    source = filled("reference", 2000)
    save_checkpoint(tmp_path / "good", {"t": source}, chunk_bytes=CHUNK)
    save_checkpoint(tmp_path / "bad", {"t": source}, chunk_bytes=CHUNK)
    chunks = json.loads((tmp_path / "bad" / "manifest.json").read_text())["tables"]["t"]["chunks"]
    bad = {"second": 1, "middle": len(chunks) // 2, "last": len(chunks) - 1}[where]
    _flip_chunk(tmp_path / "bad", bad)
    past_bad = chunks[bad]["offset"] + chunks[bad]["rows"] * 64
    real_open = _checkpoint_chunks.open_data_file

    class HeldPastTheBadChunk:
        def __init__(self, f):
            self.f = f

        def readinto(self, view):
            if self.f.tell() >= past_bad:
                time.sleep(0.3)
            return self.f.readinto(view)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def held_if_bad(path, *rest):
        f = real_open(path, *rest)
        return HeldPastTheBadChunk(f) if path == tmp_path / "bad" else f

    monkeypatch.setattr(_checkpoint_chunks, "open_data_file", held_if_bad)
    stores = [
        leanstate.KVStore(6, optimizer_state_dim=2, clock=FakeClock(5), backend=b)
        for b in ("numba", "reference")
    ]
    old = torch.arange(50_000, 50_700)
    for store in stores:
        if before != "a new store":
            store.set(old, torch.full((len(old), 8), 3.0))
            store.delete(old)
        with pytest.raises(CheckpointError, match="chunk"):
            load_checkpoint(tmp_path / "bad", {"t": store}, chunk_bytes=CHUNK // 4)
        assert len(store) == 0
    assert stores[0].rows_in_place() is not None
    fresh = torch.arange(0, 9000, 3)  # more ids than the blocks given back, with ids of the load
    for store in stores:
        store.set(fresh, torch.ones(len(fresh), 3), width_offset=2)  # the other columns: initial rows
    assert same_rows(*stores)
    for store in stores:  # an in-place load again, into a store with a long free list
        store.delete(store.keys())
        load_checkpoint(tmp_path / "good", {"t": store}, chunk_bytes=CHUNK // 4)
        store.set(old, torch.full((len(old), 8), 2.0))
    assert same_rows(*stores) and len(stores[0]) == len(source) + len(old)


@pytest.mark.parametrize("at", [5, 16, 32, 33])  # inside a slice, and on the boundaries of 16-row slices
@pytest.mark.parametrize("backend", ["numba", "torch", "reference"])
def test_an_id_repeated_inside_a_chunk_is_refused_wherever_the_slices_cut(tmp_path, at, backend):
    """A chunk whose row ``at`` repeats the id of row ``at - 1``, its CRC and id range
    made to match: only the ascending-ids check can see it, inside a slice or across the
    boundary of two (the check must carry the last id over), by every reader."""
    source = filled("reference", 100)
    save_checkpoint(tmp_path / "ck", {"t": source}, chunk_bytes=100 * 64)
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    (chunk,) = manifest["tables"]["t"]["chunks"]
    data = bytearray((tmp_path / "ck" / "t.rows").read_bytes())
    data[at * 64 : at * 64 + 8] = data[(at - 1) * 64 : (at - 1) * 64 + 8]
    (tmp_path / "ck" / "t.rows").write_bytes(bytes(data))
    chunk["crc"] = crc32c.crc32c(bytes(data))
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for live in (False, True):
        store = filled(backend, 3) if live else leanstate.KVStore(6, optimizer_state_dim=2, backend=backend)
        before = store.get_rows(store.keys())
        with pytest.raises(CheckpointError, match="ascend"):
            load_checkpoint(tmp_path / "ck", {"t": store}, chunk_bytes=16 * 64)
        assert torch.equal(store.get_rows(store.keys()), before)
    with pytest.raises(CheckpointError, match="ascend"):
        reference_checkpoint.load_checkpoint(
            tmp_path / "ck", {"t": leanstate.KVStore(6, optimizer_state_dim=2)}
        )


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=20),
    buckets=st.integers(1, 5000),
    size=st.one_of(st.none(), st.integers(1, 2**40)),
    pick=st.integers(0, 19),
)
def test_the_chunk_check_reads_buckets_by_bucket_of(keys, buckets, size, pick):
    """The version-2 chunk check's numpy bucket rule is ``bucket_of``'s, id for id."""
    ids = torch.tensor(keys, dtype=torch.int64)
    of = bucket_of(ids, total_num_buckets=buckets, bucket_size=size)
    bucket = int(of[pick % len(keys)])
    assert in_bucket(ids.numpy(), (buckets, size), bucket) == bool((of == bucket).all())


def test_saving_order_is_bucket_major_for_hashed_and_chunked_ids():
    """Kills: the bucket count read from the wrong field of the bucketing (hashed ids,
    ``id % buckets``, would fall in other buckets)."""
    keys = torch.arange(1, 9)
    hashed, buckets = bucket_major(keys, (4, None))  # bucket = id % 4
    assert hashed.tolist() == [4, 8, 1, 5, 2, 6, 3, 7] and buckets.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    chunked, buckets = bucket_major(keys, (2, 3))  # bucket = min(id // 3, 1)
    assert chunked.tolist() == keys.tolist() and buckets.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert bucket_major(keys, None) == (keys, None)
