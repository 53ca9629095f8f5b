"""The conformance kit against a user-style store with planted bugs (one at a time), a
correct one, leanstate's own wrapper and ZeRO.

``UserStore`` is what a user's Python wrapper over their own KV store looks like; each
bug is one a real store gets wrong. The kit must catch at least 10 of the 12 and raise
no false alarm on the correct store.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import leanstate
from leanstate import KVStore
from leanstate.reference.row_format import header_words, pack_metadata, unpack_metadata
from leanstate.testing import KVStoreConformance, WrapperConformance, ZeroConformance, run_store_machine

BUGS = [
    "duplicates keep the first value",
    "missing ids read zeros",
    "the seed is ignored",
    "set does not stamp the time",
    "set does not count",
    "eviction keeps one row too many",
    "eviction drops the newest ids",
    "negative ids read initial rows",
    "keys are not sorted",
    "delete counts what it was asked",
    "set_rows resets the count",
    "set ignores width_offset",
]


class UserStore:
    """A store with KVStore's methods over another one (as a wrapper over a C++ store is),
    with one planted ``bug``."""

    def __init__(self, dim: int, *, bug: str | None = None, seed: int = 0, **options) -> None:
        assert bug in (None, *BUGS)
        self.bug = bug
        self.inner = KVStore(
            dim, backend="reference", seed=0 if bug == "the seed is ignored" else seed, **options
        )

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def set(self, ids, values, *, width_offset=0):
        if self.bug == "duplicates keep the first value" and len(ids):
            first = {}
            for i, key in enumerate(ids.tolist()):
                first.setdefault(key, i)
            keep = torch.tensor(sorted(first.values()), dtype=torch.int64)
            ids, values = ids[keep], values[keep]
        if self.bug == "set ignores width_offset":
            width_offset = 0
        self.inner.set(ids, values, width_offset=width_offset)
        touched = ids[ids >= 0]
        if self.bug in ("set does not stamp the time", "set does not count") and len(touched):
            rows = self.inner.get_rows(touched)
            stamp, count, used = unpack_metadata(header_words(rows)[:, 1])
            if self.bug == "set does not stamp the time":
                stamp = torch.zeros_like(stamp)
            else:
                count = torch.ones_like(count)
            header_words(rows)[:, 1] = pack_metadata(stamp, count, used)
            self.inner.set_rows(rows)

    def get(self, ids, **kwargs):
        if self.bug == "negative ids read initial rows":
            ids = torch.where(ids < 0, ids.abs() + 1000, ids)
        out = self.inner.get(ids, **kwargs)
        if self.bug == "missing ids read zeros":
            out[~self.inner.contains(ids)] = 0
        return out

    def keys(self):
        keys = self.inner.keys()
        return keys.flip(0) if self.bug == "keys are not sorted" else keys

    def delete(self, ids):
        deleted = self.inner.delete(ids)
        return len(ids) if self.bug == "delete counts what it was asked" else deleted

    def set_rows(self, rows):
        if self.bug == "set_rows resets the count" and len(rows):
            rows = rows.clone()
            stamp, count, used = unpack_metadata(header_words(rows)[:, 1])
            header_words(rows)[:, 1] = pack_metadata(stamp, torch.ones_like(count), used)
        self.inner.set_rows(rows)

    def evict(self, **policy):
        if self.bug == "eviction keeps one row too many" and policy.get("max_rows") is not None:
            policy = {**policy, "max_rows": policy["max_rows"] + 1}
        if self.bug == "eviction drops the newest ids" and policy.get("max_rows") is not None:
            limit = policy.pop("max_rows")
            evicted = self.inner.evict(**policy).tolist()
            extra = (
                self.inner.keys()[limit:] if len(self.inner) > limit else torch.empty(0, dtype=torch.int64)
            )
            self.inner.delete(extra)
            return torch.tensor(sorted(evicted + extra.tolist()), dtype=torch.int64)
        return self.inner.evict(**policy)


def factory(bug: str | None):
    return lambda dim, **options: UserStore(dim, bug=bug, **options)


KIT = KVStoreConformance()
DIRECT = [
    name
    for name in dir(KIT)
    if name.startswith("test_") and name != "test_random_operations_match_the_reference"
]


def failing_checks(make_store, machine_examples: int, *, machine_always: bool = False) -> list[str]:
    """The kit's checks that fail on ``make_store``: the direct ones, then the state machine
    (only when they all passed, unless ``machine_always``: a failing machine shrinks, slowly)."""
    failed = []
    for name in DIRECT:
        try:
            getattr(KIT, name)(make_store=make_store)
        except Exception:  # an assertion, or the store raising where it should not
            failed.append(name)
    if failed and not machine_always:
        return failed
    try:
        run_store_machine(make_store, examples=machine_examples)
    except Exception:
        failed.append("test_random_operations_match_the_reference")
    return failed


def test_the_kit_catches_planted_bugs_and_names_them():
    caught = {bug: failing_checks(factory(bug), machine_examples=25) for bug in BUGS}
    missed = [bug for bug, checks in caught.items() if not checks]
    assert len(BUGS) - len(missed) >= 10, f"missed: {missed}"
    # the checks that fire name the behaviour
    assert "test_duplicate_ids_in_one_set_keep_the_last_value" in caught["duplicates keep the first value"]
    assert "test_missing_ids_read_their_initial_rows" in caught["missing ids read zeros"]
    assert (
        "test_eviction_keeps_exactly_max_rows_least_used_first" in caught["eviction keeps one row too many"]
    )
    assert "test_headers_stamp_the_key_time_count_and_use" in caught["set does not count"]
    assert "test_checkpoint_bytes_match_the_reference_and_load_back" in caught["set_rows resets the count"]


def test_a_correct_store_raises_no_false_alarm():
    assert failing_checks(factory(None), machine_examples=60, machine_always=True) == []


class TestTheKitOnTheNumbaStore(KVStoreConformance):
    """The kit as a user runs it: one subclass, one fixture."""

    examples = 30

    @pytest.fixture
    def make_store(self):
        if "numba" not in leanstate._backends.available("kv_store"):
            pytest.skip("numba is not installed")
        return lambda dim, **options: KVStore(dim, backend="numba", **options)


class TestTheKitOnLeanstatesWrapper(WrapperConformance):
    @pytest.fixture
    def wrap(self):
        return leanstate.checkpoint_wrapper


def test_the_wrapper_kit_catches_a_wrapper_that_drops_the_rng_state():
    def no_rng_replay(module):
        return leanstate.checkpoint_wrapper(module, preserve_rng_state=False)

    with pytest.raises(AssertionError, match="gradients|differs"):
        WrapperConformance().test_outputs_and_gradients_match_the_module(wrap=no_rng_replay)


class TestTheKitOnLeanstatesZero(ZeroConformance):
    @pytest.fixture
    def make_optimizer(self):
        return lambda params, optimizer_class, **defaults: leanstate.ZeroRedundancyOptimizer(
            params, optimizer_class, **defaults
        )


def test_spec_worked_example_fails_the_checks_it_says():
    """spec/testing.md's example, as written there, run by pytest as a user would."""
    text = (Path(__file__).parents[2] / "spec" / "testing.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "test_example.py").write_text(code)
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "test_example.py"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=600,
        )
    out = result.stdout
    failed = {line.split("::")[-1].split(" ")[0] for line in out.splitlines() if line.startswith("FAILED")}
    assert failed == {
        "test_drop_in_details",
        "test_deleted_ids_are_gone_and_their_room_is_reused",
        "test_checkpoint_bytes_match_the_reference_and_load_back",
        "test_random_operations_match_the_reference",
    }, out
    assert "keys() must ascend" in out and "4 failed, 5 passed" in out, out
