"""``leanstate.ShardedKVEmbeddingBagCollection``: KV tables sharded across ranks by buckets.

Each rank holds the rows of the buckets it owns (``leanstate.bucket_owner``) in local
KV stores of the chosen engine. A step moves each distinct id once per rank:

1. forward: the rank dedupes its ids per table and sends each distinct id to its owner
   (``all_to_all_single``, variable splits); the owner gathers the rows (missing ids read
   their initial rows, not inserted) and sends them back; the requester pools;
2. backward: the requester sums each distinct id's gradient over its positions and
   sends it to the owner; the owner sums what it received in a fixed order (source
   rank, then position) and applies the fused optimizer in its store.

The result is that of one :class:`KVEmbeddingBagCollection` trained on the concatenated
global batch: bit-identical where the arithmetic is exact, within float32 rounding
otherwise (``spec/sharding.md``). Every rank must call forward and backward each step.

Example (on every rank of an initialised process group)::

    >>> ebc = ShardedKVEmbeddingBagCollection([KVTableConfig("items", 64, feature_names=["item"])])
    >>> out = ebc(KeyedJaggedTensor(["item"], local_ids, lengths=local_lengths))
    >>> out.values().sum().backward()   # rows updated on their owners
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from leanstate.checkpoint.core import BucketedTable, ModuleTables
from leanstate.embedding import KVEmbeddingBag
from leanstate.embedding._collection import TableCollection
from leanstate.embedding._torchrec_shapes import KeyedTensor, KVTableConfig, table_configs, table_inputs
from leanstate.reference.sharding import bucket_owner, bucket_range


class _Plan:
    """One table's exchange in one step: who asked whom for which ids."""

    def __init__(self, order, send_counts, recv_counts, recv_ids) -> None:
        self.order, self.send_counts, self.recv_counts, self.recv_ids = (
            order,
            send_counts,
            recv_counts,
            recv_ids,
        )


class _ShardedLookup(torch.autograd.Function):
    """Every table's exchange and pooling in one node, so backward handles the tables in
    the same fixed order on every rank."""

    @staticmethod
    def forward(ctx, anchor, module, prepared):
        ctx.module, ctx.prepared, ctx.plans = module, prepared, []
        outputs = []
        for table, (unique, inverse, ends, weights) in prepared.items():
            rows, plan = module._fetch(table, unique)
            ctx.plans.append(plan)
            bag = module.embedding_bags[table]
            with module._timed("pool"):
                outputs.append(bag.engine.pool_rows(rows, inverse, ends, weights, bag.mode == "mean"))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        for (table, saved), plan, grad in zip(ctx.prepared.items(), ctx.plans, grads, strict=True):
            unique, inverse, ends, weights = saved
            if grad is None:  # an output the loss did not use: zero gradients, still exchanged
                grad = torch.zeros(len(ends) - 1, ctx.module.embedding_bags[table].embedding_dim)
            ctx.module._push_gradients(
                table, unique, inverse, ends, weights, plan, grad.detach().contiguous()
            )
        return None, None, None


class ShardedKVEmbeddingBagCollection(TableCollection):
    """KV embedding tables sharded across the ranks of ``process_group`` by buckets.

    Args:
        tables: ``KVTableConfig`` or TorchRec ``EmbeddingBagConfig`` list, as for
            ``KVEmbeddingBagCollection``.
        is_weighted: whether the input's weights are per-sample weights (else ignored).
        process_group: default the world; gloo on CPU, NCCL on GPUs.
        total_num_buckets: buckets per table (T); a table with ``num_embeddings`` (n) uses
            chunk mode with ``min(T, n)`` buckets of ``ceil(n / min(T, n))`` ids, a hashed
            one (``num_embeddings=None``) interleaved mode with T buckets. ``bucketing``
            holds each table's (buckets, bucket_size or None).
        clock, backend: of the local bags.

    ``forward(features)`` takes this rank's KeyedJaggedTensor-like batch and returns a
    ``KeyedTensor`` for it. ``embedding_bags[name]`` is this rank's share of a table (a
    ``KVEmbeddingBag`` holding only owned rows). ``exchange_stats`` counts the bytes this
    rank sent (``bytes``) and its share of the minimum (``min_bytes``: its distinct ids
    times a weight row and a float32 gradient row), the steps (``steps``) and the wall
    seconds spent in each phase of them (``seconds``: exchange, owner gather, pool,
    gradient exchange, update).
    """

    def __init__(
        self,
        tables: Sequence[KVTableConfig],
        *,
        is_weighted: bool = False,
        process_group: dist.ProcessGroup | None = None,
        total_num_buckets: int = 1024,
        clock=None,
        backend: str | None = None,
    ) -> None:
        given, configs = table_configs(tables)
        if not configs:
            raise TypeError(
                "ShardedKVEmbeddingBagCollection: tables must be a non-empty list of KVTableConfig "
                "or TorchRec EmbeddingBagConfig"
            )
        names = [c.name for c in configs]
        everything = [f for c in configs for f in c.feature_names]
        if len(set(names)) != len(names) or len(set(everything)) != len(everything):
            raise ValueError(
                f"ShardedKVEmbeddingBagCollection: table names must be unique and a feature may feed one "
                f"table only; got tables {names}, features {everything}"
            )
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        # The exchange runs where the group's backend moves data: NCCL moves CUDA tensors only.
        nccl = dist.get_backend(self.process_group) == "nccl"
        self._wire = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        super().__init__(
            {c.name: KVEmbeddingBag.from_config(c, clock=clock, backend=backend) for c in configs},
            given,
            is_weighted=is_weighted,
            device=None,
        )
        # table -> (buckets, bucket_size or None): a table of n ids has at most n buckets
        self.bucketing = {
            c.name: (total_num_buckets, None)
            if c.num_embeddings is None
            else (
                min(total_num_buckets, c.num_embeddings),
                -(-c.num_embeddings // min(total_num_buckets, c.num_embeddings)),
            )
            for c in configs
        }
        for buckets, _ in self.bucketing.values():
            bucket_range(self.rank, self.world_size, buckets)  # checks world_size <= buckets
        self.exchange_stats = {"steps": 0, "bytes": 0, "min_bytes": 0, "seconds": defaultdict(float)}

    def extra_repr(self) -> str:
        return (
            f"tables={list(self._table_features)}, rank={self.rank}, world_size={self.world_size}, "
            f"bucketing={self.bucketing}"
        )

    def owned_buckets(self, table: str) -> tuple[int, int]:
        """The buckets ``[first, end)`` of ``table`` this rank owns."""
        return bucket_range(self.rank, self.world_size, self.bucketing[table][0])

    def owner(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The rank owning each id of ``table`` (``-1`` for padding)."""
        buckets, size = self.bucketing[table]
        return bucket_owner(ids, world_size=self.world_size, total_num_buckets=buckets, bucket_size=size)

    @torch.compiler.disable  # collectives and the Python store: a graph break, the rest of a model compiles
    def forward(self, features) -> KeyedTensor:
        """Pool this rank's batch; rows come from (and gradients go to) their owners."""
        shape, inputs = table_inputs(
            features, self._table_features, weighted=self._is_weighted, variable_batch=False
        )
        prepared = {
            table: self.embedding_bags[table].prepare_batch(ids, offsets, weights)
            for table, (ids, offsets, weights) in inputs.items()
        }
        anchor = torch.empty(0, requires_grad=torch.is_grad_enabled() and self.training)
        outputs = _ShardedLookup.apply(anchor, self, prepared)
        self.exchange_stats["steps"] += 1
        return self._keyed(shape, dict(zip(prepared, outputs, strict=True)))

    # -- checkpoints ----------------------------------------------------------------

    def checkpoint_tables(self) -> dict[str, BucketedTable]:
        """This rank's share of every table, for ``save_checkpoint``/``load_checkpoint`` with
        ``process_group``: ``"<table>.weight"`` (whole rows, the optimizer state inside when
        offloaded) and ``"<table>.optimizer_state"`` (its own store otherwise)."""
        tables = {}
        for name, bag in self.embedding_bags.named_children():
            buckets, size = self.bucketing[name]
            tables[f"{name}.weight"] = BucketedTable(bag.store, buckets, size)
            if bag.state_store is not None:
                tables[f"{name}.optimizer_state"] = BucketedTable(bag.state_store, buckets, size)
        return ModuleTables(tables, self)

    # -- the exchange ---------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self, phase: str):
        """Add the block's wall time to ``exchange_stats["seconds"][phase]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.exchange_stats["seconds"][phase] += time.perf_counter() - start

    def _all_to_all(
        self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``send`` (grouped by destination rank) to their ranks; what this rank receives."""
        received = torch.empty((int(recv_counts.sum()), *send.shape[1:]), dtype=send.dtype, device=self._wire)
        dist.all_to_all_single(
            received,
            send.to(self._wire).contiguous(),
            output_split_sizes=recv_counts.tolist(),
            input_split_sizes=send_counts.tolist(),
            group=self.process_group,
        )
        self.exchange_stats["bytes"] += send.numel() * send.element_size()
        return received.cpu()

    def _fetch(self, table: str, unique: torch.Tensor) -> tuple[torch.Tensor, _Plan]:
        """The weights of the distinct ids ``unique`` [U, D] (row dtype), from their owners."""
        bag = self.embedding_bags[table]
        layout = bag.store.layout
        owners = self.owner(table, unique)
        order = torch.argsort(owners, stable=True)
        send_counts = torch.bincount(owners, minlength=self.world_size)
        with self._timed("exchange"):
            recv_counts = self._all_to_all(send_counts, torch.ones(self.world_size, dtype=torch.int64),
                                           torch.ones(self.world_size, dtype=torch.int64))  # fmt: skip
            recv_ids = self._all_to_all(unique[order], send_counts, recv_counts)
        with self._timed("owner gather"):
            served = bag.store.get(recv_ids, width=layout.dim)
        with self._timed("exchange"):
            # rows travel as their bytes: every collective backend moves uint8, not every one bfloat16
            back = self._all_to_all(served.view(torch.uint8), recv_counts, send_counts).view(layout.dtype)
        rows = torch.empty_like(back)
        rows[order] = back
        self.exchange_stats["min_bytes"] += len(unique) * layout.dim * (layout.itemsize + 4)
        return rows, _Plan(order, send_counts, recv_counts, recv_ids)

    def _push_gradients(self, table, unique, inverse, ends, weights, plan: _Plan, grad_output) -> None:
        """Send each distinct id's gradient to its owner, who sums and applies them."""
        bag = self.embedding_bags[table]
        with self._timed("gradient exchange"):
            grad = bag.engine.row_gradients(
                len(unique), inverse, ends, weights, bag.mode == "mean", grad_output
            )
            received = self._all_to_all(grad[plan.order], plan.send_counts, plan.recv_counts)
        with self._timed("update"):
            # received rows are in (source rank, position) order: each its own one-row bag
            owned, owned_inverse = torch.unique(plan.recv_ids, return_inverse=True)
            positions = torch.arange(len(received) + 1, dtype=torch.int64)
            bag.apply_gradient(owned, owned_inverse, positions, None, received, mean=False)
