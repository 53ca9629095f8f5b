"""The whole-row format's schema as the checkpoint I/O checks it
(``leanstate.checkpoint._format``): what a ``tables`` argument means, the documented
defaults, and the manifest rules, each where the round trips of ``test_checkpoint.py`` do
not reach."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from leanstate.checkpoint import load_checkpoint, save_checkpoint
from leanstate.checkpoint._bucketed_table import BucketedTable
from leanstate.checkpoint._files import read_manifest
from leanstate.checkpoint._format import is_count, is_crc, is_id
from leanstate.kv_store import KVStore
from leanstate.reference.checkpoint import CheckpointError
from leanstate.reference.kv_tensor import KVTensor


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
    _, manifest = read_manifest(tmp_path / "ck")
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
    ["", "a/b", ".hidden", "a\0b", "x" * 201, "é" * 101],
    ids=["empty", "a-slash", "a-leading-dot", "a-nul", "201-bytes", "202-utf8-bytes"],
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


def _table(m):
    return m["tables"]["t"]


def _chunk(i):
    return lambda m: _table(m)["chunks"][i]


# (what is edited in a manifest of table "t": 20 rows in 4 chunks of 5, view "v" of its
# weights, no extra) -> what read_manifest says; each breaks one rule only
EDITS = {
    "rows-a-string": (lambda m: _table(m).update(rows="20"), r"tables\['t'\]\.rows must be an int >= 0"),
    "file-renamed": (lambda m: _table(m).update(file="u.rows"), r"tables\['t'\]\.file must be 't\.rows'"),
    "dtype-unknown": (lambda m: _table(m).update(dtype="float64"), r"tables\['t'\]\.dtype must be one of"),
    "checksum-unknown": (
        lambda m: _table(m).update(checksum="md5"),
        r"tables\['t'\]\.checksum must be one of",
    ),
    "width-off": (lambda m: _table(m).update(width=_table(m)["width"] + 1), r"tables\['t'\]\.width is"),
    "bytes-off": (lambda m: _table(m).update(bytes=_table(m)["bytes"] + 1), r"tables\['t'\]\.bytes is"),
    "chunks-not-a-list": (lambda m: _table(m).update(chunks={}), r"tables\['t'\]\.chunks must be a list"),
    "chunk-not-an-object": (
        lambda m: _table(m)["chunks"].__setitem__(1, []),
        r"chunks\[1\] must be an object",
    ),
    "chunk-of-no-rows": (lambda m: _chunk(1)(m).update(rows=0), r"chunks\[1\]\.rows must be an int > 0"),
    "chunk-gap": (
        lambda m: _chunk(2)(m).update(offset=_chunk(2)(m)["offset"] + 1),
        r"chunks\[2\]\.offset is",
    ),
    "chunk-id-negative": (lambda m: _chunk(0)(m).update(min_id=-1), r"chunks\[0\]\.min_id must be an id"),
    "chunk-overlaps-the-last": (
        lambda m: _chunk(2)(m).update(min_id=_chunk(1)(m)["max_id"]),
        r"chunks\[2\]: ids must ascend across chunks",
    ),
    "chunk-ids-reversed": (
        lambda m: _chunk(3)(m).update(min_id=_chunk(3)(m)["max_id"] + 1),
        r"chunks\[3\]: ids must ascend",
    ),
    "crc-33-bits": (
        lambda m: _chunk(3)(m).update(crc=2**32),
        r"chunks\[3\]\.crc must be an unsigned 32-bit int",
    ),
    "rows-not-the-chunks": (
        lambda m: _table(m).update(rows=21, bytes=21 * _table(m)["row_bytes"]),
        r"tables\['t'\]\.chunks hold 20 rows; the table says 21",
    ),
    "max-id-not-the-last-chunks": (
        lambda m: _table(m).update(max_id=_table(m)["max_id"] + 1),
        r"tables\['t'\]\.min_id/max_id must be the first and last chunk's",
    ),
    "version-a-string": (lambda m: m.update(version="1"), r"format version '1' is not supported"),
    # read as version 2 (saved across ranks), whose schema needs world_size
    "version-2": (lambda m: m.update(version=2), r"the required key 'world_size' is missing"),
    "format-other": (lambda m: m.update(format="other"), r"format 'other' is not"),
    "views-missing": (lambda m: m.pop("views"), r"the required key 'views' is missing"),
    "tables-a-list": (lambda m: m.update(tables=[]), r"tables must be an object"),
    "views-a-list": (lambda m: m.update(views=[]), r"views must be an object"),
    "view-named-as-a-table": (
        lambda m: m["views"].update(t=m["views"]["v"]),
        r"views\['t'\]: a view cannot share",
    ),
    "view-of-no-table": (
        lambda m: m["views"]["v"].update(table="u"),
        r"views\['v'\]\.table must name a table",
    ),
    "view-flag-not-a-bool": (
        lambda m: m["views"]["v"].update(read_only=1),
        r"views\['v'\]\.whole_rows and \.read_only",
    ),
    "view-width-negative": (
        lambda m: m["views"]["v"].update(width=-1),
        r"views\['v'\]\.width_offset, \.width and",
    ),
    "view-past-the-row": (
        lambda m: m["views"]["v"].update(width_offset=1, width=_table(m)["width"]),
        r"views\['v'\]: its columns run past the width of table 't'",
    ),
    "extra-another-file": (
        lambda m: m.update(extra={"file": "x.pt", "bytes": 1, "crc": 1}),
        r"extra must be null or",
    ),
    "extra-crc-33-bits": (
        lambda m: m.update(extra={"file": "extra.pt", "bytes": 1, "crc": 2**32}),
        r"extra\.bytes and extra\.crc must be ints",
    ),
    # R3: every key present before it is read, each of its exact JSON type
    "format-missing": (lambda m: m.pop("format"), r"manifest: the required key 'format' is missing"),
    "version-99-and-no-views": (
        lambda m: (m.update(version=99), m.pop("views")),
        r"format version 99 is not supported",  # the version first, not the missing key
    ),
    "table-a-list": (lambda m: m["tables"].update(t=[]), r"tables\['t'\] must be an object"),
    "table-a-number": (lambda m: m["tables"].update(t=5), r"tables\['t'\] must be an object"),
    "table-without-bytes": (lambda m: _table(m).pop("bytes"), r"tables\['t'\]: the required key 'bytes'"),
    "table-without-file": (
        lambda m: _table(m).pop("file"),
        r"tables\['t'\]: the required key 'file' is missing",
    ),
    "table-without-max-id": (
        lambda m: _table(m).pop("max_id"),
        r"tables\['t'\]: the required key 'max_id' is missing",
    ),
    "table-bytes-a-float": (
        lambda m: _table(m).update(bytes=float(_table(m)["bytes"])),
        r"tables\['t'\]\.bytes must be an int",
    ),
    "table-rows-a-float": (
        lambda m: _table(m).update(rows=float(_table(m)["rows"])),
        r"tables\['t'\]\.rows must be an int",
    ),
    "dim-true": (lambda m: _table(m).update(dim=True), r"tables\['t'\]\.dim must be an int"),
    "dtype-a-list": (lambda m: _table(m).update(dtype=["float32"]), r"tables\['t'\]\.dtype must be one of"),
    "min-id-a-float": (
        lambda m: _table(m).update(min_id=float(_table(m)["min_id"])),
        r"tables\['t'\]\.min_id/max_id must be the first and last chunk's ids",
    ),
    "chunk-without-crc": (
        lambda m: _chunk(1)(m).pop("crc"),
        r"chunks\[1\]: the required key 'crc' is missing",
    ),
    "chunk-max-id-a-float": (
        lambda m: _chunk(1)(m).update(max_id=float(_chunk(1)(m)["max_id"])),
        r"chunks\[1\]\.max_id must be an id",
    ),
    "chunk-crc-true": (lambda m: _chunk(0)(m).update(crc=True), r"chunks\[0\]\.crc must be an unsigned"),
    "view-not-an-object": (lambda m: m["views"].update(v=[]), r"views\['v'\] must be an object"),
    "view-without-rows": (
        lambda m: m["views"]["v"].pop("rows"),
        r"views\['v'\]: the required key 'rows' is missing",
    ),
    "view-table-a-list": (
        lambda m: m["views"]["v"].update(table=["t"]),
        r"views\['v'\]\.table must name a table",
    ),
    "extra-without-crc": (
        lambda m: m.update(extra={"file": "extra.pt", "bytes": 1}),
        r"extra must be null or",
    ),
    "extra-bytes-a-float": (
        lambda m: m.update(extra={"file": "extra.pt", "bytes": 1.0, "crc": 1}),
        r"extra\.bytes and extra\.crc must be ints",
    ),
    # R12: a delta's own keys in a manifest of the full format
    "base-in-a-full-manifest": (
        lambda m: m.update(base={"path": "../x", "manifest_sha256": "0" * 64}),
        r"base is a delta's key",
    ),
    "removed-in-a-full-table": (
        lambda m: _table(m).update(removed={"file": "t.removed"}),
        r"tables\['t'\]\.removed is a delta's key",
    ),
}


@pytest.fixture
def saved(tmp_path):
    src = filled()
    view = KVTensor(src, width=3, read_only=True)
    save_checkpoint(tmp_path / "ck", {"t": src, "v": view}, chunk_bytes=5 * src.layout.row_bytes)
    return tmp_path / "ck"


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_manifest_breaking_one_rule_is_refused_naming_it(saved, edit):
    change, message = EDITS[edit]
    manifest = json.loads((saved / "manifest.json").read_text())
    assert len(_table(manifest)["chunks"]) == 4
    change(manifest)
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=message):
        read_manifest(saved)


def test_one_row_chunks_and_a_bare_extra_name_are_read(saved):
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["extra"] = "extra.pt"  # written before extra had a CRC
    (saved / "manifest.json").write_text(json.dumps(manifest))
    assert read_manifest(saved)[1]["extra"] == "extra.pt"
    store = filled()
    save_checkpoint(saved.parent / "ones", {"t": store}, chunk_bytes=store.layout.row_bytes)
    assert [c["rows"] for c in read_manifest(saved.parent / "ones")[1]["tables"]["t"]["chunks"]] == [1] * 20


@pytest.mark.parametrize(
    "id_range, ids",
    [
        ((4, 10), range(4, 10)),  # from a chunk's last id (4) to the next-but-one's first (10)
        ((-(2**63), 3), range(0, 3)),
        ((15, 2**63), range(15, 20)),
        ((7, 7), []),
    ],
    ids=["chunk-edges", "from-the-lowest-bound", "to-the-highest-bound", "empty"],
)
def test_an_id_range_loads_exactly_its_half_open_share(saved, id_range, ids):
    dst = KVStore(6, optimizer_state_dim=2)
    load_checkpoint(saved, {"t": dst}, id_range=id_range)
    assert sorted(dst.keys().tolist()) == list(ids)


@pytest.mark.parametrize("bound", [-(2**63) - 1, 2**63 + 1, True, 1.0])
def test_an_id_range_bound_outside_int64_and_one_or_not_an_int_is_refused(saved, bound):
    with pytest.raises(ValueError, match="load_checkpoint: id_range (lo|hi) must be an int in"):
        load_checkpoint(
            saved,
            {"t": KVStore(6, optimizer_state_dim=2)},
            id_range=(bound, 2**63) if bound < 0 else (0, bound),
        )


def test_an_id_range_must_be_a_pair_in_order(saved):
    for bad in [(1,), (3, 2), "ab"]:
        with pytest.raises(ValueError, match="load_checkpoint: id_range must"):
            load_checkpoint(saved, {"t": KVStore(6, optimizer_state_dim=2)}, id_range=bad)


@pytest.mark.parametrize(
    "state, named",
    [(0, "sgd-sized"), (1, "rowwise_adagrad-sized"), (12, "adam-sized"), (3, "3 state values per row")],
)
def test_a_store_of_another_optimizer_is_named_by_its_state_size(saved, state, named):
    with pytest.raises(CheckpointError, match=f"saved 2 state values per row, this store {named}"):
        load_checkpoint(saved, {"t": KVStore(6, optimizer_state_dim=state)})


def test_a_width_that_its_own_dim_state_and_dtype_do_not_give_is_refused(tmp_path):
    # version 2's schema derives each table's width from its dim, state and dtype, as version 1's does
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        save_checkpoint(
            tmp_path / "ck", {"t": BucketedTable(filled(), 4, None)}, process_group=dist.group.WORLD
        )
        manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
        manifest["tables"]["t"]["width"] += 1
        (tmp_path / "ck" / "manifest.json").write_text(json.dumps(manifest))
        dst = KVStore(6, optimizer_state_dim=2)
        with pytest.raises(
            CheckpointError, match=r"tables\['t'\]\.width is \d+, but dim, optimizer_state_dim and dtype give"
        ):
            load_checkpoint(
                tmp_path / "ck", {"t": BucketedTable(dst, 4, None)}, process_group=dist.group.WORLD
            )
        assert len(dst.keys()) == 0
    finally:
        dist.destroy_process_group()


def test_an_id_range_ends_at_its_upper_bound_above_small_ids(tmp_path):
    src = KVStore(6, optimizer_state_dim=2, seed=1)
    src.set(torch.tensor([0, 150, 300, 2**62]), torch.ones(4, 6))
    save_checkpoint(tmp_path / "ck", {"t": src})
    dst = KVStore(6, optimizer_state_dim=2)
    load_checkpoint(tmp_path / "ck", {"t": dst}, id_range=(0, 301))
    assert sorted(dst.keys().tolist()) == [0, 150, 300]
