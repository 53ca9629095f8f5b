"""``leanstate.KVEmbeddingBag``, ``KVEmbeddingBagCollection`` and ``KVTableConfig``.

Like FBGEMM's SSD/DRAM table-batched embeddings: the rows live in a :class:`KVStore`;
forward deduplicates the ids and pools their rows; backward sums one gradient per
distinct id and the fused optimizer updates the rows **during backward** (there is no
separate ``optimizer.step()``). With ``optimizer_offloading=True`` (default) the
optimizer state lives in the row after the weight (``[header | weight | state]``); with
``False`` it lives in a second store keyed by the same ids. The module validates and
normalises its input, then hands each batch to the embedding engine of its backend
(``spec/backends.md``), which reads and writes the rows of its store engine directly.
The collection takes TorchRec's shapes: ``KVTableConfig`` (EmbeddingBagConfig's
names), KeyedJaggedTensor input and KeyedTensor output. See ``spec/embedding.md``.

Example::

    >>> bag = KVEmbeddingBag(1000, 16, optimizer="rowwise_adagrad", lr=0.1)
    >>> pooled = bag(torch.tensor([3, 7, 7, 9]), torch.tensor([0, 2]))   # two bags
    >>> pooled.sum().backward()                                           # rows updated
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from leanstate import _backends
from leanstate._host_reads import host_read
from leanstate._rows import copy_rows
from leanstate.checkpoint.core import ModuleTables
from leanstate.embedding._bag_input import batch_summary, checked_batch
from leanstate.embedding._collection import TableCollection
from leanstate.embedding._config import BagConfig, bag_arguments
from leanstate.embedding._torchrec_shapes import (
    KeyedJaggedTensor,
    KeyedTensor,
    KVTableConfig,
    table_configs,
    table_inputs,
)
from leanstate.kv_store import KVStore
from leanstate.reference.embedding import state_elements, state_fields
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import pad4

__all__ = ["KVEmbeddingBag", "KVEmbeddingBagCollection", "KVTableConfig", "KeyedJaggedTensor", "KeyedTensor"]


_EXTRA_STATE = "_extra_state"  # nn.Module's state-dict key for get_extra_state()
_PLAIN_CHUNK_ROWS = 65536  # a migrated plain table is written this many rows at a time


def _is_plain_table(weight: object, dim: int) -> bool:
    """Whether ``weight`` is a plain ``[N, dim]`` tensor (not a KVTensor): a table to migrate."""
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == dim


class _FusedUpdate(torch.autograd.Function):
    """Pooled forward; backward hands the output gradient to the engine's fused update."""

    @staticmethod
    def forward(ctx, anchor, bag, unique, inverse, offsets, per_sample_weights):
        ctx.bag, ctx.saved = bag, (unique, inverse, offsets, per_sample_weights)
        return bag.engine.pool(unique, inverse, offsets, per_sample_weights, bag.mode == "mean")

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.detach().contiguous()
        unique, inverse, offsets, weights = ctx.saved
        grad_weights = None
        if ctx.needs_input_grad[5]:
            # d out[b] / d w_i = the row of id i (sum mode): read before the update moves it
            rows = ctx.bag.store.get(unique, width=ctx.bag.embedding_dim).float()
            bag_of = torch.repeat_interleave(
                torch.arange(len(offsets) - 1, device=rows.device),
                torch.diff(offsets),
                output_size=len(inverse),
            )
            grad_weights = (grad_output.to(rows.device)[bag_of] * rows[inverse]).sum(1)
        ctx.bag.apply_gradient(
            unique, inverse, offsets, weights.detach() if weights is not None else None, grad_output
        )
        return None, None, None, None, None, grad_weights


def _configured(name: str) -> property:
    """A read-only attribute of the bag: its config's field ``name``."""
    return property(
        lambda bag: getattr(bag.config, name), doc=f"``{name}``, as the bag was built (``config.{name}``)."
    )


class KVEmbeddingBag(nn.Module):
    """An embedding bag whose table is a KV store, trained by a fused optimizer.

    Args:
        num_embeddings: size of the id space: ids must lie in ``[0, num_embeddings)``
            (a ``ValueError`` names the first one outside); ``None`` for the whole
            non-negative int64 range (hashed ids). Negative ids are padding.
        embedding_dim: D.
        mode: ``"sum"`` or ``"mean"`` pooling.
        include_last_offset: as ``nn.EmbeddingBag``'s: ``offsets`` has B + 1 entries, the
            last the end of the last bag (TorchRec's offsets); ids after it are in no bag.
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` (FBGEMM's exact rowwise Adagrad) or
            ``"adam"``; applied to the touched rows in backward.
        lr, eps, betas, weight_decay: the optimizer's hyperparameters (weight decay is
            L2: ``g += weight_decay * w``); checked as ``torch.optim`` does.
        optimizer_offloading: keep the optimizer state in the row (True) or in a
            separate float32 store (False).
        return_whole_row: ``state_dict()["weight"]`` is a whole-row KVTensor (header,
            weight, state); requires ``optimizer_offloading``.
        dtype: of the rows: float32, float16 or bfloat16. The arithmetic is float32 and
            the output is float32 (FBGEMM's default); 16-bit rows store the float32
            optimizer state as its bytes (two elements per value).
        num_shards, init_range, seed, clock: of the store(s).
        device: where the rows live (``KVStore``'s ``device``); ids, offsets, outputs and
            gradients of a batch live there too.
        backend: of the store and the embedding engine; default the import-time choice.

    ``stats`` counts, over all forwards: ``batches``, ``ids`` (positions), ``padding_ids``
    (negative ids) and ``unique_ids`` (distinct non-padding ids, summed per batch).

    ``config`` holds the arguments as checked (a frozen ``BagConfig``): the attributes of
    those names read it, and copies are built from it. ``lr``, ``eps`` and ``weight_decay``
    are live attributes too (a scheduler writes them); ``config`` keeps the constructor's.

    ``copy.deepcopy`` gives an independent module with a copy of every row (the clock is
    shared). A ``state_dict()`` holds KVTensors, which refuse to be pickled: save the
    module with ``save_checkpoint(path, bag.checkpoint_tables(), extra=bag.extra_state())``.
    """

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        *,
        mode: str = "sum",
        include_last_offset: bool = False,
        optimizer: str = "sgd",
        lr: float = 0.01,
        eps: float = 1e-8,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        optimizer_offloading: bool = True,
        return_whole_row: bool = True,
        dtype: torch.dtype = torch.float32,
        num_shards: int = 8,
        init_range: tuple[float, float] = (-0.01, 0.01),
        seed: int = 0,
        clock=None,
        device: torch.device | str | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        config = BagConfig(
            num_embeddings=num_embeddings, embedding_dim=embedding_dim, mode=mode,
            include_last_offset=include_last_offset, optimizer=optimizer,
            lr=lr, eps=eps, betas=betas, weight_decay=weight_decay,
            optimizer_offloading=optimizer_offloading, return_whole_row=return_whole_row, dtype=dtype,
            num_shards=num_shards, init_range=init_range, seed=seed, clock=clock, device=device,
            backend=backend,
        )  # fmt: skip
        name, module = _backends.resolve("embedding", backend)
        # the optimizer's live hyperparameters: a scheduler writes them (config keeps the constructor's)
        self.lr, self.eps, self.weight_decay = config.lr, config.eps, config.weight_decay
        self.fields = state_fields(optimizer, embedding_dim)  # float32 columns
        # Adam's bias correction counts backward passes, as FBGEMM's iter: a tensor the module
        # owns, which state_dict() returns itself, so a load in place (dcp.load) restores it
        self._step = torch.zeros((), dtype=torch.int64)
        self.stats = {"batches": 0, "ids": 0, "padding_ids": 0, "unique_ids": 0}
        common = dict(num_shards=num_shards, seed=seed, clock=clock, device=device, backend=name)
        if optimizer_offloading:
            state_elems = state_width = state_elements(optimizer, embedding_dim, dtype)
            self.store = KVStore(
                embedding_dim, optimizer_state_dim=state_elems, dtype=dtype, init_range=init_range, **common
            )
            self.state_store = None
            state_start = self.store.layout.state_offset
        else:
            self.store = KVStore(embedding_dim, dtype=dtype, init_range=init_range, **common)
            state_floats = state_width = state_elements(optimizer, embedding_dim, torch.float32)
            self.state_store = (
                KVStore(state_floats, init_range=(0.0, 0.0), **common) if state_floats else None
            )
            state_start = self.state_store.layout.header_elems if self.state_store is not None else 0
        self.config = dataclasses.replace(config, backend=name, init_range=self.store.init_range)
        self._engine = module.EmbeddingEngine(
            self.store.engine,
            None if self.state_store is None else self.state_store.engine,
            state_start=state_start,
            state_width=state_width,
            optimizer=optimizer,
        )

    # the configuration, read-only (lr, eps and weight_decay are live attributes, set above)
    num_embeddings = _configured("num_embeddings")
    embedding_dim = _configured("embedding_dim")
    mode = _configured("mode")
    include_last_offset = _configured("include_last_offset")
    optimizer = _configured("optimizer")
    betas = _configured("betas")
    optimizer_offloading = _configured("optimizer_offloading")
    return_whole_row = _configured("return_whole_row")
    dtype = _configured("dtype")
    backend = _configured("backend")

    @classmethod
    def from_config(
        cls,
        config: KVTableConfig,
        *,
        clock=None,
        device: torch.device | str | None = None,
        backend: str | None = None,
    ) -> KVEmbeddingBag:
        """The bag a :class:`KVTableConfig` describes."""
        return cls(**bag_arguments(config, clock=clock, device=device, backend=backend))

    @property
    def engine(self):
        """The embedding engine of this bag's backend (``spec/backends.md``): ``pool``,
        ``pool_rows``, ``row_gradients`` and ``update`` over the bag's store engines."""
        return self._engine

    @property
    def device(self) -> torch.device:
        """Where the rows, the ids of a batch, the output and the gradients live."""
        return self.store.device

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, optimizer={self.optimizer!r}, "
            f"lr={self.lr}, dtype={self.dtype}, optimizer_offloading={self.optimizer_offloading}, "
            f"rows={len(self.store)}, backend={self.backend!r}, device={str(self.device)!r}"
        )

    def __deepcopy__(self, memo: dict) -> KVEmbeddingBag:
        clone = type(self)(**self.config.arguments())
        memo[id(self)] = clone
        clone.train(self.training)
        clone.optimizer_step, clone.stats = self.optimizer_step, dict(self.stats)
        copy_rows(self.store, clone.store)
        if self.state_store is not None:
            copy_rows(self.state_store, clone.state_store)
        return clone

    # -- forward ----------------------------------------------------------------------

    @torch.compiler.disable  # the store is Python and numba: a graph break, so the rest of a model compiles
    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pool ``input`` ids into bags, as ``nn.EmbeddingBag``: float32 ``[B, D]``.

        1-D ``input`` (int64 or int32) with ``offsets`` (the start of each bag, first 0,
        non-decreasing; with ``include_last_offset``, plus the end of the last bag), or 2-D
        ``input`` ``[B, L]`` without (each row one bag). ``per_sample_weights`` (sum mode
        only) has ``input``'s shape. Negative ids are padding: they add nothing, do not
        count in a mean, and are counted in ``stats["padding_ids"]``.
        """
        unique, inverse, ends, per_sample_weights = self.prepare_batch(input, offsets, per_sample_weights)
        anchor = torch.empty(0, requires_grad=torch.is_grad_enabled() and self.training)
        return _FusedUpdate.apply(anchor, self, unique, inverse, ends, per_sample_weights)

    # -- the fused optimizer ------------------------------------------------------------

    def prepare_batch(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The batch as the engine takes it: (distinct ids, the index of each id among them,
        bag ends ``[B + 1]``, float32 weights or None), padding removed, every argument
        checked as :meth:`forward` documents, and ``stats`` counted. The sharded
        collection prepares each rank's batch of a table with this too."""
        ids, offsets, per_sample_weights, end = checked_batch(
            input,
            offsets,
            per_sample_weights,
            device=self.device,
            num_embeddings=self.num_embeddings,
            mode=self.mode,
            include_last_offset=self.include_last_offset,
        )
        padding, length = batch_summary(ids, offsets, end, num_embeddings=self.num_embeddings)
        if length < len(ids):  # ids after the last bag's end belong to no bag (include_last_offset)
            ids = ids[:length]
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights[:length]
        device = ids.device
        ends = torch.cat([offsets, torch.tensor([len(ids)], device=device)])
        if padding:  # drop the padding without waiting for the device again: sizes are known
            keep = ids >= 0
            kept_before = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(keep, 0)])
            ends = kept_before[ends]
            kept = torch.argsort(~keep, stable=True)[: len(ids) - padding]
            ids = ids[kept]
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights[kept]
        unique, inverse = host_read(torch.unique, ids, return_inverse=True)
        self.stats["batches"] += 1
        self.stats["ids"] += len(ids) + padding
        self.stats["padding_ids"] += padding
        self.stats["unique_ids"] += len(unique)
        return unique, inverse, ends, per_sample_weights

    def apply_gradient(
        self,
        unique: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        grad_output: torch.Tensor,
        *,
        mean: bool | None = None,
    ) -> None:
        """One fused optimizer step on the rows of the distinct ``unique`` ids, from the
        gradient of the pooled output (what backward does; ``mean``: whether the bags were
        means, default this bag's mode)."""
        self.optimizer_step += 1
        beta1, beta2 = self.betas
        self.engine.update(
            unique,
            inverse,
            offsets,
            per_sample_weights,
            self.mode == "mean" if mean is None else mean,
            grad_output.to(self.device, torch.float32),
            hyperparameters=dict(
                lr=self.lr, eps=self.eps, beta1=beta1, beta2=beta2, weight_decay=self.weight_decay
            ),
            step=self.optimizer_step,
            now=self.store.now(),
        )

    # -- state ----------------------------------------------------------------------

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """KVTensors: ``weight`` (whole rows when ``return_whole_row``) and the optimizer's
        fields, and ``_extra_state`` (:meth:`get_extra_state`: the optimizer step).

        With offloading, the optimizer fields are read-only views into the rows (a whole-row
        load already brought them; with 16-bit rows they show the raw elements holding the
        float32 bytes); without, they are views of the state store.
        """
        out = destination if destination is not None else {}
        out[prefix + "weight"] = self.weight
        out.update({prefix + name: view for name, view in self._field_views().items()})
        out[prefix + _EXTRA_STATE] = self.get_extra_state()
        return out

    @property
    def weight(self) -> KVTensor:
        """The table as ``state_dict()["weight"]`` holds it (whole rows when ``return_whole_row``):
        what state-dict utilities (``get_model_state_dict``) read by attribute."""
        if self.return_whole_row:
            return KVTensor(self.store, whole_rows=True)
        return KVTensor(self.store, width=self.embedding_dim)

    def __getattr__(self, name: str):
        # The optimizer's fields by attribute too, as state-dict utilities walk every key's path.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in self.__dict__.get("fields", {}):
                return self._field_views()[name]
            raise

    @property
    def optimizer_step(self) -> int:
        """Backward passes so far (Adam's bias correction counts them)."""
        return int(self._step)

    @optimizer_step.setter
    def optimizer_step(self, step: int) -> None:
        self._step.fill_(int(step))

    def get_extra_state(self) -> torch.Tensor:
        """The optimizer step as the module's own 0-d int64 tensor (not a copy), so every
        state-dict path carries it: ``load_state_dict``, and ``dcp.load`` in place."""
        return self._step

    def set_extra_state(self, state) -> None:
        """Restore the optimizer step from :meth:`get_extra_state`'s tensor (or an int, or
        :meth:`extra_state`'s dict)."""
        if isinstance(state, Mapping):
            state = state["optimizer_step"]
        if state is not self._step:  # a load in place wrote it already
            self.optimizer_step = int(state)

    def _field_views(self) -> dict[str, KVTensor]:
        """One KVTensor per optimizer field: read-only in the rows, or of the state store."""
        if not self.optimizer_offloading:
            return {
                name: KVTensor(self.state_store, width_offset=start, width=width)
                for name, (start, width) in self.fields.items()
            }
        offset, per_float = pad4(self.embedding_dim), 4 // self.dtype.itemsize
        return {
            name: KVTensor(
                self.store, width_offset=offset + start * per_float, width=width * per_float, read_only=True
            )
            for name, (start, width) in self.fields.items()
        }

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """Copy KVTensors or tensors in, chunk by chunk (whole rows by header key). A plain
        ``[N, embedding_dim]`` ``weight`` (a TorchRec or ``nn.EmbeddingBag`` table) is rows
        ``0..N-1``; the optimizer fields and step it lacks are then not missing: they start fresh."""
        mine = self.state_dict(prefix=prefix)
        weight = state_dict.get(prefix + "weight")
        migrating = _is_plain_table(weight, self.embedding_dim)
        missing_keys.extend(
            key for key in mine if key not in state_dict and not (migrating and key != prefix + "weight")
        )
        unexpected_keys.extend(
            key
            for key in state_dict
            if key.startswith(prefix) and "." not in key[len(prefix) :] and key not in mine
        )
        if prefix + _EXTRA_STATE in state_dict:
            self.set_extra_state(state_dict[prefix + _EXTRA_STATE])
        if migrating:
            self._load_plain_rows(weight)
        for key, target in mine.items():
            if (
                key not in state_dict
                or key == prefix + _EXTRA_STATE
                or (migrating and key == prefix + "weight")
            ):
                continue
            source = state_dict[key]
            if target.whole_rows:  # keyed by each row's header: the ids are placeholders
                placeholder = torch.full((len(source),), -1, dtype=torch.int64)
                KVTensor(target.store, ids=placeholder, whole_rows=True).copy_(source)
            elif not target.read_only:
                ids = source.ids if isinstance(source, KVTensor) else target.ids
                view = KVTensor(target.store, ids=ids, width_offset=target.width_offset, width=target.width)
                view.copy_(source)
            else:
                target.ignored_writes += len(source)

    def _load_plain_rows(self, weight: torch.Tensor) -> None:
        """Write a plain ``[N, D]`` table's rows as ids ``0..N-1``, a chunk at a time (an upsert:
        rows already in the store keep their optimizer state)."""
        rows = len(weight)
        if self.num_embeddings is not None and rows > self.num_embeddings:
            raise ValueError(
                f"KVEmbeddingBag: a plain weight of {rows} rows does not fit num_embeddings={self.num_embeddings}"
            )
        for start in range(0, rows, _PLAIN_CHUNK_ROWS):
            chunk = weight[start : start + _PLAIN_CHUNK_ROWS].detach()
            ids = torch.arange(start, start + len(chunk), dtype=torch.int64, device=self.device)
            self.store.set(ids, chunk.to(self.device, self.dtype))

    def checkpoint_tables(self) -> dict[str, KVStore | KVTensor]:
        """What ``save_checkpoint`` / ``load_checkpoint`` take for this module; they save and
        restore its :meth:`extra_state` (the optimizer step) with the tables."""
        if self.optimizer_offloading:
            return ModuleTables(
                {"weight": KVTensor(self.store, whole_rows=True), **self._field_views()}, self
            )
        tables = {"weight": self.store}
        if self.state_store is not None:
            tables["optimizer_state"] = self.state_store
        return ModuleTables(tables, self)

    def extra_state(self) -> dict[str, int]:
        """Dense state to save beside the tables (``extra=`` of ``save_checkpoint``)."""
        return {"optimizer_step": self.optimizer_step}

    def load_extra_state(self, extra: Mapping[str, int]) -> None:
        """Restore what :meth:`extra_state` returned."""
        self.optimizer_step = int(extra["optimizer_step"])


class KVEmbeddingBagCollection(TableCollection):
    """KV embedding tables with TorchRec's EmbeddingBagCollection shapes.

    Args:
        tables: a list of :class:`KVTableConfig` or TorchRec ``EmbeddingBagConfig`` (read by
            :meth:`KVTableConfig.from_torchrec`; several features may share a table, and a
            feature may feed several tables), or a mapping name -> :class:`KVEmbeddingBag`
            (one feature per table, its name).
        is_weighted: whether the input's weights are per-sample weights; when False (the
            default, as TorchRec's) a weighted input's weights are ignored.
        device: where the rows live and the lookups run (default the CPU).
        clock, backend: for the bags built from configs.

    ``forward(features)`` takes a KeyedJaggedTensor (or anything with ``keys()``,
    ``values()``, ``lengths()`` or ``offsets()``, and ``weights_or_none()`` when weighted)
    holding every feature of the tables (keys no table reads are skipped), and returns a
    ``KeyedTensor`` (TorchRec's when it imports, else :class:`KeyedTensor`) with one
    ``[B, D]`` block per feature, tables in order, each table's features in order (a
    feature several tables read is ``feature@table``, TorchRec's name). A variable-batch
    KeyedJaggedTensor is pooled per key at its own stride and expanded to the batch by its
    ``inverse_indices``, as TorchRec's collection does. Each table deduplicates the ids of
    all its features together, so its fused update sees one gradient per distinct id. The
    lookup is a ``torch.compiler.disable`` boundary: the rest of a compiled model compiles
    around it.

    Example::

        >>> ebc = KVEmbeddingBagCollection([KVTableConfig("t", 8, feature_names=["user", "item"])])
        >>> kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 0, 1, 0]))
        >>> ebc(kjt)["item"].shape
        torch.Size([2, 8])
    """

    def __init__(
        self,
        tables: Sequence[KVTableConfig] | Mapping[str, KVEmbeddingBag],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        clock=None,
        backend: str | None = None,
    ) -> None:
        if isinstance(tables, Mapping):
            bags = dict(tables)
            given = configs = [
                bag.config.table(name, lr=bag.lr, eps=bag.eps, weight_decay=bag.weight_decay)
                for name, bag in bags.items()
            ]
        else:
            given, configs = table_configs(tables)
            names = [c.name for c in configs]
            if len(set(names)) != len(names):
                raise ValueError(f"KVEmbeddingBagCollection: table names must be unique; got {names}")
            bags = {
                c.name: KVEmbeddingBag.from_config(c, clock=clock, device=device, backend=backend)
                for c in configs
            }
        if not bags:
            raise ValueError("KVEmbeddingBagCollection: no tables")
        super().__init__(bags, given, is_weighted=is_weighted, device=device)

    @torch.compiler.disable  # the store is Python and numba: a graph break, so the rest of a model compiles
    def forward(self, features) -> KeyedTensor:
        """Pool each feature of ``features`` in its table; a ``KeyedTensor``."""
        shape, inputs = table_inputs(features, self._table_features, weighted=self._is_weighted)
        pooled = {}
        for table, (ids, offsets, weights) in inputs.items():
            bag = self.embedding_bags[table]
            if bag.include_last_offset:  # a bag given in a mapping may want the end too
                offsets = torch.cat([offsets, torch.tensor([len(ids)])])
            pooled[table] = bag(ids, offsets, weights)
        return self._keyed(shape, pooled)

    def checkpoint_tables(self) -> dict[str, KVStore | KVTensor]:
        """Every table's ``checkpoint_tables()``, named ``"<table>.<name>"``: one ``save_checkpoint``
        (with every table's optimizer step, :meth:`extra_state`)."""
        tables = {
            f"{table}.{name}": value
            for table, bag in self.embedding_bags.named_children()
            for name, value in bag.checkpoint_tables().items()
        }
        return ModuleTables(tables, self)
