"""The choice of an eviction's victims (``accelerated/_eviction.py``), shared by the
accelerated engines, against the rules of ``spec/kv_store.md`` stated plainly."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leanstate.accelerated._eviction import doomed
from leanstate.reference.row_format import COUNT_MAX, pack_metadata

# few distinct ages and counts, so that ties decide which rows go
rows = st.lists(
    st.tuples(st.integers(0, 8), st.integers(0, 2), st.floats(0, 3, allow_nan=False)), max_size=30
)
optional = st.one_of(st.none(), st.integers(0, 8))


@settings(max_examples=200, deadline=None)
@given(rows=rows, min_count=st.one_of(st.none(), st.integers(0, 6)), max_age_s=optional,
       min_l2_norm=st.one_of(st.none(), st.floats(0, 3)), max_rows=optional)  # fmt: skip
def test_the_victims_are_those_the_rules_name_in_their_order(
    rows, min_count, max_age_s, min_l2_norm, max_rows
):
    now = 100
    stamps = torch.tensor([now - age for age, _, _ in rows], dtype=torch.int64)
    counts = torch.tensor([count for _, count, _ in rows], dtype=torch.int64)
    meta = pack_metadata(stamps, counts, torch.ones(len(rows), dtype=torch.bool))
    weights = torch.tensor([[norm, 0.0] for _, _, norm in rows]).reshape(len(rows), 2)
    got = doomed(meta, weights, min_count=min_count, max_age_s=max_age_s, min_l2_norm=min_l2_norm,
                 max_rows=max_rows, now=now)  # fmt: skip
    expected = [
        (min_count is not None and count < min_count)
        or (max_age_s is not None and age > max_age_s)
        or (min_l2_norm is not None and torch.tensor(norm, dtype=torch.float32) < min_l2_norm)
        for age, count, norm in rows
    ]
    left = [i for i, gone in enumerate(expected) if not gone]
    if max_rows is not None and len(left) > max_rows:
        # fewest writes first, then the oldest, then the smallest id (rows are in id order)
        for i in sorted(left, key=lambda i: (rows[i][1], -rows[i][0], i))[: len(left) - max_rows]:
            expected[i] = True
    assert got.tolist() == expected


def test_a_saturated_count_and_the_used_bit_do_not_leak_into_the_rules():
    meta = pack_metadata(torch.tensor([7]), torch.tensor([COUNT_MAX]), torch.tensor([True]))
    assert not doomed(meta, None, min_count=COUNT_MAX, max_age_s=0, min_l2_norm=None, max_rows=None, now=7)
    assert doomed(meta, None, min_count=COUNT_MAX + 1, max_age_s=None, min_l2_norm=None, max_rows=None, now=7)
