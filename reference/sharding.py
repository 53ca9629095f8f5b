"""Which rank owns an id: buckets, as FBGEMM's KV ZCH tables assign them.

An id falls in one of ``total_num_buckets`` buckets, and each rank owns a contiguous
range of buckets, so both sequential and hashed ids balance and every non-negative id
has exactly one owner at every world size (``spec/sharding.md``):

- chunk mode (``bucket_size`` given, for ids in ``[0, num_embeddings)``):
  ``bucket = min(id // bucket_size, total_num_buckets - 1)`` (ids past the end fall in
  the last bucket rather than in none);
- interleaved mode (``bucket_size=None``, for hashed ids): ``bucket = id % total_num_buckets``.

Rank ``r`` of ``W`` owns buckets ``[ceil(r * T / W), ceil((r + 1) * T / W))``, that is
``owner = bucket * W // T``. Negative ids are padding: bucket and owner ``-1``.

Example::

    >>> bucket_owner(torch.tensor([0, 5, 1023, -1]), world_size=2, total_num_buckets=1024)
    tensor([ 0,  0,  1, -1])
"""

from __future__ import annotations

import torch

from leanstate.reference.arguments import int_argument


def _check(world_size: int | None, total_num_buckets: int, bucket_size: int | None) -> None:
    int_argument(total_num_buckets, "total_num_buckets", low=1, must="a positive int")
    if bucket_size is not None:
        int_argument(bucket_size, "bucket_size", low=1, must="a positive int or None (interleaved)")
    if world_size is not None:
        must = f"an int in [1, total_num_buckets={total_num_buckets}]"
        int_argument(world_size, "world_size", low=1, high=total_num_buckets, must=must)


def bucket_of(ids: torch.Tensor, *, total_num_buckets: int, bucket_size: int | None = None) -> torch.Tensor:
    """The bucket of each id (int64, ``-1`` for padding); chunk mode when ``bucket_size`` is given."""
    _check(None, total_num_buckets, bucket_size)
    ids = torch.as_tensor(ids, dtype=torch.int64)
    if bucket_size is None:
        buckets = torch.remainder(ids, total_num_buckets)
    else:
        buckets = torch.clamp(torch.div(ids, bucket_size, rounding_mode="floor"), max=total_num_buckets - 1)
    return torch.where(ids >= 0, buckets, -1)


def bucket_range(rank: int, world_size: int, total_num_buckets: int) -> tuple[int, int]:
    """The buckets ``[first, end)`` rank ``rank`` of ``world_size`` owns."""
    _check(world_size, total_num_buckets, None)
    int_argument(rank, "rank", low=0, high=world_size - 1, must=f"in [0, world_size={world_size})")
    return -(-rank * total_num_buckets // world_size), -(-(rank + 1) * total_num_buckets // world_size)


def owner_of_bucket(buckets, *, world_size: int, total_num_buckets: int):
    """The rank owning each bucket (an int or a tensor of buckets >= 0)."""
    return buckets * world_size // total_num_buckets


def bucket_owner(
    ids: torch.Tensor, *, world_size: int, total_num_buckets: int = 1024, bucket_size: int | None = None
) -> torch.Tensor:
    """The rank owning each id (int64, ``-1`` for padding): ``bucket * world_size // total_num_buckets``."""
    _check(world_size, total_num_buckets, bucket_size)
    buckets = bucket_of(ids, total_num_buckets=total_num_buckets, bucket_size=bucket_size)
    owners = owner_of_bucket(buckets, world_size=world_size, total_num_buckets=total_num_buckets)
    return torch.where(buckets >= 0, owners, -1)


def row_wise_id_range(num_embeddings: int, rank: int, world_size: int) -> tuple[int, int]:
    """The ids a rank owns under row-wise sharding (TorchRec's even blocks of ids).

    Rank ``r`` owns ``[r * block, min(num_embeddings, (r + 1) * block))`` with
    ``block = ceil(num_embeddings / world_size)``, except that the last rank's range
    runs to ``2**63``: ids at or above ``num_embeddings`` (hashed ids) are loaded there,
    never dropped, so the ranges of all ranks cover every non-negative id exactly once.
    Pass it as ``id_range``; for hashed ids prefer ``leanstate.bucket_owner``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
    block = -(-num_embeddings // world_size)
    hi = 2**63 if rank == world_size - 1 else min(num_embeddings, (rank + 1) * block)
    return min(num_embeddings, rank * block), hi
