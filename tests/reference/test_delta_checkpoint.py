"""The textbook delta checkpoint (``leanstate.reference.delta_checkpoint``) on its own: the
golden vectors, round trips over chains, id ranges, compaction, change marks, and each
reader rule D1-D6 broken once."""

import filecmp
import hashlib
import json
import re
import shutil
import struct

import crc32c
import pytest
import torch

from leanstate.kv_store import KVStore
from leanstate.reference import checkpoint as full
from leanstate.reference import delta_checkpoint as delta
from leanstate.reference.checkpoint import CheckpointError
from leanstate.reference.delta_checkpoint import compact_checkpoint, load_checkpoint, save_checkpoint
from leanstate.reference.kv_tensor import KVTensor
from tests.harness import VECTORS, FakeClock

GOLDEN = VECTORS / "delta_v1"
CHUNK = 300  # six rows of dim 5, state 1 (fp32: 4 + 8 + 4 columns = 64 bytes)


def store(dim=5, state=1, clock=None):
    return KVStore(dim, optimizer_state_dim=state, clock=clock or FakeClock(900), backend="reference")


def filled(n=60, seed=0):
    s = store()
    ids = torch.randperm(4 * n, generator=torch.Generator().manual_seed(seed))[:n]
    s.set(ids, torch.randn(n, 5, generator=torch.Generator().manual_seed(seed + 1)))
    return s


def state(s):
    keys = s.keys()
    return keys, s.get_rows(keys).view(torch.uint8)


def same(a, b):
    (ka, ra), (kb, rb) = state(a), state(b)
    return torch.equal(ka, kb) and torch.equal(ra, rb)


def change(s, seed):
    """Writes (some new ids), deletes and an eviction, as training between two saves does."""
    g = torch.Generator().manual_seed(seed)
    keys = s.keys()
    s.set(torch.randint(0, 400, (15,), generator=g), torch.randn(15, 5, generator=g))
    s.delete(keys[torch.randperm(len(keys), generator=g)[:4]])
    s.evict(max_rows=len(s) - 3)


def loaded(path, **options):
    s = store()
    extra = load_checkpoint(path, {"t": s}, **options)
    return s, extra


def manifest_of(path):
    return json.loads((path / "manifest.json").read_text())


def rewrite(path, edit):
    manifest = manifest_of(path)
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def digest_of(path):
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


def chain(tmp_path, links=3):
    """A full checkpoint c0 and deltas c1..c(links-1) of one store changed between saves."""
    s = filled()
    save_checkpoint(tmp_path / "c0", {"t": s}, chunk_bytes=CHUNK)
    for i in range(1, links):
        change(s, i)
        save_checkpoint(tmp_path / f"c{i}", {"t": s}, base=tmp_path / f"c{i - 1}", chunk_bytes=CHUNK)
    return s


# -- the golden vectors -----------------------------------------------------------------


def golden_stores():
    t = KVStore(3, optimizer_state_dim=1, backend="reference")
    u = KVStore(2, backend="reference")
    return {"t": t, "u": u, "t.opt": KVTensor(t, width_offset=4, width=1, read_only=True)}


def rows_file(path, name, width):
    return torch.frombuffer(bytearray((path / f"{name}.rows").read_bytes()), dtype=torch.float32).view(
        -1, width
    )


def test_the_golden_base_and_delta_are_what_the_textbook_saves(tmp_path):
    tables = golden_stores()
    load_checkpoint(GOLDEN / "base", tables)
    save_checkpoint(tmp_path / "base", tables, chunk_bytes=96)
    assert not filecmp.dircmp(GOLDEN / "base", tmp_path / "base").diff_files
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == sorted(
        p.name for p in (GOLDEN / "base").iterdir()
    )
    # the changes the delta records: rows rewritten (headers kept by set_rows), two removed
    tables["t"].set_rows(rows_file(GOLDEN / "delta", "t", 12))
    tables["u"].set_rows(rows_file(GOLDEN / "delta", "u", 8))
    tables["t"].delete(torch.tensor([2, 40]))
    save_checkpoint(tmp_path / "delta", tables, base=tmp_path / "base", chunk_bytes=96)
    for file in sorted((GOLDEN / "delta").iterdir()):
        assert (tmp_path / "delta" / file.name).read_bytes() == file.read_bytes(), file.name
    assert len(list((tmp_path / "delta").iterdir())) == len(list((GOLDEN / "delta").iterdir()))


def test_the_golden_delta_loads_and_compacts_to_the_golden_full_checkpoint(tmp_path):
    tables = golden_stores()
    assert load_checkpoint(GOLDEN / "delta", tables) == {}
    for name in ("t", "u"):
        expected = (GOLDEN / "compacted" / f"{name}.rows").read_bytes()
        store_ = tables[name]
        assert store_.get_rows(store_.keys()).view(torch.uint8).numpy().tobytes() == expected
    assert tables["t.opt"].ignored_writes == 4
    assert tables["t"].mark == (tables["t"].mark.epoch, digest_of(GOLDEN / "delta"))
    compact_checkpoint(GOLDEN / "delta", tmp_path / "compacted", chunk_bytes=96)
    for file in sorted((GOLDEN / "compacted").iterdir()):
        assert (tmp_path / "compacted" / file.name).read_bytes() == file.read_bytes(), file.name


def test_the_manifest_digest_is_sha256_in_lowercase_hex(vectors):
    for case in vectors("checksums.json")["cases"]:
        assert hashlib.sha256(case["ascii"].encode()).hexdigest() == case["sha256"]
    assert manifest_of(GOLDEN / "delta")["base"] == {
        "path": "../base",
        "manifest_sha256": digest_of(GOLDEN / "base"),
    }


# -- round trips ------------------------------------------------------------------------


def test_every_link_of_a_chain_loads_as_the_store_was_when_it_was_saved(tmp_path):
    s = filled()
    save_checkpoint(tmp_path / "c0", {"t": s}, chunk_bytes=CHUNK)
    snapshots = [state(s)]
    for i in range(1, 5):
        change(s, i)
        save_checkpoint(tmp_path / f"c{i}", {"t": s}, base=tmp_path / f"c{i - 1}", chunk_bytes=CHUNK)
        snapshots.append(state(s))
    for i, (keys, rows) in enumerate(snapshots):
        got, _ = loaded(tmp_path / f"c{i}")
        assert torch.equal(got.keys(), keys) and torch.equal(state(got)[1], rows), f"c{i}"
    assert manifest_of(tmp_path / "c4")["base"]["path"] == "../c3"
    removed = manifest_of(tmp_path / "c2")["tables"]["t"]["removed"]
    assert removed["ids"] > 0 and removed["bytes"] == 8 * removed["ids"]


def test_a_delta_holds_only_what_changed(tmp_path):
    s = filled()
    save_checkpoint(tmp_path / "c0", {"t": s})
    keys = s.keys()
    s.set(keys[:3], torch.zeros(3, 5))
    s.set(torch.tensor([1000]), torch.ones(1, 5))
    s.delete(keys[3:5])
    save_checkpoint(tmp_path / "c1", {"t": s}, base=tmp_path / "c0")
    table = manifest_of(tmp_path / "c1")["tables"]["t"]
    assert table["rows"] == 4 and table["removed"]["ids"] == 2
    ids = struct.unpack("<2q", (tmp_path / "c1" / "t.removed").read_bytes())
    assert list(ids) == keys[3:5].tolist()
    save_checkpoint(tmp_path / "c2", {"t": s}, base=tmp_path / "c1")  # nothing changed since
    table = manifest_of(tmp_path / "c2")["tables"]["t"]
    assert (table["rows"], table["chunks"], table["removed"]["ids"], table["removed"]["min_id"]) == (
        0,
        [],
        0,
        None,
    )
    assert (tmp_path / "c2" / "t.removed").read_bytes() == b"" and same(loaded(tmp_path / "c2")[0], s)


def test_a_chain_loads_an_id_range_and_into_a_store_holding_rows(tmp_path):
    s = chain(tmp_path)
    part, _ = loaded(tmp_path / "c2", id_range=(50, 200))
    keys = s.keys()
    inside = keys[(keys >= 50) & (keys < 200)]
    assert torch.equal(part.keys(), inside) and torch.equal(part.get_rows(inside), s.get_rows(inside))
    assert part.mark is None  # it holds a share of the checkpoint, not the checkpoint
    busy = store()
    busy.set(torch.tensor([399, 1000]), torch.ones(2, 5))
    load_checkpoint(tmp_path / "c2", {"t": busy})
    assert busy.mark is None and torch.equal(busy.get_rows(keys), s.get_rows(keys))
    assert torch.equal(busy.keys(), torch.cat([keys, torch.tensor([1000])]).unique())


def test_extra_and_views_come_from_the_head(tmp_path):
    s = filled()
    opt = KVTensor(s, width_offset=8, width=1, read_only=True)
    save_checkpoint(tmp_path / "c0", {"t": s, "t.opt": opt}, extra={"step": 1})
    change(s, 1)
    save_checkpoint(tmp_path / "c1", {"t": s, "t.opt": opt}, base=tmp_path / "c0", extra={"step": 2})
    dst = store()
    view = KVTensor(dst, width_offset=8, width=1, read_only=True)
    assert load_checkpoint(tmp_path / "c1", {"t": dst, "t.opt": view}) == {"step": 2}
    assert view.ignored_writes == len(s) and same(dst, s)


def test_compaction_is_byte_identical_to_a_full_save_of_the_store(tmp_path):
    s = chain(tmp_path, links=4)
    opt = KVTensor(s, width_offset=8, width=1, read_only=True)
    save_checkpoint(tmp_path / "c4", {"t": s, "t.opt": opt}, base=tmp_path / "c3", extra={"lr": 0.5})
    compact_checkpoint(tmp_path / "c4", tmp_path / "compacted", chunk_bytes=CHUNK)
    full.save_checkpoint(tmp_path / "full", {"t": s, "t.opt": opt}, extra={"lr": 0.5}, chunk_bytes=CHUNK)
    for name in ("manifest.json", "t.rows", "extra.pt"):
        assert filecmp.cmp(tmp_path / "compacted" / name, tmp_path / "full" / name, shallow=False), name
    assert (tmp_path / "compacted" / "extra.pt").read_bytes() == (tmp_path / "c4" / "extra.pt").read_bytes()
    assert sorted(p.name for p in (tmp_path / "compacted").iterdir()) == [
        "extra.pt",
        "manifest.json",
        "t.rows",
    ]


def test_the_full_reader_refuses_a_delta_at_its_format(tmp_path):
    chain(tmp_path, links=2)
    with pytest.raises(CheckpointError, match="format"):
        full.load_checkpoint(tmp_path / "c1", {"t": store()})


# -- change marks -----------------------------------------------------------------------


def test_saves_and_loads_into_empty_stores_set_the_marks(tmp_path):
    s = filled()
    assert s.mark is None
    save_checkpoint(tmp_path / "c0", {"t": s})
    assert s.mark.checkpoint == digest_of(tmp_path / "c0")
    fresh, _ = loaded(tmp_path / "c0")
    assert fresh.mark.checkpoint == digest_of(tmp_path / "c0")
    change(fresh, 3)  # a loaded store saves deltas against what it loaded
    save_checkpoint(tmp_path / "c1", {"t": fresh}, base=tmp_path / "c0")
    assert fresh.mark.checkpoint == digest_of(tmp_path / "c1") and same(loaded(tmp_path / "c1")[0], fresh)


def test_the_full_textbook_sets_the_marks_too(tmp_path):
    s = filled()
    full.save_checkpoint(tmp_path / "c0", {"t": s})
    assert s.mark.checkpoint == digest_of(tmp_path / "c0")
    fresh = store()
    full.load_checkpoint(tmp_path / "c0", {"t": fresh})
    assert fresh.mark.checkpoint == digest_of(tmp_path / "c0")
    assert [len(ids) for ids in fresh.changes()] == [0, 0]  # the epoch is taken after the last row
    full.load_checkpoint(tmp_path / "c0", {"t": fresh})  # it holds rows now: the mark stays
    assert fresh.mark.checkpoint == digest_of(tmp_path / "c0")
    assert torch.equal(fresh.changes()[0], fresh.keys())  # every row the load wrote is a change
    ranged = store()
    full.load_checkpoint(tmp_path / "c0", {"t": ranged}, id_range=(0, 2**63))
    assert ranged.mark is None
    (tmp_path / "c0" / "t.rows").write_bytes(b"")
    with pytest.raises(CheckpointError):
        full.load_checkpoint(tmp_path / "c0", {"t": s})
    assert s.mark.checkpoint == digest_of(tmp_path / "c0")


def test_a_store_loaded_twice_in_one_call_has_no_mark(tmp_path):
    s = filled()
    save_checkpoint(tmp_path / "c0", {"t": s, "u": s})
    twice = store()
    load_checkpoint(tmp_path / "c0", {"t": twice, "u": twice})
    assert twice.mark is None


def test_a_load_over_rows_keeps_the_mark_and_the_next_delta_holds_the_store(tmp_path):
    s = filled()
    save_checkpoint(tmp_path / "c0", {"t": s})
    s.set(torch.tensor([1, 777]), torch.ones(2, 5))
    other = filled(seed=9)
    save_checkpoint(tmp_path / "other", {"t": other})
    load_checkpoint(tmp_path / "other", {"t": s})  # a live load: upserts, tracked as writes
    assert s.mark.checkpoint == digest_of(tmp_path / "c0")
    save_checkpoint(tmp_path / "c1", {"t": s}, base=tmp_path / "c0")
    assert same(loaded(tmp_path / "c1")[0], s)


@pytest.mark.parametrize("case", ["never saved", "marked elsewhere"])
def test_a_delta_is_refused_unless_the_store_is_marked_at_the_base(tmp_path, case):
    s = filled()
    save_checkpoint(tmp_path / "c0", {"t": s})
    if case == "never saved":
        s = filled(seed=3)
    elif case == "marked elsewhere":
        change(s, 1)  # else the other checkpoint's manifest, and so its digest, is c0's
        save_checkpoint(tmp_path / "other", {"t": s})
    with pytest.raises(ValueError, match=r"tables\['t'\].*full checkpoint first"):
        save_checkpoint(tmp_path / "c1", {"t": s}, base=tmp_path / "c0")
    assert not (tmp_path / "c1").exists()


def test_a_delta_is_refused_for_other_tables_than_the_bases_or_at_the_base(tmp_path):
    s, u = filled(), filled(seed=5)
    save_checkpoint(tmp_path / "c0", {"t": s, "u": u})
    with pytest.raises(ValueError, match="not saved"):
        save_checkpoint(tmp_path / "c1", {"t": s}, base=tmp_path / "c0")
    with pytest.raises(ValueError, match="'v' is not in the base"):
        save_checkpoint(tmp_path / "c1", {"t": s, "u": u, "v": filled(seed=6)}, base=tmp_path / "c0")
    for path in (tmp_path / "c0", tmp_path / "c0" / "inside", tmp_path):
        with pytest.raises(ValueError, match="(is|lies inside|holds) the base"):
            save_checkpoint(path, {"t": s, "u": u}, base=tmp_path / "c0")
    assert same(loaded(tmp_path / "c0")[0], s)


def test_a_failed_save_leaves_the_marks_and_the_next_delta_holds_every_change(tmp_path, monkeypatch):
    s = filled()
    save_checkpoint(tmp_path / "c0", {"t": s})
    mark = s.mark
    change(s, 1)
    monkeypatch.setattr(s, "get_rows", lambda ids, **_: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        save_checkpoint(tmp_path / "c1", {"t": s}, base=tmp_path / "c0")
    monkeypatch.undo()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        save_checkpoint(tmp_path / "file" / "c1", {"t": s}, base=tmp_path / "c0")
    assert s.mark == mark
    change(s, 2)
    save_checkpoint(tmp_path / "c1", {"t": s}, base=tmp_path / "c0")
    assert same(loaded(tmp_path / "c1")[0], s)


def test_a_row_deleted_while_saving_is_saved_as_removed(tmp_path, monkeypatch):
    s = filled()
    save_checkpoint(tmp_path / "c0", {"t": s})
    s.set(s.keys()[:5], torch.zeros(5, 5))
    victim = s.keys()[2]
    get_rows = s.get_rows

    def deleting(ids, **options):
        s.delete(victim.view(1))  # as another thread might, after the ids were listed
        return get_rows(ids, **options)

    monkeypatch.setattr(s, "get_rows", deleting)
    save_checkpoint(tmp_path / "c1", {"t": s}, base=tmp_path / "c0")
    monkeypatch.undo()
    table = manifest_of(tmp_path / "c1")["tables"]["t"]
    assert table["rows"] == 4 and table["removed"]["min_id"] == int(victim)
    assert same(loaded(tmp_path / "c1")[0], s)


# -- reader rules: each broken once -----------------------------------------------------


def drop_base(tmp):
    shutil.rmtree(tmp / "c1")


def alter_base(tmp):
    rewrite(tmp / "c1", lambda m: m.update(note="edited"))


def cycle(tmp):
    """c1's base is made c2 (the head), and c2 told c1's new digest: c2 -> c1 -> c2."""
    rewrite(tmp / "c1", lambda m: m["base"].update(path="../c2"))
    rewrite(tmp / "c2", lambda m: m["base"].update(manifest_sha256=digest_of(tmp / "c1")))


def head_removed(tmp, ids, **entry):
    """Replace the head's t.removed by ``ids`` with a manifest entry that matches, except ``entry``."""
    data = struct.pack(f"<{len(ids)}q", *ids)
    (tmp / "c2" / "t.removed").write_bytes(data)
    fields = dict(ids=len(ids), bytes=len(data), min_id=ids[0], max_id=ids[-1], crc=crc32c.crc32c(data))
    rewrite(tmp / "c2", lambda m: m["tables"]["t"]["removed"].update(fields, **entry))


def a_row_id(tmp, link="c2"):
    return manifest_of(tmp / link)["tables"]["t"]["min_id"]


def flip_last_byte(file):
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))


def drop_table_in_base(tmp):
    """The base c1 loses table t; the head is told c1's new digest (so D4 is what breaks)."""
    rewrite(tmp / "c1", lambda m: (m["tables"].pop("t"), m["views"].clear()))
    rewrite(tmp / "c2", lambda m: m["base"].update(manifest_sha256=digest_of(tmp / "c1")))


DAMAGE = {
    "D2 missing base": (drop_base, "c2/manifest.json", "no checkpoint"),
    "D2 base replaced": (alter_base, "c2/manifest.json", "replaced after this delta"),
    "D2 absolute base path": (
        lambda tmp: rewrite(tmp / "c2", lambda m: m["base"].update(path=str(tmp / "c1"))),
        "c2/manifest.json",
        "base.path",
    ),
    "D3 cycle": (cycle, "c1/manifest.json", "cycle"),
    "D4 table missing in a base": (drop_table_in_base, "c1", "'t' is not in checkpoint"),
    "D5 removed file name": (
        lambda tmp: rewrite(tmp / "c2", lambda m: m["tables"]["t"]["removed"].update(file="../c1/t.removed")),
        "c2/manifest.json",
        "removed",
    ),
    "D5 removed size": (
        lambda tmp: (tmp / "c2" / "t.removed").write_bytes((tmp / "c2" / "t.removed").read_bytes()[:-8]),
        "c2/t.removed",
        "bytes",
    ),
    "D6 removed crc": (lambda tmp: flip_last_byte(tmp / "c2" / "t.removed"), "c2/t.removed", "crc32c"),
    "D6 removed order": (
        lambda tmp: head_removed(tmp, [9, 7, 300], min_id=9, max_id=300),
        "c2/t.removed",
        "ascend",
    ),
    "D6 removed ends": (lambda tmp: head_removed(tmp, [7, 9], max_id=10), "c2/t.removed", "min_id"),
    "D6 removed and a row": (
        lambda tmp: head_removed(tmp, [a_row_id(tmp)]),
        "c2/t.removed",
        "also a row",
    ),
    "R10 chunk of the base": (lambda tmp: flip_last_byte(tmp / "c1" / "t.rows"), "c1/t.rows", "check"),
    "R11 extra in the base": (
        lambda tmp: (tmp / "c1" / "extra.pt").write_bytes(b""),
        "c1/manifest.json",
        "extra",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("empty", [True, False], ids=["into-empty", "into-rows"])
def test_a_broken_chain_raises_naming_the_link_and_changes_no_store(tmp_path, damage, empty):
    chain(tmp_path)
    edit, names, words = DAMAGE[damage]
    edit(tmp_path)
    dst = store()
    if not empty:
        dst.set(torch.tensor([3, 1000]), torch.ones(2, 5))
        save_checkpoint(tmp_path / "mine", {"t": dst})
    before, mark = state(dst), dst.mark
    with pytest.raises(CheckpointError, match=words) as error:
        load_checkpoint(tmp_path / "c2", {"t": dst})
    assert str(tmp_path / names) in str(error.value)
    assert (
        torch.equal(state(dst)[0], before[0]) and torch.equal(state(dst)[1], before[1]) and dst.mark == mark
    )
    with pytest.raises(CheckpointError):
        compact_checkpoint(tmp_path / "c2", tmp_path / "compacted")
    assert not (tmp_path / "compacted").exists()


def test_a_chain_longer_than_the_limit_is_refused(tmp_path, monkeypatch):
    chain(tmp_path, links=3)
    monkeypatch.setattr(delta, "MAX_CHAIN_LINKS", 3)
    assert same(loaded(tmp_path / "c2")[0], loaded(tmp_path / "c2")[0])  # three links: at the limit
    monkeypatch.setattr(delta, "MAX_CHAIN_LINKS", 2)
    with pytest.raises(CheckpointError, match="within 2 links") as error:
        loaded(tmp_path / "c2")
    assert str(tmp_path / "c1" / "manifest.json") in str(error.value)


def test_a_removed_id_outside_the_chunks_an_id_range_reads_is_not_compared_with_rows(tmp_path):
    s = chain(tmp_path)
    data = (tmp_path / "c2" / "t.removed").read_bytes()
    removed = struct.unpack(f"<{len(data) // 8}q", data)
    hi = a_row_id(tmp_path)  # the head's smallest row id, also removed now; no chunk below it holds it
    head_removed(tmp_path, sorted([*removed, hi]))
    keys = s.keys()
    part, _ = loaded(tmp_path / "c2", id_range=(0, hi))
    assert torch.equal(part.keys(), keys[keys < hi])
    with pytest.raises(CheckpointError, match="also a row"):
        loaded(tmp_path / "c2")


# -- the manifest rules -----------------------------------------------------------------


def sound_delta():
    return json.loads((GOLDEN / "delta" / "manifest.json").read_text())


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda m: m.pop("base"), "'base' is missing"),
        (lambda m: m.update(format="leanstate-whole-row-diff"), "format"),
        (lambda m: m.update(version=True), "version"),
        (lambda m: m.update(base="../base"), "base must be an object"),
        (lambda m: m["base"].update(path=""), "base.path"),
        (lambda m: m["base"].update(path="a\0b"), "base.path"),
        (lambda m: m["base"].update(path="/abs"), "base.path"),
        (lambda m: m["base"].update(path="x" * 4097), "4097 bytes"),
        (lambda m: m["base"].update(path="\ud800"), "UTF-8"),
        (lambda m: m["base"].update(manifest_sha256="A" * 64), "manifest_sha256"),
        (lambda m: m["base"].update(manifest_sha256="a" * 63), "manifest_sha256"),
        (lambda m: m["tables"]["t"].pop("removed"), r"tables\['t'\].removed"),
        (lambda m: m["tables"]["t"]["removed"].update(file="u.removed"), "file"),
        (lambda m: m["tables"]["t"]["removed"].update(ids=-1), "ids"),
        (lambda m: m["tables"]["t"]["removed"].update(bytes=17), "bytes"),
        (lambda m: m["tables"]["u"]["removed"].update(min_id=0), "null"),
        (lambda m: m["tables"]["t"]["removed"].update(max_id=None), "min_id"),
        (lambda m: m["tables"]["t"]["removed"].update(crc=2**32), "crc"),
        (lambda m: m["tables"]["t"].update(rows=4), "rows"),  # a full manifest's rules hold too
        (lambda m: m["views"]["t.opt"].update(table="x"), "views"),
    ],
)
def test_delta_manifest_problem_names_the_rule_broken(edit, words):
    manifest = sound_delta()
    assert delta.delta_manifest_problem(manifest) is None
    edit(manifest)
    problem = delta.link_problem(manifest)
    assert problem is not None and re.search(words, problem), problem


def test_a_full_link_is_held_to_the_full_rules():
    manifest = json.loads((GOLDEN / "base" / "manifest.json").read_text())
    assert delta.link_problem(manifest) is None
    manifest["version"] = 2
    assert "process_group" in delta.link_problem(manifest)
