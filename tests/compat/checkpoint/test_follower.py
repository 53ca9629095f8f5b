"""``leanstate.Follower`` (``spec/follower.md``): a serving store follows the checkpoints a
trainer publishes, each link applied whole while other threads read, stale, forked and
damaged links refused with the tables left as they were, a restart resuming from the
stores' marks, and the hardened follower held to the textbook on random histories."""

from __future__ import annotations

import hashlib
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leanstate
from leanstate import CheckpointError, KVStore, _backends, load_checkpoint, save_checkpoint
from leanstate.reference import follower as textbook
from tests.harness import FakeClock, kill_during

BACKENDS = ["reference", "numba", "torch"]
DIM, STATE = 4, 1
MARKERS = torch.arange(0, 320, 10)  # 32 ids over every shard: each delta writes them all to one value
ROW_BYTES = 16 + 4 * (4 + 4)  # the header, the weights and the state (each padded to 4) in fp32


def new_store(backend: str = "numba") -> KVStore:
    return KVStore(DIM, optimizer_state_dim=STATE, backend=backend, clock=FakeClock(100))


def rows_of(store: KVStore) -> tuple[torch.Tensor, torch.Tensor]:
    keys = store.keys()
    return keys, store.get_rows(keys)


def assert_same(a: KVStore, b: KVStore) -> None:
    keys_a, rows_a = rows_of(a)
    keys_b, rows_b = rows_of(b)
    assert torch.equal(keys_a, keys_b)
    assert torch.equal(rows_a.view(torch.int32), rows_b.view(torch.int32))  # bit for bit


def digest(path: Path) -> str:
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


class Trainer:
    """A store that saves a full checkpoint or a delta of its last save into ``folder``."""

    def __init__(self, folder: Path, backend: str = "numba", chunk_bytes: int = 1 << 20) -> None:
        self.folder, self.chunk_bytes = folder, chunk_bytes
        self.store = new_store(backend)
        self.last: Path | None = None
        self.step = 0
        self.generator = torch.Generator().manual_seed(0)

    def write(self) -> None:
        """One step: every marker set to the step number, a few other rows written, one deleted."""
        self.step += 1
        self.store.set(MARKERS, torch.full((len(MARKERS), DIM + STATE), float(self.step)))
        others = torch.randint(1000, 1100, (6,), generator=self.generator)
        self.store.set(others, torch.randn(len(others), DIM + STATE, generator=self.generator))
        self.store.delete(torch.randint(1000, 1100, (2,), generator=self.generator))

    def save(self, name: str, *, full: bool = False, base: Path | None = None) -> Path:
        path = self.folder / name
        base = None if full else (base or self.last)
        save_checkpoint(path, {"t": self.store}, base=base, chunk_bytes=self.chunk_bytes)
        self.last = path
        return path


@pytest.fixture
def trainer(tmp_path):
    return Trainer(tmp_path / "ckpts")


def history(trainer: Trainer, deltas: int) -> list[Path]:
    trainer.write()
    links = [trainer.save("c0", full=True)]
    for k in range(1, deltas + 1):
        trainer.write()
        links.append(trainer.save(f"d{k}"))
    return links


# -- following ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", sorted(_backends.available("kv_store")))  # numba-cuda: in the simulator
def test_a_follower_applies_the_full_checkpoint_then_each_delta_in_order(tmp_path, backend):
    trainer = Trainer(tmp_path / "ckpts", backend)
    links = history(trainer, 3)
    serving = new_store(backend)
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    assert follower.poll() == links
    assert_same(serving, trainer.store)
    assert follower.position == links[-1]
    assert serving.mark.checkpoint == digest(links[-1])
    assert [a.kind for a in follower.history] == ["full", "delta", "delta", "delta"]
    assert [a.path for a in follower.history] == links
    written, removed = follower.history[2].rows, follower.history[2].removed
    assert written >= len(MARKERS) and removed <= 2
    trainer.write()
    new = trainer.save("d4")
    assert follower.poll() == [new]
    assert_same(serving, trainer.store)
    assert "at=" in repr(follower) and "applied=5" in repr(follower)


def test_a_delta_upserts_its_rows_and_deletes_its_removed_ids_exactly(trainer):
    history(trainer, 0)
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    follower.poll()
    trainer.store.delete(MARKERS[:5])
    trainer.store.set(torch.tensor([5000]), torch.ones(1, DIM + STATE))
    delta = trainer.save("d1")
    follower.poll()
    assert not serving.contains(MARKERS[:5]).any() and bool(serving.contains(torch.tensor([5000])))
    assert follower.history[-1].removed == 5 and follower.history[-1].rows == 1
    assert serving.mark.checkpoint == digest(delta)
    assert_same(serving, trainer.store)


def test_polling_again_applies_nothing_and_a_copy_of_an_applied_link_is_the_same_link(trainer):
    links = history(trainer, 2)
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    follower.poll()
    before = rows_of(serving)
    assert follower.poll() == []
    # the same manifest bytes, published later (new mtimes): the same links, applied already
    shutil.copytree(links[1], trainer.folder / "copy-of-d1", copy_function=shutil.copy)
    shutil.copytree(links[0], trainer.folder / "copy-of-c0", copy_function=shutil.copy)
    assert follower.poll() == []
    assert torch.equal(rows_of(serving)[1], before[1])
    assert len(follower.history) == 3


def test_at_the_start_the_newest_full_checkpoint_is_taken_and_older_links_skipped(trainer):
    history(trainer, 2)
    trainer.write()
    newest = trainer.save("c3", full=True)
    trainer.write()
    delta = trainer.save("d4")
    serving = new_store()
    assert leanstate.Follower(trainer.folder, {"t": serving}).poll() == [newest, delta]
    assert_same(serving, trainer.store)


def test_a_newer_full_checkpoint_replaces_the_state(trainer):
    history(trainer, 1)
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    follower.poll()
    trainer.store.delete(trainer.store.keys()[::2])  # rows the new full checkpoint lacks
    trainer.write()
    trainer.save("d2")
    trainer.write()
    full = trainer.save("c3", full=True)
    assert follower.poll() == [full]  # the delta before it is not needed
    assert_same(serving, trainer.store)
    assert follower.history[-1].kind == "full"
    trainer.write()
    new = trainer.save("d4")
    assert follower.poll() == [new]
    assert_same(serving, trainer.store)


# -- refusals -----------------------------------------------------------------------------


def test_a_stale_delta_is_refused_naming_both_links_and_changes_nothing(trainer):
    links = history(trainer, 2)
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    follower.poll()
    before, mark = rows_of(serving), serving.mark
    old = new_store()
    load_checkpoint(links[1], {"t": old})  # a second trainer resumed from d1
    old.set(MARKERS, torch.full((len(MARKERS), DIM + STATE), -1.0))
    stale = trainer.folder / "stale"
    save_checkpoint(stale, {"t": old}, base=links[1])
    with pytest.raises(CheckpointError) as error:
        follower.poll()
    message = str(error.value)
    assert str(stale) in message and str(links[1]) in message and str(links[2]) in message
    assert torch.equal(rows_of(serving)[1], before[1]) and serving.mark == mark
    assert digest(stale) in follower.refused
    assert follower.poll() == []  # remembered: not tried (nor raised) again
    trainer.write()
    new = trainer.save("d3")
    assert follower.poll() == [new]  # the real chain goes on
    assert_same(serving, trainer.store)


def test_of_two_deltas_on_one_base_the_second_is_a_fork_and_refused(trainer):
    links = history(trainer, 1)
    branch = new_store()
    load_checkpoint(links[1], {"t": branch})
    trainer.write()
    first = trainer.save("d2")
    branch.set(MARKERS, torch.full((len(MARKERS), DIM + STATE), 99.0))
    fork = trainer.folder / "d2-fork"
    save_checkpoint(fork, {"t": branch}, base=links[1])
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    with pytest.raises(CheckpointError, match="d2-fork"):
        follower.poll()
    assert follower.position == first
    assert_same(serving, trainer.store)


def test_a_delta_after_a_gap_is_refused(trainer, tmp_path):
    history(trainer, 1)
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    follower.poll()
    trainer.write()
    middle = trainer.save("d2")
    trainer.write()
    after_gap = trainer.save("d3")
    shutil.move(middle, tmp_path / "elsewhere")  # the link between is no longer under the directory
    with pytest.raises(CheckpointError, match="no longer under the directory"):
        follower.poll()
    assert digest(after_gap) in follower.refused
    assert follower.position == trainer.folder / "d1"


def test_a_corrupt_delta_is_refused_whole_and_the_chain_above_it_too(tmp_path):
    trainer = Trainer(tmp_path / "ckpts", chunk_bytes=4 * ROW_BYTES)  # several chunks: the last is bad
    history(trainer, 1)
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving}, chunk_bytes=4 * ROW_BYTES)
    follower.poll()
    before, mark = rows_of(serving), serving.mark
    trainer.write()
    bad = trainer.save("d2")
    data = bytearray((bad / "t.rows").read_bytes())
    data[-3] ^= 0xFF
    (bad / "t.rows").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="t.rows"):
        follower.poll()
    assert torch.equal(rows_of(serving)[1], before[1]) and serving.mark == mark  # no chunk applied
    trainer.write()
    above = trainer.save("d3")
    with pytest.raises(CheckpointError, match="stale, a fork or after a gap"):
        follower.poll()
    assert {digest(bad), digest(above)} <= set(follower.refused)


def test_a_damaged_manifest_is_refused_once(trainer):
    history(trainer, 1)
    broken = trainer.folder / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text('{"format": "leanstate-whole-row", "version": 7}')
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    with pytest.raises(CheckpointError, match="broken"):
        follower.poll()
    assert follower.position == trainer.folder / "d1"  # the good links were applied
    assert follower.poll() == []


def test_a_link_without_the_followed_table_or_with_another_layout_is_refused(trainer):
    history(trainer, 0)
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    follower.poll()
    other = KVStore(DIM + 1, optimizer_state_dim=STATE)
    other.set(MARKERS, torch.ones(len(MARKERS), DIM + 1 + STATE))
    save_checkpoint(trainer.folder / "wider", {"t": other})
    with pytest.raises(CheckpointError, match="dim 5 vs the store's 4"):
        follower.poll()
    save_checkpoint(trainer.folder / "renamed", {"u": trainer.store})
    with pytest.raises(CheckpointError, match="no table 't'"):
        follower.poll()
    assert follower.position == trainer.folder / "c0"
    assert_same(serving, trainer.store)


# -- incomplete saves and restarts ----------------------------------------------------------


def _save_a_delta(folder: str, name: str, base: str, ready, go) -> None:
    """A trainer process: resumes from ``base``, writes, and saves a delta (killed mid-way)."""
    store = new_store()
    load_checkpoint(base, {"t": store})
    store.set(torch.arange(2000, 6000), torch.ones(4000, DIM + STATE))
    ready.set()
    go.wait()
    save_checkpoint(Path(folder) / name, {"t": store}, base=base, chunk_bytes=8 * ROW_BYTES)


@pytest.mark.parametrize("trial", range(3))
def test_a_save_killed_mid_way_is_skipped_then_applied_once_complete(trainer, trial):
    links = history(trainer, 1)
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    follower.poll()
    kill_during(_save_a_delta, (str(trainer.folder), "d2", str(links[-1])), trial, window=0.3)
    published = (trainer.folder / "d2" / "manifest.json").exists()
    assert follower.poll() == ([trainer.folder / "d2"] if published else [])
    if not published:  # the staging directory is there, without a manifest at d2: skipped
        assert follower.position == links[-1]
        trainer.store.set(torch.arange(2000, 6000), torch.ones(4000, DIM + STATE))
        new = trainer.save("d2")
        assert follower.poll() == [new]  # the save done again, complete
        assert_same(serving, trainer.store)
    assert serving.contains(torch.arange(2000, 6000)).all()


def test_a_restarted_follower_resumes_from_the_marks_its_stores_hold(trainer):
    links = history(trainer, 2)
    serving = new_store()
    leanstate.Follower(trainer.folder, {"t": serving}).poll()
    trainer.write()
    new = trainer.save("d3")
    again = leanstate.Follower(trainer.folder, {"t": serving})
    assert again.position == links[-1]
    # a later copy of a link below the position: the resumed follower knows its chain
    shutil.copytree(links[1], trainer.folder / "copy-of-d1", copy_function=shutil.copy)
    assert again.poll() == [new]
    assert_same(serving, trainer.store)


def test_stores_that_hold_rows_of_no_known_checkpoint_are_refused(trainer, tmp_path):
    history(trainer, 1)
    unmarked = new_store()
    unmarked.set(MARKERS, torch.ones(len(MARKERS), DIM + STATE))
    with pytest.raises(ValueError, match="change marks do not name one checkpoint"):
        leanstate.Follower(trainer.folder, {"t": unmarked})
    elsewhere = new_store()
    save_checkpoint(tmp_path / "other", {"t": trainer.store})
    load_checkpoint(tmp_path / "other", {"t": elsewhere})
    with pytest.raises(ValueError, match="not under"):
        leanstate.Follower(trainer.folder, {"t": elsewhere})


def test_bad_arguments_are_clear_errors(trainer):
    with pytest.raises(TypeError, match="directory must be"):
        leanstate.Follower(3, {"t": new_store()})
    with pytest.raises(ValueError, match="chunk_bytes"):
        leanstate.Follower(trainer.folder, {"t": new_store()}, chunk_bytes=0)
    with pytest.raises(TypeError, match="on_apply must be a callable"):
        leanstate.Follower(trainer.folder, {"t": new_store()}, on_apply="print")
    with pytest.raises(ValueError, match="no store to follow"):
        leanstate.Follower(trainer.folder, {})
    view = leanstate.KVTensor(new_store(), width_offset=0, width=2)
    with pytest.raises(ValueError, match="writable partial view"):
        leanstate.Follower(trainer.folder, {"t": view})
    follower = leanstate.Follower(trainer.folder, {"t": new_store()})
    assert follower.poll() == []  # the directory does not exist yet
    with pytest.raises(ValueError, match="interval"):
        follower.follow(0)


# -- readers during applies -----------------------------------------------------------------


def _applies_with_a_reader(tmp_path: Path, backend: str, applies: int) -> tuple[int, int, int]:
    """``applies`` links (a full one every 25) followed while a thread reads the markers;
    (reads, torn reads, backward steps)."""
    trainer = Trainer(tmp_path / "ckpts", backend, chunk_bytes=4 * ROW_BYTES)  # a commit of several pieces
    trainer.write()
    trainer.save("c0", full=True)
    serving = new_store(backend)
    follower = leanstate.Follower(trainer.folder, {"t": serving}, chunk_bytes=4 * ROW_BYTES)
    follower.poll()
    stop = threading.Event()
    counts = {"reads": 0, "torn": 0, "backward": 0}

    def read() -> None:
        last = 0.0
        while not stop.is_set():
            values = serving.get(MARKERS)[:, 0]
            counts["reads"] += 1
            if not bool((values == values[0]).all()):
                counts["torn"] += 1
            if float(values[0]) < last:
                counts["backward"] += 1
            last = float(values[0])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads take turns often: a half-applied link would be seen
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for k in range(1, applies):
            trainer.write()
            trainer.save(f"l{k:04d}", full=k % 25 == 0)
            assert len(follower.poll()) == 1
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert_same(serving, trainer.store)
    return counts["reads"], counts["torn"], counts["backward"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reader_never_sees_a_link_half_applied_nor_an_older_one(tmp_path, backend):
    reads, torn, backward = _applies_with_a_reader(tmp_path, backend, 100)
    assert reads > 0 and (torn, backward) == (0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_reader_of_a_gpu_store_never_sees_a_link_half_applied(tmp_path):
    """(numba's CUDA simulator cannot launch from a second thread: on a GPU only.)"""
    reads, torn, backward = _applies_with_a_reader(tmp_path, "numba-cuda", 100)
    assert reads > 0 and (torn, backward) == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_thousand_applies_with_a_reader(tmp_path, backend):
    reads, torn, backward = _applies_with_a_reader(tmp_path, backend, 1000)
    assert reads > 0 and (torn, backward) == (0, 0)


def test_follow_polls_on_a_thread_until_close(trainer):
    history(trainer, 1)
    serving = new_store()
    errors = []
    with leanstate.Follower(trainer.folder, {"t": serving}) as follower:
        follower.follow(0.01, on_error=errors.append)
        assert follower.following
        with pytest.raises(RuntimeError, match="already following"):
            follower.follow(0.01)
        trainer.write()
        target = trainer.save("d2")
        deadline = time.monotonic() + 60
        while follower.position != target and time.monotonic() < deadline:
            time.sleep(0.01)
        assert follower.position == target
        (trainer.folder / "junk").mkdir()
        (trainer.folder / "junk" / "manifest.json").write_text("{")
        while not errors and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not follower.following
    assert len(errors) == 1 and "junk" in str(errors[0])
    assert_same(serving, trainer.store)


# -- held to the textbook -------------------------------------------------------------------

STEPS = st.lists(
    st.sampled_from(["delta", "delta", "delta", "full", "stale", "corrupt", "copy", "poll"]),
    min_size=1,
    max_size=10,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_the_follower_is_held_to_the_textbook(tmp_path_factory, steps):
    """The same directory polled by the hardened follower (numba stores) and the textbook
    (reference stores) after each step: the same links applied, the same refused, the same
    rows and marks."""
    trainer = Trainer(tmp_path_factory.mktemp("chain") / "ckpts")
    trainer.write()
    links = [trainer.save("c0", full=True)]
    serving, plain = new_store("numba"), new_store("reference")
    follower, state = leanstate.Follower(trainer.folder, {"t": serving}), textbook.FollowState()
    for n, step in enumerate([*steps, "poll"]):
        if step in ("delta", "full"):
            trainer.write()
            links.append(trainer.save(f"s{n:03d}", full=step == "full"))
        elif step == "stale" and len(links) > 1:
            old = new_store()
            load_checkpoint(links[-2], {"t": old})
            old.set(MARKERS, torch.zeros(len(MARKERS), DIM + STATE))
            save_checkpoint(trainer.folder / f"s{n:03d}", {"t": old}, base=links[-2])
        elif step == "corrupt":
            trainer.write()
            bad = trainer.save(f"s{n:03d}")
            data = bytearray((bad / "t.rows").read_bytes())
            data[len(data) // 2] ^= 0x01
            (bad / "t.rows").write_bytes(bytes(data))
            trainer.store.mark = None  # the trainer's next save is a full one
            trainer.last = None
            trainer.write()
            links.append(trainer.save(f"s{n:03d}-full", full=True))
        elif step == "copy":
            shutil.copytree(links[-1], trainer.folder / f"s{n:03d}-copy", copy_function=shutil.copy)
        outcomes = []
        for poll in (follower.poll, lambda: textbook.poll(trainer.folder, {"t": plain}, state)):
            try:
                outcomes.append((poll(), None))
            except CheckpointError:
                outcomes.append((None, "refused"))
        assert outcomes[0] == outcomes[1], step
        assert set(follower.refused) == set(state.refused)
        assert_same(serving, plain)
        assert serving.mark.checkpoint == plain.mark.checkpoint


def test_a_delta_of_removals_only_and_an_empty_delta_apply(trainer):
    history(trainer, 0)
    serving = new_store()
    follower = leanstate.Follower(trainer.folder, {"t": serving})
    follower.poll()
    trainer.store.delete(MARKERS[:3])
    removals = trainer.save("d1")
    empty = trainer.save("d2")  # nothing changed since d1
    assert follower.poll() == [removals, empty]
    assert [(a.rows, a.removed) for a in follower.history[1:]] == [(0, 3), (0, 0)]
    assert_same(serving, trainer.store)


def test_on_apply_hears_of_each_link_as_it_is_applied(trainer):
    links = history(trainer, 2)
    heard = []
    serving = new_store()
    follower = leanstate.Follower(
        trainer.folder, {"t": serving}, on_apply=lambda a: heard.append((a.path, len(serving)))
    )
    follower.poll()
    assert [path for path, _ in heard] == links
    first = new_store()
    load_checkpoint(links[0], {"t": first})
    assert heard[0][1] == len(first)  # called once the link is in, before the next is applied
