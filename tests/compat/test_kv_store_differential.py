"""Every accelerated store engine held to the reference engine, bit for bit, through the front class.

A hypothesis state machine runs the same random operations on a reference store and on
the store of the backend under test and compares every result (values, whole rows with
headers, metadata, keys, evicted ids, counts) as raw bytes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from leanstate import _backends
from leanstate.kv_store import KVStore
from leanstate.reference.row_format import COUNT_MAX, RowLayout, header_words, pack_metadata
from tests.conftest import FakeClock
from tests.reference.test_kv_store_stateful import DIM, STATE, same_bits, small_floats

ACCELERATED = sorted(b for b in _backends.available("kv_store") if b != "reference")
POOL = st.integers(-2, 40)  # a wider id pool than the model machine's: more misses
id_lists = st.lists(POOL, min_size=0, max_size=16)


class DifferentialMachine(RuleBasedStateMachine):
    backend = "numba"

    @initialize(
        dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
        num_shards=st.integers(1, 5),
        seed=st.integers(0, 2**64 - 1),
    )
    def start(self, dtype, num_shards, seed):
        self.clock = FakeClock(10)
        self.layout = RowLayout(DIM, STATE, dtype)
        common = dict(optimizer_state_dim=STATE, dtype=dtype, seed=seed, clock=self.clock)
        self.ref = KVStore(DIM, num_shards=num_shards, backend="reference", **common)
        self.fast = KVStore(DIM, num_shards=6 - num_shards, backend=self.backend, **common)

    def both(self, method, *args, **kwargs):
        a = getattr(self.ref, method)(*args, **kwargs)
        b = getattr(self.fast, method)(*args, **kwargs)
        return a, b

    @rule(ids=id_lists, offset=st.integers(0, 8), data=st.data())
    def set(self, ids, offset, data):
        width = data.draw(st.integers(0, self.layout.value_width - offset))
        flat = data.draw(st.lists(small_floats, min_size=width * len(ids), max_size=width * len(ids)))
        values = torch.tensor(flat, dtype=self.layout.dtype).reshape(len(ids), width)
        self.both("set", torch.tensor(ids, dtype=torch.int64), values, width_offset=offset)

    @rule(ids=id_lists, offset=st.integers(0, 8), data=st.data())
    def get(self, ids, offset, data):
        width = data.draw(st.none() | st.integers(0, self.layout.value_width - offset))
        a, b = self.both("get", torch.tensor(ids, dtype=torch.int64), width_offset=offset, width=width)
        assert same_bits(a, b)

    @rule(ids=id_lists)
    def reads(self, ids):
        ids = torch.tensor(ids, dtype=torch.int64)
        for method in ("get_rows", "metadata", "contains"):
            a, b = self.both(method, ids)
            assert same_bits(a, b), method

    @rule(
        ids=st.lists(st.integers(0, 40), max_size=8),
        stamps=st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=8),
        counts=st.lists(st.integers(0, COUNT_MAX), min_size=8, max_size=8),
        fill=small_floats,
        used=st.booleans(),
    )
    def set_rows(self, ids, stamps, counts, fill, used):
        rows = torch.full((len(ids), self.layout.width), fill, dtype=self.layout.dtype)
        header_words(rows)[:, 0] = torch.tensor(ids, dtype=torch.int64)
        header_words(rows)[:, 1] = pack_metadata(
            torch.tensor(stamps[: len(ids)]), torch.tensor(counts[: len(ids)]), torch.full((len(ids),), used)
        )
        before = rows.clone()
        self.both("set_rows", rows)
        assert same_bits(rows, before)  # the caller's rows are never written

    @rule(ids=id_lists)
    def delete(self, ids):
        a, b = self.both("delete", torch.tensor(ids, dtype=torch.int64))
        assert a == b

    @rule(seconds=st.integers(0, 50))
    def tick(self, seconds):
        self.clock.now += seconds

    @precondition(lambda self: len(self.ref) > 0)
    @rule(
        min_count=st.none() | st.integers(0, 3),
        max_age_s=st.none() | st.integers(0, 60),
        min_l2_norm=st.none() | st.sampled_from([0.0, 0.01, 1.0]),
        max_rows=st.none() | st.integers(0, 20),
    )
    def evict(self, min_count, max_age_s, min_l2_norm, max_rows):
        a, b = self.both(
            "evict", min_count=min_count, max_age_s=max_age_s, min_l2_norm=min_l2_norm, max_rows=max_rows
        )
        assert torch.equal(a, b)

    @rule(lo=st.integers(-5, 45), span=st.integers(0, 50))
    def keys_in_range(self, lo, span):
        a, b = self.both("keys_in_range", lo, lo + span)
        assert torch.equal(a, b)

    @invariant()
    def same_rows(self):
        if hasattr(self, "ref"):
            keys = self.ref.keys()
            assert torch.equal(keys, self.fast.keys()) and len(self.ref) == len(self.fast)
            assert same_bits(self.ref.get_rows(keys), self.fast.get_rows(keys))


def machine_for(backend: str, examples: int = 80):
    machine = type(f"Differential_{backend}", (DifferentialMachine,), {"backend": backend})
    machine.TestCase.settings = settings(max_examples=examples, stateful_step_count=30, deadline=None)
    return machine.TestCase


@pytest.mark.parametrize("backend", ACCELERATED)
def test_engine_matches_the_reference(backend):
    # the simulator runs each kernel thread as Python: fewer runs, the same machine
    machine_for(backend, examples=20 if backend == "numba-cuda" else 80)().runTest()
