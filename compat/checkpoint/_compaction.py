"""Compaction: a delta chain merged into one full checkpoint of the chain's version, byte
for byte what a full save writes from stores holding the chain's rows
(``leanstate.compact_checkpoint``, ``python -m leanstate compact``).

:func:`compact` checks the chain and its destination (D7: never a link of the chain) and
writes version 1 itself; a version-2 chain goes to :func:`compact_sharded`, one rank file
at a time at the head's world size. Both write the merge of the chain's links
(``leanstate.checkpoint._merge``) through :func:`write_merge`, cut into chunks as a full
save cuts them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from leanstate._numpy import np
from leanstate.checkpoint._bucketed_table import BucketedTable, describe_bucketing
from leanstate.checkpoint._chain import chain_extra, chain_parts, check_outside_chain, read_chain
from leanstate.checkpoint._chunks import ChunkFile, buckets_of, rows_per_chunk
from leanstate.checkpoint._files import checked_target, read_extra_bytes, staged
from leanstate.checkpoint._format import DTYPES, FORMAT_NAME, FORMAT_VERSION, table_entry
from leanstate.checkpoint._merge import LinkTable, merged
from leanstate.checkpoint._writer import new_manifest, publish_manifest, sharded_table_entry
from leanstate.checkpoint.sharded import link_table
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.row_format import RowLayout


def compact(src: Path, dst: Path, *, chunk_bytes: int, overwrite: bool, method: str) -> Path:
    """Merge the chain at ``src`` into one full checkpoint at ``dst`` of the chain's version
    (see ``leanstate.compact_checkpoint``)."""
    links = read_chain(src, method)
    dst = checked_target(dst, method)
    check_outside_chain(dst, links, f"{method}: dst", f"the head of the chain being compacted ({src})")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:  # an empty directory is free, as for convert
        raise ValueError(
            f"{method}: dst {dst} exists; pass overwrite=True (leanstate compact --force) to replace it"
        )
    if links[0].version == 2:  # across ranks: one file per rank of the head's world size
        return compact_sharded(links, dst, chunk_bytes=chunk_bytes, method=method)
    head = links[0]
    parts = {name: chain_parts(links, name, None) for name in head.manifest["tables"]}
    chain_extra(links)  # checked as a load checks it
    extra_bytes = read_extra_bytes(head.path, head.manifest)
    with staged(dst, method) as staging:
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "tables": {},
            "views": head.manifest["views"],
            "extra": None,
        }
        for name, table_parts in parts.items():
            table = head.manifest["tables"][name]
            layout = RowLayout(table["dim"], table["optimizer_state_dim"], DTYPES[table["dtype"]])
            file = staging / f"{name}.rows"
            chunks = write_merge(file, layout, table_parts, chunk_bytes)
            manifest["tables"][name] = table_entry(layout, file, chunks)
        publish_manifest(staging, dst, manifest, extra_bytes)
    return dst


def write_merge(
    file: Path,
    layout: RowLayout,
    parts: list[LinkTable],
    chunk_bytes: int,
    bucketing: tuple[int, int | None] | None = None,
) -> list[dict]:
    """The merge of ``parts`` written to ``file`` in chunks of a full save's size; with
    ``bucketing`` (a version-2 rank file, the merge bucket-major), chunks cut as
    ``chunk_spans`` cuts a full save's: never across a bucket, each entry naming its bucket."""
    per_chunk = rows_per_chunk(layout, chunk_bytes)
    buffers = [np.empty((per_chunk, layout.row_bytes), dtype=np.uint8) for _ in range(2)]
    sink = ChunkFile(file, pipelined=True)
    filled, turn, bucket = 0, 0, None

    def flush() -> None:
        nonlocal filled, turn
        # append waits for the write before it: the other buffer is free again
        sink.append(
            _as_rows(buffers[turn][:filled], layout), **({} if bucket is None else {"bucket": bucket})
        )
        filled, turn = 0, 1 - turn

    try:
        for pieces, _ in merged(parts):
            rows = pieces[0] if pieces else np.empty((0, layout.row_bytes), dtype=np.uint8)
            for start, end, run in _bucket_runs(rows, bucketing):
                if filled and run != bucket:  # a chunk never spans two buckets
                    flush()
                bucket, at = run, start
                while at < end:
                    take = min(per_chunk - filled, end - at)
                    buffers[turn][filled : filled + take] = rows[at : at + take]
                    filled, at = filled + take, at + take
                    if filled == per_chunk:
                        flush()
        if filled:
            flush()
        return sink.close()
    except BaseException:
        sink.abort()
        raise


def _bucket_runs(
    rows: np.ndarray, bucketing: tuple[int, int | None] | None
) -> list[tuple[int, int, int | None]]:
    """``[start, end)`` runs of ``rows`` (in saving order) within one bucket, each with its
    bucket (all of them one run, bucket None, without ``bucketing``)."""
    if not len(rows):
        return []
    if bucketing is None:
        return [(0, len(rows), None)]
    buckets = buckets_of(rows[:, :8].copy().view("<i8")[:, 0], bucketing)
    cuts = [0, *(np.flatnonzero(buckets[1:] != buckets[:-1]) + 1).tolist(), len(rows)]
    return [(start, end, int(buckets[start])) for start, end in zip(cuts[:-1], cuts[1:], strict=True)]


def _as_rows(data: np.ndarray, layout: RowLayout) -> torch.Tensor:
    return torch.from_numpy(data).view(layout.dtype).view(-1, layout.width)


def compact_sharded(links: list, dst: Path, *, chunk_bytes: int, method: str) -> Path:
    """Merge the version-2 chain ``links`` (head first) into one full version-2 checkpoint at
    ``dst`` (already checked), in this process: the head's world size and bucketing; rank
    r's file the merge, over every link, of the chunks and removed ids of the buckets r
    owns, in (bucket, id) order, cut into chunks as a full save cuts them. Byte for byte
    what a full save at that world size writes from stores holding the chain's rows."""
    head = links[0]
    world = head.manifest["world_size"]
    plan = {}
    for name, saved in head.manifest["tables"].items():
        chain_parts(links, name, None)  # in every link, with one layout (D4)
        bucketing = (saved["bucketing"]["buckets"], saved["bucketing"]["bucket_size"])
        for link in links[1:]:  # a load checks every link's against the module's
            other = link.manifest["tables"][name]["bucketing"]
            if (other["buckets"], other["bucket_size"]) != bucketing:
                raise CheckpointError(
                    f"table {name!r} in {link.file}: saved with "
                    f"{describe_bucketing(other['buckets'], other['bucket_size'])}, the head {head.file} with "
                    f"{describe_bucketing(*bucketing)}: every link of a chain has one bucketing"
                )
        table = BucketedTable(None, *bucketing)
        plan[name] = (RowLayout(saved["dim"], saved["optimizer_state_dim"], DTYPES[saved["dtype"]]), table)
    chain_extra(links)  # checked as a load checks it
    extra_bytes = read_extra_bytes(head.path, head.manifest)
    with staged(dst, method) as staging:
        manifest = new_manifest(world)
        for name, (layout, table) in plan.items():
            bucketing, written = (table.buckets, table.bucket_size), []
            for rank in range(world):  # one rank's file at a time: a few slices per file held
                parts = [link_table(link, name, table, rank, world) for link in reversed(links)]
                file = staging / f"{name}.rank{rank}.rows"
                chunks = write_merge(file, layout, parts, chunk_bytes, bucketing)
                written.append(
                    {
                        "file": file.name,
                        "bytes": sum(c["rows"] for c in chunks) * layout.row_bytes,
                        "chunks": chunks,
                    }
                )
            manifest["tables"][name] = sharded_table_entry(layout, bucketing, written)
        publish_manifest(staging, dst, manifest, extra_bytes)
    return dst
