"""``SafeFileSystemReader``: DCP's file reader with an allow-list unpickler for
``.metadata``, regular files inside the checkpoint only, and KV chunks read straight
from their stored record into one reused buffer."""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
import struct
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, LoadPlan, Metadata, ReadItem
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from leanstate.checkpoint.core import Behind
from leanstate.dcp._load_planner import KVLoadPlanner
from leanstate.reference.checkpoint_manifest import CheckpointError

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


_ALLOWED = (
    {
        (_METADATA_MODULE, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
            "StorageMeta",
            "MetadataIndex",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint._extension", "ExtensionRegistry"),
        ("torch", "Size"),
        ("torch._utils", "_get_layout"),  # builds a layout (torch.strided) from its name
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
    }
    | {
        ("torch", str(dtype).removeprefix("torch."))
        for dtype in vars(torch).values()
        if isinstance(dtype, torch.dtype)
    }
)


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, file, name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise CheckpointError(
                f"{self.name}: refuses to unpickle {module}.{name}: a DCP .metadata holds only DCP's own "
                "metadata classes, so this file is corrupt or crafted; nothing was loaded"
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by an allow-list unpickler.

    Only DCP's metadata classes, ``torch.Size``, dtypes, paths and builtin containers are
    constructed; any other global (a crafted file's ``os.system`` or ``open``) raises a
    :class:`CheckpointError` naming the file before anything runs. The metadata file must
    be a regular file inside the checkpoint (no FIFO, symlink or device). Tensor data is
    read with ``weights_only=True``, as the stock reader does.
    """

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        file = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            info = os.lstat(file)
        except FileNotFoundError as exc:
            raise CheckpointError(f"no DCP checkpoint at {self.path}: {file} does not exist") from exc
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{file} is not a regular file; refusing to read it")
        with open(file, "rb") as f:
            try:
                metadata = _SafeUnpickler(f, str(file)).load()
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(
                    f"{file}: not a DCP metadata file ({type(exc).__name__}: {exc})"
                ) from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner):
        """Read each item with ``weights_only=True``, from regular files inside the checkpoint
        only; an item that cannot be read names its key (and for a KV chunk, its table and chunk)."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative, items in per_file.items():  # every file and size checked before any read
            self._check_sizes(Path(self.path) / relative, relative, items, planner)
        # A KV chunk's checks and apply run on a thread while the next chunk is read: at
        # most one commit in flight, in plan order, its failure raised before a later one.
        committer = Behind("leanstate-dcp-commit")
        buffers: list[bytearray] = [bytearray(0), bytearray(0)]
        try:
            for relative, items in per_file.items():
                file = Path(self.path) / relative
                with open(file, "rb") as f:
                    for item in items:
                        info = self.storage_data[item.storage_index]
                        what = _describe(planner, item)
                        if info.transform_descriptors:
                            raise CheckpointError(
                                f"{file}: {what} is stored transformed; SafeFileSystemReader reads plain items"
                            )
                        if (
                            isinstance(planner, KVLoadPlanner)
                            and planner.accepts_loaded(item)
                            and not any(item.storage_offsets)
                        ):
                            into = planner.destination(item)  # the store's claimed blocks, or None
                            if into is None:  # two reused buffers: one being read, one committed
                                into = _row_buffer(buffers, item.lengths)
                            rows = _read_stored_rows(f, info, item.lengths, file, what, into)
                            committer.submit(planner.commit_loaded, item, rows)
                            continue
                        f.seek(info.offset)
                        data = f.read(info.length)
                        if len(data) != info.length:
                            raise CheckpointError(f"{file}: {what} is truncated")
                        if item.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(item, io.BytesIO(data))
                            continue
                        try:
                            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                        except Exception as exc:
                            raise CheckpointError(
                                f"{file}: {what} cannot be read ({type(exc).__name__}: {exc}); the file is corrupt"
                            ) from exc
                        if not isinstance(tensor, torch.Tensor):
                            raise CheckpointError(
                                f"{file}: {what} holds a {type(tensor).__name__}, not a tensor"
                            )
                        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                            if start + length > tensor.size(dim):
                                raise CheckpointError(f"{file}: {what} is smaller than its metadata says")
                            tensor = tensor.narrow(dim, start, length)
                        target = planner.resolve_tensor(item).detach()
                        if target.size() != tensor.size():
                            raise CheckpointError(
                                f"{file}: {what} has shape {tuple(tensor.size())}, expected {tuple(target.size())}"
                            )
                        target.copy_(tensor)
                        planner.commit_tensor(item, target)
            committer.settle()
        except BaseException:
            failure = committer.failure()
            if failure is not None:
                raise failure from None  # it stands earlier in the file
            raise
        finally:
            committer.close()  # no commit runs once the load is undone
        future: Future = Future()
        future.set_result(None)
        return future

    def _check_sizes(self, file: Path, relative: str, items: list[ReadItem], planner) -> None:
        """``file`` is a regular file inside the checkpoint that holds every item's byte range,
        and a KV chunk's rows fit its item: checked before anything is read or allocated, so a
        crafted ``.metadata`` can size no buffer (and no store's reserve) past the real files."""
        if Path(relative).name != relative or not stat.S_ISREG(_lstat_mode(file)):
            raise CheckpointError(f"{file} is not a regular file inside the checkpoint; refusing to read it")
        size = os.stat(file).st_size
        for item in items:
            info = self.storage_data[item.storage_index]
            rows_bytes = (
                math.prod(item.lengths)
                if isinstance(planner, KVLoadPlanner) and planner.accepts_loaded(item)
                else 0
            )
            if (
                info.offset < 0
                or info.length < 0
                or info.offset + info.length > size
                or rows_bytes > info.length
            ):
                raise CheckpointError(
                    f"{file}: {_describe(planner, item)} claims bytes {info.offset}..{info.offset + info.length} "
                    f"({rows_bytes} of rows), but the file has {size} bytes; the checkpoint is corrupt"
                )


class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a seekable file of its own."""

    def __init__(self, f, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.position = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = min(max(0, base + position), self.length)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")[: self.length - self.position]
        self.f.seek(self.offset + self.position)
        n = self.f.readinto(view)
        self.position += n
        return n


def _row_buffer(buffers: list[bytearray], lengths) -> torch.Tensor:
    """The next of two reused buffers in turn (the other may still be committed), as a
    ``uint8 [n, R]`` chunk, grown if need be."""
    n, r = lengths
    buffers.reverse()
    if len(buffers[0]) < n * r:
        buffers[0] = bytearray(n * r)
    return torch.frombuffer(buffers[0], dtype=torch.uint8, count=n * r).view(n, r)


def _read_stored_rows(f, info, lengths, file: Path, what: str, into: torch.Tensor) -> torch.Tensor:
    """The ``uint8 [n, R]`` tensor DCP stored for a KV chunk (a ``torch.save`` zip), read from its
    uncompressed data record into ``into`` (a store's claimed blocks, or a reused buffer):
    one copy, as the native load makes."""
    n, r = lengths
    try:
        records = zipfile.ZipFile(_Slice(f, info.offset, info.length)).infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise CheckpointError(f"{file}: {what} is not a tensor record ({exc}); the file is corrupt") from exc
    data = [record for record in records if record.filename.endswith("/data/0")]
    if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED or data[0].file_size != n * r:
        raise CheckpointError(f"{file}: {what} does not hold a uint8 [{n}, {r}] tensor; the file is corrupt")
    f.seek(info.offset + data[0].header_offset)
    header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{file}: {what} has a broken record header; the file is corrupt")
    name_length, extra_length = struct.unpack("<2H", header[26:30])
    f.seek(info.offset + data[0].header_offset + 30 + name_length + extra_length)
    if f.readinto(memoryview(into.numpy()).cast("B")) != n * r:
        raise CheckpointError(f"{file}: {what} is truncated")
    return into


def _lstat_mode(file: Path) -> int:
    try:
        return os.lstat(file).st_mode
    except FileNotFoundError as exc:
        raise CheckpointError(f"{file} is missing") from exc


def _describe(planner, item: ReadItem) -> str:
    describe = getattr(planner, "describe", None)
    if describe is not None:
        return describe(item)
    return f"item {item.storage_index.fqn!r}"
