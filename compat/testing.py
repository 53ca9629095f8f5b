"""The conformance kit: hold your own KV store, ZeRO-like optimizer or activation wrapper to leanstate's reference.

Subclass a base class in a test module and give it one fixture; pytest collects the
checks, and a failing one names what your implementation does differently::

    import pytest
    from leanstate.testing import KVStoreConformance

    class TestMyStore(KVStoreConformance):
        @pytest.fixture
        def make_store(self):
            return lambda dim, **options: MyStore(dim, **options)

``make_store(dim, optimizer_state_dim=, dtype=, seed=, clock=)`` must build an empty
store with ``leanstate.KVStore``'s public methods (a wrapper over a C++ store, or
``KVStore(..., backend="mine")`` for an engine registered with ``leanstate._backends``).
The checks: a hypothesis state machine running random operations on your store and on the
reference and comparing every result bit for bit, then direct checks of initial rows,
duplicate ids, header stamps, eviction boundaries, checkpoint bytes and the drop-in
details. ``WrapperConformance`` (fixture ``wrap``) and ``ZeroConformance`` (fixture
``make_optimizer``) do the same for activation wrappers and ZeRO-like optimizers. See
``spec/testing.md`` for a worked example.

The hypothesis strategies the state machine draws from are public too (``ids``,
``colliding_ids``, ``id_batches``, ``dims``, ``dtypes``, ``state_dims``, ``layouts``,
``counts``, ``evictions``, ``out_buffers``): inputs weighted to the int64 edges, hash
collisions, duplicates and padding, wide and odd dims, saturating counts and exact
eviction boundaries, for a user's own tests as for leanstate's differential ones.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import hypothesis
import pytest
import torch
from torch import nn

from leanstate._store_machine import (
    Clock,
    StoreMachine,
    first_cell,
    reference_store,
    row_difference,
    run_store_machine,
    same_bits,
)
from leanstate._strategies import (
    ID_EDGES,
    colliding_ids,
    counts,
    dims,
    dtypes,
    evictions,
    id_batches,
    ids,
    layouts,
    out_buffers,
    state_dims,
)
from leanstate.checkpoint import load_checkpoint, save_checkpoint
from leanstate.reference.row_format import COUNT_MAX, RowLayout, header_words, pack_metadata, unpack_metadata

__all__ = [
    "KVStoreConformance",
    "StoreMachine",
    "WrapperConformance",
    "ZeroConformance",
    "colliding_ids",
    "counts",
    "dims",
    "dtypes",
    "evictions",
    "id_batches",
    "ids",
    "layouts",
    "out_buffers",
    "row_difference",
    "run_store_machine",
    "same_bits",
    "state_dims",
]

DIM, STATE = 5, 2


class KVStoreConformance:
    """Checks for a KV store; a subclass provides the fixture ``make_store`` (see the module)."""

    examples = 60  # hypothesis examples of the state machine
    max_dim = 300  # the widest store the state machine draws
    settings: hypothesis.settings | None = None  # or hypothesis settings for the machine (a seed, a profile)

    def _pair(self, make_store, **options):
        options = {
            "optimizer_state_dim": STATE,
            "dtype": torch.float32,
            "seed": 7,
            "clock": Clock(),
            **options,
        }
        return reference_store(DIM, **options), make_store(DIM, **options), options["clock"]

    def test_random_operations_match_the_reference(self, make_store):
        run_store_machine(make_store, self.examples, max_dim=self.max_dim, settings=self.settings)

    def test_missing_ids_read_their_initial_rows(self, make_store):
        for seed in (0, 7, 2**63 + 5):
            ref, mine, _ = self._pair(make_store, seed=seed)
            ids = torch.tensor([17, 2**40 + 3, *ID_EDGES])
            assert same_bits(mine.get(ids), ref.get(ids)), (
                f"initial rows (seed {seed}) differ from the reference"
            )
            assert not bool(mine.contains(ids).any()), "reading a missing id inserted it"

    def test_negative_ids_are_padding(self, make_store):
        ref, mine, _ = self._pair(make_store)
        ids = torch.tensor([-1, 3, -7])
        mine.set(torch.tensor([3]), torch.ones(1, DIM))
        ref.set(torch.tensor([3]), torch.ones(1, DIM))
        assert same_bits(mine.get(ids), ref.get(ids)), "negative ids must read zeros"
        assert mine.contains(ids).tolist() == [False, True, False]

    def test_duplicate_ids_in_one_set_keep_the_last_value(self, make_store):
        ref, mine, _ = self._pair(make_store)
        ids = torch.tensor([4, 9, 4, 4])
        values = torch.arange(4 * DIM, dtype=torch.float32).reshape(4, DIM)
        for store in (ref, mine):
            store.set(ids, values)
        assert same_bits(mine.get_rows(torch.tensor([4, 9])), ref.get_rows(torch.tensor([4, 9]))), (
            "duplicate ids: the last value wins, and the count rises once per occurrence"
        )

    def test_headers_stamp_the_key_time_count_and_use(self, make_store):
        ref, mine, clock = self._pair(make_store)
        for step, now in enumerate((100, 250, 251)):
            clock.now = now
            for store in (ref, mine):
                store.set(
                    torch.tensor([5, 6][: 2 - (step == 2)]), torch.full((2 - (step == 2), DIM), float(step))
                )
        words = header_words(mine.get_rows(torch.tensor([5, 6])))
        want = header_words(ref.get_rows(torch.tensor([5, 6])))
        assert words[:, 0].tolist() == [5, 6], f"header keys are {words[:, 0].tolist()}, not the ids"
        stamp, count, used = unpack_metadata(words[:, 1])
        s, c, u = unpack_metadata(want[:, 1])
        assert stamp.tolist() == s.tolist(), f"timestamps {stamp.tolist()}, the reference {s.tolist()}"
        assert count.tolist() == c.tolist(), f"counts {count.tolist()}, the reference {c.tolist()}"
        assert used.tolist() == u.tolist(), "the used flag differs"

    def test_eviction_keeps_exactly_max_rows_least_used_first(self, make_store):
        ref, mine, clock = self._pair(make_store)
        for store in (ref, mine):
            for round_ in range(3):
                clock.now = 1000 + round_
                ids = torch.arange(0, 10 - 3 * round_)
                store.set(ids, torch.full((len(ids), DIM), 1.0))
        for policy in ({"max_rows": 6}, {"min_count": 2}, {"max_age_s": 0}, {"max_rows": 0}):
            a, b = ref.evict(**policy), mine.evict(**policy)
            assert a.tolist() == b.tolist(), (
                f"evict({policy}) evicted {b.tolist()}, the reference {a.tolist()}"
            )
            assert len(mine) == len(ref), f"after evict({policy}): {len(mine)} rows, the reference {len(ref)}"

    def test_deleted_ids_are_gone_and_their_room_is_reused(self, make_store):
        ref, mine, _ = self._pair(make_store)
        for store in (ref, mine):
            store.set(torch.arange(20), torch.ones(20, DIM))
            assert store.delete(torch.tensor([3, 3, 50, 7])) == 2
            store.set(torch.tensor([100, 101]), torch.full((2, DIM), 2.0))
        assert mine.contains(torch.tensor([3, 7, 100])).tolist() == [False, False, True]
        assert torch.equal(mine.keys(), ref.keys()), "keys after delete differ (or do not ascend)"
        assert same_bits(mine.get_rows(ref.keys()), ref.get_rows(ref.keys()))

    def test_changes_since_each_epoch_match_the_reference(self, make_store):
        """Change tracking (``spec/kv_store.md``) on a fixed sequence the random machine may
        never draw: removals in two epochs, an id deleted and written again, a block freed
        and taken by a new id; asked since every epoch. A delta checkpoint is exactly this."""
        ref, mine, _ = self._pair(make_store)
        if not all(callable(getattr(mine, name, None)) for name in ("changes", "next_epoch")):
            pytest.skip("the store does not track changes (changes, next_epoch): delta checkpoints need them")
        steps = [("set", [1, 2, 3, 4]), ("epoch",), ("delete", [1, 4]), ("set", [5]), ("epoch",)]
        steps += [("delete", [2, 5]), ("set", [1, 6]), ("epoch",), ("delete", [6]), ("set", [7])]
        for store in (ref, mine):
            for step in steps:
                if step[0] == "epoch":
                    store.next_epoch()
                elif step[0] == "delete":
                    store.delete(torch.tensor(step[1]))
                else:
                    store.set(torch.tensor(step[1]), torch.ones(len(step[1]), DIM))
        for since in range(5):
            want = [t.tolist() for t in ref.changes(since=since)]
            got = [t.tolist() for t in mine.changes(since=since)]
            assert got == want, (
                f"changes(since={since}): written {got[0]}, removed {got[1]}; "
                f"the reference: written {want[0]}, removed {want[1]}"
            )

    def test_checkpoint_bytes_match_the_reference_and_load_back(self, make_store):
        ref, mine, _ = self._pair(make_store)
        ids = torch.tensor([2**62, 5, 17, 4])
        for store in (ref, mine):
            store.set(ids, torch.arange(4 * DIM, dtype=torch.float32).reshape(4, DIM))
            store.set(ids[:2], torch.ones(2, STATE), width_offset=DIM + 3)
        with tempfile.TemporaryDirectory() as folder:
            for name, store in (("ref", ref), ("mine", mine)):
                save_checkpoint(Path(folder, name), {"t": store})
            theirs, ours = (Path(folder, n, "t.rows").read_bytes() for n in ("ref", "mine"))
            assert ours == theirs, "the whole-row checkpoint bytes differ from the reference's"
            fresh = make_store(DIM, optimizer_state_dim=STATE, dtype=torch.float32, seed=1, clock=Clock())
            load_checkpoint(Path(folder, "ref"), {"t": fresh})
            assert same_bits(fresh.get_rows(ref.keys()), ref.get_rows(ref.keys())), (
                "a loaded checkpoint's rows differ: set_rows must write each row by its header's key"
            )

    def test_out_buffers_are_filled_and_returned(self, make_store):
        ref, mine, _ = self._pair(make_store)
        ids = torch.tensor([3, 8, 2**62, -1])
        for store in (ref, mine):
            store.set(ids[:2], torch.arange(2 * DIM, dtype=torch.float32).reshape(2, DIM))
        out = torch.full((4, ref.layout.value_width), -9.0)
        got = mine.get(ids, out=out)
        assert got.data_ptr() == out.data_ptr(), "get(out=) must return out itself, not a new tensor"
        assert same_bits(out, ref.get(ids)), (
            f"get(out=) left out unfilled: {first_cell(ref.get(ids), out, ids)}"
        )
        rows = torch.full((4, ref.layout.width), -9.0)
        got = mine.get_rows(ids, out=rows)
        assert got.data_ptr() == rows.data_ptr(), "get_rows(out=) must return out itself, not a new tensor"
        difference = row_difference(rows, ref.get_rows(ids), ids, ref.layout)
        assert difference is None, f"get_rows(out=) left out unfilled: {difference}"

    @pytest.mark.parametrize("dim", [1, 64, 65, 129, 300])
    def test_initial_rows_of_any_width(self, make_store, dim):
        ids = torch.tensor([9, 2**40 + 3, *ID_EDGES])
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            options = dict(optimizer_state_dim=2, dtype=dtype, seed=11, clock=Clock())
            ref, mine = reference_store(dim, **options), make_store(dim, **options)
            difference = row_difference(mine.get(ids), ref.get(ids), ids, RowLayout(dim, 0, dtype))
            assert difference is None, f"initial rows of a {dtype} store of dim {dim}: {difference}".replace(
                "weight column", "column"
            )

    def test_set_rows_refuses_a_negative_key_and_changes_nothing(self, make_store):
        ref, mine, _ = self._pair(make_store)
        mine.set(torch.tensor([1, 2]), torch.ones(2, DIM))
        before = mine.get_rows(torch.tensor([1, 2, 5]))
        rows = ref.get_rows(torch.tensor([5, 6]))
        header_words(rows)[:, 0] = torch.tensor([5, -3])
        with pytest.raises(ValueError):
            mine.set_rows(rows)
        assert len(mine) == 2, "set_rows with a negative key must raise and insert nothing (not skip the row)"
        assert same_bits(mine.get_rows(torch.tensor([1, 2, 5])), before), "a refused set_rows changed rows"

    def test_counts_saturate_at_2_to_the_31_minus_1(self, make_store):
        ref, mine, _ = self._pair(make_store)
        for store in (ref, mine):
            rows = store.get_rows(torch.tensor([4, 7]))
            header_words(rows)[:, 0] = torch.tensor([4, 7])
            header_words(rows)[:, 1] = pack_metadata(
                torch.tensor([5, 5]), torch.tensor([COUNT_MAX - 1, COUNT_MAX]), torch.tensor([True, True])
            )
            store.set_rows(rows)
            for _ in range(3):
                store.set(torch.tensor([4, 7, 7]), torch.ones(3, DIM))
        ids = torch.tensor([4, 7])
        difference = row_difference(mine.get_rows(ids), ref.get_rows(ids), ids, ref.layout)
        assert difference is None, f"counts must stop at {COUNT_MAX}, not wrap: {difference}"

    def test_eviction_to_a_row_budget_drops_least_used_then_oldest(self, make_store):
        ref, mine, clock = self._pair(make_store)
        for store in (ref, mine):  # ties in count, broken by timestamp against the id order
            for now, batch in ((300, [1, 2]), (100, [8, 9]), (200, [5])):
                clock.now = now
                store.set(torch.tensor(batch), torch.ones(len(batch), DIM))
        clock.now = 400
        for budget in (4, 2, 0):
            a, b = ref.evict(max_rows=budget), mine.evict(max_rows=budget)
            assert a.tolist() == b.tolist(), (
                f"evict(max_rows={budget}) evicted ids {b.tolist()}, the reference {a.tolist()} "
                "(the least used first, ties broken by the oldest timestamp, then the smallest id)"
            )

    def test_l2_norm_eviction_reads_the_weights_not_the_state(self, make_store):
        ref, mine, _ = self._pair(make_store)
        for store in (ref, mine):
            store.set(torch.tensor([1, 2, 3]), torch.full((3, DIM), 0.001))
            store.set(torch.tensor([1, 2]), torch.full((2, STATE), 50.0), width_offset=ref.layout.padded_dim)
        a, b = ref.evict(min_l2_norm=0.5), mine.evict(min_l2_norm=0.5)
        assert a.tolist() == b.tolist(), (
            f"evict(min_l2_norm=0.5) evicted ids {b.tolist()}, the reference {a.tolist()} "
            "(the norm is of the weight columns only, not the optimizer state)"
        )

    def test_drop_in_details(self, make_store):
        ref, mine, _ = self._pair(make_store)
        assert mine.layout == ref.layout, f"layout {mine.layout}, expected {ref.layout}"
        assert len(mine) == 0 and mine.keys().tolist() == []
        with pytest.raises(TypeError):
            mine.set(torch.tensor([1]), torch.ones(1, DIM, dtype=torch.float64))
        with pytest.raises(ValueError):
            mine.set(torch.tensor([1, 2]), torch.ones(1, DIM))
        assert len(mine) == 0, "a rejected set changed the store"
        mine.set(torch.tensor([9, 1, 5]), torch.ones(3, DIM))
        assert mine.keys().tolist() == [1, 5, 9], "keys() must ascend"
        assert mine.keys_in_range(2, 9).tolist() == [5], "keys_in_range is half-open [lo, hi)"


class WrapperConformance:
    """Checks for an activation wrapper; a subclass provides the fixture ``wrap`` (module -> wrapped)."""

    def _model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 4))

    def test_outputs_and_gradients_match_the_module(self, wrap):
        plain = self._model()
        wrapped = wrap(self._model())
        x = torch.randn(6, 8, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        torch.manual_seed(3)
        want = plain(x)
        torch.manual_seed(3)
        got = wrapped(x2)
        assert torch.equal(got, want), "the wrapped forward differs (dropout must replay the same RNG)"
        want.square().sum().backward()
        got.square().sum().backward()
        assert torch.equal(x2.grad, x.grad), "input gradients differ"
        for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"gradient of {name} differs"

    def test_state_dict_keys_are_the_modules(self, wrap):
        plain = self._model()
        wrapped = wrap(self._model())
        assert list(wrapped.state_dict()) == list(plain.state_dict()), (
            "the wrapper leaks into state_dict keys"
        )
        wrapped.load_state_dict(plain.state_dict())


class ZeroConformance:
    """Checks for a ZeRO-like optimizer at world size 1; a subclass provides the fixture
    ``make_optimizer(params, optimizer_class, **defaults)``."""

    @pytest.fixture(autouse=True)
    def _one_rank_group(self, tmp_path):
        import torch.distributed as dist

        if dist.is_initialized():
            yield
            return
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()

    def test_steps_match_the_plain_optimizer(self, make_optimizer):
        for optimizer_class, defaults in (
            (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
            (torch.optim.Adam, {"lr": 0.01}),
        ):
            torch.manual_seed(0)
            a, b = nn.Linear(4, 3), nn.Linear(4, 3)
            b.load_state_dict(a.state_dict())
            plain = optimizer_class(a.parameters(), **defaults)
            mine = make_optimizer(b.parameters(), optimizer_class, **defaults)
            for step in range(3):
                x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
                for model, optimizer in ((a, plain), (b, mine)):
                    model(x).square().sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            for p, q in zip(a.parameters(), b.parameters(), strict=True):
                assert torch.equal(p, q), (
                    f"{optimizer_class.__name__}: parameters differ from the plain optimizer's"
                )

    def test_state_dict_round_trip_in_torch_format(self, make_optimizer):
        model = nn.Linear(4, 3)
        mine = make_optimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        model(torch.randn(2, 4)).sum().backward()
        mine.step()
        mine.consolidate_state_dict(to=0)
        state = mine.state_dict()
        assert set(state) >= {"state", "param_groups"}, f"state_dict keys {sorted(state)}: not torch's format"
        again = make_optimizer(model.parameters(), torch.optim.Adam, lr=0.5)
        again.load_state_dict(state)
        assert again.param_groups[0]["lr"] == 0.01, "load_state_dict did not restore the hyperparameters"
