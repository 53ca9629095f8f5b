"""leanstate.dcp.load of plain ``[N, D]`` tables (``nn.EmbeddingBag``'s, TorchRec's) saved by
stock ``dcp.save``: rows ``0..N-1`` of the KV tables, bit for bit, written only once the
whole load has succeeded; the optimizer's fields and step the checkpoint lacks start
fresh; a table that cannot migrate is named before anything moves.
(TorchRec's own collection and DLRM: ``test_torchrec_interop.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as stock
from torch import nn

import leanstate.dcp as kvdcp
from leanstate import CheckpointError, KVEmbeddingBag, KVStore
from leanstate.checkpoint._bucketed_table import BucketedTable

N, D = 30, 4


def plain_bag(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.EmbeddingBag:
    torch.manual_seed(seed)
    return nn.EmbeddingBag(N, D, mode="sum", dtype=dtype)


def save_plain(path, **extra) -> dict:
    """A stock DCP checkpoint of a model with a plain table ``emb`` and a dense layer ``lin``."""
    state = {"emb.weight": plain_bag().weight.detach(), "lin.weight": torch.arange(6.0).view(2, 3), **extra}
    stock.save(state, checkpoint_id=path, no_dist=True)
    return state


def bag_state(bag: KVEmbeddingBag) -> dict:
    """``bag``'s state dict under ``emb.`` and a dense layer ``lin``, as a model's would be."""
    return {**{f"emb.{k}": v for k, v in bag.state_dict().items()}, "lin.weight": torch.zeros(2, 3)}


def rows(store, ids=None) -> torch.Tensor:
    ids = store.keys() if ids is None else ids
    return store.get_rows(ids).view(torch.uint8).clone()


@pytest.mark.parametrize(
    "optimizer,whole_rows", [("sgd", True), ("rowwise_adagrad", True), ("adam", True), ("adam", False)]
)
def test_a_plain_table_loads_as_rows_0_to_n_minus_1_bit_for_bit(tmp_path, optimizer, whole_rows):
    saved = save_plain(tmp_path / "c")
    bag = KVEmbeddingBag(
        N, D, optimizer=optimizer, optimizer_offloading=whole_rows, return_whole_row=whole_rows
    )
    state = bag_state(bag)
    stats = kvdcp.load(state, checkpoint_id=tmp_path / "c")
    assert stats["emb.weight"] == {"chunks": 1, "of": 1, "rows": N}
    assert torch.equal(bag.store.keys().sort().values, torch.arange(N))
    assert torch.equal(bag.store.get(torch.arange(N), width=D), saved["emb.weight"])
    assert torch.equal(state["lin.weight"], saved["lin.weight"])  # the dense part too
    # the fields and the step the checkpoint lacks start fresh, and the state dict loads back
    fields = bag._field_views()
    assert all(not torch.any(view[:]) for view in fields.values())
    loaded = bag.load_state_dict(
        {k.removeprefix("emb."): v for k, v in state.items() if k.startswith("emb.")}
    )
    assert not loaded.missing_keys and not loaded.unexpected_keys
    assert bag.optimizer_step == 0
    ids, offsets = torch.tensor([3, 7, 7, N - 1]), torch.tensor([0, 2])
    want = nn.functional.embedding_bag(ids, saved["emb.weight"], offsets, mode="sum")
    assert torch.equal(bag(ids, offsets), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_tables_load_bit_for_bit(tmp_path, dtype):
    weight = plain_bag(dtype=dtype).weight.detach()
    stock.save({"emb.weight": weight}, checkpoint_id=tmp_path / "c", no_dist=True)
    bag = KVEmbeddingBag(N, D, dtype=dtype)
    kvdcp.load({f"emb.{k}": v for k, v in bag.state_dict().items()}, checkpoint_id=tmp_path / "c")
    assert torch.equal(bag.store.get(torch.arange(N), width=D).view(torch.int16), weight.view(torch.int16))


def test_plain_and_kv_tables_and_bytes_entries_load_together(tmp_path):
    kv = KVStore(D, optimizer_state_dim=1)
    kv.set(torch.tensor([5, 900]), torch.randn(2, D))
    weight = plain_bag(1).weight.detach()
    kvdcp.save({"kv": kv, "emb": {"weight": weight}, "step": 7, "name": "run"}, checkpoint_id=tmp_path / "c")
    bag, fresh = KVEmbeddingBag(N, D), KVStore(D, optimizer_state_dim=1)
    state = {"kv": fresh, "emb": bag.state_dict(), "step": 0, "name": ""}
    stats = kvdcp.load(state, checkpoint_id=tmp_path / "c")
    assert (state["step"], state["name"]) == (7, "run")  # bytes entries come back into the caller's dict
    assert stats["kv"]["rows"] == 2 and stats["emb.weight"]["rows"] == N
    assert torch.equal(rows(fresh), rows(kv))
    assert torch.equal(bag.store.get(torch.arange(N), width=D), weight)


def test_into_a_live_table_it_is_an_upsert_of_the_weights(tmp_path):
    saved = save_plain(tmp_path / "c")
    bag = KVEmbeddingBag(None, D, optimizer="rowwise_adagrad", lr=0.5)
    bag(torch.tensor([2, 1000]), torch.tensor([0])).sum().backward()  # rows 2 and 1000 with state
    state_of = {i: bag.momentum1[list(bag.store.keys()).index(i)].clone() for i in (2, 1000)}
    assert all(value.item() > 0 for value in state_of.values())
    outside = rows(bag.store, torch.tensor([1000]))
    kvdcp.load(bag_state(bag), checkpoint_id=tmp_path / "c")
    assert len(bag.store) == N + 1
    assert torch.equal(bag.store.get(torch.arange(N), width=D), saved["emb.weight"])
    keys = list(bag.store.keys())
    assert torch.equal(bag.momentum1[keys.index(2)], state_of[2])  # its state kept
    assert torch.equal(rows(bag.store, torch.tensor([1000])), outside)  # untouched


def test_a_failed_load_writes_no_rows(tmp_path):
    save_plain(tmp_path / "c")
    empty = KVEmbeddingBag(N, D)
    state = bag_state(empty)
    state["lin.weight"] = torch.zeros(3, 3)  # the dense part cannot load: the rows wait for it
    with pytest.raises(CheckpointError, match="lin.weight"):
        kvdcp.load(state, checkpoint_id=tmp_path / "c")
    assert len(empty.store) == 0
    live = KVEmbeddingBag(N, D)
    live.store.set(torch.tensor([0, 4]), torch.ones(2, D))
    before = rows(live.store)
    state = bag_state(live)
    state["lin.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match="lin.weight"):
        kvdcp.load(state, checkpoint_id=tmp_path / "c")
    assert torch.equal(rows(live.store), before)


def test_a_bad_kv_chunk_beside_a_plain_table_writes_neither(tmp_path):
    kv = KVStore(D)
    kv.set(torch.arange(100), torch.randn(100, D))
    kvdcp.save({"kv": kv, "emb.weight": plain_bag().weight.detach()}, checkpoint_id=tmp_path / "c")
    metadata = kvdcp.SafeFileSystemReader(tmp_path / "c").read_metadata()
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "kv/rows")
    file = tmp_path / "c" / info.relative_path
    data = bytearray(file.read_bytes())
    start = data.find(kv.get_rows(kv.keys()).view(torch.uint8).numpy().tobytes(), info.offset)
    data[start + 100] ^= 0x10
    file.write_bytes(bytes(data))
    bag, fresh = KVEmbeddingBag(N, D), KVStore(D)
    with pytest.raises(CheckpointError, match="crc32c"):
        kvdcp.load({"kv": fresh, "emb.weight": bag.weight}, checkpoint_id=tmp_path / "c")
    assert len(fresh) == 0 and len(bag.store) == 0


def test_a_table_that_cannot_migrate_is_named_before_anything_moves(tmp_path):
    save_plain(tmp_path / "c", **{"other.weight": torch.ones(N, D + 1)})
    bag, wide = KVEmbeddingBag(N, D), KVEmbeddingBag(N, D + 2)
    state = {"emb.weight": bag.weight, "other.weight": wide.weight}
    with pytest.raises(CheckpointError, match=r"'other.weight' is a torch.float32 tensor of shape \[30, 5\]"):
        kvdcp.load(state, checkpoint_id=tmp_path / "c")
    assert len(bag.store) == 0 and len(wide.store) == 0
    sharded = {"emb.weight": BucketedTable(bag.store, 4, 8)}
    with pytest.raises(CheckpointError, match="plain KV table in a one-rank group"):
        kvdcp.load(sharded, checkpoint_id=tmp_path / "c")
    assert len(bag.store) == 0
    # a key the checkpoint lacks is still missing, migration or not
    with pytest.raises(CheckpointError, match="Missing key.*absent"):
        kvdcp.load({"emb.weight": bag.weight, "absent": torch.zeros(1)}, checkpoint_id=tmp_path / "c")
    assert len(bag.store) == 0
