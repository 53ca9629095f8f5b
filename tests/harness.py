"""The one shared test harness: golden vectors, a settable clock, memory probes, ports and
process groups. Test files import from here, never from each other."""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leanstate import KVStore
from leanstate._tools.ranks import free_port, start_ranks

VECTORS = Path(__file__).resolve().parents[1] / "spec" / "vectors"


class FailingRows(KVStore):
    """A store whose rows cannot be read (a device lost mid-save, say)."""

    def get_rows(self, ids, *args, **kwargs):
        raise OSError("the device is gone")


class FakeClock:
    """A settable clock in whole seconds, for deterministic headers."""

    def __init__(self, now: int = 1_700_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


# -- stores -------------------------------------------------------------------------------


_opened: list[str] | None = None  # the paths opened while files_opened() counts, else None


def _note_open(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], str | bytes | os.PathLike):
        _opened.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def files_opened():
    """The paths this process opens inside the block (``open`` and ``os.open`` alike, seen
    by an audit hook: hooks cannot be removed, so one is added once and counts only here)."""
    global _opened
    if not getattr(files_opened, "hooked", False):
        sys.addaudithook(_note_open)
        files_opened.hooked = True
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def check_backend(backend: str, examples: int = 80, max_dim: int = 300) -> None:
    """Run the conformance kit's state machine on ``backend``'s stores against the reference
    (shard counts vary with the seed; dims up to ``max_dim``)."""
    from leanstate.kv_store import KVStore
    from leanstate.testing import run_store_machine

    def make_store(dim, *, seed, **options):
        return KVStore(dim, backend=backend, seed=seed, num_shards=1 + seed % 5, **options)

    run_store_machine(make_store, examples=examples, max_dim=max_dim)


def rewrite_dcp_item(path: Path, fqn: str, offset: int, change) -> None:
    """In the DCP checkpoint at ``path``, replace the tensor stored for item ``fqn`` at row (or
    element) ``offset`` by ``change(tensor)``, saved as DCP saves it, in place (the record
    keeps its length)."""
    from leanstate.dcp import SafeFileSystemReader

    metadata = SafeFileSystemReader(path).read_metadata()
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn and k.offset[0] == offset)
    file = path / info.relative_path
    data = bytearray(file.read_bytes())
    record = bytes(data[info.offset : info.offset + info.length])
    tensor = change(torch.load(io.BytesIO(record), weights_only=True).clone())
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    assert len(buffer.getvalue()) == info.length, "the rewritten record must keep its length"
    data[info.offset : info.offset + info.length] = buffer.getvalue()
    file.write_bytes(bytes(data))


# -- memory -------------------------------------------------------------------------------


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


PROBE_PRELUDE = '''
import ctypes, gc

def resident_bytes(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

def reset_peak():
    """Free what can be freed, reset the high-water mark to the current RSS; that RSS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed heap, so the base is tight
    base = resident_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return base

def peak_since(base):
    return resident_bytes("VmHWM") - base
'''


def run_probe(script: str, *args: object, timeout: float = 600) -> dict:
    """Run ``script`` in a fresh Python with :data:`PROBE_PRELUDE`'s ``reset_peak()`` and
    ``peak_since(base)`` defined; the JSON it prints last."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE_PRELUDE + script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- processes killed mid-way --------------------------------------------------------------


def kill_during(fn, args: tuple, trial: int, window: float) -> None:
    """Run ``fn(*args, ready, go)`` in a process of its own (forked from a server that
    imported torch: a fresh interpreter would spend seconds importing it), let it set up
    until it sets ``ready``, then ``go`` and SIGKILL it a random time (seeded by ``trial``)
    within ``window`` seconds later."""
    import random

    from leanstate._tools.ranks import forked

    context = forked(fn)
    ready, go = context.Event(), context.Event()
    child = context.Process(target=fn, args=(*args, ready, go))
    child.start()
    assert ready.wait(120)
    go.set()
    time.sleep(random.Random(trial).uniform(0.0, window))
    child.kill()  # SIGKILL
    child.join()


# -- ranks --------------------------------------------------------------------------------


@contextlib.contextmanager
def one_rank_group():
    """A gloo group of this process alone (an in-memory store, no port), destroyed after the
    block; what the block's modules still hold of it is collected first."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        gc.collect()
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, folder: str, module: str, names: list[str] | None) -> None:
    """Run the scenarios ``names`` (default ``BY_WORLD[world]``) of test module ``module`` on this rank."""
    scenarios = importlib.import_module(module).SCENARIOS
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    results = {}
    for name in names if names is not None else importlib.import_module(module).BY_WORLD[world]:
        try:
            scenarios[name](rank, world, folder)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            print(f"world {world} rank {rank} {name}:\n{results[name]}", file=sys.stderr, flush=True)
        dist.barrier()
    Path(folder, f"world{world}-rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_world(world: int, folder: Path, module: str, names: list[str] | None = None) -> dict[str, list[str]]:
    """Start ``world`` gloo ranks running ``module``'s ``SCENARIOS``; scenario -> failures.

    A world whose processes die (not a failing scenario: those are recorded) is started
    once more on a fresh port, since the port is picked before the ranks bind it.
    """
    try:
        return _run_world_once(world, folder, module, names)
    except (mp.ProcessRaisedException, mp.ProcessExitedException, TimeoutError) as exc:
        print(f"world {world} died ({type(exc).__name__}); starting it again", file=sys.stderr)
        return _run_world_once(world, folder, module, names)


ONE_AT_A_TIME = "LEANSTATE_TESTS_ONE_AT_A_TIME"  # set by make mutate's coverage run


class Worlds:
    """The outcomes of a test module's ``SCENARIOS`` per world size, run only as the
    session's selected tests need them: a world's selected scenarios in one start of its
    ranks, when a test first asks for that world (so a mutant that reruns one test runs one
    scenario). ``needs``: scenario -> ``(world, scenario)`` that must have run before it (a
    checkpoint one saves, another resumes). With ``ONE_AT_A_TIME`` in the environment (the
    mutation tool's coverage run, which files what ranks run under the test that starts
    them) each test starts the ranks of its own scenario."""

    def __init__(
        self, folder: Path, module: str, request, needs: dict[str, tuple[int, str]] | None = None
    ) -> None:
        self.folder, self.module, self.needs = folder, module, needs or {}
        self.one_at_a_time = bool(os.environ.get(ONE_AT_A_TIME))
        self.selected: dict[int, set[str]] = {}
        for item in request.session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if item.module.__name__ == module and "world" in params and "scenario" in params:
                self.selected.setdefault(params["world"], set()).add(params["scenario"])
        self.results: dict[int, dict[str, list[str]]] = {}

    def outcome(self, world: int, scenario: str) -> list[str]:
        """The failures of ``scenario`` at ``world`` ranks (empty: it passed on every rank)."""
        if self.one_at_a_time:
            if scenario in self.needs:
                self._run(*self.needs[scenario])
            return self._run(world, scenario)[scenario]
        if world not in self.results:
            for name in sorted(self.selected.get(world, ())):
                if name in self.needs and self.needs[name][0] not in self.results:
                    self.results[self.needs[name][0]] = self._run(*self.needs[name])
            self.results[world] = self._run(world, scenario)
        return self.results[world][scenario]

    def _run(self, world: int, scenario: str) -> dict[str, list[str]]:
        """``world``'s ranks running ``scenario`` and (but one at a time) its selected ones."""
        names = {scenario} | (set() if self.one_at_a_time else self.selected.get(world, set()))
        return run_world(world, self.folder, self.module, sorted(names))


def _run_world_once(world: int, folder: Path, module: str, names: list[str] | None) -> dict[str, list[str]]:
    args = (world, free_port(), str(folder), module, names)
    context = start_ranks(_worker, args, world, join=False)
    deadline = time.monotonic() + 600
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"world of {world} did not finish")
    outcome: dict[str, list[str]] = {}
    for rank in range(world):
        for name, result in json.loads((folder / f"world{world}-rank{rank}.json").read_text()).items():
            if result != "ok":
                outcome.setdefault(name, []).append(f"rank {rank}:\n{result}")
            else:
                outcome.setdefault(name, [])
    return outcome
