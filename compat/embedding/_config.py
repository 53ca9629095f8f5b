"""A KV embedding bag's configuration, kept once: the constructor's arguments, checked and
normalised, in one frozen record (``KVEmbeddingBag.config``). The bag's attributes, its
``repr`` and its copies read it; :meth:`BagConfig.table` and :func:`bag_arguments` map it
to and from ``KVTableConfig``'s TorchRec names (``pooling``, ``data_type``,
``weight_init_min``/``max``), the one place that mapping is written.

The defaults are the constructor's (``KVEmbeddingBag.__init__``), so the record has none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from leanstate.embedding._torchrec_shapes import KVTableConfig
from leanstate.reference.arguments import int_argument
from leanstate.reference.embedding import OPTIMIZERS


def _check_number(name: str, value: object, *, low: float = 0.0, below: float | None = None) -> float:
    """``value`` as a finite float in ``[low, below)``, else a ``ValueError`` naming ``name``."""
    bound = f"[{low}, {below})" if below is not None else f">= {low}"
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if (
        isinstance(value, bool)
        or not math.isfinite(number)
        or number < low
        or (below is not None and number >= below)
    ):
        raise ValueError(f"KVEmbeddingBag: invalid {name}: {value!r} (must be a finite number {bound})")
    return number


@dataclass(frozen=True)
class BagConfig:
    """What a :class:`KVEmbeddingBag` was built with, as ``KVEmbeddingBag(**config.arguments())``
    takes it (the arguments are documented there). Building one checks every argument the
    bag checks before its stores exist (the stores check ``num_shards``, ``init_range``,
    ``seed``, ``clock`` and ``device``), with the bag's error messages; ``lr``, ``eps``,
    ``weight_decay`` and ``betas`` become floats, ``include_last_offset`` a bool.

    ``lr``, ``eps`` and ``weight_decay`` here are the constructor's: the bag's attributes
    of those names are the optimizer's live hyperparameters, which a scheduler may change
    (as ``torch.optim``'s ``defaults`` and ``param_groups``).
    """

    num_embeddings: int | None
    embedding_dim: int
    mode: str
    include_last_offset: bool
    optimizer: str
    lr: float
    eps: float
    betas: tuple[float, float]
    weight_decay: float
    optimizer_offloading: bool
    return_whole_row: bool
    dtype: torch.dtype
    num_shards: int
    init_range: tuple[float, float]
    seed: int
    clock: Callable[[], int] | None
    device: torch.device | str | None
    backend: str | None

    def __post_init__(self) -> None:
        if self.num_embeddings is not None:  # (frozen: the checked ints replace what was passed)
            must = "a positive int, or None for hashed ids"
            number = int_argument(self.num_embeddings, "KVEmbeddingBag: num_embeddings", low=1, must=must)
            object.__setattr__(self, "num_embeddings", number)
        object.__setattr__(
            self,
            "embedding_dim",
            int_argument(self.embedding_dim, "KVEmbeddingBag: embedding_dim", low=1, must="a positive int"),
        )
        if self.mode not in ("sum", "mean"):
            raise ValueError(f"KVEmbeddingBag: mode must be 'sum' or 'mean'; got {self.mode!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"KVEmbeddingBag: optimizer must be one of {OPTIMIZERS}; got {self.optimizer!r}")
        try:
            beta1, beta2 = self.betas
        except (TypeError, ValueError):
            raise ValueError(f"KVEmbeddingBag: betas must be two numbers; got {self.betas!r}") from None
        normalised = dict(
            lr=_check_number("lr", self.lr),
            eps=_check_number("eps", self.eps),
            weight_decay=_check_number("weight_decay", self.weight_decay),
            betas=(_check_number("betas[0]", beta1, below=1.0), _check_number("betas[1]", beta2, below=1.0)),
            include_last_offset=bool(self.include_last_offset),
        )
        if self.return_whole_row and not self.optimizer_offloading:
            raise ValueError(
                "return_whole_row=True needs optimizer_offloading=True (the whole row holds the "
                "optimizer state only when it is offloaded into the row); pass return_whole_row=False"
            )
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"KVEmbeddingBag: dtype must be float32, float16 or bfloat16; got {self.dtype!r}")
        for name, value in normalised.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def arguments(self) -> dict[str, Any]:
        """The constructor's keyword arguments (the clock itself, not a copy)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def table(self, name: str, **live: float) -> KVTableConfig:
        """The :class:`KVTableConfig` that builds a bag like this one (one feature, the table's
        name); ``live`` gives hyperparameters that have changed since (``lr``, ``eps``,
        ``weight_decay``)."""
        low, high = self.init_range
        fields = dict(
            pooling=self.mode,
            data_type=self.dtype,
            optimizer=self.optimizer,
            lr=self.lr,
            eps=self.eps,
            betas=self.betas,
            weight_decay=self.weight_decay,
            optimizer_offloading=self.optimizer_offloading,
            return_whole_row=self.return_whole_row,
            num_shards=self.num_shards,
            weight_init_min=low,
            weight_init_max=high,
            seed=self.seed,
        )
        return KVTableConfig(name, self.embedding_dim, self.num_embeddings, **{**fields, **live})


def bag_arguments(table: KVTableConfig, **given: Any) -> dict[str, Any]:
    """``KVEmbeddingBag``'s keyword arguments for the bag ``table`` describes; ``given`` adds
    what a table config does not hold (``clock``, ``device``, ``backend``)."""
    return dict(
        num_embeddings=table.num_embeddings,
        embedding_dim=table.embedding_dim,
        mode=table.pooling,
        optimizer=table.optimizer,
        lr=table.lr,
        eps=table.eps,
        betas=table.betas,
        weight_decay=table.weight_decay,
        optimizer_offloading=table.optimizer_offloading,
        return_whole_row=table.return_whole_row,
        dtype=table.data_type,
        num_shards=table.num_shards,
        init_range=(table.weight_init_min, table.weight_init_max),
        seed=table.seed,
        **given,
    )
