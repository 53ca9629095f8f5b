import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from leanstate.reference.hashing import init_value, initial_weights, shard_of, shards_of

int64s = st.integers(-(2**63), 2**63 - 1)


def test_shard_hash_golden(vectors):
    cases = vectors("shard_hash.json")["cases"]
    ids = torch.tensor([c["id"] for c in cases], dtype=torch.int64)
    for n in (1, 3, 8, 64):
        expected = [c["shards"][str(n)] for c in cases]
        assert [shard_of(c["id"], n) for c in cases] == expected
        assert shards_of(ids, n).tolist() == expected


@given(st.lists(int64s, min_size=1, max_size=50), st.integers(1, 2**32 - 1))
def test_vectorised_shards_match_the_definition(ids, num_shards):
    got = shards_of(torch.tensor(ids, dtype=torch.int64), num_shards).tolist()
    assert got == [shard_of(i, num_shards) for i in ids]
    assert all(0 <= s < num_shards for s in got)


def test_shards_spread_ids():
    counts = torch.bincount(shards_of(torch.arange(80_000), 8), minlength=8)
    assert counts.min() > 9_000, counts


def test_initial_rows_golden(vectors):
    v = vectors("initial_rows.json")
    low, high = v["init_range"]
    ids = torch.tensor([r["id"] for r in v["rows"]], dtype=torch.int64)
    got = initial_weights(ids, v["dim"], seed=v["seed"], low=low, high=high, dtype=torch.float32)
    for row, r in zip(got, v["rows"]):
        assert row.numpy().tobytes().hex() == r["float32_hex"]
    for dtype, field in ((torch.float16, "float16_hex"), (torch.bfloat16, "bfloat16_hex")):
        cast = initial_weights(ids, v["dim"], seed=v["seed"], low=low, high=high, dtype=dtype)
        assert [row.view(torch.uint8).numpy().tobytes().hex() for row in cast] == [
            r[field] for r in v["rows"]
        ]
        plain = [init_value(v["seed"], r["id"], c, low, high) for c in range(v["dim"])]
        assert struct.pack(f"<{v['dim']}f", *plain).hex() == r["float32_hex"]


@given(st.lists(int64s, min_size=1, max_size=8), st.integers(0, 2**64 - 1), st.integers(1, 9))
def test_vectorised_initial_weights_match_the_definition(ids, seed, dim):
    got = initial_weights(torch.tensor(ids), dim, seed=seed, low=-0.5, high=0.25, dtype=torch.float32)
    for row, key in zip(got.tolist(), ids):
        assert row == [init_value(seed, key, c, -0.5, 0.25) for c in range(dim)]
        assert all(-0.5 <= x < 0.25 for x in row)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_initial_weights_are_rounded_float32(dtype):
    ids = torch.arange(20)
    f32 = initial_weights(ids, 7, seed=3, low=-1, high=1, dtype=torch.float32)
    assert torch.equal(initial_weights(ids, 7, seed=3, low=-1, high=1, dtype=dtype), f32.to(dtype))
