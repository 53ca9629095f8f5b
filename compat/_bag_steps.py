"""The steps a KV embedding bag takes per batch, shared by the plain and sharded modules.

``leanstate.KVEmbeddingBag`` and ``ShardedKVEmbeddingBagCollection`` both check and
normalise a bag's input here (``prepare``), hand the output gradient to the bag's
embedding engine here (``apply_gradient``), and read KeyedJaggedTensor-shaped input per
table here (``table_inputs``). Everything touches a bag through its public attributes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def check_ids(ids: object) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"KVEmbeddingBag: input must be a tensor of int64 ids; got {type(ids).__name__}")
    if ids.dtype != torch.int64:
        how = " (convert them with ids.to(torch.int64))" if not ids.dtype.is_floating_point else ""
        raise TypeError(f"KVEmbeddingBag: input ids must be torch.int64; got {ids.dtype}{how}")
    _check_dense("input", ids)
    return ids


def _check_dense(argument: str, tensor: torch.Tensor) -> None:
    """A strided tensor with data: sparse and meta tensors hold no values to look up."""
    if tensor.layout != torch.strided:
        raise TypeError(
            f"KVEmbeddingBag: {argument} must be a dense tensor; got layout {tensor.layout} (use .to_dense())"
        )
    if tensor.is_meta:
        raise TypeError(
            f"KVEmbeddingBag: {argument} is a meta tensor (shape only, no values); pass real data"
        )


def prepare(bag, input, offsets, per_sample_weights):
    """(distinct ids, inverse, bag ends [B + 1], weights or None) with padding removed;
    every argument checked, and ``stats`` counted."""
    ids, offsets, per_sample_weights = normalise(bag, input, offsets, per_sample_weights)
    device = ids.device
    ends = torch.cat([offsets, torch.tensor([len(ids)], device=device)])
    keep = ids >= 0
    padding = len(ids) - int(keep.sum())
    if padding:
        positions = torch.arange(len(offsets), device=device)
        bag_of = torch.repeat_interleave(positions, torch.diff(ends), output_size=len(ids))
        kept = torch.bincount(bag_of[keep], minlength=len(offsets))
        ends = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(kept, 0)])
        ids = ids[keep]
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights[keep]
    unique, inverse = torch.unique(ids, return_inverse=True)
    bag.stats["batches"] += 1
    bag.stats["ids"] += len(ids) + padding
    bag.stats["padding_ids"] += padding
    bag.stats["unique_ids"] += len(unique)
    return unique, inverse, ends, per_sample_weights


def normalise(bag, input, offsets, per_sample_weights):
    """(1-D ids, int64 offsets [B], float32 weights or None) on the bag's device, every argument checked."""
    ids = check_ids(input)
    if per_sample_weights is not None:
        if not isinstance(per_sample_weights, torch.Tensor):
            raise TypeError(
                f"KVEmbeddingBag: per_sample_weights must be a tensor; got {type(per_sample_weights).__name__}"
            )
        if not per_sample_weights.dtype.is_floating_point:
            raise TypeError(
                f"KVEmbeddingBag: per_sample_weights must be a real floating tensor; got {per_sample_weights.dtype}"
            )
        _check_dense("per_sample_weights", per_sample_weights)
    if ids.dim() == 2:
        if offsets is not None:
            raise ValueError("KVEmbeddingBag: offsets must be None for 2-D input (each row is one bag)")
        # bag b starts at b * L: [B, 0] input is B empty bags (zeros), as nn.EmbeddingBag gives
        offsets = torch.arange(ids.shape[0], dtype=torch.int64, device=ids.device) * ids.shape[1]
        if per_sample_weights is not None and per_sample_weights.shape != ids.shape:
            raise ValueError(
                f"KVEmbeddingBag: per_sample_weights has shape {tuple(per_sample_weights.shape)}; "
                f"input has {tuple(ids.shape)}"
            )
        ids = ids.reshape(-1)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
    elif ids.dim() == 1:
        if offsets is None:
            raise ValueError(
                "KVEmbeddingBag: offsets is required for 1-D input: the start of each bag, e.g. "
                "torch.tensor([0, 2]) for bags input[0:2] and input[2:]; or pass 2-D input [B, L]"
            )
        if (
            not isinstance(offsets, torch.Tensor)
            or offsets.dim() != 1
            or offsets.dtype.is_floating_point
            or offsets.dtype.is_complex
            or offsets.dtype == torch.bool
        ):
            raise TypeError(
                f"KVEmbeddingBag: offsets must be a 1-D integer tensor; got "
                f"{offsets.dtype if isinstance(offsets, torch.Tensor) else type(offsets).__name__}"
            )
        _check_dense("offsets", offsets)
    else:
        raise ValueError(f"KVEmbeddingBag: input must be 1-D or 2-D; got {ids.dim()}-D")
    ids, offsets = ids.to(bag.device).contiguous(), offsets.to(bag.device, torch.int64)
    # one check, so one host sync on a device: start at 0, never decrease, end within the input
    if len(offsets) and bool((offsets[0] != 0) | (torch.diff(offsets) < 0).any() | (offsets[-1] > len(ids))):
        raise ValueError(
            f"KVEmbeddingBag: offsets must start at 0, never decrease and stay <= len(input)={len(ids)}; "
            f"got {offsets.tolist()[:8]}{'...' if len(offsets) > 8 else ''}"
        )
    if not len(offsets) and len(ids):
        raise ValueError(f"KVEmbeddingBag: offsets is empty but input holds {len(ids)} ids")
    if bag.num_embeddings is not None and len(ids):
        outside = ids >= bag.num_embeddings
        if bool(outside.any()):
            bad = int(ids[outside][0])
            raise ValueError(
                f"KVEmbeddingBag: id {bad} is outside [0, num_embeddings={bag.num_embeddings}); "
                "pass num_embeddings=None for hashed ids (negative ids are padding)"
            )
    if per_sample_weights is not None:
        if bag.mode != "sum":
            raise ValueError("KVEmbeddingBag: per_sample_weights is only supported with mode='sum'")
        if not isinstance(per_sample_weights, torch.Tensor) or per_sample_weights.shape != ids.shape:
            raise ValueError(
                f"KVEmbeddingBag: per_sample_weights must be a tensor of input's shape {tuple(ids.shape)}"
            )
        # not detached: the weights' gradient (the rows of their ids) flows back to the caller
        per_sample_weights = per_sample_weights.to(bag.device, torch.float32).contiguous()
    return ids, offsets, per_sample_weights


def apply_gradient(bag, unique, inverse, offsets, per_sample_weights, grad_output, *, mean=None) -> None:
    """Update the rows of the distinct ``unique`` ids from the pooled output's gradient.

    ``mean``: whether the bags were means (default: this bag's mode).
    """
    bag.optimizer_step += 1
    beta1, beta2 = bag.betas
    bag.engine.update(
        unique,
        inverse,
        offsets,
        per_sample_weights,
        bag.mode == "mean" if mean is None else mean,
        grad_output.to(bag.device, torch.float32),
        hyperparameters=dict(lr=bag.lr, eps=bag.eps, beta1=beta1, beta2=beta2, weight_decay=bag.weight_decay),
        step=bag.optimizer_step,
        now=bag.store.now(),
    )


def build_bag(config, *, clock, backend: str | None):
    """The :class:`KVEmbeddingBag` a ``KVTableConfig`` describes."""
    from leanstate.embedding import KVEmbeddingBag  # the front module imports this one

    return KVEmbeddingBag(
        config.num_embeddings,
        config.embedding_dim,
        mode=config.pooling,
        optimizer=config.optimizer,
        lr=config.lr,
        eps=config.eps,
        betas=config.betas,
        weight_decay=config.weight_decay,
        optimizer_offloading=config.optimizer_offloading,
        return_whole_row=config.return_whole_row,
        dtype=config.data_type,
        num_shards=config.num_shards,
        init_range=(config.weight_init_min, config.weight_init_max),
        seed=config.seed,
        clock=clock,
        backend=backend,
    )


def jagged_parts(features) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(keys, values, lengths, weights or None) of a KeyedJaggedTensor-like, checked."""
    keys, values = list(features.keys()), features.values()
    if hasattr(features, "lengths"):
        lengths = features.lengths()
    else:
        lengths = torch.diff(features.offsets())
    weights = features.weights_or_none() if hasattr(features, "weights_or_none") else None
    lengths = torch.as_tensor(lengths).cpu().to(torch.int64)
    if not keys:
        raise ValueError("KVEmbeddingBagCollection: the features have no keys")
    if lengths.dim() != 1 or len(lengths) % len(keys):
        raise ValueError(
            f"KVEmbeddingBagCollection: lengths has {len(lengths)} entries, not a multiple of the "
            f"{len(keys)} keys {keys} (lengths are key-major: len(keys) * batch_size)"
        )
    if bool((lengths < 0).any()) or int(lengths.sum()) != len(values):
        raise ValueError(
            f"KVEmbeddingBagCollection: lengths must be >= 0 and sum to len(values)={len(values)}; "
            f"they sum to {int(lengths.sum())}"
        )
    if weights is not None and len(weights) != len(values):
        raise ValueError(
            f"KVEmbeddingBagCollection: weights_or_none() has {len(weights)} entries; values has {len(values)}"
        )
    return keys, values, lengths, weights


def table_inputs(features, table_features: Mapping[str, list[str]]):
    """(batch size, table -> (ids, offsets, weights or None)): each table's features' bags
    one after the other, in the table's feature order, from a KeyedJaggedTensor-like."""
    keys, values, lengths, weights = jagged_parts(features)
    wanted = [f for names in table_features.values() for f in names]
    unknown = [k for k in keys if k not in wanted]
    missing = [k for k in wanted if k not in keys]
    if unknown or missing:
        raise KeyError(
            f"KVEmbeddingBagCollection: no table for features {unknown}; missing features {missing}"
        )
    batch = len(lengths) // len(keys)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    position = {key: k for k, key in enumerate(keys)}
    inputs = {}
    for table, names in table_features.items():
        parts, part_weights, part_lengths = [], [], []
        for name in names:
            k = position[name]
            first = int(starts[k * batch]) if batch else 0
            last = int(ends[(k + 1) * batch - 1]) if batch else 0
            parts.append(values[first:last])
            part_lengths.append(lengths[k * batch : (k + 1) * batch])
            if weights is not None:
                part_weights.append(weights[first:last])
        table_lengths = torch.cat(part_lengths)
        offsets = torch.cumsum(table_lengths, 0) - table_lengths
        inputs[table] = (torch.cat(parts), offsets, torch.cat(part_weights) if weights is not None else None)
    return batch, inputs


def per_feature(pooled: torch.Tensor, features: int, batch: int) -> list[torch.Tensor]:
    """A table's pooled ``[features * batch, D]`` output as one ``[batch, D]`` block per feature
    (also for an empty batch, where ``split`` would give one block)."""
    return [pooled[k * batch : (k + 1) * batch] for k in range(features)]


class Tables(nn.Module):
    """The collection's bags by table name, as a mapping: ``tables[name]``, ``len``,
    iteration over the names, ``keys()``, ``values()``, ``items()``, ``in``.

    Not an ``nn.ModuleDict``, whose own methods would forbid tables named ``items``,
    ``keys``, ``values`` or ``update``: here the bags are registered directly, so a table
    may have any name and ``tables.items()`` is always the method.
    """

    def __init__(self, bags: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for name, bag in bags.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"table names must be non-empty strings without '.'; got {name!r}")
            self._modules[name] = bag  # not add_module: it refuses names of methods

    def __getitem__(self, name: str) -> nn.Module:
        try:
            return self._modules[name]
        except KeyError:
            raise KeyError(f"no table {name!r}; the tables are {list(self._modules)}") from None

    def __iter__(self):
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def keys(self):
        """The table names, in order."""
        return self._modules.keys()

    def values(self):
        """The bags, in table order."""
        return self._modules.values()

    def items(self):
        """(name, bag) pairs, in table order."""
        return self._modules.items()


class FusedOptimizer(torch.optim.Optimizer):
    """The fused tables' hyperparameters as a ``torch.optim.Optimizer`` (TorchRec's
    ``fused_optimizer``): one parameter group per table, whose ``lr`` (and ``eps``,
    ``weight_decay``) write through to the bag, so ``torch.optim.lr_scheduler`` drives
    them. ``step`` and ``zero_grad`` do nothing: the bags update their rows in backward.
    """

    def __init__(self, bags: Mapping[str, nn.Module]) -> None:
        bags = dict(bags)
        super().__init__([_TableGroup(name, bag) for name, bag in bags.items()], {})
        # Optimizer.__init__ copies each group into a plain dict: put the live ones back
        self.param_groups = [_TableGroup(g["table"], bags[g["table"]], g) for g in self.param_groups]

    def step(self, closure=None):
        """Nothing to do (the update happened in backward); calls ``closure`` if given."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the tables keep no gradients."""


class _TableGroup(dict):
    """A parameter group whose hyperparameters are the bag's own."""

    _LIVE = ("lr", "eps", "weight_decay")

    def __init__(self, table: str, bag: nn.Module, base: Mapping | None = None) -> None:
        super().__init__(base or {"params": [torch.zeros(0, requires_grad=True)]})
        dict.__setitem__(self, "table", table)
        self._bag = bag
        for key in self._LIVE:
            dict.__setitem__(self, key, getattr(bag, key))

    def __setitem__(self, key, value) -> None:
        if key in self._LIVE:
            setattr(self._bag, key, float(value))
        super().__setitem__(key, value)

    def __getitem__(self, key):
        if key in self._LIVE:
            return getattr(self._bag, key)
        return super().__getitem__(key)
