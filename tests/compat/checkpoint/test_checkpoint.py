import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import crc32c
import pytest
import torch

from leanstate.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from leanstate.checkpoint._background import finish_removals
from leanstate.checkpoint._files import read_manifest
from leanstate.checkpoint.legacy import load_legacy_checkpoint, save_legacy_checkpoint
from leanstate.kv_store import KVStore
from leanstate.reference.checkpoint import CheckpointError
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import header_words
from leanstate.reference.sharding import row_wise_id_range
from tests.harness import VECTORS, FakeClock, run_probe

ROOT = Path(__file__).resolve().parents[3]


def filled(n=300, dim=6, state=2, dtype=torch.float32, **kwargs):
    store = KVStore(dim, optimizer_state_dim=state, dtype=dtype, clock=FakeClock(500), **kwargs)
    ids = torch.randperm(10 * n)[:n]
    store.set(ids, torch.randn(n, dim).to(dtype))
    store.set(ids[: n // 2], torch.randn(n // 2, state).to(dtype), width_offset=store.layout.padded_dim)
    return store


def snapshot(store):
    keys = store.keys()
    return keys, store.get_rows(keys)


def same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_keeps_rows_and_metadata(tmp_path, dtype):
    src = filled(dtype=dtype)
    save_checkpoint(tmp_path / "ck", {"t": src}, extra={"step": torch.tensor(7), "lr": 0.5}, chunk_bytes=1000)
    dst = KVStore(6, optimizer_state_dim=2, dtype=dtype, num_shards=3)
    extra = load_checkpoint(tmp_path / "ck", {"t": dst}, chunk_bytes=700)
    assert same(snapshot(src), snapshot(dst))
    assert extra["step"].item() == 7 and extra["lr"] == 0.5
    assert len(read_manifest(tmp_path / "ck")[1]["tables"]["t"]["chunks"]) > 10


def test_rows_are_stored_in_ascending_id_order_in_chunks(tmp_path):
    src = filled()
    save_checkpoint(tmp_path / "ck", {"t": src}, chunk_bytes=2000)
    table = read_manifest(tmp_path / "ck")[1]["tables"]["t"]
    raw = (tmp_path / "ck" / "t.rows").read_bytes()
    rows = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(-1, table["width"])
    assert torch.equal(header_words(rows)[:, 0], src.keys())
    offsets = [c["offset"] for c in table["chunks"]]
    assert offsets == sorted(offsets) and sum(c["rows"] for c in table["chunks"]) == table["rows"] == len(src)
    assert all(a["max_id"] < b["min_id"] for a, b in zip(table["chunks"], table["chunks"][1:]))


def test_golden_checkpoint_loads_bit_exactly_and_saves_back_identically(tmp_path):
    golden = VECTORS / "checkpoint_v1"
    store = KVStore(3, optimizer_state_dim=1)
    load_checkpoint(golden, {"t": store})
    raw = (golden / "t.rows").read_bytes()
    assert store.get_rows(store.keys()).numpy().tobytes() == raw
    table = read_manifest(golden)[1]["tables"]["t"]
    save_checkpoint(tmp_path / "again", {"t": store}, chunk_bytes=2 * table["row_bytes"])
    assert (tmp_path / "again" / "t.rows").read_bytes() == raw

    def without_checksums(folder):
        manifest = json.loads((folder / "manifest.json").read_text())
        table = manifest["tables"]["t"]
        algorithm = table.pop("checksum")
        crcs = [chunk.pop("crc") for chunk in table["chunks"]]
        return manifest, algorithm, crcs

    golden_manifest, golden_algorithm, golden_crcs = without_checksums(golden)
    again_manifest, again_algorithm, again_crcs = without_checksums(tmp_path / "again")
    assert again_manifest == golden_manifest
    # The golden file uses zlib's CRC-32 (still read); saves write CRC-32C.
    assert (golden_algorithm, again_algorithm) == ("crc32", "crc32c")
    chunk = 2 * table["row_bytes"]
    pieces = [raw[i : i + chunk] for i in range(0, len(raw), chunk)]
    assert golden_crcs == [zlib.crc32(p) for p in pieces]
    assert again_crcs == [crc32c.crc32c(p) for p in pieces]


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_golden_bfloat16_crc32c_checkpoint_loads_and_saves_back_identically(tmp_path, backend):
    golden = VECTORS / "checkpoint_v1_bf16_crc32c"
    store = KVStore(3, optimizer_state_dim=1, dtype=torch.bfloat16, backend=backend)
    load_checkpoint(golden, {"t": store})
    raw = (golden / "t.rows").read_bytes()
    assert store.get_rows(store.keys()).view(torch.uint8).numpy().tobytes() == raw
    table = read_manifest(golden)[1]["tables"]["t"]
    save_checkpoint(tmp_path / "again", {"t": store}, chunk_bytes=2 * table["row_bytes"])
    assert (tmp_path / "again" / "t.rows").read_bytes() == raw
    assert read_manifest(tmp_path / "again")[1]["tables"]["t"] == table  # crc32c, chunks, every field


def test_crc32c_is_the_castagnoli_crc_of_the_vectors(vectors):
    v = vectors("checksums.json")
    for case in v["cases"]:
        data = case["ascii"].encode()
        assert crc32c.crc32c(data) == case["crc32c"] and zlib.crc32(data) == case["crc32"]
    assert next(c for c in v["cases"] if c["ascii"] == "123456789")["crc32c"] == 0xE3069283  # the check value


def test_saving_the_same_store_twice_gives_the_same_bytes(tmp_path):
    src = filled()
    for name in ("a", "b"):
        save_checkpoint(tmp_path / name, {"t": src}, chunk_bytes=1500)
    for file in ("t.rows", "manifest.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()


def test_id_range_loads_a_share_and_reads_only_its_chunks(tmp_path):
    src = KVStore(4, clock=FakeClock())
    src.set(torch.arange(100), torch.randn(100, 4))
    save_checkpoint(tmp_path / "ck", {"t": src}, chunk_bytes=10 * src.layout.row_bytes)
    # Corrupt the last chunk: a share that does not touch it must still load.
    data = tmp_path / "ck" / "t.rows"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(raw)
    part = KVStore(4)
    load_checkpoint(tmp_path / "ck", {"t": part}, id_range=(25, 47))
    assert part.keys().tolist() == list(range(25, 47))
    assert torch.equal(part.get_rows(part.keys()), src.get_rows(part.keys()))
    with pytest.raises(CheckpointError, match="chunk 9 of .*t.rows"):
        load_checkpoint(tmp_path / "ck", {"t": KVStore(4)}, id_range=(85, 200))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_world_size_partitions_the_rows(tmp_path, world_size):
    src = KVStore(4, clock=FakeClock())
    src.set(torch.arange(0, 101, 3), torch.randn(34, 4))
    src.set(torch.tensor([123456789, 2**62]), torch.randn(2, 4))  # above num_embeddings: never dropped
    save_checkpoint(tmp_path / "ck", {"t": src}, chunk_bytes=7 * src.layout.row_bytes)
    seen = []
    for rank in range(world_size):
        share = KVStore(4)
        load_checkpoint(tmp_path / "ck", {"t": share}, id_range=row_wise_id_range(101, rank, world_size))
        seen.extend(share.keys().tolist())
        assert torch.equal(share.get_rows(share.keys()), src.get_rows(share.keys()))
    assert seen == src.keys().tolist()


def test_whole_row_views_and_read_only_optimizer_views(tmp_path):
    src = filled(n=50)
    weight = KVTensor(src, whole_rows=True)
    momentum = KVTensor(src, width_offset=src.layout.padded_dim, width=2, read_only=True)
    src.set(torch.tensor([100_000, 100_001]), torch.ones(2, 6))  # the store grows after the views
    save_checkpoint(tmp_path / "ck", {"t.weight": weight, "t.momentum": momentum})
    _, manifest = read_manifest(tmp_path / "ck")
    assert manifest["tables"]["t.weight"]["rows"] == 52
    assert manifest["views"]["t.momentum"] == {
        "table": "t.weight",
        "whole_rows": False,
        "width_offset": 8,
        "width": 2,
        "read_only": True,
        "rows": 52,
    }
    dst = KVStore(6, optimizer_state_dim=2)
    dst_weight = KVTensor(dst, whole_rows=True)
    dst_momentum = KVTensor(dst, width_offset=8, width=2, read_only=True)
    load_checkpoint(tmp_path / "ck", {"t.weight": dst_weight, "t.momentum": dst_momentum})
    assert same(snapshot(src), snapshot(dst))  # the state arrived with the whole rows
    assert dst_momentum.ignored_writes == 52


def test_a_partial_view_needs_its_whole_table(tmp_path):
    src = filled(n=5)
    with pytest.raises(ValueError, match="partial view"):
        save_checkpoint(tmp_path / "ck", {"m": KVTensor(src, width=2)})
    save_checkpoint(tmp_path / "ck", {"t": src})
    with pytest.raises(ValueError, match="writable partial view"):
        load_checkpoint(tmp_path / "ck", {"t": KVTensor(KVStore(6, optimizer_state_dim=2), width=2)})


def test_progress_is_reported(tmp_path):
    src = filled(n=100)
    calls = []
    save_checkpoint(tmp_path / "ck", {"t": src}, chunk_bytes=1000, progress=lambda *a: calls.append(a))
    assert calls[-1] == ("t", 100, 100) and len(calls) > 3
    calls.clear()
    load_checkpoint(
        tmp_path / "ck", {"t": KVStore(6, optimizer_state_dim=2)}, progress=lambda *a: calls.append(a)
    )
    assert calls[-1] == ("t", 100, 100)


def test_saving_over_a_checkpoint_replaces_it_whole(tmp_path):
    save_checkpoint(tmp_path / "ck", {"a": filled(n=10), "b": filled(n=10)})
    new = filled(n=20)
    save_checkpoint(tmp_path / "ck", {"a": new})
    assert sorted(os.listdir(tmp_path / "ck")) == ["a.rows", "manifest.json"]
    others = [p for p in tmp_path.iterdir() if p.name != "ck"]  # at most the old copy, being deleted
    assert all(p.name.startswith(".ck.previous-") and not (p / "manifest.json").exists() for p in others)
    finish_removals()
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging or previous copy left
    dst = KVStore(6, optimizer_state_dim=2)
    load_checkpoint(tmp_path / "ck", {"a": dst})
    assert same(snapshot(new), snapshot(dst))


def test_legacy_round_trip_keeps_values_not_metadata(tmp_path):
    src = filled(n=30)
    save_legacy_checkpoint(tmp_path / "old", {"t": src})
    dst = KVStore(6, optimizer_state_dim=2, clock=FakeClock(900))
    load_legacy_checkpoint(tmp_path / "old", {"t": dst})
    keys = src.keys()
    assert torch.equal(dst.keys(), keys)
    assert torch.equal(dst.get(keys), src.get(keys))
    assert not torch.equal(dst.metadata(keys), src.metadata(keys))


def test_legacy_round_trip_without_optimizer_state(tmp_path):
    src = KVStore(4, clock=FakeClock())
    src.set(torch.arange(5), torch.randn(5, 4))
    save_legacy_checkpoint(tmp_path / "old", {"t": src})
    assert (tmp_path / "old" / "t.optimizer").stat().st_size == 0
    dst = KVStore(4)
    load_legacy_checkpoint(tmp_path / "old", {"t": dst})
    assert torch.equal(dst.get(src.keys()), src.get(src.keys()))


# -- faults: a clear error naming the file and chunk, and nothing applied ---------------


@pytest.fixture
def saved(tmp_path):
    src = filled(n=200)
    path = save_checkpoint(tmp_path / "ck", {"t": src}, chunk_bytes=20 * src.layout.row_bytes)
    return path


def target_with_rows():
    store = KVStore(6, optimizer_state_dim=2)
    store.set(torch.tensor([1, 2, 3]), torch.ones(3, 6))
    return store


def corrupt(path: Path, how: str) -> None:
    manifest_file = path / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    data = path / "t.rows"
    if how == "truncated":
        data.write_bytes(data.read_bytes()[:-100])
    elif how == "flipped":
        raw = bytearray(data.read_bytes())
        raw[len(raw) - 50] ^= 0x01  # in the last chunk: earlier chunks must not be applied either
        data.write_bytes(raw)
    elif how == "version":
        manifest["version"] = 99
    elif how == "outside":
        shutil.copy(data, path.parent / "evil.rows")
        manifest["tables"]["t"]["file"] = "../evil.rows"
    elif how == "missing-file":
        data.unlink()
    elif how == "format":
        manifest["format"] = "something-else"
    if how in ("version", "outside", "format"):
        manifest_file.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", r"t\.rows has \d+ bytes, the manifest expects \d+ \(truncated\)"),
        ("flipped", r"chunk 9 of .*t\.rows \(bytes \d+\.\.\d+\) fails its crc32c check"),
        ("version", r"manifest\.json: format version 99 is not supported"),
        (
            "outside",
            r"tables\['t'\]\.file must be 't\.rows' \(a plain name inside the checkpoint\); got '\.\./evil\.rows'",
        ),
        ("missing-file", r"data file .*t\.rows is missing"),
        ("format", r"format 'something-else'"),
    ],
)
@pytest.mark.parametrize("holds_rows", [True, False], ids=["verify-first", "one-pass-undone"])
def test_bad_checkpoints_leave_the_store_as_it_was(saved, how, message, holds_rows):
    corrupt(saved, how)
    store = target_with_rows() if holds_rows else KVStore(6, optimizer_state_dim=2)
    before = snapshot(store)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(saved, {"t": store}, chunk_bytes=1000)
    assert same(before, snapshot(store))


@pytest.mark.parametrize(
    "store, message",
    [
        (KVStore(6, optimizer_state_dim=2, dtype=torch.float16), "dtype float32 vs the store's float16"),
        (KVStore(5, optimizer_state_dim=2), "dim 6 vs the store's 5"),
        (KVStore(6, optimizer_state_dim=1), "optimizer_state_dim 2 vs the store's 1"),
    ],
)
def test_layout_mismatch_names_the_table_and_file(saved, store, message):
    with pytest.raises(CheckpointError, match=f"table 't' in .*t.rows: {message}"):
        load_checkpoint(saved, {"t": store})
    assert len(store) == 0


def test_missing_table_and_missing_checkpoint(saved, tmp_path):
    store = target_with_rows()
    with pytest.raises(CheckpointError, match=r"table 'u' is not in checkpoint .*ck \(it has: t\)"):
        load_checkpoint(saved, {"t": store, "u": KVStore(6, optimizer_state_dim=2)})
    assert len(store) == 3  # the good table was not applied either
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nothing", {"t": store})


def test_inspect_reports_ok_and_the_first_bad_chunk(saved):
    def inspect():
        return subprocess.run(
            [sys.executable, "-m", "leanstate", "inspect", str(saved)], capture_output=True, text=True
        )

    ok = inspect()
    assert ok.returncode == 0 and "table t: 200 rows" in ok.stdout and "OK: 10 chunks verified" in ok.stdout
    corrupt(saved, "flipped")
    bad = inspect()
    assert bad.returncode == 1 and "BAD: table 't': chunk 9 of" in bad.stdout


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="chunk_bytes"):
        save_checkpoint(tmp_path / "ck", {"t": filled(n=3)}, chunk_bytes=0)
    with pytest.raises(TypeError, match=r"tables\['t'\] must be a KVStore or KVTensor"):
        save_checkpoint(tmp_path / "ck", {"t": torch.zeros(3)})
    with pytest.raises(ValueError, match="table name"):
        save_checkpoint(tmp_path / "ck", {"../t": filled(n=3)})
    with pytest.raises(ValueError, match="id_range"):
        load_checkpoint(tmp_path / "ck", {}, id_range=(5, 1))
    assert not (tmp_path / "ck").exists()


# -- a save killed part-way ----------------------------------------------------------------

KILLED_SAVE = textwrap.dedent(
    """
    import sys, time, torch
    from leanstate.kv_store import KVStore
    from leanstate.checkpoint import save_checkpoint

    store = KVStore(16)
    store.set(torch.arange(5000), torch.full((5000, 16), 2.0))

    def progress(table, done, total):
        print("chunk", done, flush=True)
        time.sleep(60)  # the parent kills us here, mid-save

    save_checkpoint(sys.argv[1], {"t": store}, chunk_bytes=4096, progress=progress)
    """
)


def test_a_save_killed_with_sigkill_leaves_the_previous_checkpoint(tmp_path):
    old = KVStore(16, clock=FakeClock())
    old.set(torch.arange(10), torch.ones(10, 16))
    path = save_checkpoint(tmp_path / "ck", {"t": old})
    before = sorted(os.listdir(path))
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().startswith("chunk")
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert sorted(os.listdir(path)) == before
    restored = KVStore(16)
    load_checkpoint(path, {"t": restored})
    assert same(snapshot(old), snapshot(restored))
    assert list(verify_checkpoint(path))
    # what the killed save left is a hidden sibling, never the target
    assert all(p.name.startswith(".ck.saving-") for p in tmp_path.iterdir() if p.name != "ck")


# -- memory: whole-row streaming vs the legacy load ----------------------------------------

MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from leanstate.kv_store import KVStore
    from leanstate.checkpoint import load_checkpoint
    from leanstate.checkpoint.legacy import load_legacy_checkpoint

    kind, path, rows, dim = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    # A live store that already holds the rows (resume): only the load's own memory shows.
    store = KVStore(dim, optimizer_state_dim=1)
    for start in range(0, rows, 20_000):
        store.set(torch.arange(start, min(rows, start + 20_000)), torch.zeros(min(20_000, rows - start), dim))
    base = reset_peak()
    if kind == "whole":
        load_checkpoint(path, {"t": store}, chunk_bytes=2 * 2**20)
    else:
        load_legacy_checkpoint(path, {"t": store})
    # The table's content: ids, weights and optimizer state (what the legacy flow holds).
    table = rows * (8 + (dim + 1) * 4)
    print(json.dumps({"extra": peak_since(base), "table": table}))
    """
)


def test_whole_row_load_memory_is_bounded_and_the_legacy_load_is_not(tmp_path):
    rows, dim = 200_000, 128
    src = KVStore(dim, optimizer_state_dim=1)
    for start in range(0, rows, 50_000):
        src.set(torch.arange(start, start + 50_000), torch.randn(50_000, dim))
    save_checkpoint(tmp_path / "whole", {"t": src})
    save_legacy_checkpoint(tmp_path / "legacy", {"t": src})
    del src
    results = {}
    for kind in ("whole", "legacy"):
        results[kind] = run_probe(MEMORY_PROBE, kind, tmp_path / kind, rows, dim)
    table = results["whole"]["table"]
    assert results["whole"]["extra"] < table / 4, results
    # The legacy flow holds the table's three tensors at once: its peak is the table's
    # content (RSS counts whole pages, and the store's own writes add little with numba).
    assert results["legacy"]["extra"] > 0.95 * table, results


def test_a_layout_mismatch_names_the_optimizers(tmp_path):
    saved = KVStore(4, optimizer_state_dim=1)  # rowwise Adagrad: one value per row
    saved.set(torch.tensor([1]), torch.ones(1, 4))
    save_checkpoint(tmp_path / "c", {"t": saved})
    with pytest.raises(CheckpointError, match="saved rowwise_adagrad-sized, this store adam-sized"):
        load_checkpoint(tmp_path / "c", {"t": KVStore(4, optimizer_state_dim=8)})


def test_bucketings_are_described_in_words():
    from leanstate.checkpoint._bucketed_table import describe_bucketing

    assert describe_bucketing(1024, None) == "1024 interleaved buckets (id % 1024, for hashed ids)"
    assert describe_bucketing(64, 98) == "64 buckets of 98 consecutive ids (id // 98)"


def test_every_fsync_of_the_save_protocol_happens_in_order(tmp_path, monkeypatch):
    """Data files, extra state and manifest are fsynced, then the staging directory, and
    after the rename the parent directory (the durability protocol of the spec)."""
    real = os.fsync
    synced = []

    def counting(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    a, b = KVStore(4, optimizer_state_dim=1), KVStore(4)
    a.set(torch.arange(5), torch.ones(5, 4))
    b.set(torch.arange(3), torch.ones(3, 4))
    for pipelined in (True, False):
        synced.clear()
        save_checkpoint(tmp_path / "c", {"a": a, "b": b}, extra={"step": 1}, pipelined=pipelined)
        names = [Path(p).name for p in synced]
        assert sorted(names[:3]) == ["a.rows", "b.rows", "extra.pt"], names
        assert names[3] == "manifest.json" and names[4].startswith(".c.saving-"), names
        assert synced[5] == str(tmp_path) and len(synced) == 6, synced


def test_duplicate_ids_inside_one_chunk_are_refused(tmp_path):
    store = KVStore(4)
    store.set(torch.arange(10), torch.ones(10, 4))
    path = save_checkpoint(tmp_path / "c", {"t": store})
    manifest = json.loads((path / "manifest.json").read_text())
    table = manifest["tables"]["t"]
    data = bytearray((path / "t.rows").read_bytes())
    row = table["row_bytes"]
    data[row : 2 * row] = data[:row]  # ids 0, 0, 2, ...: non-descending, not strictly ascending
    (path / "t.rows").write_bytes(bytes(data))
    table["chunks"][0]["crc"] = crc32c.crc32c(bytes(data))
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="ids do not ascend"):
        load_checkpoint(path, {"t": KVStore(4)})


@pytest.mark.parametrize("bad", ["the live store's table", "the empty store's table"])
@pytest.mark.parametrize("order", ["empty first", "live first"])
def test_a_load_into_an_empty_and_a_live_store_verifies_before_it_applies(tmp_path, bad, order):
    """One table into an empty store, another into a store holding rows, one of the two
    files damaged: the live store could not be restored, so nothing is applied before
    every chunk is verified; both stores end as they were, in either order."""
    save_checkpoint(tmp_path / "ck", {"a": filled(200), "b": filled(200)}, chunk_bytes=2000)
    damaged = tmp_path / "ck" / ("b.rows" if bad == "the live store's table" else "a.rows")
    data = bytearray(damaged.read_bytes())
    data[-30] ^= 0x01
    damaged.write_bytes(bytes(data))
    empty, live = KVStore(6, optimizer_state_dim=2), filled(40, backend="numba")
    before = snapshot(live)
    tables = {"a": empty, "b": live} if order == "empty first" else {"b": live, "a": empty}
    with pytest.raises(CheckpointError, match="crc32c"):
        load_checkpoint(tmp_path / "ck", tables)
    assert len(empty) == 0 and same(snapshot(live), before)


@pytest.mark.parametrize("backend", ["numba", "torch", "reference"])
@pytest.mark.parametrize("pipelined", [True, False])
def test_rows_deleted_while_a_save_runs_are_left_out_and_the_checkpoint_loads(tmp_path, backend, pipelined):
    """Rows deleted after the save listed its keys, before their chunk is gathered, are
    not written (a deleted row reads as zeros, key 0: it would break the ascending ids
    and the checkpoint would never load); the rest load bit for bit."""
    store = filled(400, backend=backend)
    keys = store.keys()
    doomed = keys[300::3]  # in chunks gathered after the first progress report
    reports = []

    def delete_once(table, done, total):
        if not reports:
            store.delete(doomed)
        reports.append(done)

    save_checkpoint(
        tmp_path / "ck",
        {"t": store},
        chunk_bytes=20 * store.layout.row_bytes,
        progress=delete_once,
        pipelined=pipelined,
    )
    loaded = KVStore(6, optimizer_state_dim=2, backend="reference")
    load_checkpoint(tmp_path / "ck", {"t": loaded})
    assert torch.equal(loaded.keys(), store.keys()) and len(loaded) == len(keys) - len(doomed)
    assert same(snapshot(loaded), snapshot(store))


def test_a_backend_argument_is_deprecated_and_ignored_and_none_warns_nothing(tmp_path):
    """``backend=`` once chose the I/O path; every backend now shares one, so passing it
    warns (naming the call) and changes nothing; leaving it out warns nothing."""
    import warnings

    store = filled(40)
    for method in ("save_checkpoint", "load_checkpoint"):
        with pytest.warns(DeprecationWarning, match=rf"{method}\(backend=\.\.\.\) is deprecated and ignored"):
            save_checkpoint(
                tmp_path / "a", {"t": store}, backend="numba" if method == "save_checkpoint" else None
            )
            loaded = KVStore(6, optimizer_state_dim=2)
            load_checkpoint(
                tmp_path / "a", {"t": loaded}, backend="numba" if method == "load_checkpoint" else None
            )
        assert same(snapshot(loaded), snapshot(store))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        save_checkpoint(tmp_path / "b", {"t": store})
        load_checkpoint(tmp_path / "b", {"t": KVStore(6, optimizer_state_dim=2)})


def test_a_modules_tables_load_with_its_extra_state(tmp_path):
    """``checkpoint_tables()`` of a module saves its extra state (the optimizer step) beside
    the caller's and a load restores it; a checkpoint saved without it (plain tables)
    leaves the module's step as it was."""
    from leanstate import KVEmbeddingBag

    def bag():
        return KVEmbeddingBag(50, 4, optimizer="adam", lr=0.1, clock=FakeClock())

    trained = bag()
    for step in range(3):
        trained(torch.tensor([step, 7]), torch.tensor([0])).sum().backward()
    save_checkpoint(tmp_path / "module", trained.checkpoint_tables(), extra={"epoch": 1})
    fresh = bag()
    assert load_checkpoint(tmp_path / "module", fresh.checkpoint_tables()) == {
        "epoch": 1,
        "optimizer_step": 3,
    }
    assert fresh.optimizer_step == 3 and same(snapshot(fresh.store), snapshot(trained.store))
    save_checkpoint(tmp_path / "plain", dict(trained.checkpoint_tables()))
    again = bag()
    again.optimizer_step = 5
    load_checkpoint(tmp_path / "plain", again.checkpoint_tables())
    assert again.optimizer_step == 5


def test_a_load_refuses_a_path_that_is_not_one_and_a_bad_chunk_size_naming_them(tmp_path):
    save_checkpoint(tmp_path / "c", {"t": filled(n=3)})
    with pytest.raises(TypeError, match="load_checkpoint: path must be a str or os.PathLike; got int"):
        load_checkpoint(7, {"t": KVStore(6, optimizer_state_dim=2)})
    store = KVStore(6, optimizer_state_dim=2)
    with pytest.raises(ValueError, match="chunk_bytes"):
        load_checkpoint(tmp_path / "c", {"t": store}, chunk_bytes=0)
    assert len(store) == 0


def test_verify_yields_every_chunk_then_checks_the_extra_state(tmp_path):
    """One (table, chunk, rows) as each chunk passes, in the manifest's order (a bad chunk
    is not yielded), and only then the extra state: a damaged extra fails after every
    chunk has been yielded."""
    store = filled(n=40)
    save_checkpoint(tmp_path / "c", {"t": store}, chunk_bytes=10 * store.layout.row_bytes, extra={"k": 1})
    chunks = read_manifest(tmp_path / "c")[1]["tables"]["t"]["chunks"]
    assert list(verify_checkpoint(tmp_path / "c")) == [("t", i, c["rows"]) for i, c in enumerate(chunks)]
    extra = next(p for p in (tmp_path / "c").iterdir() if p.name.startswith("extra"))
    extra.write_bytes(extra.read_bytes()[:-1] + bytes([extra.read_bytes()[-1] ^ 1]))
    passed = []
    with pytest.raises(CheckpointError, match="extra"):
        for item in verify_checkpoint(tmp_path / "c"):
            passed.append(item)
    assert len(passed) == len(chunks) == 4
    data = bytearray((tmp_path / "c" / "t.rows").read_bytes())
    data[chunks[2]["offset"] + 20] ^= 1  # the third chunk: two pass, the bad one is never yielded
    (tmp_path / "c" / "t.rows").write_bytes(bytes(data))
    passed.clear()
    with pytest.raises(CheckpointError, match="chunk 2"):
        for item in verify_checkpoint(tmp_path / "c"):
            passed.append(item)
    assert [index for _, index, _ in passed] == [0, 1]


def test_a_version_2_checkpoint_refuses_id_range_in_one_process(tmp_path):
    """id_range selects rows of a version-1 checkpoint; buckets decide a version-2 one's, so
    asking for a range is an error that loads nothing."""
    from leanstate.checkpoint.core import BucketedTable
    from tests.harness import one_rank_group

    with one_rank_group() as group:
        save_checkpoint(tmp_path / "v2", {"t": BucketedTable(filled(n=20), 2, None)}, process_group=group)
    store = KVStore(6, optimizer_state_dim=2)
    with pytest.raises(ValueError, match="id_range applies to version-1 checkpoints; this one is version 2"):
        load_checkpoint(tmp_path / "v2", {"t": store}, id_range=(0, 100))
    assert len(store) == 0


def test_compaction_names_a_source_that_is_not_a_path(tmp_path):
    from leanstate.checkpoint import compact_checkpoint

    with pytest.raises(TypeError, match="compact_checkpoint: src must be a str or os.PathLike; got int"):
        compact_checkpoint(7, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["save_checkpoint", "load_checkpoint", "compact_checkpoint"])
def test_without_numpy_a_checkpoint_call_refuses_before_anything_else(tmp_path, monkeypatch, method):
    """With numpy missing (as ``leanstate._numpy`` records it) a checkpoint call raises the
    fix first: before it warns about ``backend=``, reads its arguments or touches a file.
    Kills: the check left out, or made after the deprecation warning."""
    import warnings

    import leanstate
    from leanstate import _numpy

    store = KVStore(4)
    store.set(torch.tensor([3]), torch.ones(1, 4))
    save_checkpoint(tmp_path / "c", {"t": store})
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setattr(_numpy, "_reason", ModuleNotFoundError("No module named 'numpy'"))
    calls = {
        "save_checkpoint": lambda: leanstate.save_checkpoint(tmp_path / "d", {"t": store}, backend="numba"),
        "load_checkpoint": lambda: leanstate.load_checkpoint(
            tmp_path / "c", {"t": KVStore(4)}, backend="numba"
        ),
        # a src that is no path: the missing numpy is still what it says first
        "compact_checkpoint": lambda: leanstate.compact_checkpoint(42, tmp_path / "d"),
    }
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(ModuleNotFoundError, match=rf"^{method}: .*pip install numpy"):
            calls[method]()
    assert [str(w.message) for w in warned] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("method", ["save_checkpoint", "load_checkpoint"])
def test_a_call_that_fails_still_says_backend_is_deprecated(tmp_path, method):
    """The deprecation of ``backend=`` is said as the call starts, so a call that then
    fails (no checkpoint at the path, a path that is a file) says it too. Kills: the
    warning given only after the work succeeded."""
    (tmp_path / "file").write_text("not a checkpoint")
    with pytest.warns(DeprecationWarning, match=rf"{method}\(backend=\.\.\.\) is deprecated"):
        with pytest.raises((ValueError, FileNotFoundError, CheckpointError)):
            if method == "save_checkpoint":
                save_checkpoint(tmp_path / "file", {"t": filled(4)}, backend="numba")
            else:
                load_checkpoint(
                    tmp_path / "missing", {"t": KVStore(6, optimizer_state_dim=2)}, backend="numba"
                )
