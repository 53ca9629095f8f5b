"""The textbook whole-row checkpoint (``leanstate.reference.checkpoint``) on its own: the
golden vectors, round trips, id ranges, views, and the errors a reader of the spec expects."""

import json
import sys

import pytest
import torch

from leanstate.kv_store import KVStore
from leanstate.reference import checkpoint as reference
from leanstate.reference.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from leanstate.reference.kv_tensor import KVTensor
from tests.harness import VECTORS, FakeClock


def filled(n=200, dim=5, state=1, dtype=torch.float32):
    store = KVStore(dim, optimizer_state_dim=state, dtype=dtype, clock=FakeClock(900), backend="reference")
    ids = torch.randperm(5 * n, generator=torch.Generator().manual_seed(n))[:n]
    store.set(ids, torch.randn(n, dim, generator=torch.Generator().manual_seed(1)).to(dtype))
    return store


def rows_of(store):
    keys = store.keys()
    return keys, store.get_rows(keys).view(torch.uint8)


@pytest.mark.parametrize("golden", ["checkpoint_v1", "checkpoint_v1_bf16_crc32c"])
def test_golden_checkpoints_load_bit_exactly(golden):
    folder = VECTORS / golden
    table = json.loads((folder / "manifest.json").read_text())["tables"]["t"]
    dtype = reference.DTYPES[table["dtype"]]
    store = KVStore(
        table["dim"], optimizer_state_dim=table["optimizer_state_dim"], dtype=dtype, backend="reference"
    )
    load_checkpoint(folder, {"t": store})
    assert (
        store.get_rows(store.keys()).view(torch.uint8).numpy().tobytes() == (folder / "t.rows").read_bytes()
    )


def test_the_crc32c_golden_saves_back_byte_for_byte(tmp_path):
    folder = VECTORS / "checkpoint_v1_bf16_crc32c"
    manifest = json.loads((folder / "manifest.json").read_text())
    table = manifest["tables"]["t"]
    store = KVStore(3, optimizer_state_dim=1, dtype=torch.bfloat16, backend="reference")
    load_checkpoint(folder, {"t": store})
    save_checkpoint(tmp_path / "again", {"t": store}, chunk_bytes=2 * table["row_bytes"])
    assert (tmp_path / "again" / "t.rows").read_bytes() == (folder / "t.rows").read_bytes()
    assert json.loads((tmp_path / "again" / "manifest.json").read_text())["tables"]["t"] == table


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_keeps_whole_rows_and_extra(tmp_path, dtype):
    src = filled(dtype=dtype)
    save_checkpoint(tmp_path / "c", {"t": src}, extra={"step": torch.tensor(3)}, chunk_bytes=300)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert len(manifest["tables"]["t"]["chunks"]) > 5 and manifest["extra"]["file"] == "extra.pt"
    dst = KVStore(5, optimizer_state_dim=1, dtype=dtype, backend="reference")
    extra = load_checkpoint(tmp_path / "c", {"t": dst})
    keys, rows = rows_of(src)
    assert torch.equal(dst.keys(), keys) and torch.equal(rows_of(dst)[1], rows)
    assert extra["step"].item() == 3


def test_saving_again_replaces_the_checkpoint_and_leaves_no_temporary(tmp_path):
    save_checkpoint(tmp_path / "c", {"t": filled(50)})
    save_checkpoint(tmp_path / "c", {"t": filled(20)})
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["tables"]["t"]["rows"] == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_id_range_loads_only_its_ids(tmp_path):
    src = filled(300)
    save_checkpoint(tmp_path / "c", {"t": src}, chunk_bytes=500)
    dst = KVStore(5, optimizer_state_dim=1, backend="reference")
    load_checkpoint(tmp_path / "c", {"t": dst}, id_range=(100, 700))
    keys = src.keys()
    assert torch.equal(dst.keys(), keys[(keys >= 100) & (keys < 700)])


def test_views_are_recorded_and_read_only_views_count_their_ignored_writes(tmp_path):
    src = filled(40)
    optimizer = KVTensor(src, width_offset=src.layout.padded_dim, width=1, read_only=True)
    save_checkpoint(tmp_path / "c", {"t": src, "t.opt": optimizer})
    view = json.loads((tmp_path / "c" / "manifest.json").read_text())["views"]["t.opt"]
    assert view == {
        "table": "t",
        "whole_rows": False,
        "width_offset": 8,
        "width": 1,
        "read_only": True,
        "rows": 40,
    }
    dst = KVStore(5, optimizer_state_dim=1, backend="reference")
    dst_view = KVTensor(dst, width_offset=8, width=1, read_only=True)
    load_checkpoint(tmp_path / "c", {"t": dst, "t.opt": dst_view})
    assert dst_view.ignored_writes == 40 and len(dst) == 40


@pytest.mark.parametrize(
    "damage, error",
    [
        (lambda c: (c / "t.rows").write_bytes((c / "t.rows").read_bytes()[:-1]), CheckpointError),
        (lambda c: (c / "manifest.json").write_text("{"), CheckpointError),
        (lambda c: (c / "manifest.json").unlink(), FileNotFoundError),
        (lambda c: (c / "t.rows").unlink(), CheckpointError),
    ],
    ids=["truncated", "not-json", "no-manifest", "no-rows-file"],
)
def test_a_damaged_checkpoint_raises_and_loads_nothing(tmp_path, damage, error):
    save_checkpoint(tmp_path / "c", {"t": filled(30)}, chunk_bytes=200)
    damage(tmp_path / "c")
    dst = KVStore(5, optimizer_state_dim=1, backend="reference")
    with pytest.raises(error):
        load_checkpoint(tmp_path / "c", {"t": dst})
    assert len(dst) == 0


def test_a_flipped_byte_in_the_last_chunk_changes_no_row(tmp_path):
    save_checkpoint(tmp_path / "c", {"t": filled(30)}, chunk_bytes=200)
    data = bytearray((tmp_path / "c" / "t.rows").read_bytes())
    data[-3] ^= 1
    (tmp_path / "c" / "t.rows").write_bytes(bytes(data))
    dst = filled(10)
    before = rows_of(dst)
    with pytest.raises(CheckpointError, match="crc32c"):
        load_checkpoint(tmp_path / "c", {"t": dst})
    assert all(torch.equal(a, b) for a, b in zip(rows_of(dst), before))


def test_a_store_of_another_layout_is_refused(tmp_path):
    save_checkpoint(tmp_path / "c", {"t": filled(10)})
    with pytest.raises(CheckpointError, match="saved as"):
        load_checkpoint(tmp_path / "c", {"t": KVStore(6, optimizer_state_dim=1, backend="reference")})


def test_the_reference_is_plain_code():
    """The textbook: no threads, locks, signals or pools (DESIGN §2)."""
    source = open(reference.__file__).read()
    for module in ("threading", "signal", "fcntl", "concurrent"):
        assert f"import {module}" not in source and f"from {module}" not in source, module
    assert "leanstate.reference.checkpoint" in sys.modules
