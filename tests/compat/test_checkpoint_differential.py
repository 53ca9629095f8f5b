"""The hardened checkpoint I/O (``leanstate.save_checkpoint`` / ``load_checkpoint``) held to
the textbook (``leanstate.reference.checkpoint``), as the accelerated stores are held to
the reference store: over random tables (row counts, dims, state dims, dtypes, chunk
sizes, deleted rows, views, extra state) both write byte-identical directories, each
loads what the other wrote into identical rows, and on the same damaged checkpoint both
raise the same error class and change no store.
"""

from __future__ import annotations

import json
import shutil

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leanstate
from leanstate.kv_store import KVStore
from leanstate.reference import checkpoint as reference
from leanstate.reference.kv_tensor import KVTensor
from tests.harness import FakeClock

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def tables(draw):
    """A store with random rows (some deleted, some with a second write), and how to save it."""
    n = draw(st.integers(0, 120))
    dim = draw(st.integers(1, 40))
    state = draw(st.integers(0, 2))
    dtype = draw(st.sampled_from(DTYPES))
    backend = draw(st.sampled_from(["reference", "numba", "torch"]))
    seed = draw(st.integers(0, 2**16))
    store = KVStore(dim, optimizer_state_dim=state, dtype=dtype, clock=FakeClock(seed), backend=backend)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randperm(4 * n + 1, generator=generator)[:n] * draw(st.sampled_from([1, 7919, 2**40]))
    store.set(ids, torch.randn(n, dim, generator=generator).to(dtype))
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


def fresh(store, holding=None):
    layout = store.layout
    out = KVStore(layout.dim, optimizer_state_dim=layout.state_dim, dtype=layout.dtype, backend="reference")
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


@SETTINGS
@given(tables(), st.sampled_from(sorted(DAMAGE)), st.integers(0, 2**20), st.booleans())
def test_both_refuse_the_same_damage_with_the_same_error_class(tmp_path_factory, table, damage, at, live):
    store, chunk_bytes, extra, _ = table
    damage_fn, needs_rows = DAMAGE[damage]
    if needs_rows and len(store) == 0:
        damage_fn = DAMAGE["manifest not JSON"][0]
    folder = tmp_path_factory.mktemp("bad")
    reference.save_checkpoint(folder / "c", {"t": store}, extra=extra, chunk_bytes=chunk_bytes)
    damage_fn(folder / "c", at)
    outcomes = []
    for load in (reference.load_checkpoint, leanstate.load_checkpoint):
        target = fresh(store, store.keys()[:3] if live else None)
        before = rows_of(target)
        try:
            load(folder / "c", {"t": target})
            outcome = None
        except Exception as exc:
            outcome = type(exc)
            after = rows_of(target)
            assert all(torch.equal(x, y) for x, y in zip(before, after)), (load, damage)
        outcomes.append(outcome)
    assert outcomes[0] == outcomes[1], (damage, outcomes)
    shutil.rmtree(folder)
