"""The conformance kit against a user-style store with planted bugs (one at a time), a
correct one, leanstate's own wrapper and ZeRO.

``UserStore`` is what a user's Python wrapper over their own KV store looks like; each
bug is one a real store gets wrong (change tracking among them). The kit must catch each
by the check named for it and raise no false alarm on the correct store.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, settings

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
    "set_rows writes into the caller's rows",
    "get(out=) returns a new tensor",
    "get_rows(out=) returns a new tensor",
    "initial weights are zero past column 64",
    "set_rows skips a negative key",
    "the count wraps past 2**31-1",
    "eviction breaks count ties by id",
    "the l2 norm includes the optimizer state",
    "keys_in_range includes hi",
    "contains is true for negative ids",
    "metadata of a missing id is not zero",
    "get reads from column 0 whatever width_offset",
    "set past column 0 gives a new id zeros before its columns",
    "changes never reports a removal",
    "changes drops the removals after the first epoch it is asked about",
    "a deleted and rewritten id is reported removed too",
]
# Each bug and the check that must catch it: its name says what broke.
CAUGHT_BY = {
    "duplicates keep the first value": "test_duplicate_ids_in_one_set_keep_the_last_value",
    "missing ids read zeros": "test_missing_ids_read_their_initial_rows",
    "the seed is ignored": "test_missing_ids_read_their_initial_rows",
    "set does not stamp the time": "test_headers_stamp_the_key_time_count_and_use",
    "set does not count": "test_headers_stamp_the_key_time_count_and_use",
    "eviction keeps one row too many": "test_eviction_keeps_exactly_max_rows_least_used_first",
    "eviction drops the newest ids": "test_eviction_to_a_row_budget_drops_least_used_then_oldest",
    "negative ids read initial rows": "test_negative_ids_are_padding",
    "keys are not sorted": "test_deleted_ids_are_gone_and_their_room_is_reused",
    "delete counts what it was asked": "test_deleted_ids_are_gone_and_their_room_is_reused",
    "set_rows resets the count": "test_checkpoint_bytes_match_the_reference_and_load_back",
    "set ignores width_offset": "test_checkpoint_bytes_match_the_reference_and_load_back",
    "set_rows writes into the caller's rows": "test_random_operations_match_the_reference",
    "get(out=) returns a new tensor": "test_out_buffers_are_filled_and_returned",
    "get_rows(out=) returns a new tensor": "test_out_buffers_are_filled_and_returned",
    "initial weights are zero past column 64": "test_initial_rows_of_any_width",
    "set_rows skips a negative key": "test_set_rows_refuses_a_negative_key_and_changes_nothing",
    "the count wraps past 2**31-1": "test_counts_saturate_at_2_to_the_31_minus_1",
    "eviction breaks count ties by id": "test_eviction_to_a_row_budget_drops_least_used_then_oldest",
    "the l2 norm includes the optimizer state": "test_l2_norm_eviction_reads_the_weights_not_the_state",
    "keys_in_range includes hi": "test_drop_in_details",
    "contains is true for negative ids": "test_negative_ids_are_padding",
    "metadata of a missing id is not zero": "test_random_operations_match_the_reference",
    "get reads from column 0 whatever width_offset": "test_random_operations_match_the_reference",
    "set past column 0 gives a new id zeros before its columns": "test_random_operations_match_the_reference",
    "changes never reports a removal": "test_changes_since_each_epoch_match_the_reference",
    "changes drops the removals after the first epoch it is asked about": (
        "test_changes_since_each_epoch_match_the_reference"
    ),
    "a deleted and rewritten id is reported removed too": "test_changes_since_each_epoch_match_the_reference",
}


class UserStore:
    """A store with KVStore's methods over another one (as a wrapper over a C++ store is),
    with one planted ``bug``."""

    def __init__(self, dim: int, *, bug: str | None = None, seed: int = 0, **options) -> None:
        assert bug in (None, *BUGS)
        self.bug, self.deleted = bug, set()
        self.inner = KVStore(
            dim, backend="reference", seed=0 if bug == "the seed is ignored" else seed, **options
        )

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def mark(self):  # an attribute the inner store acts on: set there, not on the wrapper
        return self.inner.mark

    @mark.setter
    def mark(self, mark):
        self.inner.mark = mark

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
        counts_before = unpack_metadata(self.inner.metadata(ids[ids >= 0]))[1]
        new = ids[(ids >= 0) & ~self.inner.contains(ids)]
        self.inner.set(ids, values, width_offset=width_offset)
        if (
            self.bug == "set past column 0 gives a new id zeros before its columns"
            and width_offset
            and len(new)
        ):
            self.inner.set(new, torch.zeros(len(new), width_offset, dtype=values.dtype))
        touched = ids[ids >= 0]
        if self.bug == "the count wraps past 2**31-1" and len(touched):
            rows = self.inner.get_rows(touched)
            stamp, _, used = unpack_metadata(header_words(rows)[:, 1])
            occurrences = (touched[:, None] == touched[None, :]).sum(1)
            wrapped = (counts_before + occurrences) & (2**31 - 1)
            header_words(rows)[:, 1] = pack_metadata(stamp, wrapped, used)
            self.inner.set_rows(rows)
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
        if self.bug == "get(out=) returns a new tensor":
            kwargs.pop("out", None)
        if self.bug == "get reads from column 0 whatever width_offset":
            kwargs["width_offset"] = 0
        out = self.inner.get(ids, **kwargs)
        missing = ~self.inner.contains(ids)
        if self.bug == "missing ids read zeros":
            out[missing] = 0
        if self.bug == "initial weights are zero past column 64" and self.inner.dim > 64:
            out[missing, 64 - kwargs.get("width_offset", 0) : self.inner.dim] = 0
        return out

    def get_rows(self, ids, **kwargs):
        if self.bug == "get_rows(out=) returns a new tensor":
            kwargs.pop("out", None)
        return self.inner.get_rows(ids, **kwargs)

    def contains(self, ids):
        found = self.inner.contains(ids)
        return found | (ids < 0) if self.bug == "contains is true for negative ids" else found

    def metadata(self, ids):
        meta = self.inner.metadata(ids)
        if self.bug == "metadata of a missing id is not zero":
            meta[~self.inner.contains(ids)] = 1
        return meta

    def keys_in_range(self, lo, hi):
        if self.bug == "keys_in_range includes hi" and hi < 2**63:
            hi += 1
        return self.inner.keys_in_range(lo, hi)

    def keys(self):
        keys = self.inner.keys()
        return keys.flip(0) if self.bug == "keys are not sorted" else keys

    def delete(self, ids):
        self.deleted.update(ids.tolist())
        deleted = self.inner.delete(ids)
        return len(ids) if self.bug == "delete counts what it was asked" else deleted

    def changes(self, since=None):
        written, removed = self.inner.changes(since=since)
        if self.bug == "changes never reports a removal":
            removed = removed[:0]
        if self.bug == "changes drops the removals after the first epoch it is asked about":
            first = since if since is not None else (self.inner.mark.epoch if self.inner.mark else 0)
            removed = removed[~torch.isin(removed, self.inner.changes(since=first + 1)[1])]
        if self.bug == "a deleted and rewritten id is reported removed too":
            again = written[torch.isin(written, torch.tensor(sorted(self.deleted), dtype=torch.int64))]
            removed = torch.unique(torch.cat([removed, again]))
        return written, removed

    def set_rows(self, rows):
        if self.bug == "set_rows skips a negative key":
            rows = rows[header_words(rows)[:, 0] >= 0]
        if self.bug == "set_rows writes into the caller's rows" and len(rows):
            self.inner.set_rows(rows)
            header_words(rows)[:, 1] |= torch.tensor(-(2**63))  # marks the caller's rows used
            return
        if self.bug == "set_rows resets the count" and len(rows):
            rows = rows.clone()
            stamp, count, used = unpack_metadata(header_words(rows)[:, 1])
            header_words(rows)[:, 1] = pack_metadata(stamp, torch.ones_like(count), used)
        self.inner.set_rows(rows)

    def evict(self, **policy):
        policy = {k: v for k, v in policy.items() if v is not None}
        if self.bug == "the l2 norm includes the optimizer state" and "min_l2_norm" in policy:
            keys = self.inner.keys()
            values = self.inner.get(keys)
            weak = keys[torch.linalg.vector_norm(values.float(), dim=1) < policy.pop("min_l2_norm")]
            self.inner.delete(weak)
            return torch.sort(torch.cat([weak, self._evict(policy)])).values
        if self.bug == "eviction breaks count ties by id" and "max_rows" in policy:
            limit = policy.pop("max_rows")
            evicted = self._evict(policy)
            keys = self.inner.keys()
            count = unpack_metadata(self.inner.metadata(keys))[1]
            ranked = sorted(range(len(keys)), key=lambda i: (int(count[i]), int(keys[i])))
            extra = keys[ranked[: max(0, len(keys) - limit)]]
            self.inner.delete(extra)
            return torch.sort(torch.cat([evicted, extra])).values
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


def _no_policy_left(store, policy):
    return store.inner.evict(**policy) if policy else torch.empty(0, dtype=torch.int64)


UserStore._evict = lambda self, policy: _no_policy_left(self, policy)


def factory(bug: str | None):
    return lambda dim, **options: UserStore(dim, bug=bug, **options)


KIT = KVStoreConformance()
DIRECT = [
    name
    for name in dir(KIT)
    if name.startswith("test_") and name != "test_random_operations_match_the_reference"
]


def _calls(name: str):
    """The direct check ``name`` as calls: one per parameter set of its parametrize mark."""
    check = getattr(KIT, name)
    marks = [m for m in getattr(check, "pytestmark", []) if m.name == "parametrize"]
    if not marks:
        return [check]
    argument, values = marks[0].args
    return [lambda make_store, v=v: check(make_store=make_store, **{argument: v}) for v in values]


def failing_checks(make_store, machine_examples: int, *, machine_always: bool = False) -> list[str]:
    """The kit's checks that fail on ``make_store``: the direct ones, then the state machine
    (only when they all passed, unless ``machine_always``: a failing machine shrinks, slowly)."""
    failed = []
    for name in DIRECT:
        try:
            for call in _calls(name):
                call(make_store=make_store)
        except (Exception, pytest.fail.Exception):  # an assertion, a missing raise, or a raise
            failed.append(name)
    if failed and not machine_always:
        return failed
    try:
        run_store_machine(make_store, examples=machine_examples)
    except Exception:
        failed.append("test_random_operations_match_the_reference")
    return failed


def test_the_kit_catches_every_planted_bug_by_the_check_named_for_it():
    caught = {bug: failing_checks(factory(bug), machine_examples=40) for bug in BUGS}
    wrong = {bug: checks for bug, checks in caught.items() if CAUGHT_BY[bug] not in checks}
    assert not wrong, f"not caught by the check named for them: {wrong}"


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
    assert "keys() must ascend" in out and "4 failed, 16 passed" in out, out


def _rows_pair(dtype=torch.float32):
    store = KVStore(3, optimizer_state_dim=2, dtype=dtype, seed=4)
    ids = torch.tensor([5, 9])
    store.set(ids, torch.ones(2, 3, dtype=dtype))
    rows = store.get_rows(ids)
    return rows, rows.clone(), ids, store.layout


def test_row_difference_names_the_first_field_that_differs():
    from leanstate.testing import row_difference

    mine, reference, ids, layout = _rows_pair()
    assert row_difference(mine, reference, ids, layout) is None
    assert row_difference(mine[:1], reference, ids, layout).startswith("rows of shape (1, ")
    assert "torch.float64" in row_difference(mine.double(), reference, ids, layout)
    header_words(mine)[1, 0] = 10
    assert row_difference(mine, reference, ids, layout) == "id 9: header key 10, the reference 9"
    saved = [int(v) for v in unpack_metadata(header_words(reference)[0, 1:2])]  # timestamp, count, used
    for k, (field, value) in enumerate([("timestamp", saved[0] + 7), ("count", saved[1] + 2), ("used", 0)]):
        changed = list(saved)
        changed[k] = value
        mine = reference.clone()
        header_words(mine)[0, 1] = pack_metadata(*(torch.tensor([v]) for v in changed))
        assert (
            row_difference(mine, reference, ids, layout)
            == f"id 5: header {field} {value}, the reference {saved[k]}"
        )


@pytest.mark.parametrize(
    "column, part",
    [
        ("weight_offset", "weight column 0"),
        ("pad", "weight padding column 3"),
        ("state_offset", "state column 0"),
    ],
)
def test_row_difference_names_the_column_of_a_weight_padding_or_state(column, part):
    from leanstate.testing import row_difference

    mine, reference, ids, layout = _rows_pair()
    at = layout.weight_offset + layout.dim if column == "pad" else getattr(layout, column)
    mine[1, at] = 2.5
    assert (
        row_difference(mine, reference, ids, layout)
        == f"id 9: {part} is 2.5, the reference {reference[1, at].item()}"
    )


class _OffByOneInIdThree(KVStore):
    """A store whose ``get`` returns 64 in one cell of id 3 (the kit's values are quarters in [-2, 2])."""

    def get(self, ids, *args, **kwargs):
        values = super().get(ids, *args, **kwargs)
        if values.shape[1] > 1:
            values[ids == 3, 1] = 64
        return values


# The machine's first failing run as it is: caught is enough, no shrinking, no database.
UNSHRUNK = settings(
    max_examples=300,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    phases=[Phase.generate],
    database=None,
)


def test_the_state_machine_names_the_id_column_and_both_values_of_a_difference():
    def make_store(dim, **options):
        return _OffByOneInIdThree(dim, backend="reference", **options)

    with pytest.raises(AssertionError) as failure:
        # not shrunk: the first failing get, id 3 wherever it falls among its ids
        run_store_machine(
            make_store,
            settings=UNSHRUNK,
        )
    message = str(failure.value)
    found = re.search(r"id 3, column 1: (\S+), the reference (\S+)", message)
    assert found is not None, message
    assert float(found.group(1)) == 64 != float(found.group(2)), message
    # the operations show short id lists by value (a get, or a get into out=, fails first)
    assert re.search(r"\n  get\((tensor\()?\[-?\d", message), message
    shown = int(re.search(r"after \(the last (\d+) operations\)", message).group(1))
    listed = message.split("operations):\n")[1].splitlines()
    assert len(listed) == shown and re.match(r"  get\((tensor\()?\[", listed[-1]), (
        message
    )  # the last ones, to the failing get


class _SkipsEmptyWrites(KVStore):
    """A store whose ``set`` of no columns returns at once (the reference still inserts the
    ids and counts the write)."""

    def set(self, ids, values, *args, **kwargs):
        if values.shape[1] == 0:
            return None
        return super().set(ids, values, *args, **kwargs)


def test_the_state_machine_writes_no_columns_too():
    def make_store(dim, **options):
        return _SkipsEmptyWrites(dim, backend="reference", **options)

    with pytest.raises(AssertionError):
        run_store_machine(
            make_store,
            settings=UNSHRUNK,
        )
