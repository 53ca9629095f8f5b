"""The checkpoint core's surface for the rest of leanstate: what ``dcp``, the embedding
modules and the tools build on, declared in one place.

Not user API (users call ``save_checkpoint``, ``load_checkpoint`` and the classes
``leanstate`` exports): it is the seam between the checkpoint core and the sub-packages
built on it. Another sub-package imports these names from here, never from the core's
underscore modules (``tests/test_seams.py`` checks it), so renaming or reshaping one of
them is a change seen here first, with every caller found by its import.
"""

from __future__ import annotations

from leanstate.checkpoint._arguments import check_layout
from leanstate.checkpoint._background import Behind, finish_removals
from leanstate.checkpoint._bucketed_table import BucketedTable, describe_bucketing
from leanstate.checkpoint._chain import read_chain, verify_chain
from leanstate.checkpoint._chunks import (
    ChunkFile,
    TableRead,
    chunk_spans,
    gather,
    in_saving_order,
    read_chunks,
    rows_per_chunk,
    saving_order,
)
from leanstate.checkpoint._files import (
    checked_target,
    publish,
    read_extra,
    read_manifest_and_digest,
    replace_directory,
    staged,
    write_synced,
)
from leanstate.checkpoint._format import (
    CHECKSUM,
    DTYPES,
    EXTRA_FILE,
    MANIFEST,
    check_chunk_bytes,
    is_delta,
    layout_fields,
    table_entry,
)
from leanstate.checkpoint._load import load_all_or_nothing
from leanstate.checkpoint._module_tables import ModuleTables
from leanstate.checkpoint._ranks import all_true, distributed, group_rank, staged_by_rank_0

__all__ = [
    # the files: a manifest read with its digest, staging, atomic publishing
    "EXTRA_FILE",
    "MANIFEST",
    "checked_target",
    "publish",
    "read_extra",
    "read_manifest_and_digest",
    "replace_directory",
    "staged",
    "write_synced",
    # the format's facts and checks
    "CHECKSUM",
    "DTYPES",
    "check_chunk_bytes",
    "is_delta",
    "layout_fields",
    "table_entry",
    # the tables a checkpoint names, and their layout
    "BucketedTable",
    "ModuleTables",
    "check_layout",
    "describe_bucketing",
    # chunks: which rows go where, read and written
    "ChunkFile",
    "TableRead",
    "chunk_spans",
    "gather",
    "in_saving_order",
    "read_chunks",
    "rows_per_chunk",
    "saving_order",
    # loading: all or nothing, across ranks, with the file work in the background
    "Behind",
    "all_true",
    "distributed",
    "finish_removals",
    "group_rank",
    "load_all_or_nothing",
    "staged_by_rank_0",
    # delta chains: read from their manifests, verified link by link
    "read_chain",
    "verify_chain",
]
