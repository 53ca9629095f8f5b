"""Checkpoint files that are not what they claim: special files, links out of the
checkpoint, garbage manifests, and save paths that cannot be written.

The rule (``spec/checkpoint_format.md``): only regular files inside PATH are opened, each
file's size is compared with the manifest before it is read, and every failure is a
``CheckpointError`` naming the file (or table); ``inspect`` prints one BAD line for any
input.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from leanstate import CheckpointError, KVStore, load_checkpoint, save_checkpoint
from leanstate._tools.cli import main
from leanstate.checkpoint._files import read_manifest


def small_store(seed: int = 0) -> KVStore:
    store = KVStore(4, optimizer_state_dim=1, backend="reference", seed=seed)
    store.set(
        torch.arange(seed, seed + 50), torch.randn(50, 4, generator=torch.Generator().manual_seed(seed))
    )
    return store


PROBE = textwrap.dedent(
    """
    import io, json, sys, contextlib
    from leanstate import CheckpointError, KVStore, load_checkpoint
    from leanstate._tools.cli import main

    results = {}
    for path in sys.argv[1:]:
        try:
            load_checkpoint(path, {"t": KVStore(4, optimizer_state_dim=1)})
            load = "loaded"
        except CheckpointError as exc:
            load = "CheckpointError: " + str(exc)
        except BaseException as exc:
            load = f"raw {type(exc).__name__}: {exc}"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["inspect", path])
        results[path] = {"load": load, "code": code, "bad": [l for l in out.getvalue().splitlines() if "BAD" in l]}
    print(json.dumps(results))
    """
)


def test_special_files_and_links_out_of_the_checkpoint_fail_promptly(tmp_path):
    other = save_checkpoint(tmp_path / "other", {"t": small_store(100)}, extra={"step": 1})
    cases = {}

    def case(name):
        path = save_checkpoint(tmp_path / name, {"t": small_store()}, extra={"step": 2})
        cases[name] = path
        return path

    os.remove(case("fifo-rows") / "t.rows")
    os.mkfifo(tmp_path / "fifo-rows" / "t.rows")
    os.remove(case("fifo-extra") / "extra.pt")
    os.mkfifo(tmp_path / "fifo-extra" / "extra.pt")
    os.remove(case("extra-dev-zero") / "extra.pt")
    os.symlink("/dev/zero", tmp_path / "extra-dev-zero" / "extra.pt")
    # the other checkpoint's rows, with its manifest entry: consistent, but outside PATH
    path = case("rows-elsewhere")
    os.remove(path / "t.rows")
    os.symlink(other / "t.rows", path / "t.rows")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tables"]["t"] = json.loads((other / "manifest.json").read_text())["tables"]["t"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    os.remove(case("dir-rows") / "t.rows")
    os.mkdir(tmp_path / "dir-rows" / "t.rows")
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, cases.values())], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    expected = {
        "fifo-rows": "t.rows is a FIFO",
        "fifo-extra": "extra.pt is a FIFO",
        "extra-dev-zero": "extra.pt is a symlink",
        "rows-elsewhere": "t.rows is a symlink",
        "dir-rows": "t.rows is a directory",
    }
    for name, needle in expected.items():
        got = results[str(cases[name])]
        assert got["load"].startswith("CheckpointError") and needle in got["load"], (name, got)
        assert got["code"] == 1 and len(got["bad"]) == 1 and needle in got["bad"][0], (name, got)


def test_an_extra_file_the_manifest_does_not_list_is_refused(tmp_path):
    path = save_checkpoint(tmp_path / "c", {"t": small_store()}, extra={"step": 3})
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["extra"] = None  # the extra state silently dropped
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="says there is no extra state, but .*extra.pt exists"):
        load_checkpoint(path, {"t": KVStore(4, optimizer_state_dim=1)})


def garbage_manifests():
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=20,
    )
    valid = {
        "format": "leanstate-whole-row",
        "version": 1,
        "tables": {},
        "views": {},
        "extra": None,
    }
    fields = ["format", "version", "tables", "views", "extra", "world_size", "width", "row_bytes"]
    mutated = st.builds(
        lambda key, value, version: {**valid, "version": version, key: value},
        st.sampled_from(fields),
        json_values,
        st.sampled_from([1, 2, 10**40]),
    )
    texts = st.one_of(
        json_values.map(json.dumps),
        mutated.map(json.dumps),
        st.sampled_from(["[" * 200_000, "1" * 5000, '{"version": ' + "9" * 5000 + "}", "\udcff", "", "{"]),
        st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
    )
    return texts


@settings(max_examples=60, deadline=None)
@given(text=garbage_manifests())
def test_inspect_prints_one_bad_line_for_any_garbage_manifest(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("garbage")
    (path / "manifest.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    try:
        read_manifest(path)
        assume(False)  # a mutation that happens to be a valid (empty) checkpoint
    except (CheckpointError, FileNotFoundError):
        pass

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["inspect", str(path)])
    lines = out.getvalue().splitlines()
    assert code == 1 and sum(line.startswith("BAD") for line in lines) == 1, lines
    with pytest.raises((CheckpointError, FileNotFoundError)):
        load_checkpoint(path, {"t": KVStore(4, optimizer_state_dim=1)})
    shutil.rmtree(path)


def test_save_paths_that_cannot_be_written_are_named(tmp_path):
    store = small_store()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    with pytest.raises(ValueError, match="dangling symlink"):
        save_checkpoint(tmp_path / "dangling", {"t": store})
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="which is a file, not a directory"):
        save_checkpoint(tmp_path / "a-file" / "ckpt", {"t": store})
    with pytest.raises(ValueError, match="table name .* cannot be a file name .not encodable as UTF-8"):
        save_checkpoint(tmp_path / "c", {"bad\udcffname": store})


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys, torch
    from leanstate import CheckpointError, KVStore, save_checkpoint

    path = sys.argv[1]
    store = KVStore(64, optimizer_state_dim=1, backend="reference")
    store.set(torch.arange(20_000), torch.ones(20_000, 64))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    try:
        save_checkpoint(path, {"t": store})
        print("saved")
    except CheckpointError as exc:
        print("CheckpointError:", exc)
    """
)


def test_a_full_disk_names_the_checkpoint_and_keeps_the_previous_one(tmp_path):
    path = save_checkpoint(tmp_path / "c", {"t": small_store()})
    before = (path / "t.rows").read_bytes()
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.stdout.startswith("CheckpointError:") and str(path) in done.stdout, done.stdout + done.stderr
    assert "File too large" in done.stdout or "No space" in done.stdout, done.stdout
    assert (path / "t.rows").read_bytes() == before
    assert not list(tmp_path.glob(".c.saving-*")), "the failed save left its staging directory"


INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys, torch
    from leanstate import KVStore, load_checkpoint

    path, mode = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the parent ignores SIGINT
    store = KVStore(8, optimizer_state_dim=1)
    if mode == "live":
        store.set(torch.arange(500), torch.zeros(500, 8))  # a store that already holds rows
    calls = []

    def progress(table, done, total):
        calls.append(done)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the apply

    try:
        load_checkpoint(path, {"t": store}, chunk_bytes=4096, progress=progress)
        print("no interrupt")
    except KeyboardInterrupt:
        print("interrupted", len(store), len(calls))
    """
)


@pytest.mark.parametrize("mode", ["live", "empty"])
def test_ctrl_c_during_a_load_finishes_a_live_store_or_empties_a_fresh_one(tmp_path, mode):
    source = KVStore(8, optimizer_state_dim=1, backend="reference")
    source.set(torch.arange(4000), torch.ones(4000, 8))
    path = save_checkpoint(tmp_path / "c", {"t": source}, chunk_bytes=4096)
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED, str(path), mode], capture_output=True, text=True, timeout=300
    )
    words = done.stdout.split()
    assert words[0] == "interrupted", done.stdout + done.stderr
    rows, calls = int(words[1]), int(words[2])
    if mode == "live":  # every chunk applied, then the interrupt: 4000 rows, not 500 + part
        assert rows == 4000 and calls > 1, done.stdout
    else:  # rows went into an empty store: emptied again
        assert rows == 0 and calls == 1, done.stdout
