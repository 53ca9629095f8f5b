"""The conformance kit's state machine (``leanstate.testing.StoreMachine``) and the helpers
its checks share: bit comparisons that say where two results differ, a settable clock.

Random operations on a store under test and on the reference store, inputs drawn from
``leanstate._strategies`` (edge and colliding ids, padding, wide and odd dims, every
dtype, saturating counts, eviction boundaries, ``out=`` buffers), every result compared
as raw bytes. Change tracking too (``spec/kv_store.md``): epochs end at random, and the
ids written and removed since a few remembered marks are compared with the reference's
and with a plain model kept here (id -> epoch of its last write or removal).
"""

from __future__ import annotations

import hypothesis
import torch
from hypothesis import strategies as st
from hypothesis.database import ExampleDatabase
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from leanstate._strategies import PADDING_IDS, counts, evictions, id_batches, ids, layouts, out_buffers
from leanstate.kv_store import KVStore
from leanstate.reference.kv_store import ChangeMark
from leanstate.reference.row_format import RowLayout, header_words, pack_metadata, unpack_metadata

_IDS = id_batches(padding=True)  # duplicates, colliding ids, the int64 edges and padding
_FLOATS = st.integers(-8, 8).map(lambda x: x / 4)  # exact in every dtype
# Narrow choices shrink in a few steps (each step reruns the program): a column is a spot
# modulo the columns there are (at most 304), values come from one of 256 seeds.
_MARK, _SPOT, _SEED = st.integers(0, 7), st.integers(0, 1023), st.integers(0, 255)


def row_difference(mine: torch.Tensor, reference: torch.Tensor, ids, layout: RowLayout) -> str | None:
    """Where two batches of whole rows first differ, in words (the id, and the header field
    or the weight or state column), or None when they are bit-identical."""
    if mine.shape != reference.shape or mine.dtype != reference.dtype:
        return f"rows of shape {tuple(mine.shape)} {mine.dtype}, the reference {tuple(reference.shape)} {reference.dtype}"
    ids = torch.as_tensor(ids).tolist()
    mine_words, ref_words = header_words(mine.contiguous()), header_words(reference.contiguous())
    fields = ("timestamp", "count", "used")
    for row, key in enumerate(ids):
        if int(mine_words[row, 0]) != int(ref_words[row, 0]):
            return f"id {key}: header key {int(mine_words[row, 0])}, the reference {int(ref_words[row, 0])}"
        got, want = (unpack_metadata(w[row : row + 1, 1]) for w in (mine_words, ref_words))
        for name, a, b in zip(fields, got, want):
            if int(a) != int(b):
                return f"id {key}: header {name} {int(a)}, the reference {int(b)}"
        a, b = (r[row].contiguous().view(_INTEGER_OF_SIZE[r.element_size()]) for r in (mine, reference))
        for column in torch.nonzero(a != b).flatten().tolist():
            if column < layout.weight_offset:
                continue
            part, index = (
                ("weight", column - layout.weight_offset)
                if column < layout.state_offset
                else ("state", column - layout.state_offset)
            )
            if part == "weight" and index >= layout.dim:
                part = "weight padding"
            value, expected = mine[row, column].item(), reference[row, column].item()
            return f"id {key}: {part} column {index} is {value}, the reference {expected}"
    return None


_INTEGER_OF_SIZE = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}  # compare bits, not values


def shown(value) -> str:
    """``value`` for a failure message (a short tensor as its list)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.tolist()})" if value.numel() <= 24 else f"tensor of shape {tuple(value.shape)}"
    return repr(value)


def first_cell(reference: torch.Tensor, mine: torch.Tensor, ids) -> str:
    """The first position where two results differ, naming the id of its row."""
    if reference.shape != mine.shape or reference.dtype != mine.dtype:
        return f"shape {tuple(mine.shape)} {mine.dtype}, the reference {tuple(reference.shape)} {reference.dtype}"
    bits = _INTEGER_OF_SIZE[reference.element_size()]
    where = torch.nonzero(reference.contiguous().view(bits) != mine.contiguous().view(bits))
    if len(where) == 0:
        return "no difference"
    row, *column = where[0].tolist()
    key = ids[row] if row < len(ids) else row
    at = f"id {key}" + (f", column {column[0]}" if column else "")
    return f"{at}: {mine[tuple(where[0].tolist())].item()}, the reference {reference[tuple(where[0].tolist())].item()}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality of two tensors (headers read as floats may be NaN)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


class Clock:
    """A settable clock in whole seconds: both stores see the same time."""

    def __init__(self, now: int = 1_700_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def reference_store(dim: int, **options) -> KVStore:
    """A store of the reference backend, the one every other is held to."""
    return KVStore(dim, backend="reference", **options)


class StoreMachine(RuleBasedStateMachine):
    """Random operations on the store under test (``make_store``) and on the reference; every
    result compared bit for bit (values, whole rows with headers, metadata, keys, evicted ids)."""

    make_store = staticmethod(reference_store)
    max_dim = 300  # the widest store drawn

    @initialize(seed=st.integers(0, 2**64 - 1), data=st.data())
    def start(self, seed, data):
        self.clock = Clock(10)
        self.layout = layout = data.draw(layouts(self.max_dim), label="layout")
        options = dict(optimizer_state_dim=layout.state_dim, dtype=layout.dtype, seed=seed, clock=self.clock)
        self.ref = reference_store(layout.dim, **options)
        self.mine = self.make_store(layout.dim, **options)
        self.ops = [f"a store of dim {layout.dim}, state {layout.state_dim}, {layout.dtype}, seed {seed}"]
        # change tracking: the model (id -> epoch of its last write / removal) and the marks
        # it is fair to ask about (none from before tracking was last turned back on)
        self.epoch, self.tracking, self.marks = 1, True, [0]
        self.written: dict[int, int] = {}
        self.removed: dict[int, int] = {}
        self.tracks = all(hasattr(self.mine, m) for m in ("changes", "next_epoch", "track_changes"))

    def wrote(self, ids) -> None:
        """The model: ``ids`` (padding skipped) were written in the current epoch."""
        if self.tracking:
            for key in (k for k in torch.as_tensor(ids).tolist() if k >= 0):
                self.written[key] = self.epoch
                self.removed.pop(key, None)

    def gone(self, ids) -> None:
        """The model: ``ids`` (present before) were deleted or evicted in the current epoch."""
        if self.tracking:
            for key in torch.as_tensor(ids).tolist():
                self.removed[key] = self.epoch
                self.written.pop(key, None)

    def both(self, method, *args, **kwargs):
        words = [shown(a) for a in args] + [f"{k}={shown(v)}" for k, v in kwargs.items()]
        self.ops.append(f"{method}({', '.join(words)})")
        return getattr(self.ref, method)(*args, **kwargs), getattr(self.mine, method)(*args, **kwargs)

    def fail(self, what: str) -> None:
        """Raise naming what differs and the operations that led there."""
        steps = "\n  ".join(self.ops[-12:])
        raise AssertionError(f"{what}\nafter (the last {min(12, len(self.ops))} operations):\n  {steps}")

    def columns(self, data, width_or_none: bool = False) -> tuple[int, int | None]:
        """A column offset and a width inside the value columns, often on a part's boundary."""
        total, layout = self.layout.value_width, self.layout
        marks = (0, 1, layout.dim, layout.padded_dim, total)
        mark = data.draw(_MARK)  # fixed strategies: one built per draw is validated per draw
        offset = marks[mark] if mark < len(marks) else data.draw(_SPOT) % (total + 1)
        width = data.draw(_SPOT) % (total - offset + 1)
        return offset, None if width_or_none and data.draw(st.booleans()) else width

    @rule(ids=_IDS, data=st.data())
    def set(self, ids, data):
        offset, width = self.columns(data)
        # seeded values: a wide row would overrun hypothesis's buffer drawn value by value
        generator = torch.Generator().manual_seed(data.draw(_SEED))
        values = torch.randint(-8, 9, (len(ids), width), generator=generator) / 4  # exact in every dtype
        self.both(
            "set", torch.tensor(ids, dtype=torch.int64), values.to(self.layout.dtype), width_offset=offset
        )
        self.wrote(ids)

    @rule(ids=_IDS, data=st.data())
    def get(self, ids, data):
        offset, width = self.columns(data, width_or_none=True)
        a, b = self.both("get", torch.tensor(ids, dtype=torch.int64), width_offset=offset, width=width)
        if not same_bits(a, b):
            self.fail(
                f"get(ids={ids}, width_offset={offset}, width={width}) differs: {first_cell(a, b, ids)}"
            )

    @rule(ids=_IDS, whole=st.booleans(), data=st.data())
    def read_into(self, ids, whole, data):
        method, width = ("get_rows", self.layout.width) if whole else ("get", self.layout.value_width)
        out = data.draw(out_buffers((len(ids), width), self.layout.dtype))
        self.ops.append(
            f"{method}({ids}, out=a [{len(ids)}, {width}] buffer of {out.flatten()[:1].tolist()})"
        )
        keys = torch.tensor(ids, dtype=torch.int64)
        want, got = getattr(self.ref, method)(keys), getattr(self.mine, method)(keys, out=out)
        if got.data_ptr() != out.data_ptr():
            self.fail(f"{method}(out=) returned a new tensor, not out")
        if not same_bits(out, want):
            self.fail(f"{method}(out=) left out unlike the reference: {first_cell(want, out, ids)}")

    @rule(ids=_IDS)
    def reads(self, ids):
        ids = torch.tensor(ids, dtype=torch.int64)
        for method in ("get_rows", "metadata", "contains"):
            a, b = self.both(method, ids)
            if method == "get_rows" and not same_bits(b, a):
                self.fail(f"get_rows: {row_difference(b, a, ids, self.layout)}")
            if not same_bits(a, b):
                self.fail(f"{method}({ids.tolist()}) differs: {first_cell(a, b, ids.tolist())}")

    @rule(
        ids=st.lists(ids(), max_size=8),
        stamps=st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=8),
        counts=st.lists(counts(), min_size=8, max_size=8),
        fill=_FLOATS,
        used=st.booleans(),
        negative=st.none() | st.tuples(st.integers(0, 7), st.sampled_from(PADDING_IDS)),
    )
    def set_rows(self, ids, stamps, counts, fill, used, negative):
        if negative is not None and negative[0] <= len(ids) < 8:  # one key set_rows must refuse
            ids = [*ids[: negative[0]], negative[1], *ids[negative[0] :]]
        rows = torch.full((len(ids), self.layout.width), fill, dtype=self.layout.dtype)
        header_words(rows)[:, 0] = torch.tensor(ids, dtype=torch.int64)
        header_words(rows)[:, 1] = pack_metadata(
            torch.tensor(stamps[: len(ids)]), torch.tensor(counts[: len(ids)]), torch.full((len(ids),), used)
        )
        before = rows.clone()  # a copy: an alias would change with the rows it guards
        if any(key < 0 for key in ids):
            self.ops.append(f"set_rows(rows keyed {ids}), refused")
            for store in (self.ref, self.mine):
                try:
                    store.set_rows(rows)
                except ValueError:
                    continue
                self.fail(f"set_rows of rows keyed {ids} did not raise ValueError (a negative key)")
        else:
            self.both("set_rows", rows)
            self.wrote(ids)
        if not same_bits(rows, before):
            self.fail("set_rows wrote into the caller's rows (it must copy them)")

    @rule(ids=_IDS)
    def delete(self, ids):
        ids = torch.tensor(ids, dtype=torch.int64)
        present = torch.unique(ids[self.ref.contains(ids)])
        a, b = self.both("delete", ids)
        if a != b:
            self.fail(f"delete({ids.tolist()}) returned {b}, the reference {a} (the count of ids removed)")
        self.gone(present)

    @rule(seconds=st.integers(0, 50))
    def tick(self, seconds):
        self.clock.now += seconds

    @precondition(lambda self: len(self.ref) > 0)
    @rule(data=st.data())
    def evict(self, data):
        keys = self.ref.keys()
        stamp, count, _ = unpack_metadata(self.ref.metadata(keys))
        norms = torch.linalg.vector_norm(self.ref.get(keys, width=self.layout.dim).float(), dim=1)
        policy = data.draw(
            evictions(
                counts=count.tolist(),
                ages=(self.clock.now - stamp).tolist(),
                norms=norms.tolist(),
                rows=len(keys),
            )
        )
        a, b = self.both("evict", **policy)
        if not torch.equal(a, b):
            self.fail(f"evict({policy}) evicted ids {b.tolist()}, the reference {a.tolist()}")
        self.gone(a)

    @rule(lo=ids(padding=True), span=st.integers(0, 50) | st.just(2**63))
    def keys_in_range(self, lo, span):
        hi = min(lo + span, 2**63)  # up to the end of the id space
        a, b = self.both("keys_in_range", lo, hi)
        if not torch.equal(a, b):
            self.fail(f"keys_in_range({lo}, {hi}) gave {b.tolist()}, the reference {a.tolist()}")

    # -- change tracking ---------------------------------------------------------------

    def on_both(self, method, *args):
        """``method`` on the reference, and on the store under test when it tracks changes."""
        self.ops.append(f"{method}({', '.join(map(shown, args))})")
        mine = getattr(self.mine, method)(*args) if self.tracks else None
        return getattr(self.ref, method)(*args), mine

    @rule()
    def new_epoch(self):
        a, b = self.on_both("next_epoch")
        if a != self.epoch or (self.tracks and b != a):
            self.fail(f"next_epoch() returned {b}, the reference {a}; epoch {self.epoch} was current")
        self.epoch += 1
        if self.tracking:
            self.marks.append(a)

    @precondition(lambda self: self.marks)
    @rule(data=st.data())
    def changes(self, data):
        mark = data.draw(st.sampled_from(self.marks), label="since")
        present = set(self.ref.keys().tolist())
        model = (
            sorted(k for k, e in self.written.items() if e > mark and k in present),
            sorted(k for k, e in self.removed.items() if e > mark and k not in present),
        )
        a, b = self.on_both("changes", mark)
        for name, got in (("the reference", a), ("the store", b)):
            if got is None:
                continue
            if not all(t.dtype == torch.int64 and t.dim() == 1 and t.device.type == "cpu" for t in got):
                self.fail(f"changes({mark}) of {name}: not two 1-D int64 CPU tensors: {got}")
            written, removed = (t.tolist() for t in got)
            if (written, removed) != model:
                self.fail(
                    f"changes(since={mark}) of {name}: written {written}, removed {removed}; "
                    f"expected written {model[0]}, removed {model[1]}"
                )

    @precondition(lambda self: self.marks)
    @rule(data=st.data())
    def set_mark(self, data):
        """A checkpoint taken at a remembered mark: the stores forget the removals up to it."""
        mark = ChangeMark(data.draw(st.sampled_from(self.marks), label="mark"), "0" * 64)
        self.ops.append(f"mark = {mark}")
        for store in (self.ref, self.mine) if self.tracks else (self.ref,):
            store.mark = mark
            if store.mark != mark:
                self.fail(f"mark = {mark} left mark {store.mark}")
        self.marks = [m for m in self.marks if m >= mark.epoch]  # the earlier ones are forgotten
        if self.tracks and not all(map(torch.equal, self.mine.changes(), self.mine.changes(mark.epoch))):
            self.fail("changes() is not changes(since=mark.epoch)")

    @rule()
    def track_changes(self):
        """Tracking off (nothing recorded) or back on: either way no mark stays, and no mark
        from before is fair to ask about again."""
        self.tracking = not self.tracking
        self.on_both("track_changes", self.tracking)
        for store in (self.ref, self.mine) if self.tracks else (self.ref,):
            if store.tracking != self.tracking or store.mark is not None:
                self.fail(f"track_changes({self.tracking}) left tracking {store.tracking}, mark {store.mark}")
        self.marks = []

    @invariant()
    def same_rows(self):
        if hasattr(self, "ref"):
            keys = self.ref.keys()
            mine = self.mine.keys()
            if not torch.equal(keys, mine):
                self.fail(f"keys() gave {mine.tolist()}, the reference {keys.tolist()} (ids, ascending)")
            if len(self.ref) != len(self.mine):
                self.fail(f"len() is {len(self.mine)}, the reference {len(self.ref)}")
            rows, want = self.mine.get_rows(keys), self.ref.get_rows(keys)
            if not same_bits(rows, want):  # words only then: row_difference reads row by row
                self.fail(f"whole rows differ: {row_difference(rows, want, keys, self.layout)}")


def run_store_machine(
    make_store,
    examples: int = 60,
    steps: int = 30,
    *,
    max_dim: int = 300,
    settings: hypothesis.settings | None = None,
) -> None:
    """Run :class:`StoreMachine` on ``make_store``; raises on the first difference (shrunk).

    Stores are drawn with dims up to ``max_dim`` (most at most 8; a slow store, such as
    one run in a simulator, takes a smaller bound). ``settings`` (hypothesis's) replace
    ``examples`` and ``steps`` when given (a seed,
    a profile's database, ``derandomize``...). Each store keeps its own failing examples
    in hypothesis's database, keyed by ``make_store``'s name, so one store's failure is
    replayed on that store, not on the next one checked.
    """
    name = getattr(make_store, "__qualname__", type(make_store).__qualname__)
    module = getattr(make_store, "__module__", "")
    machine = type(
        f"StoreMachineFor[{module}.{name}]",
        (StoreMachine,),
        {"make_store": staticmethod(make_store), "max_dim": max_dim},
    )
    # no explain phase: it varies every choice of the shrunk program (minutes on a machine
    # drawing this much); the failure names the last operations and hypothesis the program
    phases = [phase for phase in hypothesis.Phase if phase != hypothesis.Phase.explain]
    chosen = settings or hypothesis.settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, phases=phases
    )
    if chosen.database is not None:
        chosen = hypothesis.settings(chosen, database=_KeyedDatabase(chosen.database, f"{module}.{name}"))
    machine.TestCase.settings = chosen
    machine.TestCase().runTest()


class _KeyedDatabase(ExampleDatabase):
    """``database`` with every key prefixed by ``prefix``: the state machines of different
    stores share one test function, so hypothesis would give them one key."""

    def __init__(self, database: ExampleDatabase, prefix: str) -> None:
        super().__init__()
        self.database, self.prefix = database, prefix.encode() + b":"

    def save(self, key: bytes, value: bytes) -> None:
        self.database.save(self.prefix + key, value)

    def fetch(self, key: bytes):
        return self.database.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.database.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.database.move(self.prefix + src, self.prefix + dest, value)
