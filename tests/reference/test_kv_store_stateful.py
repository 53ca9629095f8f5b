"""A hypothesis state machine holding the reference store to a plain dict model.

The accelerated engines are held to the reference itself by the differential machine
in ``tests/compat/test_kv_store_differential.py``.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from leanstate.kv_store import KVStore
from leanstate.reference.hashing import initial_weights
from leanstate.reference.row_format import COUNT_MAX, RowLayout, header_words, pack_metadata
from tests.harness import FakeClock

DIM, STATE = 5, 2
POOL = st.integers(-2, 24)  # a small id pool makes hits, misses and duplicates common
id_lists = st.lists(POOL, min_size=0, max_size=12)
small_floats = st.integers(-8, 8).map(lambda x: x / 4)  # exact in every dtype


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality: headers reinterpreted as floats may be NaN."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


class KVStoreMachine(RuleBasedStateMachine):
    def make_store(self, dtype, num_shards, clock) -> KVStore:
        return KVStore(
            DIM,
            optimizer_state_dim=STATE,
            dtype=dtype,
            num_shards=num_shards,
            seed=17,
            clock=clock,
            backend="reference",
        )

    @initialize(
        dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
        num_shards=st.integers(1, 5),
    )
    def start(self, dtype, num_shards):
        self.clock = FakeClock(10)
        self.store = self.make_store(dtype, num_shards, self.clock)
        self.layout = RowLayout(DIM, STATE, dtype)
        self.model: dict[int, tuple[torch.Tensor, int, int]] = {}  # id -> (values, timestamp, count)

    # -- the model -------------------------------------------------------------------

    def initial(self, key: int) -> torch.Tensor:
        values = torch.zeros(self.layout.value_width, dtype=self.layout.dtype)
        values[:DIM] = initial_weights(
            torch.tensor([key]), DIM, seed=17, low=-0.01, high=0.01, dtype=self.layout.dtype
        )[0]
        return values

    def model_values(self, key: int) -> torch.Tensor:
        if key < 0:
            return torch.zeros(self.layout.value_width, dtype=self.layout.dtype)
        return self.model[key][0] if key in self.model else self.initial(key)

    def model_row(self, key: int) -> torch.Tensor:
        row = torch.zeros(1, self.layout.width, dtype=self.layout.dtype)
        if key in self.model:
            values, stamp, count = self.model[key]
            row[0, self.layout.header_elems :] = values
            meta = pack_metadata(torch.tensor([stamp]), torch.tensor([count]), torch.tensor([True]))
            header_words(row)[0] = torch.cat([torch.tensor([key]), meta])
        return row[0]

    # -- rules ------------------------------------------------------------------------

    @rule(ids=id_lists, offset=st.integers(0, 8), data=st.data())
    def set(self, ids, offset, data):
        width = data.draw(st.integers(0, self.layout.value_width - offset))
        values = torch.tensor(
            data.draw(
                st.lists(
                    st.lists(small_floats, min_size=width, max_size=width),
                    min_size=len(ids),
                    max_size=len(ids),
                )
            ),
            dtype=self.layout.dtype,
        ).reshape(len(ids), width)
        self.store.set(torch.tensor(ids, dtype=torch.int64), values, width_offset=offset)
        for key, row in zip(ids, values):
            if key < 0:
                continue
            current = self.model_values(key).clone()
            current[offset : offset + width] = row
            count = self.model[key][2] if key in self.model else 0
            self.model[key] = (current, self.clock.now, min(count + 1, COUNT_MAX))

    @rule(ids=id_lists, offset=st.integers(0, 8), data=st.data())
    def get(self, ids, offset, data):
        width = data.draw(st.integers(0, self.layout.value_width - offset))
        got = self.store.get(torch.tensor(ids, dtype=torch.int64), width_offset=offset, width=width)
        assert got.shape == (len(ids), width)
        for key, row in zip(ids, got):
            assert same_bits(row, self.model_values(key)[offset : offset + width]), key

    @rule(ids=id_lists)
    def get_rows(self, ids):
        got = self.store.get_rows(torch.tensor(ids, dtype=torch.int64))
        for key, row in zip(ids, got):
            assert same_bits(row, self.model_row(key)), key

    @rule(
        ids=st.lists(st.integers(0, 24), max_size=6),
        stamps=st.lists(st.integers(0, 2**32 - 1), min_size=6, max_size=6),
        counts=st.lists(st.integers(0, COUNT_MAX), min_size=6, max_size=6),
        fill=small_floats,
    )
    def set_rows(self, ids, stamps, counts, fill):
        rows = torch.full((len(ids), self.layout.width), fill, dtype=self.layout.dtype)
        meta = pack_metadata(
            torch.tensor(stamps[: len(ids)]),
            torch.tensor(counts[: len(ids)]),
            torch.zeros(len(ids)),
        )
        header_words(rows)[:, 0] = torch.tensor(ids, dtype=torch.int64)
        header_words(rows)[:, 1] = meta
        self.store.set_rows(rows)
        for key, row, stamp, count in zip(ids, rows, stamps, counts):
            self.model[key] = (row[self.layout.header_elems :].clone(), stamp, count)

    @rule(ids=id_lists)
    def delete(self, ids):
        removed = self.store.delete(torch.tensor(ids, dtype=torch.int64))
        assert removed == len({k for k in ids if k in self.model})
        for key in ids:
            self.model.pop(key, None)

    @rule(seconds=st.integers(0, 50))
    def tick(self, seconds):
        self.clock.now += seconds

    @precondition(lambda self: len(self.model) > 0)
    @rule(
        min_count=st.none() | st.integers(0, 3),
        max_age_s=st.none() | st.integers(0, 60),
        min_l2_norm=st.none() | st.sampled_from([0.0, 0.01, 1.0]),
        max_rows=st.none() | st.integers(0, 10),
    )
    def evict(self, min_count, max_age_s, min_l2_norm, max_rows):
        got = self.store.evict(
            min_count=min_count, max_age_s=max_age_s, min_l2_norm=min_l2_norm, max_rows=max_rows
        )
        doomed = set()
        for key, (values, stamp, count) in self.model.items():
            norm = float(torch.linalg.vector_norm(values[:DIM].float()))
            if (
                (min_count is not None and count < min_count)
                or (max_age_s is not None and self.clock.now - stamp > max_age_s)
                or (min_l2_norm is not None and norm < min_l2_norm)
            ):
                doomed.add(key)
        if max_rows is not None:
            rest = sorted(
                (k for k in self.model if k not in doomed),
                key=lambda k: (self.model[k][2], self.model[k][1], k),
            )
            doomed.update(rest[: max(0, len(rest) - max_rows)])
        assert got.tolist() == sorted(doomed)
        for key in doomed:
            del self.model[key]

    @invariant()
    def same_keys(self):
        if hasattr(self, "store"):
            assert self.store.keys().tolist() == sorted(self.model)
            assert len(self.store) == len(self.model)


KVStoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestReferenceKVStore = KVStoreMachine.TestCase
