"""KV tables through ``torch.distributed.checkpoint``: one ``dcp.save`` for the whole model.

A state dict may hold KV tables beside dense tensors: a ``KVStore``, a ``KVTensor`` of
one (``module.state_dict()`` of a plain bag), or a sharded module's
``checkpoint_tables()`` (``BucketedTable`` values). :class:`KVSavePlanner` writes each
table's exact whole rows as chunked ``uint8 [N, R]`` items, a schema and a CRC per
chunk; :class:`KVLoadPlanner` streams them back chunk by chunk into the stores, each
rank reading only the chunks that can hold ids it owns, with memory about one chunk
whatever the table size. The dense part goes through DCP's default planners
untouched. :class:`SafeFileSystemReader` reads ``.metadata`` with an allow-list
unpickler. :func:`save` and :func:`load` add what a bare ``dcp.save``/``dcp.load``
cannot: an atomic save (a staging directory renamed into place) and a load that
changes no store on any rank when any chunk on any rank is bad. See ``spec/dcp.md``.

One idea a module: ``_state`` (what a state dict holds), ``_sources`` (rows to save),
``_save_planner``, ``_load_planner``, ``_reader`` (the safe reader), ``_transaction``
(save and load, all or nothing), ``_migrate`` (plain tables, TorchRec's, loaded as KV
rows) and ``_convert``.

Example (on every rank)::

    >>> state = {"dense": mlp.state_dict(), "sparse": ebc.checkpoint_tables()}
    >>> leanstate.dcp.save(state, checkpoint_id="ckpt", process_group=group)
    >>> leanstate.dcp.load(fresh_state, checkpoint_id="ckpt", process_group=group)
"""

from leanstate.dcp._convert import convert
from leanstate.dcp._load_planner import KVLoadPlanner
from leanstate.dcp._migrate import load
from leanstate.dcp._reader import SafeFileSystemReader
from leanstate.dcp._save_planner import KVSavePlanner
from leanstate.dcp._save_planner import refuse_stock_planner as _refuse_stock_planner  # noqa: F401 (pickled by this name)
from leanstate.dcp._state import INDEX_KEY
from leanstate.dcp._transaction import save

__all__ = ["INDEX_KEY", "KVLoadPlanner", "KVSavePlanner", "SafeFileSystemReader", "convert", "load", "save"]
