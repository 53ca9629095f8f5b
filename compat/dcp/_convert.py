"""``leanstate.dcp.convert``: a whole-row checkpoint to DCP and back, chunk for chunk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from leanstate.checkpoint.core import (
    DTYPES,
    EXTRA_FILE,
    MANIFEST,
    ChunkFile,
    checked_target,
    is_delta,
    publish,
    read_extra,
    read_manifest_and_digest,
    staged,
    table_entry,
    write_synced,
)
from leanstate.dcp._reader import SafeFileSystemReader
from leanstate.dcp._state import DEFAULT_CHUNK_BYTES, INDEX_KEY, NativeTable
from leanstate.dcp._transaction import load, save
from leanstate.reference.checkpoint import FORMAT_NAME, FORMAT_VERSION
from leanstate.reference.checkpoint_manifest import CheckpointError
from leanstate.reference.row_format import RowLayout, header_words

NATIVE_MANIFEST, NATIVE_EXTRA = "leanstate.native.manifest", "leanstate.native.extra"


class _FileSink:
    """What a DCP table loads into on its way to a whole-row file: rows appended in the
    saved order, which must ascend by id across chunks (the native format's rule)."""

    def __init__(self, file: Path, layout: RowLayout) -> None:
        self.layout = layout
        self.out = ChunkFile(file)
        self.last = -1

    def __len__(self) -> int:
        return 0

    def keys(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    def get(self, ids, **kwargs):
        raise TypeError("convert: a conversion sink is written, not read")

    get_rows = get

    def set(self, ids, values, **kwargs) -> None:
        raise TypeError("convert: a conversion sink takes whole rows only")

    def delete(self, ids) -> None:
        """Nothing to undo: a failed conversion removes the whole staging directory."""

    def reserve(self, rows: int) -> None:
        """Nothing to reserve: rows go to the file."""

    def set_rows(self, rows: torch.Tensor) -> None:
        ids = header_words(rows)[:, 0]
        if int(ids[0]) <= self.last:
            raise CheckpointError(
                f"convert: table {self.out.file.stem!r} was saved in bucket order by several ranks, not "
                "ascending by id; load it with leanstate.dcp.load and save it with leanstate.save_checkpoint"
            )
        self.last = int(ids[-1])
        self.out.append(rows)

    def close(self) -> dict:
        return table_entry(self.layout, self.out.file, self.out.close())

    # a store's change tracking (``SupportsRows``): a sink records none
    mark = None

    def changes(self, since: int | None = None):
        raise TypeError("convert: a conversion sink is written, not read")

    def next_epoch(self) -> int:
        return 0


def convert(
    source: str | os.PathLike, target: str | os.PathLike, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> str:
    """Convert a whole-row checkpoint (version 1) to DCP or a DCP checkpoint back; returns
    the format written (``"dcp"`` or ``"native"``).

    Native to DCP keeps every chunk as it was and carries the manifest and the extra
    state's bytes along, so converting back gives byte-identical files. A DCP checkpoint
    saved otherwise converts when its tables ascend by id (one rank, or chunk-mode
    bucketing); its dense entries are not part of a native checkpoint and are left out.
    """
    source, target = Path(source), Path(target)
    if (source / MANIFEST).is_file():
        version, manifest, _ = read_manifest_and_digest(source)
        if is_delta(manifest):
            raise CheckpointError(
                f"convert: {source} is a delta checkpoint (the rows changed since its base); merge its chain "
                f"into one full checkpoint first: `python -m leanstate compact {source} FULL`, then convert FULL"
            )
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"convert: {source} is a version-{version} (sharded) checkpoint; load it into a "
                "sharded module and save it with leanstate.dcp.save"
            )
        state: dict[str, object] = {
            name: NativeTable(source, name, table) for name, table in manifest["tables"].items()
        }
        state[NATIVE_MANIFEST] = torch.frombuffer(
            bytearray((source / MANIFEST).read_bytes()), dtype=torch.uint8
        )
        if manifest["extra"] is not None:
            read_extra(source, manifest)  # checked first
            data = (source / EXTRA_FILE).read_bytes()
            state[NATIVE_EXTRA] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        save(state, checkpoint_id=target, chunk_bytes=chunk_bytes)
        return "dcp"
    metadata = SafeFileSystemReader(source).read_metadata()
    index = (metadata.planner_data or {}).get(INDEX_KEY)
    if index is None:
        raise CheckpointError(f"convert: {source} holds no leanstate KV tables")
    target = checked_target(target, "convert")
    with staged(target, "convert") as staging:
        sinks = {}
        for name, table in index["tables"].items():
            schema = table["schema"]
            layout = RowLayout(schema["dim"], schema["optimizer_state_dim"], DTYPES[schema["dtype"]])
            sinks[name] = _FileSink(staging / f"{name}.rows", layout)
        state = dict(sinks)
        carried = {key: metadata.state_dict_metadata.get(key) for key in (NATIVE_MANIFEST, NATIVE_EXTRA)}
        for key, entry in carried.items():
            if entry is not None:
                state[key] = torch.empty(entry.size, dtype=torch.uint8)
        try:
            load(state, checkpoint_id=source)
        finally:
            entries = {name: sink.close() for name, sink in sinks.items()}
        if carried[NATIVE_MANIFEST] is not None:
            manifest = bytes(state[NATIVE_MANIFEST].numpy())
            saved = json.loads(manifest)
            for name, entry in entries.items():
                if [c["crc"] for c in entry["chunks"]] != [c["crc"] for c in saved["tables"][name]["chunks"]]:
                    raise CheckpointError(f"convert: table {name!r} does not match the manifest it carries")
        else:
            saved = manifest = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "tables": entries,
                "views": {},
                "extra": None,
            }
        if carried[NATIVE_EXTRA] is not None:
            write_synced(staging / EXTRA_FILE, bytes(state[NATIVE_EXTRA].numpy()))
        publish(staging, target, manifest=manifest)
    return "native"
