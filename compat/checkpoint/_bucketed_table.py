"""A sharded module's table as its checkpoints see it: this rank's store and the table's
bucketing (``spec/sharding.md``). Checkpoint plumbing beside the ownership rules of
``leanstate.reference.sharding``, which it applies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanstate.reference.kv_store import SupportsRows
from leanstate.reference.sharding import bucket_of, bucket_owner


def describe_bucketing(buckets: int, bucket_size: int | None) -> str:
    """A bucketing in words: ``"1024 buckets of 98 consecutive ids (id // 98)"`` or
    ``"1024 interleaved buckets (id % 1024)"``."""
    if bucket_size is None:
        return f"{buckets} interleaved buckets (id % {buckets}, for hashed ids)"
    return f"{buckets} buckets of {bucket_size} consecutive ids (id // {bucket_size})"


@dataclass(frozen=True)
class BucketedTable:
    """One table of a sharded module as a checkpoint sees it: this rank's store and the
    table's bucketing (``buckets`` buckets; chunk mode with ``bucket_size``, else interleaved)."""

    store: SupportsRows
    buckets: int
    bucket_size: int | None

    def owner(self, ids: torch.Tensor, world_size: int) -> torch.Tensor:
        """The rank owning each id at ``world_size``."""
        return bucket_owner(
            ids, world_size=world_size, total_num_buckets=self.buckets, bucket_size=self.bucket_size
        )

    def bucket(self, ids: torch.Tensor) -> torch.Tensor:
        """The bucket of each id."""
        return bucket_of(ids, total_num_buckets=self.buckets, bucket_size=self.bucket_size)
