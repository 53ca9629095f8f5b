"""The hardened checkpoint I/O (``leanstate.save_checkpoint`` / ``load_checkpoint``) held to
the textbook (``leanstate.reference.checkpoint``), as the accelerated stores are held to
the reference store: over random tables (row counts, dims, state dims, dtypes, chunk
sizes, deleted rows, views, extra state) both write byte-identical directories, each
loads what the other wrote into identical rows, and on the same damaged checkpoint both
raise the same error class and change no store.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import stat
import zlib

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leanstate
from leanstate._tools.cli import main
from leanstate.kv_store import KVStore
from leanstate.reference import checkpoint as reference
from leanstate.reference import delta_checkpoint as delta
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import header_words, pack_metadata, unpack_metadata
from leanstate.testing import counts, id_batches, layouts
from tests.harness import VECTORS, FakeClock


@st.composite
def tables(draw):
    """A store with random rows (among them the int64 edges and colliding ids; some deleted,
    some with a second write, some with saturating counts), and how to save it."""
    n = draw(st.integers(0, 120))
    layout = draw(layouts())
    dim, state, dtype = layout.dim, layout.state_dim, layout.dtype
    backend = draw(st.sampled_from(["reference", "numba", "torch"]))
    seed = draw(st.integers(0, 2**16))
    store = KVStore(dim, optimizer_state_dim=state, dtype=dtype, clock=FakeClock(seed), backend=backend)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randperm(4 * n + 1, generator=generator)[:n] * draw(st.sampled_from([1, 7919, 2**40]))
    ids = torch.unique(torch.cat([ids, torch.tensor(draw(id_batches(max_size=6)), dtype=torch.int64)]))
    n = len(ids)
    ids = ids[torch.randperm(n, generator=generator)]
    store.set(ids, torch.randn(n, dim, generator=generator).to(dtype))
    counted = draw(st.lists(counts(), max_size=min(n, 3)))
    rows = store.get_rows(ids[: len(counted)])
    stamps, _, used = unpack_metadata(header_words(rows)[:, 1])
    header_words(rows)[:, 1] = pack_metadata(stamps, torch.tensor(counted, dtype=torch.int64), used)
    store.set_rows(rows)
    again = draw(st.integers(0, n))
    store.set(ids[:again], torch.randn(again, dim, generator=generator).to(dtype))
    deleted = draw(st.integers(0, n))
    store.delete(ids[n - deleted :])
    row_bytes = store.layout.row_bytes
    chunk_bytes = draw(st.sampled_from([1, row_bytes, 3 * row_bytes + 1, 2**20]))
    extra = draw(st.sampled_from([None, {"step": torch.tensor(seed), "lr": 0.25}]))
    return store, chunk_bytes, extra, draw(st.booleans())


def saved_tables(store, with_view):
    named = {"t": store}
    if with_view:  # the optimizer's read-only view, recorded beside the whole rows
        layout = store.layout
        named["t.state"] = KVTensor(
            store, width_offset=layout.padded_dim, width=layout.state_dim, read_only=True
        )
    return named


def files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def rows_of(store):
    keys = store.keys()
    return keys, store.get_rows(keys).view(torch.uint8)


def same_rows(a, b):
    return all(torch.equal(x, y) for x, y in zip(rows_of(a), rows_of(b)))


def fresh(store, holding=None, backend="reference"):
    layout = store.layout
    out = KVStore(layout.dim, optimizer_state_dim=layout.state_dim, dtype=layout.dtype, backend=backend)
    if holding is not None and len(holding):
        out.set_rows(store.get_rows(holding))
    return out


SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(tables(), st.booleans())
def test_both_write_the_same_bytes_and_load_each_other(tmp_path_factory, table, pipelined):
    store, chunk_bytes, extra, with_view = table
    folder = tmp_path_factory.mktemp("ck")
    reference.save_checkpoint(
        folder / "ref", saved_tables(store, with_view), extra=extra, chunk_bytes=chunk_bytes
    )
    leanstate.save_checkpoint(
        folder / "fast",
        saved_tables(store, with_view),
        extra=extra,
        chunk_bytes=chunk_bytes,
        pipelined=pipelined,
    )
    assert files(folder / "ref") == files(folder / "fast")
    keys = store.keys()
    for holding in (None, keys[: len(keys) // 2]):  # empty stores (one pass) and live ones (verify first)
        by_reference, by_fast = fresh(store, holding), fresh(store, holding)
        got = reference.load_checkpoint(folder / "fast", {"t": by_reference}, chunk_bytes=chunk_bytes)
        got_fast = leanstate.load_checkpoint(folder / "ref", {"t": by_fast}, chunk_bytes=chunk_bytes)
        assert same_rows(by_reference, store) and same_rows(by_fast, store)
        assert (extra is None and got == got_fast == {}) or got.keys() == got_fast.keys() == extra.keys()
    lo, hi = sorted(int(i) for i in torch.randint(0, 2**41, (2,)))
    ranged = [fresh(store), fresh(store)]
    reference.load_checkpoint(folder / "ref", {"t": ranged[0]}, id_range=(lo, hi))
    leanstate.load_checkpoint(folder / "ref", {"t": ranged[1]}, id_range=(lo, hi))
    assert same_rows(*ranged)


def _flip(file, at):
    data = bytearray(file.read_bytes())
    data[at % len(data)] ^= 0x10
    file.write_bytes(bytes(data))


def _manifest(edit):
    def damage(folder, at):
        manifest = json.loads((folder / "manifest.json").read_text())
        edit(manifest, at)
        (folder / "manifest.json").write_text(json.dumps(manifest))

    return damage


def _set_chunk(field, value):
    def edit(manifest, at):
        chunks = manifest["tables"]["t"]["chunks"]
        chunks[at % len(chunks)][field] = value(chunks[at % len(chunks)][field])

    return edit


DAMAGE = {
    "rows byte flipped": (lambda f, at: _flip(f / "t.rows", at), True),
    "rows truncated": (
        lambda f, at: (f / "t.rows").write_bytes((f / "t.rows").read_bytes()[: -1 - at % 7]),
        True,
    ),
    "rows trailing byte": (
        lambda f, at: (f / "t.rows").write_bytes((f / "t.rows").read_bytes() + b"\0"),
        False,
    ),
    "rows file missing": (lambda f, at: (f / "t.rows").unlink(), False),
    "manifest not JSON": (lambda f, at: (f / "manifest.json").write_text('{"format": '), False),
    "manifest missing": (lambda f, at: (f / "manifest.json").unlink(), False),
    "version 3": (_manifest(lambda m, at: m.update(version=3)), False),
    "other format": (_manifest(lambda m, at: m.update(format="something-else")), False),
    "dim changed": (_manifest(lambda m, at: m["tables"]["t"].update(dim=m["tables"]["t"]["dim"] + 1)), False),
    "dtype changed": (
        _manifest(
            lambda m, at: m["tables"]["t"].update(
                dtype="float16" if m["tables"]["t"]["dtype"] != "float16" else "float32"
            )
        ),
        False,
    ),
    "chunk crc changed": (_manifest(_set_chunk("crc", lambda crc: crc ^ 1)), True),
    "chunk min_id changed": (_manifest(_set_chunk("min_id", lambda i: i + 1)), True),
    "chunk rows changed": (_manifest(_set_chunk("rows", lambda n: n + 1)), True),
    "extra flipped": (lambda f, at: _flip(f / "extra.pt", at) if (f / "extra.pt").exists() else None, False),
}


def _table(edit):
    return _manifest(lambda m, at: edit(m["tables"]["t"], at))


def _drop_chunk(where):
    """A chunk removed from the list, the table's rows and bytes left as they were."""

    def edit(table, at):
        chunks = table["chunks"]
        del chunks[{"first": 0, "middle": len(chunks) // 2, "last": -1}[where]]

    return _table(edit)


def _shift_offset(rows):
    def edit(table, at):
        chunks = table["chunks"]
        i = max(1, at % len(chunks)) if len(chunks) > 1 else 0
        chunks[i]["offset"] += rows * table["row_bytes"]

    return _table(edit)


def _starts_at_the_last_id(folder, at):
    """A chunk's first row carries the id the chunk before it ended on, and its min_id and
    CRC say so (every chunk sound on its own: only the rule across chunks can see the
    row that would be lost); with one chunk, its own range inverted."""
    manifest = json.loads((folder / "manifest.json").read_text())
    table = manifest["tables"]["t"]
    chunks, row_bytes = table["chunks"], table["row_bytes"]
    if len(chunks) == 1:
        chunks[0]["min_id"] = chunks[0]["max_id"] + 1
    else:
        i = max(1, at % len(chunks))
        data = bytearray((folder / "t.rows").read_bytes())
        start, end = chunks[i]["offset"], chunks[i]["offset"] + chunks[i]["rows"] * row_bytes
        data[start : start + 8] = data[start - row_bytes : start - row_bytes + 8]
        (folder / "t.rows").write_bytes(bytes(data))
        chunks[i]["min_id"] = chunks[i - 1]["max_id"]
        chunks[i]["crc"] = (crc32c.crc32c if table["checksum"] == "crc32c" else zlib.crc32)(
            bytes(data[start:end])
        )
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _extra_of(value):
    """``extra.pt`` replaced by ``torch.save(value)``, its size and CRC in the manifest to match."""

    def damage(folder, at):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        (folder / "extra.pt").write_bytes(buffer.getvalue())
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["extra"] = {
            "file": "extra.pt",
            "bytes": len(buffer.getvalue()),
            "crc": crc32c.crc32c(buffer.getvalue()),
        }
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))

    return damage


def _edit_text(edit):
    def damage(folder, at):
        (folder / "manifest.json").write_text(edit((folder / "manifest.json").read_text()))

    return damage


def _replace_manifest(kind):
    def damage(folder, at):
        manifest = folder / "manifest.json"
        if kind == "symlink":  # the same bytes, one link away
            os.rename(manifest, folder / "real.json")
            os.symlink(folder / "real.json", manifest)
        else:
            manifest.unlink()
            os.mkfifo(manifest)

    return damage


def _view(**fields):
    view = {"table": "t", "whole_rows": False, "width_offset": 0, "width": 1, "read_only": True, "rows": 1}
    return _manifest(lambda m, at: m.update(views={"v": {**view, **fields}}))


# Damage to the manifest's structure: each breaks a rule of the format's reader list
# (spec/checkpoint_format.md) while every byte of the data stays sound.
STRUCTURAL = {
    "first chunk dropped": (_drop_chunk("first"), True),
    "middle chunk dropped": (_drop_chunk("middle"), True),
    "last chunk dropped": (_drop_chunk("last"), True),
    "chunks overlap": (_shift_offset(-1), True),
    "gap between chunks": (_shift_offset(1), True),
    "file outside the checkpoint": (_table(lambda t, at: t.update(file="../other/t.rows")), False),
    "absolute file": (_table(lambda t, at: t.update(file="/dev/zero")), False),
    "file of another name": (_table(lambda t, at: t.update(file="u.rows")), False),
    "extra file outside": (
        _manifest(lambda m, at: m.update(extra={"file": "../x", "bytes": 1, "crc": 0})),
        False,
    ),
    "chunk starts at the previous chunk's last id": (_starts_at_the_last_id, True),
    "table min_id off by one": (_table(lambda t, at: t.update(min_id=t["min_id"] - 1)), True),
    "table max_id off by one": (_table(lambda t, at: t.update(max_id=t["max_id"] + 1)), True),
    "bytes not rows x row_bytes": (_table(lambda t, at: t.update(bytes=t["bytes"] + 1)), False),
    "extra null, file present": (
        lambda f, at: (
            _manifest(lambda m, at: m.update(extra=None))(f, at),
            (f / "extra.pt").write_bytes(b"x"),
        ),
        False,
    ),
    "extra key missing": (_manifest(lambda m, at: m.pop("extra")), False),
    "views key missing": (_manifest(lambda m, at: m.pop("views")), False),
    "manifest is a symlink": (_replace_manifest("symlink"), False),
    "manifest is a FIFO": (_replace_manifest("fifo"), False),
    "views a list": (_manifest(lambda m, at: m.update(views=[])), False),
    "view of a missing table": (_view(table="missing"), False),
    "view rows a string": (_view(rows="3"), False),
    "view past the row": (_view(width=10**6), False),
    "view named like a table": (_manifest(lambda m, at: m.update(views={"t": m["views"].get("t")})), False),
    "float offset": (_table(lambda t, at: t["chunks"][0].update(offset=0.0)), True),
    "version 1.0": (_manifest(lambda m, at: m.update(version=1.0)), False),
    "version true": (_manifest(lambda m, at: m.update(version=True)), False),
    "version a string": (_manifest(lambda m, at: m.update(version="1")), False),
    "unknown checksum": (_table(lambda t, at: t.update(checksum="md5")), False),
    "NaN": (_manifest(lambda m, at: m["tables"]["t"].update(note=float("nan"))), False),
    "duplicate key": (
        _edit_text(lambda text: text.replace('"format"', '"version": 1, "format"', 1)),
        False,
    ),
    "table name with a dot": (
        _manifest(lambda m, at: m.update(tables={".t": {**m["tables"]["t"], "file": ".t.rows"}})),
        False,
    ),
    "a huge row count": (
        _table(
            lambda t, at: t.update(
                rows=2**40,
                bytes=2**40 * t["row_bytes"],
                max_id=2**62,
                chunks=[{"offset": 0, "rows": 2**40, "min_id": 0, "max_id": 2**62, "crc": 0}],
            )
        ),
        False,
    ),
    "manifest in UTF-16": (
        lambda f, at: (f / "manifest.json").write_bytes((f / "manifest.json").read_text().encode("utf-16")),
        False,
    ),
    "manifest with a UTF-8 BOM": (
        lambda f, at: (f / "manifest.json").write_bytes(b"\xef\xbb\xbf" + (f / "manifest.json").read_bytes()),
        False,
    ),
    "extra holds a list": (_extra_of([1, 2]), False),
    "nesting 100,000 deep": (
        _edit_text(lambda text: text[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        False,
    ),
}


def _refusals_agree(folder, damage_fn, at, store, live):
    """Damage the checkpoint at ``folder``, load it with both implementations (the hardened
    one into a store of the drawn backend, so an empty one takes its in-place path), and
    return their outcomes: the error classes, with every store left as it was."""
    damage_fn(folder, at)
    outcomes = []
    for load, backend in (
        (reference.load_checkpoint, "reference"),
        (leanstate.load_checkpoint, store.backend),
    ):
        target = fresh(store, store.keys()[:3] if live else None, backend)
        before = rows_of(target)
        try:
            load(folder, {"t": target})
            outcome = None
        except Exception as exc:
            outcome = type(exc)
            after = rows_of(target)
            assert all(torch.equal(x, y) for x, y in zip(before, after)), (load, exc)
        outcomes.append(outcome)
    return outcomes


@SETTINGS
@given(tables(), st.sampled_from(sorted({**DAMAGE, **STRUCTURAL})), st.integers(0, 2**20), st.booleans())
def test_both_refuse_the_same_damage_with_the_same_error_class(tmp_path_factory, table, damage, at, live):
    store, chunk_bytes, extra, _ = table
    damage_fn, needs_rows = {**DAMAGE, **STRUCTURAL}[damage]
    if needs_rows and len(store) == 0:
        damage_fn = DAMAGE["manifest not JSON"][0]
    folder = tmp_path_factory.mktemp("bad")
    reference.save_checkpoint(folder / "c", {"t": store}, extra=extra, chunk_bytes=chunk_bytes)
    outcomes = _refusals_agree(folder / "c", damage_fn, at, store, live)
    assert outcomes[0] == outcomes[1], (damage, outcomes)
    shutil.rmtree(folder)


@pytest.mark.parametrize("damage", sorted(STRUCTURAL))
def test_both_refuse_structural_damage_to_the_manifest(tmp_path, damage):
    """Every structural damage, on a table of several chunks with extra state and a view:
    both refuse it with a CheckpointError, and no store changes."""
    damage_fn, _ = STRUCTURAL[damage]
    for backend, live in (("numba", False), ("torch", True), ("reference", False)):
        store = KVStore(4, optimizer_state_dim=1, clock=FakeClock(7), backend=backend)
        store.set(torch.arange(0, 300, 3), torch.randn(100, 4, generator=torch.Generator().manual_seed(3)))
        folder = tmp_path / f"{backend}-{live}"
        reference.save_checkpoint(
            folder, saved_tables(store, True), extra={"step": 3}, chunk_bytes=20 * store.layout.row_bytes
        )
        outcomes = _refusals_agree(folder, damage_fn, 5, store, live)
        assert outcomes == [leanstate.CheckpointError, leanstate.CheckpointError], (damage, backend, outcomes)


GOLDEN_DAMAGE = json.loads((VECTORS / "checkpoint_v1_damaged.json").read_text())


@pytest.mark.parametrize("case", GOLDEN_DAMAGE["cases"], ids=lambda case: case["name"])
def test_the_golden_damaged_manifests_are_refused_by_both_naming_the_key(tmp_path, case):
    """spec/vectors/checkpoint_v1_damaged.json: sound rows, a manifest breaking one rule;
    both implementations give the vector's error, naming what it names."""
    shutil.copy(VECTORS / GOLDEN_DAMAGE["rows_file"], tmp_path / "t.rows")
    (tmp_path / "manifest.json").write_text(case["manifest"])
    for load, backend in ((reference.load_checkpoint, "reference"), (leanstate.load_checkpoint, "numba")):
        store = KVStore(3, optimizer_state_dim=1, backend=backend)
        with pytest.raises(Exception) as raised:
            load(tmp_path, {"t": store})
        assert type(raised.value).__name__ == GOLDEN_DAMAGE["error"], (load, raised.value)
        assert case["names"] in str(raised.value) and "manifest.json" in str(raised.value), raised.value
        assert len(store) == 0


@pytest.mark.parametrize("backend", ["numba", "torch", "reference"])
def test_an_empty_table_loads_into_an_empty_store_of_every_backend(tmp_path, backend):
    """A sound checkpoint of an empty table beside a full one (its file empty, no chunks):
    both loads take it into empty stores of every backend, and the full table's rows too."""
    empty, full = KVStore(4, optimizer_state_dim=1), KVStore(4, optimizer_state_dim=1, clock=FakeClock(3))
    full.set(torch.arange(0, 90, 3), torch.ones(30, 4))
    reference.save_checkpoint(tmp_path / "c", {"e": empty, "f": full}, extra={"step": 1})
    for load in (reference.load_checkpoint, leanstate.load_checkpoint):
        stores = {name: KVStore(4, optimizer_state_dim=1, backend=backend) for name in ("e", "f")}
        assert load(tmp_path / "c", stores) == {"step": 1}
        assert len(stores["e"]) == 0 and same_rows(stores["f"], full)


# -- chains: every link held to the rules of the head ---------------------------------------

LINKS = {"head": 0, "middle": 1, "base": 2}


def _chain_of_three(folder, backend):
    """A full checkpoint and two deltas of ``t`` (each with extra state and a read-only
    view, several chunks a link), saved by the textbook; head first."""
    store = KVStore(4, optimizer_state_dim=1, clock=FakeClock(9), backend=backend)
    generator = torch.Generator().manual_seed(11)
    store.set(torch.arange(0, 300, 3), torch.randn(100, 4, generator=generator))
    chunk = 8 * store.layout.row_bytes
    paths = [folder / "d2", folder / "d1", folder / "c0"]
    for step, path in enumerate(reversed(paths)):
        base = None if step == 0 else paths[3 - step]
        if step:
            store.set(torch.arange(step, 300, 7), torch.randn(43, 4, generator=generator))
            store.delete(torch.arange(3 * step, 300, 29))
        delta.save_checkpoint(
            path, saved_tables(store, True), base=base, extra={"step": step}, chunk_bytes=chunk
        )
    return paths, store


def _repin(paths, index):
    """Each link newer than ``paths[index]`` names the damaged manifest's digest again (when it
    is still a regular file), so the damage, not a digest mismatch, is what a reader meets."""
    for newer in range(index - 1, -1, -1):
        below = paths[newer + 1] / "manifest.json"
        if not (os.path.lexists(below) and stat.S_ISREG(os.lstat(below).st_mode)):
            return
        manifest = json.loads((paths[newer] / "manifest.json").read_text())
        manifest["base"]["manifest_sha256"] = hashlib.sha256(below.read_bytes()).hexdigest()
        (paths[newer] / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _chain_verdicts(head, store, tmp):
    """The error class each reader gives the chain at ``head`` (None: accepted): the textbook
    load, the hardened load into an empty store of the drawn backend and into a live torch
    store, both compactions; and whether ``inspect`` refused it. A refused load changes no store."""
    outcomes = {}
    runs = {
        "textbook load": lambda: delta.load_checkpoint(head, {"t": fresh(store)}),
        "hardened load, empty": lambda: leanstate.load_checkpoint(
            head, {"t": fresh(store, None, store.backend)}
        ),
        "hardened load, live": None,
        "textbook compaction": lambda: delta.compact_checkpoint(head, tmp / "tc"),
        "hardened compaction": lambda: leanstate.compact_checkpoint(head, tmp / "hc"),
    }
    live = fresh(store, store.keys()[:5], "torch")
    before = rows_of(live)
    runs["hardened load, live"] = lambda: leanstate.load_checkpoint(head, {"t": live})
    for name, run in runs.items():
        try:
            run()
            outcomes[name] = None
        except Exception as exc:
            outcomes[name] = type(exc)
    if outcomes["hardened load, live"] is not None:
        assert all(torch.equal(x, y) for x, y in zip(before, rows_of(live)))
    with contextlib.redirect_stdout(io.StringIO()):
        refused_by_inspect = main(["inspect", str(head)]) != 0
    return outcomes, refused_by_inspect


@pytest.mark.parametrize("link", sorted(LINKS))
@pytest.mark.parametrize("damage", sorted({**DAMAGE, **STRUCTURAL}))
def test_every_damage_to_any_link_of_a_chain_gets_one_verdict_from_every_reader(tmp_path, damage, link):
    """Each damage of the full format's list, applied to the head, a middle link or the full
    base of a chain (newer links re-pinned to it): the textbook and the hardened load, both
    compactions and ``inspect`` refuse it alike, with one error class."""
    damage_fn, _ = {**DAMAGE, **STRUCTURAL}[damage]
    paths, store = _chain_of_three(tmp_path, "numba")
    damage_fn(paths[LINKS[link]], 3)
    _repin(paths, LINKS[link])
    outcomes, refused_by_inspect = _chain_verdicts(paths[0], store, tmp_path)
    assert len(set(outcomes.values())) == 1, (damage, link, outcomes)
    assert refused_by_inspect == (outcomes["textbook load"] is not None), (damage, link, outcomes)
    assert outcomes["textbook load"] in (leanstate.CheckpointError, FileNotFoundError), outcomes


# the damages that do not depend on version 1's table layout: they apply to a version-2 link as
# they are (a version-2 manifest's table entry lists files, not chunks)
ANY_VERSION = [
    name
    for name in sorted({**DAMAGE, **STRUCTURAL})
    if name
    in {
        "manifest not JSON", "manifest missing", "version 3", "other format", "extra flipped",
        "extra null, file present", "extra key missing", "manifest is a symlink", "manifest is a FIFO",
        "version 1.0", "version true", "version a string", "NaN", "duplicate key", "manifest in UTF-16",
        "manifest with a UTF-8 BOM", "extra holds a list", "nesting 100,000 deep", "extra file outside",
    }
]  # fmt: skip


def _chain_across_ranks(folder):
    """The chain of :func:`_chain_of_three` saved across ranks (one rank): version 2 throughout."""
    from leanstate.checkpoint._bucketed_table import BucketedTable
    from tests.harness import one_rank_group

    store = KVStore(4, optimizer_state_dim=1, clock=FakeClock(9), backend="numba")
    generator = torch.Generator().manual_seed(11)
    store.set(torch.arange(0, 300, 3), torch.randn(100, 4, generator=generator))
    paths = [folder / "v2-d2", folder / "v2-d1", folder / "v2-c0"]
    with one_rank_group() as group:
        for step, path in enumerate(reversed(paths)):
            if step:
                store.set(torch.arange(step, 300, 7), torch.randn(43, 4, generator=generator))
                store.delete(torch.arange(3 * step, 300, 29))
            leanstate.save_checkpoint(
                path,
                {"t": BucketedTable(store, 8, None)},
                process_group=group,
                base=None if step == 0 else paths[3 - step],
                extra={"step": step},
                chunk_bytes=8 * store.layout.row_bytes,
            )
    return paths, store


@pytest.mark.parametrize("link", sorted(LINKS))
@pytest.mark.parametrize("damage", ANY_VERSION)
def test_a_chain_across_ranks_gets_the_textbooks_verdict_on_the_same_damage(tmp_path, damage, link):
    """Version 2 has no textbook of its own: each damage that applies to any version, at the
    same link of a version-2 chain, is refused by its load into plain stores, its compaction
    and ``inspect`` with the class the textbook gives the version-1 chain."""
    damage_fn, _ = {**DAMAGE, **STRUCTURAL}[damage]
    v1, store = _chain_of_three(tmp_path, "reference")
    damage_fn(v1[LINKS[link]], 3)
    _repin(v1, LINKS[link])
    try:
        delta.load_checkpoint(v1[0], {"t": fresh(store)})
        expected = None
    except Exception as exc:
        expected = type(exc)
    v2, _ = _chain_across_ranks(tmp_path)
    damage_fn(v2[LINKS[link]], 3)
    _repin(v2, LINKS[link])
    outcomes = {}
    for name, run in (
        ("load", lambda: leanstate.load_checkpoint(v2[0], {"t": fresh(store, None, "numba")})),
        ("compaction", lambda: leanstate.compact_checkpoint(v2[0], tmp_path / "v2-out")),
    ):
        try:
            run()
            outcomes[name] = None
        except Exception as exc:
            outcomes[name] = type(exc)
    with contextlib.redirect_stdout(io.StringIO()):
        outcomes["inspect refused"] = main(["inspect", str(v2[0])]) != 0
    assert outcomes == {"load": expected, "compaction": expected, "inspect refused": expected is not None}, (
        damage,
        link,
        outcomes,
    )
