"""What the sharded-embedding and DCP tests train: two tables over 1-3 ranks, the same
global batch at every world size, and the checks that a rank's rows match one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from leanstate import (
    KeyedJaggedTensor,
    KVEmbeddingBagCollection,
    KVTableConfig,
    ShardedKVEmbeddingBagCollection,
)

G = 6  # samples per global batch, split evenly over 1, 2 or 3 ranks
KEYS = ["f1", "f2", "h"]
HUGE = [0, 5, 2**40 + 3, 2**62 + 11, 2**63 - 1, 123456789, 2**31, 977]  # hashed ids across int64


def configs():
    return [
        KVTableConfig("exact", 8, num_embeddings=64, feature_names=["f1", "f2"], lr=0.5, seed=1),
        KVTableConfig(
            "hashed", 4, feature_names=["h"], pooling="mean", optimizer="rowwise_adagrad", lr=0.1, seed=2
        ),
    ]


def samples(step: int) -> list[list[list[int]]]:
    """The global batch of ``step``, the same at every world size: per key, ``G`` samples of
    0-2 ids. Ids of the exact table appear at most twice (drawn from a permutation of the
    id space, repeated once); the hashed table's repeat often, across the int64 range."""
    generator = torch.Generator().manual_seed(step)
    permutation = torch.randperm(64, generator=generator).tolist()
    stream = iter(permutation + permutation)
    lengths = torch.randint(0, 3, (len(KEYS), G), generator=generator).tolist()
    picks = iter(torch.randint(0, len(HUGE), (len(KEYS) * G * 2,), generator=generator).tolist())
    return [
        [[HUGE[next(picks)] if key == "h" else next(stream) for _ in range(n)] for n in lengths[k]]
        for k, key in enumerate(KEYS)
    ]


def batch_of(step: int, first: int, count: int) -> KeyedJaggedTensor:
    """Samples ``[first, first + count)`` of every key of ``step``'s global batch."""
    per_key = [bags[first : first + count] for bags in samples(step)]
    values = [i for bags in per_key for bag in bags for i in bag]
    lengths = [len(bag) for bags in per_key for bag in bags]
    return KeyedJaggedTensor(KEYS, torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths))


def local_batch(step: int, rank: int, world: int) -> KeyedJaggedTensor:
    return batch_of(step, rank * (G // world), G // world)


def global_batch(step: int) -> KeyedJaggedTensor:
    return batch_of(step, 0, G)


def upstream(step: int) -> torch.Tensor:
    return torch.randn(G, 8 + 8 + 4, generator=torch.Generator().manual_seed(10_000 + step))


def train_step(sharded, single, step, rank, world):
    """One step of both; the outputs for this rank's samples must agree."""
    b = G // world
    out = sharded(local_batch(step, rank, world))
    want = single(global_batch(step))
    grad = upstream(step)
    (out.values() * grad[rank * b : (rank + 1) * b]).sum().backward()
    (want.values() * grad).sum().backward()
    mine = want.values()[rank * b : (rank + 1) * b].detach()
    got = out.values().detach()
    assert torch.equal(got[:, :16], mine[:, :16]), f"step {step}: exact table outputs differ"
    torch.testing.assert_close(got[:, 16:], mine[:, 16:], rtol=1e-6, atol=1e-6)


def assert_rows_match(sharded, single, rank, world):
    """This rank's rows equal the single process's; over all ranks each row exactly once."""
    for table in ("exact", "hashed"):
        mine, full = sharded.embedding_bags[table].store, single.embedding_bags[table].store
        keys = mine.keys()
        assert bool((sharded.owner(table, keys) == rank).all()), f"{table}: a row on the wrong rank"
        rows, want = mine.get_rows(keys), full.get_rows(keys)
        if table == "exact":
            assert torch.equal(rows, want), "exact table rows (headers included) differ"
        else:
            assert torch.equal(rows[:, :4].view(torch.int64), want[:, :4].view(torch.int64)), "headers differ"
            torch.testing.assert_close(rows[:, 4:], want[:, 4:], rtol=1e-6, atol=1e-6)
        everyone = [None] * world
        dist.all_gather_object(everyone, keys.tolist())
        union = sorted(k for part in everyone for k in part)
        assert union == full.keys().tolist(), f"{table}: the ranks' rows are not the saved rows exactly once"


def build():
    return ShardedKVEmbeddingBagCollection(configs(), clock=lambda: 1000), KVEmbeddingBagCollection(
        configs(), clock=lambda: 1000
    )
