"""The whole-row format's schema as the checkpoint I/O checks it
(``leanstate._checkpoint_format``): what a ``tables`` argument means, the documented
defaults, and the manifest rules, each where the round trips of ``test_checkpoint.py`` do
not reach."""

from __future__ import annotations

import inspect

import pytest
import torch

from leanstate._checkpoint_files import read_manifest
from leanstate._checkpoint_format import is_count, is_crc, is_id
from leanstate.checkpoint import load_checkpoint, save_checkpoint
from leanstate.kv_store import KVStore
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.sharding import BucketedTable


def filled(n: int = 20, dim: int = 6, state: int = 2) -> KVStore:
    store = KVStore(dim, optimizer_state_dim=state, seed=1)
    store.set(torch.arange(n), torch.randn(n, dim, generator=torch.Generator().manual_seed(n)))
    return store


@pytest.mark.parametrize("function", [save_checkpoint, load_checkpoint])
def test_a_chunk_is_64_mib_by_default_as_the_spec_states(function):
    assert inspect.signature(function).parameters["chunk_bytes"].default == 64 * 2**20


def test_tables_that_are_not_a_mapping_are_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="save_checkpoint: tables must be a mapping"):
        save_checkpoint(tmp_path / "ck", [filled()])
    assert not (tmp_path / "ck").exists()


def test_a_whole_row_view_of_some_columns_is_a_view_not_a_table(tmp_path):
    src = filled()
    past_header = src.layout.header_elems
    save_checkpoint(
        tmp_path / "ck", {"t": src, "body": KVTensor(src, whole_rows=True, width_offset=past_header)}
    )
    manifest = read_manifest(tmp_path / "ck")
    assert set(manifest["tables"]) == {"t"}
    assert manifest["views"]["body"]["whole_rows"] is True
    assert manifest["views"]["body"]["width_offset"] == past_header
    dst = KVStore(6, optimizer_state_dim=2)
    with pytest.raises(ValueError, match="writable partial view"):
        load_checkpoint(tmp_path / "ck", {"t": KVTensor(dst, whole_rows=True, width_offset=past_header)})
    assert len(dst.keys()) == 0


def test_a_sharded_modules_table_without_a_process_group_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"tables\['t'\] is a sharded module's table .* pass process_group="):
        save_checkpoint(tmp_path / "ck", {"t": BucketedTable(filled(), 4, None)})
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    "name",
    ["a/b", ".hidden", "a\0b", "x" * 201, "é" * 101],
    ids=["a-slash", "a-leading-dot", "a-nul", "201-bytes", "202-utf8-bytes"],
)
def test_a_table_name_breaking_one_rule_alone_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="save_checkpoint: table name .* must be a plain file name"):
        save_checkpoint(tmp_path / "ck", {name: filled()})
    assert not (tmp_path / "ck").exists()


def test_a_table_name_of_200_bytes_is_a_file_name(tmp_path):
    save_checkpoint(tmp_path / "ck", {"x" * 200: filled()})
    assert (tmp_path / "ck" / ("x" * 200 + ".rows")).exists()


def test_counts_ids_and_crcs_stop_at_their_bounds():
    assert is_count(0) and is_count(2**63 - 1) and not is_count(2**63) and not is_count(-1)
    assert not is_count(True) and not is_count(1.0)
    assert is_id(2**63 - 1) and not is_id(2**63)
    assert is_crc(2**32 - 1) and not is_crc(2**32) and not is_crc(-1)
