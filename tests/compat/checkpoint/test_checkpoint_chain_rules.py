"""Every link as strict as the head (``spec/checkpoint_format.md``: R2, R3, R11-R13, D5,
D7, D8): a save or compaction never writes into its own chain, a relabelled link is never
read as a full checkpoint, every link's extra state is checked, and a field of the wrong
JSON type is refused. Each rule is held on the textbook and on the hardened path alike
(version 1; version 2 where it has the rule), with the chain left loadable."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import crc32c
import pytest
import torch

import leanstate
from leanstate._tools.cli import main
from leanstate.checkpoint._bucketed_table import BucketedTable
from leanstate.kv_store import KVStore
from leanstate.reference import delta_checkpoint as textbook
from leanstate.reference.checkpoint import CheckpointError
from tests.harness import FakeClock, one_rank_group

DIM, STATE = 4, 1
WIDTH = DIM + STATE


def new_store(backend: str = "reference") -> KVStore:
    return KVStore(DIM, optimizer_state_dim=STATE, backend=backend, clock=FakeClock(50))


def rows_of(store: KVStore) -> tuple[torch.Tensor, torch.Tensor]:
    keys = store.keys()
    return keys, store.get_rows(keys).view(torch.int32)


def same(a: KVStore, b: KVStore) -> bool:
    return all(torch.equal(x, y) for x, y in zip(rows_of(a), rows_of(b), strict=True))


def manifest_of(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def write_manifest(path: Path, manifest: dict) -> None:
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def digest_of(path: Path) -> str:
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


def edit_link(links: list[Path], index: int, edit) -> None:
    """``edit`` the manifest of ``links[index]`` (head first), then re-pin every newer link's
    ``base.manifest_sha256``: only the edited rule can refuse the chain, never a digest."""
    manifest = manifest_of(links[index])
    edit(manifest)
    write_manifest(links[index], manifest)
    for newer in range(index - 1, -1, -1):
        pinned = manifest_of(links[newer])
        pinned["base"]["manifest_sha256"] = digest_of(links[newer + 1])
        write_manifest(links[newer], pinned)


SAVES = {"textbook": textbook.save_checkpoint, "hardened": leanstate.save_checkpoint}


def build_chain(
    folder: Path, save=leanstate.save_checkpoint, *, extra: bool = True
) -> tuple[list[Path], KVStore]:
    """c0 (full), d1 and d2 (deltas) of one table, each with extra state; head first."""
    store = new_store()
    store.set(torch.arange(1, 61), torch.randn(60, WIDTH, generator=torch.Generator().manual_seed(2)))
    options = {"chunk_bytes": 10 * store.layout.row_bytes}
    step = (lambda n: {"extra": {"step": n}}) if extra else (lambda n: {})
    save(folder / "c0", {"t": store}, **options, **step(0))
    store.set(torch.arange(0, 80, 9), torch.ones(9, WIDTH))
    store.delete(torch.tensor([2, 4]))
    save(folder / "d1", {"t": store}, base=folder / "c0", **options, **step(1))
    store.set(torch.tensor([4, 100]), torch.full((2, WIDTH), 2.0))
    store.delete(torch.tensor([5]))
    save(folder / "d2", {"t": store}, base=folder / "d1", **options, **step(2))
    return [folder / "d2", folder / "d1", folder / "c0"], store


def verdicts(head: Path, tmp: Path) -> dict[str, type | None]:
    """How each reader takes the chain at ``head``: both loads (the hardened one into an
    empty store and into a live one), both compactions and ``inspect``; the error class of
    each (None: accepted). No load changes its store when it refuses."""
    outcomes: dict[str, type | None] = {}

    def attempt(name: str, run) -> None:
        try:
            run()
            outcomes[name] = None
        except Exception as exc:  # the class is the verdict
            outcomes[name] = type(exc)

    for name, load, live in (
        ("textbook load", textbook.load_checkpoint, False),
        ("hardened load, empty", leanstate.load_checkpoint, False),
        ("hardened load, live", leanstate.load_checkpoint, True),
    ):
        store = new_store("numba" if not live else "torch")
        if live:
            store.set(torch.arange(200, 210), torch.zeros(10, WIDTH))
        before = rows_of(store)
        attempt(name, lambda load=load, store=store: load(head, {"t": store}))
        if outcomes[name] is not None:
            assert all(torch.equal(x, y) for x, y in zip(before, rows_of(store), strict=True)), name
    attempt("textbook compaction", lambda: textbook.compact_checkpoint(head, tmp / "tc"))
    attempt("hardened compaction", lambda: leanstate.compact_checkpoint(head, tmp / "hc"))
    outcomes["inspect"] = CheckpointError if main(["inspect", str(head)]) else None
    return outcomes


# -- D7: a save never writes into its own chain ------------------------------------------


@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("save", sorted(SAVES))
def test_rotating_slots_refuse_the_save_that_would_overwrite_a_link_and_every_slot_still_loads(
    tmp_path, slots, save
):
    """The loop "keep N slots, each delta on the previous one": the save that comes back to
    slot 0 (the full checkpoint, the base of the base...) is refused; before the rule it was
    accepted and left neither slot loadable. (Kills: D7 checked against the base alone.)"""
    store = new_store()
    store.set(torch.arange(30), torch.randn(30, WIDTH, generator=torch.Generator().manual_seed(4)))
    SAVES[save](tmp_path / "slot0", {"t": store})
    for i in range(1, slots):
        store.set(torch.tensor([100 + i]), torch.ones(1, WIDTH))
        SAVES[save](tmp_path / f"slot{i}", {"t": store}, base=tmp_path / f"slot{i - 1}")
    before = {p.name: (p / "manifest.json").read_bytes() for p in tmp_path.iterdir()}
    store.set(torch.tensor([999]), torch.ones(1, WIDTH))
    with pytest.raises(ValueError, match=r"slot0.*(link of the chain|the base)"):
        SAVES[save](tmp_path / "slot0", {"t": store}, base=tmp_path / f"slot{slots - 1}")
    assert {p.name: (p / "manifest.json").read_bytes() for p in tmp_path.iterdir()} == before
    for i in range(slots):
        loaded = new_store()
        leanstate.load_checkpoint(tmp_path / f"slot{i}", {"t": loaded})
        assert len(loaded) == 30 + i
    # the way out the message names: a full checkpoint into the slot
    SAVES[save](tmp_path / "slot0", {"t": store})
    SAVES[save](tmp_path / "slot1", {"t": store}, base=tmp_path / "slot0")


@pytest.mark.parametrize("save", sorted(SAVES))
def test_a_delta_that_would_hold_its_base_or_a_lower_link_is_refused(tmp_path, save):
    """``outer`` is a checkpoint; ``outer/inner`` one too; a delta of ``inner`` saved at
    ``outer`` would delete ``inner`` when it replaces ``outer``. The same for a link below
    the base. (Kills: only "equal to or inside the base" checked, not "holds it".)"""
    store = new_store()
    store.set(torch.arange(20), torch.zeros(20, WIDTH))
    SAVES[save](tmp_path / "outer", {"t": store})
    SAVES[save](tmp_path / "outer" / "inner", {"t": store})
    with pytest.raises(ValueError, match="holds"):
        SAVES[save](tmp_path / "outer", {"t": store}, base=tmp_path / "outer" / "inner")
    SAVES[save](tmp_path / "d1", {"t": store}, base=tmp_path / "outer" / "inner")
    with pytest.raises(ValueError, match="holds"):  # outer holds inner, the base of d1
        SAVES[save](tmp_path / "outer", {"t": store}, base=tmp_path / "d1")
    with pytest.raises(ValueError, match="inside"):
        SAVES[save](tmp_path / "outer" / "inner" / "deep", {"t": store}, base=tmp_path / "d1")
    for path in (tmp_path / "outer", tmp_path / "outer" / "inner", tmp_path / "d1"):
        leanstate.load_checkpoint(path, {"t": new_store()})


def test_a_sibling_sharing_a_name_prefix_is_not_inside_a_link(tmp_path):
    """``d1-next`` beside ``d1`` is neither inside nor holding it: components, not string
    prefixes, decide. (Kills: the check weakened to ``startswith``.)"""
    links, store = build_chain(tmp_path)
    leanstate.save_checkpoint(tmp_path / "d2-next", {"t": store}, base=links[0])
    leanstate.compact_checkpoint(tmp_path / "d2-next", tmp_path / "c0-full")
    textbook.compact_checkpoint(tmp_path / "d2-next", tmp_path / "d1-full")


def test_a_delta_across_ranks_refuses_to_overwrite_a_link_of_its_chain(tmp_path):
    """Version 2, one rank: the rotating-slots save is refused (every rank walks the chain),
    and every slot still loads."""
    store = new_store()
    store.set(torch.arange(40), torch.ones(40, WIDTH))
    tables = {"t": BucketedTable(store, 8, None)}
    with one_rank_group() as group:
        leanstate.save_checkpoint(tmp_path / "s0", tables, process_group=group)
        for i in (1, 2):
            store.set(torch.tensor([100 + i]), torch.zeros(1, WIDTH))
            leanstate.save_checkpoint(
                tmp_path / f"s{i}", tables, process_group=group, base=tmp_path / f"s{i - 1}"
            )
        with pytest.raises(ValueError, match=r"s0.*a link of the chain"):
            leanstate.save_checkpoint(tmp_path / "s0", tables, process_group=group, base=tmp_path / "s2")
        with pytest.raises(ValueError, match="holds the base"):
            leanstate.save_checkpoint(tmp_path, tables, process_group=group, base=tmp_path / "s2")
        for i in range(3):
            loaded = new_store()
            leanstate.load_checkpoint(
                tmp_path / f"s{i}", {"t": BucketedTable(loaded, 8, None)}, process_group=group
            )
            assert len(loaded) == 40 + i


# -- compaction's destination --------------------------------------------------------------


@pytest.mark.parametrize("compact", ["textbook", "hardened", "command"])
def test_compaction_refuses_an_existing_destination_unless_told_to_replace_it(tmp_path, compact):
    links, store = build_chain(tmp_path)
    other = new_store()
    other.set(torch.arange(500, 700), torch.zeros(200, WIDTH))
    leanstate.save_checkpoint(tmp_path / "out", {"t": other})
    run = {
        "textbook": lambda **kw: textbook.compact_checkpoint(links[0], tmp_path / "out", **kw),
        "hardened": lambda **kw: leanstate.compact_checkpoint(links[0], tmp_path / "out", **kw),
        "command": lambda overwrite=False: (
            main(["compact", str(links[0]), str(tmp_path / "out"), *(["--force"] if overwrite else [])])
            or None
        ),
    }[compact]
    if compact == "command":
        assert main(["compact", str(links[0]), str(tmp_path / "out")]) == 1
    else:
        with pytest.raises(ValueError, match="exists.*overwrite=True"):
            run()
    unchanged = new_store()
    leanstate.load_checkpoint(tmp_path / "out", {"t": unchanged})
    assert same(unchanged, other)
    run(overwrite=True)
    compacted = new_store()
    leanstate.load_checkpoint(tmp_path / "out", {"t": compacted})
    assert same(compacted, store)


# -- R12: a relabelled link ------------------------------------------------------------------


def _relabel(manifest: dict) -> None:
    manifest["format"] = "leanstate-whole-row"  # base and removed kept: a delta in disguise


@pytest.mark.parametrize("index", [0, 1], ids=["head", "middle"])
def test_a_delta_relabelled_as_a_full_checkpoint_is_refused_by_every_reader(tmp_path, index):
    """Before R12 the relabelled head loaded 3 rows of 60 with no error and the relabelled
    middle link silently ended the chain. (Kills: unknown keys ignored in a full manifest.)"""
    links, _ = build_chain(tmp_path)
    edit_link(links, index, _relabel)
    outcomes = verdicts(links[0], tmp_path)
    assert set(outcomes.values()) == {CheckpointError}, outcomes


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(base={"path": "../elsewhere", "manifest_sha256": "0" * 64}),
        lambda m: m["tables"]["t"].update(
            removed={"file": "t.removed", "ids": 0, "bytes": 0, "min_id": None, "max_id": None, "crc": 0}
        ),
    ],
    ids=["base key", "removed key"],
)
def test_a_full_base_with_a_delta_key_is_refused(tmp_path, edit):
    links, _ = build_chain(tmp_path)
    edit_link(links, 2, edit)
    outcomes = verdicts(links[0], tmp_path)
    assert set(outcomes.values()) == {CheckpointError}, outcomes
    with pytest.raises(CheckpointError, match="is a delta's key"):
        textbook.load_checkpoint(links[2], {"t": new_store()})
    with pytest.raises(CheckpointError, match="is a delta's key"):
        leanstate.load_checkpoint(links[2], {"t": new_store()})


# -- R11 on every link -------------------------------------------------------------------------


def _extra_null(manifest: dict) -> None:
    manifest["extra"] = None  # while extra.pt stays in the directory


def _extra_crc(manifest: dict) -> None:
    manifest["extra"]["crc"] ^= 1


@pytest.mark.parametrize("index", [1, 2], ids=["middle", "base"])
@pytest.mark.parametrize("edit", [_extra_null, _extra_crc], ids=["null beside extra.pt", "wrong crc"])
def test_extra_state_damaged_below_the_head_is_refused_by_every_reader(tmp_path, index, edit):
    """Before, only the head's extra state was checked by load and compaction, while
    ``inspect`` reported the same link BAD. (Kills: R11 applied to the head alone.)"""
    links, _ = build_chain(tmp_path)
    edit_link(links, index, edit)
    outcomes = verdicts(links[0], tmp_path)
    assert set(outcomes.values()) == {CheckpointError}, outcomes


def test_extra_state_below_the_head_is_checked_across_ranks_too(tmp_path):
    """Version 2: a load into plain stores and a compaction refuse a middle link's bad extra."""
    with one_rank_group() as group:
        store = new_store()
        store.set(torch.arange(40), torch.ones(40, WIDTH))
        tables = {"t": BucketedTable(store, 8, None)}
        leanstate.save_checkpoint(tmp_path / "c0", tables, process_group=group, extra={"step": 0})
        store.set(torch.tensor([3]), torch.zeros(1, WIDTH))
        leanstate.save_checkpoint(
            tmp_path / "d1", tables, process_group=group, base=tmp_path / "c0", extra={"step": 1}
        )
        store.set(torch.tensor([4]), torch.zeros(1, WIDTH))
        leanstate.save_checkpoint(
            tmp_path / "d2", tables, process_group=group, base=tmp_path / "d1", extra={"step": 2}
        )
        links = [tmp_path / "d2", tmp_path / "d1", tmp_path / "c0"]
        edit_link(links, 1, _extra_crc)
        with pytest.raises(CheckpointError, match="d1/extra.pt"):
            leanstate.load_checkpoint(
                links[0], {"t": BucketedTable(new_store(), 8, None)}, process_group=group
            )
    with pytest.raises(CheckpointError, match="d1/extra.pt"):
        leanstate.load_checkpoint(links[0], {"t": new_store()})
    with pytest.raises(CheckpointError, match="d1/extra.pt"):
        leanstate.compact_checkpoint(links[0], tmp_path / "full")
    assert main(["inspect", str(links[0])]) == 1


# -- R3 and D5: exact types, keys present ---------------------------------------------------


def _chunk_min_as(value_of):
    def edit(manifest):
        table = manifest["tables"]["t"]
        table["min_id"] = value_of(table["min_id"])

    return edit


TYPE_DAMAGE = {
    "table min_id a float": _chunk_min_as(float),
    "removed min_id a float": lambda m: m["tables"]["t"]["removed"].update(
        min_id=float(m["tables"]["t"]["removed"]["min_id"])
    ),
    "removed ids true": lambda m: m["tables"]["t"]["removed"].update(ids=True),
    "removed entry without max_id": lambda m: m["tables"]["t"]["removed"].pop("max_id"),
    "removed entry without crc": lambda m: m["tables"]["t"]["removed"].pop("crc"),
    "view rows a float": lambda m: m["views"].update(
        v={"table": "t", "whole_rows": False, "width_offset": 0, "width": 1, "read_only": True, "rows": 3.0}
    ),
    "view table a list": lambda m: m["views"].update(
        v={"table": ["t"], "whole_rows": False, "width_offset": 0, "width": 1, "read_only": True, "rows": 3}
    ),
    "dtype a list": lambda m: m["tables"]["t"].update(dtype=["float32"]),
    "checksum an object": lambda m: m["tables"]["t"].update(checksum={"crc32c": 1}),
    "extra bytes a float": lambda m: m["extra"].update(bytes=float(m["extra"]["bytes"])),
    "chunk crc true": lambda m: m["tables"]["t"]["chunks"][0].update(crc=True),
}


@pytest.mark.parametrize("index", [0, 1], ids=["head", "middle"])
@pytest.mark.parametrize("damage", sorted(TYPE_DAMAGE))
def test_a_field_of_the_wrong_json_type_is_refused_by_every_reader(tmp_path, damage, index):
    """``1.0`` and ``true`` compare equal to ``1`` in Python; a list is unhashable: each is a
    CheckpointError naming the key, never accepted and never a TypeError. (Kills: a ``.get``
    for a required key, an equality test before the type test.)"""
    links, _ = build_chain(tmp_path)
    edit_link(links, index, TYPE_DAMAGE[damage])
    outcomes = verdicts(links[0], tmp_path)
    assert set(outcomes.values()) == {CheckpointError}, outcomes


def test_the_table_min_id_true_damage_reaches_a_link_whose_first_id_is_one(tmp_path):
    """The chain's full link starts at id 1 (``true == 1`` in Python): its table min_id as
    ``true`` is refused by both loads, where the old check compared it equal."""
    links, _ = build_chain(tmp_path)
    assert manifest_of(links[2])["tables"]["t"]["min_id"] == 1
    edit_link(links, 2, lambda m: m["tables"]["t"].update(min_id=True))
    outcomes = verdicts(links[0], tmp_path)
    assert set(outcomes.values()) == {CheckpointError}, outcomes


def test_an_empty_table_and_an_empty_removed_entry_need_their_null_ids(tmp_path):
    """R13 and D5: an empty table's ``min_id``/``max_id`` and a removal-less entry's are
    present and null; absent is refused (read with ``.get``, a missing key was null)."""
    store, empty = new_store(), new_store()
    store.set(torch.arange(5), torch.ones(5, WIDTH))
    for save in SAVES.values():
        save(tmp_path / "c0", {"t": store, "e": empty})
        store.set(torch.tensor([1]), torch.zeros(1, WIDTH))
        save(tmp_path / "d1", {"t": store, "e": empty}, base=tmp_path / "c0")
    links = [tmp_path / "d1", tmp_path / "c0"]
    assert manifest_of(links[0])["tables"]["e"]["removed"]["ids"] == 0
    for index, edit in (
        (1, lambda m: m["tables"]["e"].pop("min_id")),
        (0, lambda m: m["tables"]["e"].pop("max_id")),
        (0, lambda m: m["tables"]["e"]["removed"].pop("min_id")),
        (0, lambda m: m["tables"]["e"]["removed"].update(min_id=0)),
    ):
        saved = {p: (p / "manifest.json").read_bytes() for p in links}
        edit_link(links, index, edit)
        for load in (textbook.load_checkpoint, leanstate.load_checkpoint):
            with pytest.raises(CheckpointError):
                load(links[0], {"t": new_store(), "e": new_store()})
        for p, data in saved.items():
            (p / "manifest.json").write_bytes(data)
    for load in (textbook.load_checkpoint, leanstate.load_checkpoint):
        loaded = {"t": new_store(), "e": new_store()}
        load(links[0], loaded)
        assert same(loaded["t"], store) and len(loaded["e"]) == 0


# -- R2: the JSON limits, stated --------------------------------------------------------------


def _nested(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "note, refused",
    [(_nested(61), False), (_nested(62), True), ("9" * 4300, False), ("9" * 4301, True)],
    ids=["nesting 64", "nesting 65", "4,300 digits", "4,301 digits"],
)
def test_the_json_limits_are_the_specs_in_both_readers(tmp_path, note, refused):
    """An ignored key is held to R2 like every other: nesting at most 64 and integers of at
    most 4,300 digits, whatever the parser or interpreter setting would take."""
    store = new_store()
    store.set(torch.arange(3), torch.ones(3, WIDTH))
    leanstate.save_checkpoint(tmp_path / "c", {"t": store})
    manifest = manifest_of(tmp_path / "c")
    manifest["tables"]["t"]["note"] = "NOTE"  # levels 1 (top), 2 (tables) and 3 (t) above it
    text = json.dumps(manifest, indent=1)
    (tmp_path / "c" / "manifest.json").write_text(
        text.replace('"NOTE"', note if isinstance(note, str) else json.dumps(note))
    )
    for load in (textbook.load_checkpoint, leanstate.load_checkpoint):
        if refused:
            with pytest.raises(CheckpointError, match="JSON"):
                load(tmp_path / "c", {"t": new_store()})
        else:
            load(tmp_path / "c", {"t": new_store()})


def test_a_non_ascii_name_is_written_escaped_and_read_in_either_spelling(tmp_path):
    store = new_store()
    store.set(torch.arange(4), torch.ones(4, WIDTH))
    for save in SAVES.values():
        save(tmp_path / "c", {"ü": store})
        text = (tmp_path / "c" / "manifest.json").read_text()
        assert '"\\u00fc"' in text and "ü" not in text
    (tmp_path / "c" / "manifest.json").write_text(text.replace("\\u00fc", "ü"), encoding="utf-8")
    for load in (textbook.load_checkpoint, leanstate.load_checkpoint):
        loaded = new_store()
        load(tmp_path / "c", {"ü": loaded})
        assert same(loaded, store)


# -- D8 ----------------------------------------------------------------------------------------


def test_removing_an_id_no_link_holds_is_accepted_and_changes_nothing(tmp_path):
    links, store = build_chain(tmp_path)
    ids = sorted(
        {
            *torch.frombuffer(bytearray((links[0] / "t.removed").read_bytes()), dtype=torch.int64).tolist(),
            7777,
        }
    )
    data = torch.tensor(ids, dtype=torch.int64).numpy().tobytes()
    (links[0] / "t.removed").write_bytes(data)
    manifest = manifest_of(links[0])
    manifest["tables"]["t"]["removed"].update(
        ids=len(ids), bytes=len(data), min_id=ids[0], max_id=ids[-1], crc=crc32c.crc32c(data)
    )
    write_manifest(links[0], manifest)
    for load in (textbook.load_checkpoint, leanstate.load_checkpoint):
        loaded = new_store()
        load(links[0], {"t": loaded})
        assert same(loaded, store)
    live = new_store()
    live.set(torch.tensor([7777]), torch.ones(1, WIDTH))
    leanstate.load_checkpoint(links[0], {"t": live})
    assert bool(live.contains(torch.tensor([7777]))[0])  # a live store's own row stays


# -- the golden damaged chains -------------------------------------------------------------------

VECTORS = Path(__file__).parents[3] / "spec" / "vectors"
GOLDEN = json.loads((VECTORS / "delta_v1_damaged.json").read_text())


def golden_stores(backend: str = "reference") -> dict[str, KVStore]:
    return {"t": KVStore(3, optimizer_state_dim=1, backend=backend), "u": KVStore(2, backend=backend)}


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda case: case["name"])
def test_the_golden_damaged_chains_are_refused_by_every_reader_naming_the_key(tmp_path, case):
    """spec/vectors/delta_v1_damaged.json: the golden chain of delta_v1/ with one link's
    manifest breaking one rule (the newer link re-pinned); both loads and both compactions
    give a CheckpointError whose message names what the vector names."""
    shutil.copytree(VECTORS / "delta_v1", tmp_path / "v", ignore=shutil.ignore_patterns("compacted"))
    for link, text in case["manifests"].items():
        (tmp_path / "v" / link / "manifest.json").write_text(text)
    head = tmp_path / "v" / "delta"
    for run in (
        lambda: textbook.load_checkpoint(head, golden_stores()),
        lambda: leanstate.load_checkpoint(head, golden_stores("numba")),
        lambda: textbook.compact_checkpoint(head, tmp_path / "tc"),
        lambda: leanstate.compact_checkpoint(head, tmp_path / "hc"),
    ):
        with pytest.raises(CheckpointError) as raised:
            run()
        assert case["names"] in str(raised.value), (case["name"], raised.value)
    assert main(["inspect", str(head)]) == 1


def test_the_golden_chain_itself_is_sound(tmp_path):
    """The vectors' undamaged chain loads: a refusal above is the damage's, not the copy's."""
    shutil.copytree(VECTORS / "delta_v1", tmp_path / "v")
    for load in (textbook.load_checkpoint, leanstate.load_checkpoint):
        load(tmp_path / "v" / "delta", golden_stores())


@pytest.mark.parametrize("key", ["base", "files removed"])
def test_a_full_checkpoint_across_ranks_with_a_delta_key_is_refused(tmp_path, key):
    """R12 in version 2: a full manifest with a ``base``, or a rank file's ``removed``."""
    store = new_store()
    store.set(torch.arange(20), torch.ones(20, WIDTH))
    with one_rank_group() as group:
        leanstate.save_checkpoint(tmp_path / "c0", {"t": BucketedTable(store, 4, None)}, process_group=group)
    manifest = manifest_of(tmp_path / "c0")
    if key == "base":
        manifest["base"] = {"path": "../x", "manifest_sha256": "0" * 64}
    else:
        manifest["tables"]["t"]["files"][0]["removed"] = {"file": "t.rank0.removed", "ids": 0}
    write_manifest(tmp_path / "c0", manifest)
    with pytest.raises(CheckpointError, match="is a delta's key"):
        leanstate.load_checkpoint(tmp_path / "c0", {"t": new_store()})
    with pytest.raises(CheckpointError, match="is a delta's key"):
        leanstate.compact_checkpoint(tmp_path / "c0", tmp_path / "out")


def _removed(manifest: dict) -> dict:
    return manifest["tables"]["t"]["removed"]


DELTA_EDITS = {
    "no removed entry": (
        lambda m: m["tables"]["t"].pop("removed"),
        r"tables\['t'\]: the required key 'removed'",
    ),
    "removed a list": (
        lambda m: m["tables"]["t"].update(removed=[]),
        r"tables\['t'\]\.removed must be an object",
    ),
    "removed without crc": (lambda m: _removed(m).pop("crc"), r"removed: the required key 'crc' is missing"),
    "removed without min_id": (lambda m: _removed(m).pop("min_id"), r"removed: the required key 'min_id'"),
    "removed of another file": (
        lambda m: _removed(m).update(file="u.removed"),
        r"removed\.file must be 't\.removed'",
    ),
    "removed ids a float": (
        lambda m: _removed(m).update(ids=float(_removed(m)["ids"])),
        r"removed\.ids and \.bytes",
    ),
    "removed bytes not 8 x ids": (
        lambda m: _removed(m).update(bytes=_removed(m)["bytes"] + 8),
        r"not 8 x ids",
    ),
    "removed min_id above max_id": (
        lambda m: _removed(m).update(min_id=_removed(m)["max_id"] + 1),
        r"removed\.min_id/max_id must be ids with min_id <= max_id",
    ),
    "base a string": (lambda m: m.update(base="../d1"), r"base must be an object"),
    "base path absolute": (
        lambda m: m["base"].update(path="/d1"),
        r"base\.path must be a non-empty relative path",
    ),
    "base digest in capitals": (
        lambda m: m["base"].update(manifest_sha256=m["base"]["manifest_sha256"].upper()),
        r"base\.manifest_sha256 must be 64 lowercase hex digits",
    ),
    "version 3 and no base": (lambda m: (m.update(version=3), m.pop("base")), r"format version 3 of a delta"),
}


@pytest.mark.parametrize("edit", sorted(DELTA_EDITS))
def test_a_delta_manifest_breaking_one_rule_is_refused_naming_its_key(tmp_path, edit):
    """D1, D2, D5 and R3 in the hardened schema, message by message (the textbook refuses
    each too, with the same class)."""
    links, _ = build_chain(tmp_path)
    change, message = DELTA_EDITS[edit]
    edit_link(links, 0, change)
    with pytest.raises(CheckpointError, match=message):
        leanstate.load_checkpoint(links[0], {"t": new_store()})
    with pytest.raises(CheckpointError):
        textbook.load_checkpoint(links[0], {"t": new_store()})


def test_a_delta_in_one_process_of_a_base_saved_across_ranks_is_refused(tmp_path):
    """Kills: the version check of a one-process delta's base left out (it would write a
    version-1 delta naming a version-2 base, a chain no reader loads)."""
    store = new_store()
    store.set(torch.arange(20), torch.ones(20, WIDTH))
    with one_rank_group() as group:
        leanstate.save_checkpoint(tmp_path / "c0", {"t": BucketedTable(store, 4, None)}, process_group=group)
    with pytest.raises(ValueError, match="saved across ranks; save its delta with process_group="):
        leanstate.save_checkpoint(tmp_path / "d1", {"t": store}, base=tmp_path / "c0")
    assert not (tmp_path / "d1").exists()


def test_compacting_a_chain_across_ranks_onto_an_existing_checkpoint_needs_overwrite(tmp_path):
    """Kills: the existing-destination check placed after the version-2 branch (which returns)."""
    store = new_store()
    store.set(torch.arange(20), torch.ones(20, WIDTH))
    tables = {"t": BucketedTable(store, 4, None)}
    with one_rank_group() as group:
        leanstate.save_checkpoint(tmp_path / "c0", tables, process_group=group)
        store.set(torch.tensor([3]), torch.zeros(1, WIDTH))
        leanstate.save_checkpoint(tmp_path / "d1", tables, process_group=group, base=tmp_path / "c0")
    leanstate.save_checkpoint(tmp_path / "out", {"t": new_store()})
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    with pytest.raises(ValueError, match="exists; pass overwrite=True"):
        leanstate.compact_checkpoint(tmp_path / "d1", tmp_path / "out")
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before
    leanstate.compact_checkpoint(tmp_path / "d1", tmp_path / "out", overwrite=True)
    assert manifest_of(tmp_path / "out")["version"] == 2


def test_compaction_takes_overwrite_as_a_bool_only(tmp_path):
    """Kills: the type check of ``overwrite`` left out (a truthy string would replace a checkpoint)."""
    links, _ = build_chain(tmp_path)
    leanstate.save_checkpoint(tmp_path / "out", {"t": new_store()})
    with pytest.raises(TypeError, match="overwrite must be True or False"):
        leanstate.compact_checkpoint(links[0], tmp_path / "out", overwrite="yes")
    assert leanstate.load_checkpoint(tmp_path / "out", {"t": new_store()}) == {}


def test_the_integer_limit_holds_whatever_the_interpreter_allows(tmp_path):
    """R2's 4,300 digits are the format's, not CPython's setting: with the interpreter's limit
    lifted, a 4,301-digit integer is still refused and a negative one of 4,300 digits (its
    sign not counted) still read. Kills: the limit left to ``int()``, the sign counted."""
    import sys

    store = new_store()
    store.set(torch.arange(3), torch.ones(3, WIDTH))
    leanstate.save_checkpoint(tmp_path / "c", {"t": store})
    text = json.dumps({**manifest_of(tmp_path / "c"), "note": "NOTE"}, indent=1)
    previous = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # no limit of the interpreter's own
    try:
        for note, refused in (("9" * 4301, True), ("-" + "9" * 4300, False)):
            (tmp_path / "c" / "manifest.json").write_text(text.replace('"NOTE"', note))
            for load in (textbook.load_checkpoint, leanstate.load_checkpoint):
                if refused:
                    with pytest.raises(CheckpointError, match="4301 digits"):
                        load(tmp_path / "c", {"t": new_store()})
                else:
                    load(tmp_path / "c", {"t": new_store()})
    finally:
        sys.set_int_max_str_digits(previous)


def test_a_failed_load_across_ranks_still_reports_what_it_read(tmp_path):
    """``last_load_stats`` after a load into a live store that fails in its verify pass: the
    chunks read before the bad one are counted. Kills: the verify pass not counting."""
    from leanstate.checkpoint.sharded import last_load_stats

    store = new_store()
    store.set(torch.arange(200), torch.ones(200, WIDTH))
    tables = {"t": BucketedTable(store, 4, None)}
    with one_rank_group() as group:
        leanstate.save_checkpoint(
            tmp_path / "c", tables, process_group=group, chunk_bytes=10 * store.layout.row_bytes
        )
        data = bytearray((tmp_path / "c" / "t.rank0.rows").read_bytes())
        data[-5] ^= 1  # the last chunk's rows: every chunk before it reads sound
        (tmp_path / "c" / "t.rank0.rows").write_bytes(bytes(data))
        live = new_store()
        live.set(torch.tensor([7]), torch.zeros(1, WIDTH))
        with pytest.raises(CheckpointError, match="crc32c"):
            leanstate.load_checkpoint(
                tmp_path / "c", {"t": BucketedTable(live, 4, None)}, process_group=group
            )
    row_bytes = store.layout.row_bytes  # 20 chunks of 10 rows: the 19 before the bad one, once each
    assert last_load_stats == {"bytes_read": 19 * 10 * row_bytes, "chunks_read": 19, "rows_loaded": 0}
    assert len(live) == 1


def test_a_table_name_that_is_not_a_string_is_a_value_error_naming_it(tmp_path):
    """Kills: the name rule reading a non-string as a string (an AttributeError instead)."""
    store = new_store()
    for save in SAVES.values():
        with pytest.raises(ValueError, match="table name 5"):
            save(tmp_path / "c", {5: store})


@pytest.mark.parametrize("size, refused", [(4096, False), (4097, True)])
def test_a_base_path_is_at_most_4096_bytes(tmp_path, size, refused):
    """D2's bound exactly: 4,096 bytes of UTF-8 are a path (the base then is missing), 4,097
    are refused as too long before any base is looked for."""
    links, _ = build_chain(tmp_path)
    edit_link(
        links, 0, lambda m: m["base"].update(path="a/" * (size // 2 - 1) + ("ab" if size % 2 == 0 else "abc"))
    )
    assert len(manifest_of(links[0])["base"]["path"].encode()) == size
    for load in (textbook.load_checkpoint, leanstate.load_checkpoint):
        with pytest.raises(CheckpointError) as raised:
            load(links[0], {"t": new_store()})
        assert ("4096" in str(raised.value)) == refused, str(raised.value)[:300]


def test_a_table_missing_from_a_checkpoint_across_ranks_is_named(tmp_path):
    """Kills: the layout of each table checked before the check that every table is there
    (a KeyError instead of the error naming the missing table)."""
    store = new_store()
    store.set(torch.arange(20), torch.ones(20, WIDTH))
    with one_rank_group() as group:
        leanstate.save_checkpoint(tmp_path / "c0", {"t": BucketedTable(store, 4, None)}, process_group=group)
        asked = {"t": BucketedTable(new_store(), 4, None), "u": BucketedTable(new_store(), 4, None)}
        with pytest.raises(CheckpointError, match="no table 'u'"):
            leanstate.load_checkpoint(tmp_path / "c0", asked, process_group=group)
