"""``python -m leanstate inspect PATH``: a checkpoint's manifest (whole-row version 1 or 2,
a delta chain link by link, or a ``leanstate.dcp`` checkpoint's index), every chunk verified."""

from __future__ import annotations

import warnings
from pathlib import Path

from leanstate.checkpoint import verify_checkpoint
from leanstate.checkpoint.core import DTYPES, MANIFEST, describe_bucketing, is_delta, read_manifest_and_digest
from leanstate.checkpoint.sharded import verify_sharded
from leanstate.kv_store import KVStore
from leanstate.reference.checkpoint_manifest import CheckpointError


def main(path: str) -> int:
    """Print the manifest (or DCP index) of the checkpoint at ``path`` and verify every chunk
    and the extra state; 0 when all is well, else one BAD line naming the fault and 1."""
    try:
        if (Path(path) / ".metadata").exists() and not (Path(path) / MANIFEST).exists():
            return _dcp(path)
        return _native(path)
    except Exception as exc:  # a manifest the schema checks let through: still one line
        message = (str(exc).strip().splitlines() or [""])[0][:300]
        print(f"BAD: {path}: cannot be inspected ({type(exc).__name__}: {message})")
        return 1


def _dcp(path: str) -> int:
    """``inspect`` of a ``leanstate.dcp`` checkpoint: its KV tables, every chunk's CRC-32C
    and id order checked by a verify-only load into empty reference stores."""
    import torch.distributed.checkpoint as stock
    from torch.distributed.checkpoint.api import CheckpointException

    from leanstate.dcp import INDEX_KEY, KVLoadPlanner, SafeFileSystemReader
    from leanstate.dcp.core import split_key

    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    except CheckpointError as exc:
        print(f"BAD: {exc}")
        return 1
    index = (metadata.planner_data or {}).get(INDEX_KEY)
    dense = [key for key in metadata.state_dict_metadata if not split_key(key)[1]]
    print(f"{path}: DCP checkpoint, {len(dense)} dense or table keys")
    if index is None:
        print("OK: no leanstate KV tables in it (nothing to verify)")
        return 0
    stores = {}
    for name, table in index["tables"].items():
        schema = table["schema"]
        print(
            f"  table {name}: {table['rows']} rows x {schema['width']} {schema['dtype']} (dim {schema['dim']}, "
            f"state {schema['optimizer_state_dim']}), {len(table['chunks'])} chunks"
        )
        stores[name] = KVStore(
            schema["dim"],
            optimizer_state_dim=schema["optimizer_state_dim"],
            dtype=DTYPES[schema["dtype"]],
            backend="reference",
        )
    planner = KVLoadPlanner(verify_only=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            stock.load(stores, storage_reader=SafeFileSystemReader(path), planner=planner, no_dist=True)
    except CheckpointException as exc:
        first = next(iter(exc.failures.values()))[0]
        print(f"BAD: {path}: {first}")
        return 1
    chunks = sum(stats["chunks"] for stats in planner.stats.values())
    print(f"OK: {chunks} chunks verified")
    return 0


def _sharded(path: str, manifest: dict) -> int:
    """``inspect`` of a checkpoint saved across ranks (format version 2)."""
    print(f"  saved by {manifest['world_size']} ranks")
    for name, t in manifest["tables"].items():
        b = t["bucketing"]
        print(
            f"  table {name}: {t['rows']} rows x {t['width']} {t['dtype']} (dim {t['dim']}, "
            f"state {t['optimizer_state_dim']}), {describe_bucketing(b['buckets'], b['bucket_size'])}"
        )
        for f in t["files"]:
            print(f"    {f['file']} (rank {f['rank']}): {f['bytes']} bytes in {len(f['chunks'])} chunks")
    if manifest["extra"]:
        print(f"  extra state: {manifest['extra']}")
    try:
        checked = sum(1 for _ in verify_sharded(path))
    except (OSError, CheckpointError) as exc:
        print(f"BAD: {exc}")
        return 1
    print(f"OK: {checked} chunks verified" + (", extra state verified" if manifest["extra"] else ""))
    return 0


def _chain(path: str) -> int:
    """``inspect`` of a delta: every link of its chain, each verified."""
    from leanstate.checkpoint.core import read_chain, verify_chain

    try:
        links = read_chain(Path(path), "inspect")
    except (OSError, CheckpointError) as exc:
        print(f"BAD: {exc}")
        return 1
    print(f"{path}: a delta chain of {len(links)} links, the head first")
    for depth, link in enumerate(links):
        kind = "delta" if link.delta else "full checkpoint"
        print(f"  link {depth}: {link.path} ({kind}, manifest sha256 {link.digest[:16]})")
        for name, t in link.manifest["tables"].items():
            files = t.get("files") or [t]  # version 2: a file per rank
            removed = sum(f["removed"]["ids"] for f in files) if link.delta else 0
            removed = f", {removed} ids removed" if link.delta else ""
            across = f" in {len(files)} rank files" if "files" in t else ""
            print(
                f"    table {name}: {t['rows']} rows x {t['width']} {t['dtype']}, "
                f"{sum(f['bytes'] for f in files)} bytes in {sum(len(f['chunks']) for f in files)} "
                f"chunks{across}{removed}"
            )
    verified = 0
    try:
        for link in verify_chain(links):
            print(f"  link {verified} verified: {link.path}")
            verified += 1
    except (OSError, CheckpointError) as exc:
        print(f"BAD: link {verified} ({links[verified].path}): {exc}")
        return 1
    print(f"OK: {verified} links verified")
    return 0


def _native(path: str) -> int:
    """``inspect`` of a whole-row checkpoint (version 1 or 2, or a delta chain)."""
    try:
        version, manifest, _ = read_manifest_and_digest(Path(path))
    except (OSError, CheckpointError) as exc:
        print(f"BAD: {exc}")
        return 1
    if is_delta(manifest):
        return _chain(path)
    print(f"{path}: {manifest['format']} version {version}")
    if version == 2:
        return _sharded(path, manifest)
    for name, t in manifest["tables"].items():
        print(
            f"  table {name}: {t['rows']} rows x {t['width']} {t['dtype']} (dim {t['dim']}, "
            f"state {t['optimizer_state_dim']}), {t['bytes']} bytes in {len(t['chunks'])} chunks, "
            f"ids {t['min_id']}..{t['max_id']}, file {t['file']}"
        )
    for name, v in manifest["views"].items():
        kind = "read-only view" if v["read_only"] else "view"
        first, last = v["width_offset"], v["width_offset"] + v["width"]
        print(
            f"  {kind} {name}: of {v['table']}, {v['width']} columns ({first} to {last - 1}), {v['rows']} rows"
        )
    if manifest["extra"]:
        print(f"  extra state: {manifest['extra']}")
    checked = 0
    try:
        for _ in verify_checkpoint(path):
            checked += 1
    except (OSError, CheckpointError) as exc:
        print(f"BAD: {exc}")
        return 1
    print(f"OK: {checked} chunks verified" + (", extra state verified" if manifest["extra"] else ""))
    return 0
