"""``leanstate.KVEmbeddingBag`` and ``KVEmbeddingBagCollection``: the embedding front modules.

Like FBGEMM's SSD/DRAM table-batched embeddings: the rows live in a :class:`KVStore`;
forward deduplicates the ids and pools their rows; backward sums one gradient per
distinct id and the fused optimizer updates the rows **during backward** (there is no
separate ``optimizer.step()``). With ``optimizer_offloading=True`` (default) the
optimizer state lives in the row after the weight (``[header | weight | state]``); with
``False`` it lives in a second store keyed by the same ids. The module validates and
normalises its input, then hands each batch to the embedding engine of its backend
(``spec/backends.md``), which reads and writes the rows of its store engine directly.
See ``spec/embedding.md``.

Example::

    >>> bag = KVEmbeddingBag(16, optimizer="rowwise_adagrad", lr=0.1)
    >>> pooled = bag(torch.tensor([3, 7, 7, 9]), torch.tensor([0, 2]))   # two bags
    >>> pooled.sum().backward()                                           # rows updated
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import torch
from torch import nn

from leanstate import _backends
from leanstate.kv_store import KVStore
from leanstate.reference.embedding import OPTIMIZERS, state_fields
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import pad4


class _FusedUpdate(torch.autograd.Function):
    """Pooled forward; backward hands the output gradient to the engine's fused update."""

    @staticmethod
    def forward(ctx, anchor, bag, unique, inverse, offsets, per_sample_weights):
        ctx.bag, ctx.saved = bag, (unique, inverse, offsets, per_sample_weights)
        return bag._engine.pool(unique, inverse, offsets, per_sample_weights, bag.mode == "mean")

    @staticmethod
    def backward(ctx, grad_output):
        ctx.bag._apply_gradient(*ctx.saved, grad_output.detach().contiguous())
        return (None,) * 6


class KVEmbeddingBag(nn.Module):
    """An embedding bag whose table is a KV store, trained by a fused optimizer.

    Args:
        embedding_dim: D.
        mode: ``"sum"`` or ``"mean"`` pooling.
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` (FBGEMM's exact rowwise Adagrad) or
            ``"adam"``; applied to the touched rows in backward.
        lr, eps, betas, weight_decay: the optimizer's hyperparameters (weight decay is
            L2: ``g += weight_decay * w``).
        optimizer_offloading: keep the optimizer state in the row (True) or in a
            separate store (False).
        return_whole_row: ``state_dict()["weight"]`` is a whole-row KVTensor (header,
            weight, state); requires ``optimizer_offloading``.
        num_shards, init_range, seed, clock: of the store(s).
        backend: of the store and the embedding engine; default the import-time choice.
    """

    def __init__(
        self,
        embedding_dim: int,
        *,
        mode: str = "sum",
        optimizer: str = "sgd",
        lr: float = 0.01,
        eps: float = 1e-8,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        optimizer_offloading: bool = True,
        return_whole_row: bool = True,
        num_shards: int = 8,
        init_range: tuple[float, float] = (-0.01, 0.01),
        seed: int = 0,
        clock=None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        if mode not in ("sum", "mean"):
            raise ValueError(f"KVEmbeddingBag: mode must be 'sum' or 'mean'; got {mode!r}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"KVEmbeddingBag: optimizer must be one of {OPTIMIZERS}; got {optimizer!r}")
        if return_whole_row and not optimizer_offloading:
            raise ValueError(
                "return_whole_row=True needs optimizer_offloading=True (the whole row holds the "
                "optimizer state only when it is offloaded into the row); pass return_whole_row=False"
            )
        name, module = _backends.resolve("embedding", backend)
        self.backend = name
        self.embedding_dim, self.mode, self.optimizer = embedding_dim, mode, optimizer
        self.lr, self.eps, self.betas, self.weight_decay = lr, eps, tuple(betas), weight_decay
        self.optimizer_offloading, self.return_whole_row = optimizer_offloading, return_whole_row
        self.fields = state_fields(optimizer, embedding_dim)
        state_dim = sum(width for _, width in self.fields.values())
        self.optimizer_step = 0  # Adam's bias correction counts backward passes, as FBGEMM's iter
        common = dict(num_shards=num_shards, seed=seed, clock=clock, backend=name)
        if optimizer_offloading:
            self.store = KVStore(
                embedding_dim, optimizer_state_dim=state_dim, init_range=init_range, **common
            )
            self.state_store = None
            state_start = self.store.layout.state_offset
        else:
            self.store = KVStore(embedding_dim, init_range=init_range, **common)
            self.state_store = KVStore(state_dim, init_range=(0.0, 0.0), **common) if state_dim else None
            state_start = self.store.layout.header_elems
        self._engine = importlib.import_module(module).EmbeddingEngine(
            self.store._engine,
            None if self.state_store is None else self.state_store._engine,
            state_start=state_start,
            optimizer=optimizer,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.embedding_dim}, mode={self.mode!r}, optimizer={self.optimizer!r}, lr={self.lr}, "
            f"optimizer_offloading={self.optimizer_offloading}, rows={len(self.store)}, backend={self.backend!r}"
        )

    # -- forward ----------------------------------------------------------------------

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pool ``ids`` into bags starting at ``offsets`` (as ``nn.EmbeddingBag``); [B, D].

        Negative ids are padding: they add nothing and do not count in a mean.
        """
        if ids.dtype != torch.int64 or ids.dim() != 1 or offsets.dim() != 1:
            raise TypeError("ids must be a 1-D int64 tensor and offsets a 1-D tensor")
        ids, offsets = ids.cpu(), offsets.cpu().to(torch.int64)
        ends = torch.cat([offsets, torch.tensor([len(ids)])])
        keep = ids >= 0
        if not keep.all():
            bag = torch.repeat_interleave(torch.arange(len(offsets)), torch.diff(ends), output_size=len(ids))
            kept = torch.bincount(bag[keep], minlength=len(offsets))
            ends = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kept, 0)])
            ids = ids[keep]
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights[keep]
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.detach().cpu().to(torch.float32).contiguous()
        unique, inverse = torch.unique(ids, return_inverse=True)
        anchor = torch.empty(0, requires_grad=torch.is_grad_enabled() and self.training)
        return _FusedUpdate.apply(anchor, self, unique, inverse, ends, per_sample_weights)

    # -- the fused optimizer ------------------------------------------------------------

    def _apply_gradient(self, unique, inverse, offsets, per_sample_weights, grad_output) -> None:
        """Update the rows of the distinct ``unique`` ids from the pooled output's gradient."""
        self.optimizer_step += 1
        beta1, beta2 = self.betas
        self._engine.update(
            unique,
            inverse,
            offsets,
            per_sample_weights,
            self.mode == "mean",
            grad_output.cpu().to(torch.float32),
            hyperparameters=dict(
                lr=self.lr, eps=self.eps, beta1=beta1, beta2=beta2, weight_decay=self.weight_decay
            ),
            step=self.optimizer_step,
            now=self.store._now(),
        )

    # -- state ----------------------------------------------------------------------

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """KVTensors: ``weight`` (whole rows when ``return_whole_row``) and the optimizer's fields.

        With offloading, the optimizer fields are read-only views into the rows (a whole-row
        load already brought them); without, they are views of the state store.
        """
        out = destination if destination is not None else {}
        if self.return_whole_row:
            out[prefix + "weight"] = KVTensor(self.store, whole_rows=True)
        else:
            out[prefix + "weight"] = KVTensor(self.store, width=self.embedding_dim)
        out.update({prefix + name: view for name, view in self._field_views().items()})
        return out

    def _field_views(self) -> dict[str, KVTensor]:
        """One KVTensor per optimizer field: read-only in the rows, or of the state store."""
        if not self.optimizer_offloading:
            return {
                name: KVTensor(self.state_store, width_offset=start, width=width)
                for name, (start, width) in self.fields.items()
            }
        offset = pad4(self.embedding_dim)
        return {
            name: KVTensor(self.store, width_offset=offset + start, width=width, read_only=True)
            for name, (start, width) in self.fields.items()
        }

    def load_state_dict(self, state_dict: Mapping[str, object], strict: bool = True):
        """Copy KVTensors or tensors in, chunk by chunk (whole rows by header key)."""
        mine = self.state_dict()
        missing = [k for k in mine if k not in state_dict]
        unexpected = [k for k in state_dict if k not in mine]
        if strict and (missing or unexpected):
            raise KeyError(f"KVEmbeddingBag.load_state_dict: missing {missing}, unexpected {unexpected}")
        for key, target in mine.items():
            if key not in state_dict:
                continue
            source = state_dict[key]
            if target.whole_rows:  # keyed by each row's header: the ids are placeholders
                placeholder = torch.full((len(source),), -1, dtype=torch.int64)
                KVTensor(target.store, ids=placeholder, whole_rows=True).copy_(source)
                continue
            if not target.read_only:
                ids = source.ids if isinstance(source, KVTensor) else target.ids
                KVTensor(target.store, ids=ids, width_offset=target.width_offset, width=target.width).copy_(
                    source
                )
            else:
                target.ignored_writes += len(source)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def checkpoint_tables(self) -> dict[str, KVStore | KVTensor]:
        """What ``save_checkpoint`` / ``load_checkpoint`` take for this module."""
        if self.optimizer_offloading:
            return {"weight": KVTensor(self.store, whole_rows=True), **self._field_views()}
        tables = {"weight": self.store}
        if self.state_store is not None:
            tables["optimizer_state"] = self.state_store
        return tables

    def extra_state(self) -> dict[str, int]:
        """Dense state to save beside the tables (``extra=`` of ``save_checkpoint``)."""
        return {"optimizer_step": self.optimizer_step}

    def load_extra_state(self, extra: Mapping[str, int]) -> None:
        """Restore what :meth:`extra_state` returned."""
        self.optimizer_step = int(extra["optimizer_step"])


class KVEmbeddingBagCollection(nn.Module):
    """Named KV embedding bags with TorchRec-shaped input and output.

    ``forward(features)`` takes a KeyedJaggedTensor-like object (``keys()``, ``values()``,
    ``lengths()``; lengths key-major, ``len(keys) * B``) and returns a dict of pooled
    ``[B, D]`` tensors by key (what ``KeyedTensor.to_dict()`` gives).

    Example::

        >>> ebc = KVEmbeddingBagCollection({"user": KVEmbeddingBag(8), "item": KVEmbeddingBag(8)})
        >>> out = ebc(KeyedJagged(["user", "item"], torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1, 0])))
    """

    def __init__(self, tables: Mapping[str, KVEmbeddingBag]) -> None:
        super().__init__()
        self.tables = nn.ModuleDict(tables)

    def forward(self, features) -> dict[str, torch.Tensor]:
        keys, values, lengths = list(features.keys()), features.values(), features.lengths()
        unknown = [k for k in keys if k not in self.tables]
        if unknown:
            raise KeyError(f"no table for feature keys {unknown}; tables: {list(self.tables)}")
        batch = len(lengths) // len(keys)
        out, start = {}, 0
        for k, key in enumerate(keys):
            bag_lengths = lengths[k * batch : (k + 1) * batch]
            count = int(bag_lengths.sum())
            offsets = torch.cumsum(bag_lengths, 0) - bag_lengths
            out[key] = self.tables[key](values[start : start + count], offsets)
            start += count
        return out


class KeyedJagged:
    """A minimal KeyedJaggedTensor stand-in: keys, values and key-major lengths."""

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor) -> None:
        self._keys, self._values, self._lengths = list(keys), values, lengths

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths
