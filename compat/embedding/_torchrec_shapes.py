"""TorchRec's shapes, as much of them as the collections read and return:
``KeyedJaggedTensor`` input (every feature's ids, key-major, with lengths or offsets
and optional per-id weights) and ``KeyedTensor`` output (per-key pooled embeddings side
by side), and how a collection cuts a KeyedJaggedTensor-like into per-table bags.
A real ``torchrec.KeyedJaggedTensor`` works as input as well, and when TorchRec imports
the output is TorchRec's own ``KeyedTensor`` (``keyed_tensor``). ``KVTableConfig`` is
EmbeddingBagConfig's shape for a KV table; ``KVTableConfig.from_torchrec`` reads one.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

_DATA_TYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}


class KeyedJaggedTensor:
    """TorchRec's KeyedJaggedTensor, as much of it as the collection reads.

    ``values`` holds every feature's ids, key-major; ``lengths`` (or ``offsets``,
    ``len(keys) * B + 1`` of them) says how many belong to each (key, sample); ``weights``
    are optional per-id weights. A real ``torchrec.KeyedJaggedTensor`` works as well.

    Example::

        >>> KeyedJaggedTensor(["user", "item"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 0, 1, 0]))
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> None:
        if (lengths is None) == (offsets is None):
            raise ValueError("KeyedJaggedTensor: pass exactly one of lengths and offsets")
        self._keys, self._values, self._weights = list(keys), values, weights
        self._lengths = lengths if lengths is not None else torch.diff(offsets)

    @classmethod
    def from_lengths_sync(cls, keys, values, lengths, weights=None) -> KeyedJaggedTensor:
        """TorchRec's constructor by lengths."""
        return cls(keys, values, weights=weights, lengths=lengths)

    def keys(self) -> list[str]:
        """The feature names."""
        return self._keys

    def values(self) -> torch.Tensor:
        """Every id, key-major."""
        return self._values

    def lengths(self) -> torch.Tensor:
        """Ids per (key, sample), key-major."""
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """Where each (key, sample) starts in ``values``, plus the end."""
        return torch.cat([torch.zeros(1, dtype=self._lengths.dtype), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> torch.Tensor | None:
        """The per-id weights, or None."""
        return self._weights

    def __repr__(self) -> str:
        return f"KeyedJaggedTensor(keys={self._keys}, values={len(self._values)}, weighted={self._weights is not None})"


class KeyedTensor:
    """TorchRec's KeyedTensor: per-key pooled embeddings side by side in one ``[B, sum D]`` tensor."""

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor) -> None:
        self._keys, self._lengths, self._values = list(keys), list(length_per_key), values
        starts = [0]
        for length in self._lengths:
            starts.append(starts[-1] + length)
        self._offsets = starts

    def keys(self) -> list[str]:
        """The feature names, in column order."""
        return self._keys

    def values(self) -> torch.Tensor:
        """``[B, sum D]``."""
        return self._values

    def length_per_key(self) -> list[int]:
        """D of each key."""
        return self._lengths

    def offset_per_key(self) -> list[int]:
        """First column of each key, plus the total."""
        return self._offsets

    def key_dim(self) -> int:
        """The dimension the keys run along (1)."""
        return 1

    def __getitem__(self, key: str) -> torch.Tensor:
        index = self._keys.index(key)
        return self._values[:, self._offsets[index] : self._offsets[index + 1]]

    def to_dict(self) -> dict[str, torch.Tensor]:
        """Key -> ``[B, D]``."""
        return {key: self[key] for key in self._keys}

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._lengths}, values={tuple(self._values.shape)})"


@functools.cache
def _torchrec_keyed_tensor() -> type | None:
    """TorchRec's ``KeyedTensor`` class when TorchRec imports, else None. Imported with the first
    output rather than with leanstate: TorchRec's import costs about two seconds."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedTensor as torchrec_keyed_tensor
    except (
        Exception
    ):  # absent or broken (e.g. no fbgemm): leanstate's own shape, as for any optional dependency
        return None
    return torchrec_keyed_tensor


def keyed_tensor(keys: list[str], length_per_key: list[int], values: torch.Tensor):
    """A collection's output: TorchRec's ``KeyedTensor`` when TorchRec imports (so ``regroup``,
    ``KTRegroupAsDict``, ``.to()`` work on it), else leanstate's :class:`KeyedTensor`."""
    cls = _torchrec_keyed_tensor()
    if cls is None:
        return KeyedTensor(keys, length_per_key, values)
    return cls(keys=keys, length_per_key=length_per_key, values=values)


@dataclass
class BatchShape:
    """How a KeyedJaggedTensor's bags become the output's rows: ``size`` rows; ``strides``, the
    bags of each key; ``inverse``, for each key the bag of every output row (TorchRec's
    ``inverse_indices``, variable-batch inputs), or None when row ``b`` is bag ``b``."""

    size: int
    strides: dict[str, int]
    inverse: dict[str, torch.Tensor] | None


def _variable_stride(features) -> bool:
    variable = getattr(features, "variable_stride_per_key", None)
    return variable is not None and bool(variable())


def _strides(features, keys: list[str], lengths: torch.Tensor) -> list[int]:
    """The bags of each key: ``stride_per_key()`` of a variable-batch input, else the same for all."""
    if _variable_stride(features):  # its lengths are key-major, each key at its own stride
        strides = [int(s) for s in features.stride_per_key()]
        if len(strides) != len(keys) or sum(strides) != len(lengths):
            raise ValueError(
                f"KVEmbeddingBagCollection: stride_per_key() {strides} does not match the {len(keys)} keys "
                f"and {len(lengths)} lengths"
            )
        return strides
    if lengths.dim() != 1 or len(lengths) % len(keys):
        raise ValueError(
            f"KVEmbeddingBagCollection: lengths has {len(lengths)} entries, not a multiple of the "
            f"{len(keys)} keys {keys} (lengths are key-major: len(keys) * batch_size)"
        )
    return [len(lengths) // len(keys)] * len(keys)


def jagged_parts(
    features, *, weighted: bool
) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """(keys, values, lengths, weights or None, bags per key) of a KeyedJaggedTensor-like,
    checked. The weights are read only when ``weighted`` (the collection's
    ``is_weighted``): TorchRec's collections ignore a weighted input's weights otherwise."""
    keys, values = list(features.keys()), features.values()
    if hasattr(features, "lengths"):
        lengths = features.lengths()
    else:
        lengths = torch.diff(features.offsets())
    weights = None
    if weighted:
        weights = features.weights_or_none() if hasattr(features, "weights_or_none") else None
        if weights is None:
            raise ValueError(
                "KVEmbeddingBagCollection: is_weighted=True but the features carry no weights "
                "(weights_or_none() is None)"
            )
    lengths = torch.as_tensor(lengths).cpu().to(torch.int64)
    if not keys:
        raise ValueError("KVEmbeddingBagCollection: the features have no keys")
    strides = _strides(features, keys, lengths)
    if bool((lengths < 0).any()) or int(lengths.sum()) != len(values):
        raise ValueError(
            f"KVEmbeddingBagCollection: lengths must be >= 0 and sum to len(values)={len(values)}; "
            f"they sum to {int(lengths.sum())}"
        )
    if weights is not None and len(weights) != len(values):
        raise ValueError(
            f"KVEmbeddingBagCollection: weights_or_none() has {len(weights)} entries; values has {len(values)}"
        )
    return keys, values, lengths, weights, strides


def _inverse_indices(
    features, strides: Mapping[str, int], wanted: list[str]
) -> dict[str, torch.Tensor] | None:
    """Each wanted key's row of the input's ``inverse_indices`` (TorchRec's EBC expands each key's
    pooled bags to the full batch by them), checked against its bags; None without them."""
    read = getattr(features, "inverse_indices_or_none", None)
    inverse = read() if read is not None else None
    if inverse is None:
        if len({strides[k] for k in wanted}) > 1:
            raise ValueError(
                f"KVEmbeddingBagCollection: a variable-batch KeyedJaggedTensor without inverse_indices: the "
                f"features have { ({k: strides[k] for k in wanted}) } bags, which make no one batch; pass inverse_indices"
            )
        return None
    names, indices = inverse
    rows = {name: i for i, name in enumerate(names)}
    indices = torch.as_tensor(indices).cpu().to(torch.int64)
    absent = [k for k in wanted if k not in rows]
    if absent or indices.dim() != 2 or len(indices) != len(names):
        raise ValueError(
            f"KVEmbeddingBagCollection: inverse_indices must be (keys, [len(keys), batch] indices) naming "
            f"every feature read; got keys {list(names)} and shape {list(indices.shape)}, missing {absent}"
        )
    out = {}
    for key in wanted:
        index = indices[rows[key]]
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= strides[key]):
            raise ValueError(
                f"KVEmbeddingBagCollection: inverse_indices of {key!r} must lie in [0, {strides[key]}) "
                f"(its bags); got {int(index.min())}..{int(index.max())}"
            )
        out[key] = index
    return out


def table_inputs(
    features, table_features: Mapping[str, list[str]], *, weighted: bool, variable_batch: bool = True
) -> tuple[BatchShape, dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]]:
    """(the output's :class:`BatchShape`, table -> (ids, offsets, weights or None)): each table's
    features' bags one after the other, in the table's feature order, from a
    KeyedJaggedTensor-like (a feature several tables read, in each of them). A key no
    table reads is skipped, as TorchRec does; a table's feature missing from the input is
    a ``KeyError``. Weights are per-sample weights when ``weighted``, else ignored.
    A variable-batch input is refused unless ``variable_batch``."""
    read = getattr(features, "inverse_indices_or_none", None)
    if not variable_batch and (_variable_stride(features) or (read is not None and read() is not None)):
        raise ValueError(
            "ShardedKVEmbeddingBagCollection: variable-batch KeyedJaggedTensors (stride_per_key_per_rank, "
            "inverse_indices) are not supported; pass one batch size for every key"
        )
    keys, values, lengths, weights, strides = jagged_parts(features, weighted=weighted)
    wanted = list(dict.fromkeys(f for names in table_features.values() for f in names))
    missing = [k for k in wanted if k not in keys]
    if missing:
        raise KeyError(f"KVEmbeddingBagCollection: missing features {missing}; the input has {keys}")
    stride_of = dict(zip(keys, strides, strict=True))
    inverse = _inverse_indices(features, stride_of, wanted)
    size = len(next(iter(inverse.values()))) if inverse else stride_of[wanted[0]]
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    first_bag = dict(zip(keys, [0, *itertools.accumulate(strides)], strict=False))
    inputs = {}
    for table, names in table_features.items():
        parts, part_weights, part_lengths = [], [], []
        for name in names:
            bag = first_bag[name]
            first, last = int(bounds[bag]), int(bounds[bag + stride_of[name]])
            parts.append(values[first:last])
            part_lengths.append(lengths[bag : bag + stride_of[name]])
            if weights is not None:
                part_weights.append(weights[first:last])
        table_lengths = torch.cat(part_lengths)
        offsets = torch.cumsum(table_lengths, 0) - table_lengths
        inputs[table] = (torch.cat(parts), offsets, torch.cat(part_weights) if weights is not None else None)
    return BatchShape(size, {k: stride_of[k] for k in wanted}, inverse), inputs


def embedding_names(table_features: Mapping[str, list[str]]) -> list[str]:
    """The output's keys, TorchRec's rule: every table's features in order, a feature several
    tables read named ``feature@table``."""
    tables_of = collections.Counter(f for names in table_features.values() for f in names)
    return [
        f"{f}@{table}" if tables_of[f] > 1 else f for table, names in table_features.items() for f in names
    ]


def _data_type(value: object) -> torch.dtype:
    """A torch dtype, or TorchRec's ``DataType.FP32/FP16/BF16`` (or its name), as a dtype."""
    if isinstance(value, torch.dtype):
        return value
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.upper() in _DATA_TYPES:
        return _DATA_TYPES[name.upper()]
    raise TypeError(f"KVTableConfig: data_type must be a torch dtype or FP32/FP16/BF16; got {value!r}")


def _pooling(value: object) -> str:
    """``"sum"``/``"mean"``, or TorchRec's ``PoolingType.SUM/MEAN``, as a mode name."""
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.lower() in ("sum", "mean"):
        return name.lower()
    raise ValueError(f"KVTableConfig: pooling must be 'sum' or 'mean'; got {value!r}")


def _uniform_range(config) -> tuple[float | None, float | None]:
    """The uniform range a TorchRec config initialises its rows from: its ``init_fn`` when that
    is TorchRec's default (``partial(torch.nn.init.uniform_, a=..., b=...)``), else its
    ``weight_init_min/max`` when it has no ``init_fn``. Any other ``init_fn`` is a
    ``ValueError``: a KV table draws each row from (seed, id), never through a function."""
    init_fn = getattr(config, "init_fn", None)
    if init_fn is None:
        return getattr(config, "weight_init_min", None), getattr(config, "weight_init_max", None)
    if isinstance(init_fn, functools.partial) and init_fn.func is torch.nn.init.uniform_ and not init_fn.args:
        return init_fn.keywords.get("a", 0.0), init_fn.keywords.get("b", 1.0)
    raise ValueError(
        f"KVTableConfig.from_torchrec: table {config.name!r} has init_fn={init_fn!r}, which a KV table "
        "cannot run (its rows are drawn from (seed, id) when first read); pass weight_init_min/max instead"
    )


@dataclass
class KVTableConfig:
    """One table of a :class:`KVEmbeddingBagCollection`, with TorchRec EmbeddingBagConfig's names.

    ``feature_names`` (default ``[name]``) may list several features: they share the
    table's rows, and each is pooled on its own. ``data_type`` and ``pooling`` take torch
    dtypes and strings, or TorchRec's ``DataType``/``PoolingType`` members.
    ``weight_init_min``/``weight_init_max`` default to +-0.01; ``None`` means TorchRec's
    default, +-sqrt(1 / num_embeddings) (a table with ``num_embeddings``).
    :meth:`from_torchrec` reads a TorchRec ``EmbeddingBagConfig``.

    Example::

        >>> KVTableConfig("items", 64, feature_names=["clicked", "bought"], optimizer="rowwise_adagrad")
    """

    name: str
    embedding_dim: int
    num_embeddings: int | None = None
    feature_names: list[str] = field(default_factory=list)
    pooling: str = "sum"
    data_type: torch.dtype = torch.float32
    optimizer: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    optimizer_offloading: bool = True
    return_whole_row: bool | None = None  # default: follows optimizer_offloading
    num_shards: int = 8
    weight_init_min: float | None = -0.01
    weight_init_max: float | None = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"KVTableConfig: name must be a non-empty string; got {self.name!r}")
        self.feature_names = list(self.feature_names) or [self.name]
        if self.return_whole_row is None:  # whole rows exist only when the state lives in them
            self.return_whole_row = self.optimizer_offloading
        self.pooling = _pooling(self.pooling)
        self.data_type = _data_type(self.data_type)
        if self.weight_init_min is None or self.weight_init_max is None:
            if self.num_embeddings is None:
                raise ValueError(
                    f"KVTableConfig: table {self.name!r} has no num_embeddings, so TorchRec's default "
                    "init range +-sqrt(1 / num_embeddings) does not exist; pass weight_init_min/max"
                )
            bound = math.sqrt(1 / self.num_embeddings)  # TorchRec's get_weight_init_min/max
            self.weight_init_min = -bound if self.weight_init_min is None else self.weight_init_min
            self.weight_init_max = bound if self.weight_init_max is None else self.weight_init_max

    @classmethod
    def from_torchrec(cls, config, **kv_options) -> KVTableConfig:
        """The KV table of a TorchRec ``EmbeddingBagConfig``: its name, sizes, features, pooling,
        data type and init range (its default ``init_fn``, or ``weight_init_min/max``);
        ``kv_options`` set the rest (``optimizer``, ``lr``, ``seed``, ...) or override a field
        (``num_embeddings=None`` for hashed ids). A custom ``init_fn`` is a ``ValueError``.

        Example::

            >>> KVTableConfig.from_torchrec(EmbeddingBagConfig(1000, 16, "t", feature_names=["f"]), lr=0.1)
        """
        needed = ("name", "embedding_dim", "num_embeddings", "feature_names", "pooling")
        if not all(hasattr(config, attribute) for attribute in needed):
            raise TypeError(
                f"tables must be KVTableConfig or TorchRec EmbeddingBagConfig objects; got {type(config).__name__}"
            )
        low, high = _uniform_range(config)
        fields = dict(
            name=config.name,
            embedding_dim=config.embedding_dim,
            num_embeddings=config.num_embeddings,
            feature_names=list(config.feature_names),
            pooling=config.pooling,
            data_type=getattr(config, "data_type", torch.float32),
            weight_init_min=low,
            weight_init_max=high,
        )
        return cls(**{**fields, **kv_options})


def table_configs(tables: Sequence) -> tuple[list, list[KVTableConfig]]:
    """(the configs as given, as ``KVTableConfig``): TorchRec ``EmbeddingBagConfig``s through
    :meth:`KVTableConfig.from_torchrec`. A TorchRec config without ``feature_names`` gets
    ``[name]``, as TorchRec's collection sets it, so ``embedding_bag_configs()`` readers
    (``DLRM``) see the feature."""
    given = list(tables)
    for config in given:
        if (
            not isinstance(config, KVTableConfig)
            and hasattr(config, "feature_names")
            and not config.feature_names
        ):
            config.feature_names = [config.name]
    kv = [c if isinstance(c, KVTableConfig) else KVTableConfig.from_torchrec(c) for c in given]
    return given, kv
