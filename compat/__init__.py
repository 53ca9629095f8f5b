"""leanstate: lean training state (KV embedding store, checkpoints, ZeRO, activation wrappers).

Each component has a readable pure-Python reference (``leanstate.reference``) and
accelerated mirrors (``leanstate.accelerated``); the public names here build the
backend chosen at import time (see :func:`backend_info`), or the one passed as
``backend=``.

Example::

    >>> import torch, leanstate
    >>> store = leanstate.KVStore(16, optimizer_state_dim=1)
    >>> store.set(torch.tensor([3]), torch.ones(1, 16))
    >>> store.get(torch.tensor([3])).shape
    torch.Size([1, 20])
"""

from importlib.metadata import PackageNotFoundError, version

from leanstate._backends import BackendInfo, backend_info
from leanstate._backends import register as register_backend
from leanstate._backends import unregister as unregister_backend
from leanstate.checkpoint import compact_checkpoint, last_load_stats, load_checkpoint, save_checkpoint
from leanstate.checkpoint.follower import Follower
from leanstate.checkpoint.legacy import load_legacy_checkpoint, save_legacy_checkpoint
from leanstate.embedding import (
    KeyedJaggedTensor,
    KeyedTensor,
    KVEmbeddingBag,
    KVEmbeddingBagCollection,
    KVTableConfig,
)
from leanstate.embedding.sharded import ShardedKVEmbeddingBagCollection
from leanstate.kv_store import KVStore
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.pinned_pool import PinnedMemoryPool
from leanstate.reference.row_format import RowLayout
from leanstate.reference.sharding import bucket_owner, row_wise_id_range
from leanstate.reference.wrappers import (
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from leanstate.wrappers import offload_wrapper
from leanstate.zero import ZeroRedundancyOptimizer

try:
    __version__ = version("leanstate")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ActivationWrapper",
    "BackendInfo",
    "CheckpointError",
    "CheckpointImpl",
    "CheckpointWrapper",
    "Follower",
    "KVEmbeddingBag",
    "KVEmbeddingBagCollection",
    "KVStore",
    "KVTableConfig",
    "KVTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "OffloadWrapper",
    "PinnedMemoryPool",
    "RowLayout",
    "ShardedKVEmbeddingBagCollection",
    "apply_activation_checkpointing",
    "backend_info",
    "bucket_owner",
    "checkpoint_wrapper",
    "compact_checkpoint",
    "load_checkpoint",
    "last_load_stats",
    "load_legacy_checkpoint",
    "offload_wrapper",
    "ZeroRedundancyOptimizer",
    "register_backend",
    "row_wise_id_range",
    "save_checkpoint",
    "save_legacy_checkpoint",
    "unregister_backend",
]
