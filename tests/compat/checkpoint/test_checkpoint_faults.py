"""Checkpoint faults: every kind of corruption, bad arguments, killed saves and their leftovers.

Each corrupted checkpoint must give a ``CheckpointError`` (a ``ValueError``) naming the
file, leave the store exactly as it was (a store holding rows is verified first; an
empty one is emptied again), and make ``leanstate inspect`` say BAD.
"""

import fcntl
import io
import json
import threading
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from leanstate._tools.cli import main as leanstate_main
from leanstate.checkpoint import _background, load_checkpoint, save_checkpoint, verify_checkpoint
from leanstate.checkpoint import _files as _checkpoint_files
from leanstate.checkpoint._background import finish_removals
from leanstate.checkpoint._files import read_manifest
from leanstate.kv_store import KVStore
from leanstate.reference.checkpoint import CheckpointError
from tests.harness import FakeClock, kill_during

ROWS = 120


def filled(n=ROWS):
    store = KVStore(6, optimizer_state_dim=2, clock=FakeClock(500), backend="reference")
    store.set(torch.arange(0, 3 * n, 3), torch.randn(n, 6, generator=torch.Generator().manual_seed(0)))
    return store


def snapshot(store):
    keys = store.keys()
    return keys, store.get_rows(keys).view(torch.uint8)


def same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.fixture
def saved(tmp_path):
    src = filled()
    return save_checkpoint(
        tmp_path / "ck", {"t": src}, extra={"step": 7, "lr": torch.tensor([0.5])}, chunk_bytes=20 * 64
    )


def edit_manifest(path: Path, change) -> None:
    file = path / "manifest.json"
    manifest = json.loads(file.read_text())
    change(manifest)
    file.write_text(json.dumps(manifest))


def rewrite(path: Path, name: str, change) -> None:
    (path / name).write_bytes(change(bytearray((path / name).read_bytes())))


def flip(offset):
    def change(raw):
        raw[offset] ^= 0x01
        return raw

    return change


def numpy_extra(path: Path) -> None:
    """An extra file that unpickles only with weights_only=False, its size and CRC made to match."""
    buffer = io.BytesIO()
    torch.save({"state": np.arange(3)}, buffer)
    data = buffer.getvalue()
    (path / "extra.pt").write_bytes(data)
    edit_manifest(
        path, lambda m: m.update(extra={"file": "extra.pt", "bytes": len(data), "crc": crc32c.crc32c(data)})
    )


def swap_rows(path: Path) -> None:
    """Two rows of chunk 0 swapped and the chunk's CRC made to match: ids no longer ascend."""
    raw = bytearray((path / "t.rows").read_bytes())
    raw[0:64], raw[64:128] = raw[64:128], raw[0:64]
    (path / "t.rows").write_bytes(raw)
    crc = crc32c.crc32c(bytes(raw[: 20 * 64]))
    edit_manifest(path, lambda m: m["tables"]["t"]["chunks"][0].update(crc=crc))


FAULTS = {
    "rows truncated": (
        lambda p: rewrite(p, "t.rows", lambda r: r[:-100]),
        r"t\.rows has \d+ bytes.*truncated",
    ),
    "rows trailing": (lambda p: rewrite(p, "t.rows", lambda r: r + b"x"), r"t\.rows has \d+ bytes.*trailing"),
    "rows flipped late": (
        lambda p: rewrite(p, "t.rows", flip(-50)),
        r"chunk 5 of .*t\.rows .*fails its crc32c",
    ),
    "rows flipped early": (
        lambda p: rewrite(p, "t.rows", flip(84)),
        r"chunk 0 of .*t\.rows .*fails its crc32c",
    ),
    "rows file missing": (lambda p: (p / "t.rows").unlink(), r"data file .*t\.rows is missing"),
    "rows swapped": (swap_rows, r"chunk 0 of .*t\.rows.*row ids do not ascend"),
    "extra truncated": (lambda p: rewrite(p, "extra.pt", lambda r: r[:-10]), r"extra\.pt has \d+ bytes"),
    "extra flipped": (lambda p: rewrite(p, "extra.pt", flip(-20)), r"extra\.pt fails its crc32c"),
    "extra missing": (lambda p: (p / "extra.pt").unlink(), r"extra state file .*extra\.pt is missing"),
    "extra outside": (
        lambda p: edit_manifest(p, lambda m: m["extra"].update(file="../other/extra.pt")),
        r"manifest\.json: extra must be null or",
    ),
    "extra needs pickle": (numpy_extra, r"extra\.pt cannot be loaded with weights_only=True"),
    "chunk entry deleted": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"]["chunks"].pop(1)),
        r"manifest\.json: tables\['t'\]\.chunks\[1\]\.offset is \d+; the chunks must be contiguous",
    ),
    "chunk max_id -1": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"]["chunks"][0].update(max_id=-1)),
        r"tables\['t'\]\.chunks\[0\]\.max_id must be an id",
    ),
    "chunk max_id wrong": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"]["chunks"][0].update(max_id=58)),
        r"chunk 0 of .*t\.rows.* holds ids 0\.\.57, the manifest says 0\.\.58",
    ),
    "chunk min_id wrong": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"]["chunks"][2].update(min_id=121)),
        r"chunk 2 of .*holds ids 120\.\.177, the manifest says 121\.\.177",
    ),
    "chunk offset -8": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"]["chunks"][0].update(offset=-8)),
        r"tables\['t'\]\.chunks\[0\]\.offset is -8",
    ),
    "chunk rows changed": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"]["chunks"][5].update(rows=19)),
        r"tables\['t'\]\.chunks hold 119 rows; the table says 120",
    ),
    "crc a string": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"]["chunks"][0].update(crc="12")),
        r"tables\['t'\]\.chunks\[0\]\.crc must be an unsigned 32-bit int",
    ),
    "no chunks key": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"].pop("chunks")),
        r"tables\['t'\]: the required key 'chunks' is missing",
    ),
    "no row_bytes key": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"].pop("row_bytes")),
        r"tables\['t'\]: the required key 'row_bytes' is missing",
    ),
    "width wrong": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"].update(width=13)),
        r"tables\['t'\]\.width is 13, but dim, optimizer_state_dim and dtype give 16",
    ),
    "bytes wrong": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"].update(bytes=64)),
        r"tables\['t'\]\.bytes is 64, not rows x row_bytes",
    ),
    "dtype unknown": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"].update(dtype="float64")),
        r"tables\['t'\]\.dtype must be one of",
    ),
    "checksum unknown": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"].update(checksum="md5")),
        r"tables\['t'\]\.checksum must be one of",
    ),
    "min_id of table wrong": (
        lambda p: edit_manifest(p, lambda m: m["tables"]["t"].update(min_id=1)),
        r"tables\['t'\]\.min_id/max_id must be the first and last chunk's",
    ),
    "manifest a list": (
        lambda p: (p / "manifest.json").write_text("[]"),
        r"manifest\.json: the manifest must be a JSON object",
    ),
    "manifest not json": (lambda p: (p / "manifest.json").write_text("{"), r"manifest\.json: not valid JSON"),
    "tables a list": (lambda p: edit_manifest(p, lambda m: m.update(tables=[])), r"tables must be an object"),
    "version": (
        lambda p: edit_manifest(p, lambda m: m.update(version=99)),
        r"format version 99 is not supported",
    ),
    "format": (lambda p: edit_manifest(p, lambda m: m.update(format="x")), r"format 'x' is not"),
}


def inspect(path, capsys):
    """``leanstate inspect PATH`` in this process: (exit code, verdict word); no exception escapes."""
    capsys.readouterr()
    code = leanstate_main(["inspect", str(path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    return code, last.split(":")[0]


@pytest.mark.parametrize("holds_rows", [True, False], ids=["store-with-rows", "empty-store"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_fault_is_a_clear_error_and_changes_nothing(saved, fault, holds_rows, capsys):
    damage, message = FAULTS[fault]
    damage(saved)
    store = KVStore(6, optimizer_state_dim=2, backend="reference")
    if holds_rows:
        store.set(torch.tensor([0, 3, 10_000]), torch.full((3, 6), 9.0))  # 0 and 3 are in the checkpoint too
    before = snapshot(store)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(saved, {"t": store}, chunk_bytes=7 * 64)
    assert isinstance(info.value, ValueError)
    assert str(saved) in str(info.value)  # names the file
    assert same(before, snapshot(store))
    assert inspect(saved, capsys) == (1, "BAD")


def test_a_sound_checkpoint_verifies_and_loads_its_extra(saved, capsys):
    assert sum(rows for _, _, rows in verify_checkpoint(saved)) == ROWS
    assert inspect(saved, capsys) == (0, "OK")
    store = KVStore(6, optimizer_state_dim=2)
    extra = load_checkpoint(saved, {"t": store})
    assert extra["step"] == 7 and torch.equal(extra["lr"], torch.tensor([0.5]))
    _, manifest = read_manifest(saved)
    assert manifest["extra"]["bytes"] == (saved / "extra.pt").stat().st_size


# -- id ranges: the exact chunks, bounds up to 2**63 --------------------------------------


def test_id_range_reads_exactly_the_chunks_it_needs(saved):
    chunks = read_manifest(saved)[1]["tables"]["t"]["chunks"]  # 20 rows each: ids 0..57, 60..117, ...
    lo, hi = chunks[2]["max_id"], chunks[4]["min_id"]  # lo is chunk 2's last id; hi is chunk 4's first
    # Damage the chunks outside [2, 3]: reading one of them would fail its CRC.
    raw = bytearray((saved / "t.rows").read_bytes())
    for index in (1, 4):
        raw[chunks[index]["offset"] + 70] ^= 0x01
    (saved / "t.rows").write_bytes(raw)
    store = KVStore(6, optimizer_state_dim=2)
    load_checkpoint(saved, {"t": store}, id_range=(lo, hi))
    assert store.keys().tolist() == list(range(lo, hi, 3))


@pytest.mark.parametrize("id_range", [(0, 2**63), (-(2**63), 2**63), [0, 2**63]])
def test_id_range_bounds_reach_2_to_the_63(saved, id_range):
    store = KVStore(6, optimizer_state_dim=2)
    load_checkpoint(saved, {"t": store}, id_range=id_range)
    assert len(store) == ROWS


@pytest.mark.parametrize("id_range", [5, (1,), ("a", 2), (5, 1), (0, 2**64), (0.5, 3), (True, 3)])
def test_bad_id_ranges_name_the_argument(saved, id_range):
    store = KVStore(6, optimizer_state_dim=2)
    with pytest.raises(ValueError, match="load_checkpoint: id_range"):
        load_checkpoint(saved, {"t": store}, id_range=id_range)
    assert len(store) == 0


# -- bad save arguments: a clear error, nothing written -----------------------------------


@pytest.mark.parametrize(
    "extra, error, message",
    [
        ([1, 2], TypeError, "extra must be a mapping"),
        ({"rng": np.random.get_state()}, ValueError, "extra must load back with torch.load"),
        ({"a": np.arange(3)}, ValueError, "extra must load back with torch.load"),
    ],
)
def test_extra_is_checked_at_save_time(tmp_path, extra, error, message):
    with pytest.raises(error, match=message):
        save_checkpoint(tmp_path / "ck", {"t": filled(5)}, extra=extra)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name, message",
    [
        ("x" * 300, "at most 200 bytes"),
        ("a/b", "plain file name"),
        (".hidden", "plain file name"),
        ("", "plain"),
    ],
)
def test_bad_table_names_are_refused(tmp_path, name, message):
    with pytest.raises(ValueError, match=message):
        save_checkpoint(tmp_path / "ck", {name: filled(5)})


def test_bad_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match="path must name a checkpoint directory"):
        save_checkpoint("", {"t": filled(5)})
    regular = tmp_path / "file"
    regular.write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        save_checkpoint(regular, {"t": filled(5)})
    assert regular.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a checkpoint"):
        save_checkpoint(other, {"t": filled(5)})
    assert (other / "todo.txt").read_text() == "mine"


# -- what killed saves leave behind ---------------------------------------------------------


def test_the_next_save_removes_stale_staging_but_not_a_live_one(tmp_path):
    path = tmp_path / "ck"
    dead = tmp_path / ".ck.saving-dead0000"
    dead.mkdir()
    (dead / "t.rows").write_bytes(b"x" * 100)
    (tmp_path / ".ck.saving-dead0000.lock").write_text("")
    orphan_lock = tmp_path / ".ck.saving-gone0000.lock"
    orphan_lock.write_text("")
    live = tmp_path / ".ck.saving-live0000"
    live.mkdir()
    with open(f"{live}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        save_checkpoint(path, {"t": filled(5)})
        left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".ck.saving-live0000", ".ck.saving-live0000.lock", "ck"]


def test_a_cleanup_in_the_window_before_a_save_locks_changes_nothing(tmp_path, monkeypatch):
    """Another save's stale-staging cleanup runs between this save's creation of its lock
    file and its ``flock`` (the window forced here): the cleanup may take that unlocked
    lock file for a dead save's. The save must still publish without an error, its
    staging directory must never be seen unlocked, and nothing may be left behind."""
    path = tmp_path / "ck"
    real_flock = fcntl.flock
    raced, staging_seen = [], []

    def flock_after_a_cleanup(file, operation):
        name = getattr(file, "name", "")
        if operation == fcntl.LOCK_EX and str(name).endswith(".lock") and not raced:
            raced.append(name)
            staging_seen.append(Path(str(name).removesuffix(".lock")).exists())
            _checkpoint_files.remove_stale_staging(path)  # another save starting now
        return real_flock(file, operation)

    monkeypatch.setattr(_checkpoint_files.fcntl, "flock", flock_after_a_cleanup)
    save_checkpoint(path, {"t": filled(5)})
    save_checkpoint(path, {"t": filled(7)})
    finish_removals()
    assert raced and staging_seen == [False]  # the staging directory comes after its lock
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    fresh = KVStore(6, optimizer_state_dim=2, backend="reference")
    load_checkpoint(path, {"t": fresh})
    assert len(fresh) == 7


def test_the_hint_names_only_a_complete_previous_copy(tmp_path):
    path = tmp_path / "ck"
    half = tmp_path / ".ck.previous-aaaa0000"  # a copy whose deletion was interrupted
    half.mkdir()
    (half / "t.rows").write_bytes(b"x")
    with pytest.raises(FileNotFoundError) as info:
        read_manifest(path)
    assert "previous" not in str(info.value)
    whole = tmp_path / ".ck.previous-bbbb0000"
    save_checkpoint(whole, {"t": filled(5)})
    with pytest.raises(FileNotFoundError, match=r"left the previous checkpoint at .*previous-bbbb0000"):
        read_manifest(path)


def test_save_returns_before_the_previous_copy_is_deleted_and_that_copy_never_looks_complete(
    tmp_path, monkeypatch
):
    path = tmp_path / "ck"
    save_checkpoint(path, {"t": filled(5)})
    held, release = threading.Event(), threading.Event()
    real_rmtree = _background.shutil.rmtree

    marker_at_start = []

    class Recorded(threading.Thread):
        def start(self):
            marker_at_start.extend((c / "manifest.json").exists() for c in tmp_path.glob(".ck.previous-*"))
            super().start()

    monkeypatch.setattr(_background.threading, "Thread", Recorded)

    def slow_rmtree(folder, **kwargs):
        held.set()
        release.wait(timeout=60)
        real_rmtree(folder, **kwargs)

    monkeypatch.setattr(_background.shutil, "rmtree", slow_rmtree)
    save_checkpoint(path, {"t": filled(7)})  # returns while the old copy's deletion is held
    assert held.wait(timeout=60)
    copies = list(tmp_path.glob(".ck.previous-*"))
    assert len(copies) == 1 and not (copies[0] / "manifest.json").exists()
    assert marker_at_start == [False]  # removed before the deletion began: never half-deleted and complete
    with pytest.raises(FileNotFoundError):
        read_manifest(copies[0])
    fresh = KVStore(6, optimizer_state_dim=2, backend="reference")
    load_checkpoint(path, {"t": fresh})
    assert len(fresh) == 7
    release.set()
    finish_removals()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def _save_when_told(path: str, ready, go) -> None:
    """The process killed during its save: a filled store, then the save of version 2 on ``go``."""
    store = KVStore(32, backend="reference")
    store.set(torch.arange(3000), torch.full((3000, 32), 2.0))
    ready.set()
    go.wait()
    save_checkpoint(path, {"t": store}, extra={"version": 2}, chunk_bytes=4096)


def save_version(path: Path, version: int) -> None:
    store = KVStore(32, backend="reference")
    store.set(torch.arange(3000), torch.full((3000, 32), float(version)))
    save_checkpoint(path, {"t": store}, extra={"version": version}, chunk_bytes=4096)


def version_at(path: Path) -> int:
    store = KVStore(32)
    extra = load_checkpoint(path, {"t": store})
    assert len(store) == 3000 and torch.all(store.get(store.keys()) == extra["version"])
    return extra["version"]


@pytest.mark.parametrize(
    "trial", [*range(20), *(pytest.param(t, marks=pytest.mark.slow) for t in range(20, 120))]
)
def test_a_save_killed_at_a_random_point_leaves_the_old_or_the_new_checkpoint(tmp_path, trial):
    path = tmp_path / "ck"
    replacing = trial % 4 != 0  # most trials replace a checkpoint; some save where there was none
    if replacing:
        save_version(path, 1)
    kill_during(_save_when_told, (str(path),), trial, 0.15)
    if (path / "manifest.json").exists():
        assert version_at(path) in ((1, 2) if replacing else (2,))
    else:
        assert not path.exists() or not replacing  # a checkpoint is never left half-replaced
        if replacing:  # killed between the two renames: the hint names the complete previous copy
            with pytest.raises(FileNotFoundError, match="left the previous checkpoint at") as info:
                read_manifest(path)
            named = Path(str(info.value).split(" at ")[-1].split(" (rename")[0])
            assert version_at(named) == 1
    # the next save succeeds and removes what the killed one left: staging, locks, copies
    save_version(path, 3)
    assert version_at(path) == 3
    finish_removals()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
