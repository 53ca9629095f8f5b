"""File-system safety for every checkpoint format: what is read, where it is written,
and how a save becomes visible.

- reads: only regular files (no symlink out of the directory, no FIFO that blocks),
  sizes checked before allocation, the manifest parsed as plain JSON;
- writes: a locked staging sibling (``.NAME.saving-X`` with its ``.lock``), every
  file fsynced, the marker file (a manifest, or DCP's ``.metadata``) written last;
- publish: one fsync-and-rename; the previous copy waits aside until the rename is
  done and is removed marker first, so a half-deleted copy never looks complete;
- cleanup: staging directories whose lock no live save holds are stale;
- signals: Ctrl-C deferred while verified rows are applied to a live store.

Version 1, version 2 (across ranks) and the DCP adapter all go through here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import secrets
import shutil
import signal
import stat
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import crc32c
import torch

from leanstate.checkpoint._background import finish_removals, remove_later
from leanstate.checkpoint._format import (
    EXTRA_FILE,
    MANIFEST,
    checked_problem,
    delta_manifest_problem,
    is_delta,
    manifest_problem,
    manifest_v2_problem,
    saved_across_ranks,
)
from leanstate.reference.checkpoint_manifest import MAX_DEPTH, MAX_INT_DIGITS, CheckpointError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_regular(file: Path, what: str):
    """``file`` opened for reading if it is a regular file: not a symlink (which could read
    outside the checkpoint), FIFO (which would block), directory or device.

    Raises :class:`CheckpointError` naming ``what`` and the file otherwise, or when it is
    missing.
    """
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{what} {file} is missing") from exc
    except OSError as exc:  # ELOOP: a symlink
        kind = "a symlink" if os.path.islink(file) else f"unreadable ({exc.strerror})"
        raise CheckpointError(
            f"{what} {file} is {kind}; only regular files inside the checkpoint are read"
        ) from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
        raise CheckpointError(f"{what} {file} is {kind}, not a regular file; refusing to read it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def checked_target(path: object, method: str) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{method}: path must be a str or os.PathLike; got {type(path).__name__}")
    if str(path) == "" or Path(path).name in ("", ".", ".."):
        raise ValueError(f"{method}: path must name a checkpoint directory; got {str(path)!r}")
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise ValueError(f"{method}: {path} is a dangling symlink; pass the directory it should name")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{method}: {path} is under {parent}, which is a file, not a directory")
            break
    if path.exists() and not path.is_dir():
        raise ValueError(f"{method}: {path} exists and is not a directory; refusing to replace it")
    if path.is_dir() and any(path.iterdir()) and not (path / MANIFEST).is_file():
        raise ValueError(
            f"{method}: {path} is a non-empty directory that is not a checkpoint; refusing to replace it"
        )
    return path


def remove_stale_staging(path: Path) -> None:
    """Delete what killed saves of ``path`` left: staging directories and their lock files.

    A save takes the lock file ``.NAME.saving-X.lock`` before it creates the staging
    directory ``.NAME.saving-X`` and drops it after renaming that directory into place:
    a staging directory whose lock no live save holds (or that has none) is stale.
    """
    for staging in path.parent.glob(f".{path.name}.saving-*"):
        if staging.name.endswith(".lock"):
            continue
        try:
            with open(f"{staging}.lock") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live save
        except FileNotFoundError:
            pass
        shutil.rmtree(staging, ignore_errors=True)
    for lock_file in path.parent.glob(f".{path.name}.saving-*.lock"):
        if not Path(str(lock_file).removesuffix(".lock")).exists():
            try:
                with open(lock_file) as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.remove(lock_file)
            except (BlockingIOError, FileNotFoundError):
                continue


def replace_directory(staging: Path, path: Path, previous: Path) -> None:
    """fsync the complete ``staging`` directory and rename it to ``path``; an old ``path``
    waits at ``previous`` until the rename is done (and comes back if it fails)."""
    fsync_dir(staging)
    if path.exists():
        os.rename(path, previous)
    try:
        os.rename(staging, path)
    except BaseException:
        if previous.exists():
            os.rename(previous, path)
        raise
    fsync_dir(path.parent)


def extra_bytes_of(extra: object, method: str) -> bytes:
    """``extra`` serialised, after checking that it loads back with ``weights_only=True``."""
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"{method}: extra must be a mapping of names to tensors and plain values; got {type(extra).__name__}"
        )
    buffer = io.BytesIO()
    torch.save(dict(extra), buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"{method}: extra must load back with torch.load(weights_only=True) (tensors, numbers, strings, "
            f"lists and dicts of them); it does not: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from exc
    return data


def parse_manifest(file: Path) -> tuple[object, str]:
    """The JSON in ``file`` (a regular file) and the SHA-256 of its bytes (how a delta names
    its base), or :class:`CheckpointError` naming it for anything that is not plain JSON:
    bad bytes, nesting too deep, numbers too long."""
    with open_regular(file, "manifest") as f:
        text = f.read()
    try:  # UTF-8 only (json.loads of bytes would also take UTF-16 and UTF-32), no BOM
        parsed = json.loads(
            text.decode("utf-8"),
            object_pairs_hook=_unique_keys,
            parse_constant=_no_constant,
            parse_int=_bounded_int,
        )
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digits
        message = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{file}: not valid JSON ({type(exc).__name__}: {message})") from exc
    if _nesting(parsed) > MAX_DEPTH:
        raise CheckpointError(f"{file}: not valid JSON for the format: nested more than {MAX_DEPTH} deep")
    return parsed, hashlib.sha256(text).hexdigest()


def _bounded_int(digits: str) -> int:
    """R2's integer limit, the same in every interpreter (CPython's default, which a setting can move)."""
    count = len(digits) - digits.startswith("-")
    if count > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {count} digits; the format allows at most {MAX_INT_DIGITS}")
    return int(digits)


def _nesting(value: object) -> int:
    """The depth of arrays and objects in a parsed JSON value (``[]`` is 1), level by level:
    no recursion, so no limit of its own."""
    depth, level = 0, [value]
    while True:
        containers = [item for item in level if isinstance(item, dict | list)]
        if not containers:
            return depth
        depth += 1
        level = [
            child for item in containers for child in (item.values() if isinstance(item, dict) else item)
        ]


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are distinct: a repeated key would leave one reader's value
    different from another's."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the key {key!r} appears twice in one object")
        seen.add(key)
    return dict(pairs)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON (NaN and Infinity are not numbers of the format)")


def read_manifest(path: str | os.PathLike) -> tuple[int, dict]:
    """The format version and the manifest of the full checkpoint at ``path``, checked
    against its version's schema: the one read of a manifest that every load makes.

    Version 1 (one process, ascending ids) or version 2 (saved across ranks,
    ``spec/sharding.md``); a delta is refused with what to do instead. Raises
    :class:`CheckpointError` naming ``manifest.json`` and the offending key, or
    ``FileNotFoundError`` (with the previous copy an interrupted save left, if complete).
    """
    version, manifest, _ = read_manifest_and_digest(path)
    if is_delta(manifest):
        raise CheckpointError(
            f"{Path(path) / MANIFEST}: a delta checkpoint (only the rows changed since its base): "
            "load it with leanstate.load_checkpoint(path, tables), or merge it into a full checkpoint "
            "with leanstate.compact_checkpoint(path, new_path)"
        )
    return version, manifest


def read_manifest_and_digest(path: str | os.PathLike) -> tuple[int, dict, str]:
    """:func:`read_manifest` that also takes a delta (version 1 of the delta format) and
    gives the SHA-256 of the manifest's bytes."""
    path = Path(path)
    file = path / MANIFEST
    if not os.path.lexists(file):
        complete = [
            p for p in sorted(path.parent.glob(f".{path.name}.previous-*")) if (p / MANIFEST).is_file()
        ]
        hint = (
            f"; an interrupted save left the previous checkpoint at {complete[0]} (rename it to {path})"
            if complete
            else ""
        )
        raise FileNotFoundError(f"no checkpoint at {path}: {file} does not exist{hint}")
    manifest, digest = parse_manifest(file)
    version = 2 if saved_across_ranks(manifest) else 1
    if is_delta(manifest):
        problem = checked_problem(delta_manifest_problem, manifest)
    else:
        problem = checked_problem(manifest_v2_problem if version == 2 else manifest_problem, manifest)
    if problem is not None:
        raise CheckpointError(f"{file}: {problem}")
    return version, manifest, digest


def read_extra(path: Path, manifest: dict) -> dict[str, object]:
    """The dense ``extra`` state, checked (size, CRC, ``weights_only`` load) before any row moves."""
    data = read_extra_bytes(path, manifest)
    if data is None:
        return {}
    file = path / EXTRA_FILE
    try:
        loaded = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{file} cannot be loaded with weights_only=True ({type(exc).__name__}: {first_line})"
        ) from exc
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{file} holds a {type(loaded).__name__}, not the dict a save writes")
    return loaded


def read_extra_bytes(path: Path, manifest: dict) -> bytes | None:
    """The bytes of the ``extra`` state file, size and CRC checked; None when there is none."""
    extra = manifest["extra"]
    if extra is None:
        if os.path.lexists(path / EXTRA_FILE):
            raise CheckpointError(
                f"{path / MANIFEST} says there is no extra state, but {path / EXTRA_FILE} exists: the "
                "manifest does not describe this checkpoint"
            )
        return None
    # the bare "extra.pt", written before extra had a size and CRC, carries neither to check
    expected, crc = (None, None) if isinstance(extra, str) else (extra["bytes"], extra["crc"])
    file = path / EXTRA_FILE
    with open_regular(file, "extra state file") as f:
        size = os.fstat(f.fileno()).st_size
        if expected is not None and size != expected:  # checked before reading: no allocation
            raise CheckpointError(f"{file} has {size} bytes, the manifest expects {expected}")
        data = f.read()
    if crc is not None and crc32c.crc32c(data) != crc:
        raise CheckpointError(f"{file} fails its crc32c check; the file is corrupt")
    return data


@contextlib.contextmanager
def interrupts_deferred():
    """Hold SIGINT (Ctrl-C) until the block ends, then raise ``KeyboardInterrupt``."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


@contextlib.contextmanager
def staged(path: Path, method: str) -> Iterator[Path]:
    """A new, locked staging directory beside ``path`` for one save; removed (with its lock)
    unless the block published it. An ``OSError`` inside (disk full, I/O error) becomes a
    :class:`CheckpointError` naming ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(path)
    staging, lock = _locked_staging_name(path)
    try:
        staging.mkdir()
        yield staging
    except OSError as exc:  # disk full, file too large, I/O error: name what was being saved
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"{method}: saving {path} failed ({exc.strerror or exc}); the previous checkpoint at that path, "
            "if any, is unchanged"
        ) from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.remove(lock.name)
        lock.close()


def _locked_staging_name(path: Path):
    """A fresh staging name for a save of ``path`` and its lock file, open and locked.

    Another save's cleanup may delete a lock file between its creation and our ``flock``
    (it takes the lock, sees no staging directory and removes the file); the lock we then
    take is on a deleted file, which protects nothing. So the lock counts only once the
    file at the lock's path is still the one we locked; otherwise a new name is tried.
    The staging directory is created only after this, so it never exists unlocked.
    """
    while True:
        staging = path.parent / f".{path.name}.saving-{secrets.token_hex(4)}"
        lock = open(f"{staging}.lock", "w")  # held while saving: a later save leaves this one alone
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.stat(lock.name).st_ino == os.fstat(lock.fileno()).st_ino:
                return staging, lock
        except FileNotFoundError:
            pass
        lock.close()


def write_synced(file: Path, data: bytes) -> None:
    """Write ``data`` to a new ``file`` and fsync it."""
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_extra(staging: Path, extra_bytes: bytes) -> dict:
    """Write the serialised extra state, fsynced; its manifest entry."""
    write_synced(staging / EXTRA_FILE, extra_bytes)
    return {"file": EXTRA_FILE, "bytes": len(extra_bytes), "crc": crc32c.crc32c(extra_bytes)}


def publish(
    staging: Path, path: Path, *, manifest: dict | bytes | None = None, marker: str = MANIFEST
) -> None:
    """Make the complete ``staging`` directory the checkpoint at ``path``.

    ``manifest`` (JSON, or its bytes) is written to ``marker`` last, when given: its
    presence marks a complete save. The old checkpoint waits at a ``.previous-X``
    sibling until the rename is done; then its marker is removed (it never looks
    complete again) and its files are deleted on a background thread, off the save's
    critical path (``spec/checkpoint_format.md``).
    """
    if manifest is not None:
        data = manifest if isinstance(manifest, bytes) else json.dumps(manifest, indent=1).encode()
        write_synced(staging / marker, data)
    previous = path.parent / f".{path.name}.previous-{secrets.token_hex(4)}"
    replace_directory(staging, path, previous)
    remove_previous_copies(path, marker)


def remove_previous_copies(path: Path, marker: str = MANIFEST) -> None:
    """Delete the previous copies of ``path`` (``.NAME.previous-*``, this save's and any an
    interrupted one left): each marker now, the files on a background thread. A removal
    still running for ``path`` is waited for first, so two never race."""
    finish_removals(path)
    old = sorted(path.parent.glob(f".{path.name}.previous-*"))
    for copy in old:
        try:
            os.remove(copy / marker)
        except (FileNotFoundError, NotADirectoryError):
            pass
    remove_later(path, old)
