"""What the plain and the sharded KV embedding collections share: the bags by table name,
the fused optimizer's face for schedulers and TorchRec's ``CombinedOptimizer``, and one
base class with the surface both expose (``embedding_bags``, ``fused_optimizer``,
``feature_names``, ``embedding_bag_configs``, ``is_weighted``, ``device``,
``extra_state``, ``load_extra_state``) and the step from per-table pooled outputs to a
``KeyedTensor``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping

import torch
from torch import nn

from leanstate.embedding._torchrec_shapes import (
    BatchShape,
    KeyedTensor,
    embedding_names,
    keyed_tensor,
)


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

    It also has the surface of TorchRec's ``KeyedOptimizer`` that ``CombinedOptimizer``
    reads (``params`` by key ``embedding_bags.<table>.weight``, ``state``,
    ``post_load_state_dict``, ``save_param_groups``). Its ``state`` is empty: the
    optimizer state lives in the rows and the step count in the module's state dict.
    """

    def __init__(self, bags: Mapping[str, nn.Module]) -> None:
        bags = dict(bags)
        super().__init__([_TableGroup(name, bag) for name, bag in bags.items()], {})
        # Optimizer.__init__ copies each group into a plain dict: put the live ones back
        self.param_groups = [_TableGroup(g["table"], bags[g["table"]], g) for g in self.param_groups]
        self.defaults["_save_param_groups"] = False  # KeyedOptimizer's flag, read by CombinedOptimizer
        self.params = {f"embedding_bags.{g['table']}.weight": g["params"][0] for g in self.param_groups}

    def step(self, closure=None):
        """Nothing to do (the update happened in backward); calls ``closure`` if given."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the tables keep no gradients."""

    def post_load_state_dict(self) -> None:
        """Nothing to do (``KeyedOptimizer``'s hook after a load): there is no state here."""

    def save_param_groups(self, save: bool) -> None:
        """Whether a ``KeyedOptimizer`` state dict holds the parameter groups (TorchRec's flag)."""
        self.defaults["_save_param_groups"] = save


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


class TableCollection(nn.Module):
    """Base of ``KVEmbeddingBagCollection`` and ``ShardedKVEmbeddingBagCollection``: KV
    embedding bags by table name, each fed by one or more features.

    A subclass checks its tables, calls ``super().__init__(bags, features)`` and pools in
    ``forward`` (its own way: locally, or through the owners of the rows).
    """

    def __init__(
        self,
        bags: Mapping[str, nn.Module],
        configs: list,
        *,
        is_weighted: bool,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        _register_with_torchrec()
        self._fused_optimizer = None
        self.embedding_bags = Tables(bags)
        self._configs = configs
        self._table_features = {c.name: list(c.feature_names) for c in configs}
        for table, names in self._table_features.items():
            if len(set(names)) != len(names):
                raise ValueError(f"{type(self).__name__}: table {table!r} lists a feature twice: {names}")
        # TorchRec's output keys: a feature several tables read is feature@table
        self._embedding_names = embedding_names(self._table_features)
        self._is_weighted = bool(is_weighted)
        self._device = torch.device(device) if device is not None else next(iter(bags.values())).device

    def embedding_bag_configs(self) -> list:
        """The table configs, as given (TorchRec's ``EmbeddingBagConfig`` or ``KVTableConfig``);
        for a mapping of bags, a ``KVTableConfig`` describing each. TorchRec's ``DLRM`` reads them."""
        return self._configs

    def is_weighted(self) -> bool:
        """Whether the input's weights are per-sample weights (else they are ignored, as TorchRec does)."""
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        """Where the rows, the lookups and the outputs live (TorchRec's compute device)."""
        return self._device

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The tables' fused optimizer as a ``torch.optim.Optimizer`` (one group per table, its
        ``lr`` the bag's): what ``torch.optim.lr_scheduler`` schedulers drive."""
        if self._fused_optimizer is None:
            self._fused_optimizer = FusedOptimizer(dict(self.embedding_bags.items()))
        return self._fused_optimizer

    def feature_names(self) -> list[str]:
        """Every table's features, in output order (a feature several tables read once for each:
        the output names it ``feature@table``, TorchRec's rule)."""
        return [f for names in self._table_features.values() for f in names]

    def extra_state(self) -> dict[str, dict[str, int]]:
        """Table name -> that bag's ``extra_state()``."""
        return {table: bag.extra_state() for table, bag in self.embedding_bags.items()}

    def load_extra_state(self, extra: Mapping[str, Mapping[str, int]]) -> None:
        """Restore what :meth:`extra_state` returned."""
        for table, bag in self.embedding_bags.items():
            bag.load_extra_state(extra[table])

    def _keyed(self, shape: BatchShape, pooled: Mapping[str, torch.Tensor]) -> KeyedTensor:
        """Each table's pooled output (its features' bags one after the other) as one
        ``[shape.size, D]`` block per feature, tables in order, expanded by the inverse
        indices of a variable-batch input as TorchRec's collection does: the collection's
        ``KeyedTensor`` (TorchRec's when it imports)."""
        blocks, dims = [], []
        for table, out in pooled.items():
            start = 0
            for name in self._table_features[table]:
                block = out[start : start + shape.strides[name]]
                start += shape.strides[name]
                if shape.inverse is not None:
                    block = block.index_select(0, shape.inverse[name].to(block.device))
                blocks.append(block)
                dims.append(self.embedding_bags[table].embedding_dim)
        return keyed_tensor(self._embedding_names, dims, torch.cat(blocks, dim=1))


@functools.cache
def _register_with_torchrec() -> None:
    """Make the collections TorchRec ``FusedOptimizerModule``s when TorchRec imports, so
    ``DistributedModelParallel.fused_optimizer`` (which collects the fused optimizers of
    the modules that are) includes their tables. The class is an ABC: registered, not
    inherited, so TorchRec stays optional. Done when the first collection is built, not
    on the first forward: a model is wrapped in DMP before it runs."""
    if importlib.util.find_spec("torchrec") is None:
        return
    try:
        from torchrec.optim.fused import FusedOptimizerModule
    except Exception:  # broken (e.g. no fbgemm): nothing to register with, as when absent
        return
    FusedOptimizerModule.register(TableCollection)
