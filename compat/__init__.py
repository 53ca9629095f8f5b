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

from leanstate._backends import BackendInfo, backend_info
from leanstate._dispatch import BackendDispatch
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import RowLayout

__all__ = ["BackendInfo", "KVStore", "KVTensor", "RowLayout", "backend_info"]


class KVStore(metaclass=BackendDispatch):
    """A sharded id -> row store (DESIGN §3.2); see ``leanstate.reference.kv_store.KVStore``.

    ``KVStore(dim, *, optimizer_state_dim=0, dtype=torch.float32, num_shards=8,
    init_range=(-0.01, 0.01), seed=0, clock=None, backend=None)``
    """

    _component = "kv_store"
