"""The torch store engine against the reference with thousands of ids: enough inserts and
deletes to fill its hash table with tombstones, trigger its rebuilds and reuse freed blocks
(the kit's state machine draws from ~40 ids, which a 1024-slot table rarely stresses)."""

from __future__ import annotations

import pytest
import torch

from leanstate import _backends
from leanstate.kv_store import KVStore
from leanstate.testing import same_bits
from tests.harness import FakeClock, run_probe

pytestmark = pytest.mark.skipif(
    "torch" not in _backends.available("kv_store"), reason="torch engine unavailable"
)


@pytest.mark.parametrize("seed", [0, 1])
def test_waves_of_inserts_and_deletes_match_the_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    clock = FakeClock(100)
    stores = {
        name: KVStore(6, optimizer_state_dim=1, backend=name, clock=clock, seed=3, num_shards=4)
        for name in ("reference", "torch")
    }
    live = torch.empty(0, dtype=torch.int64)
    for wave in range(6):
        clock.now += 7
        fresh = torch.randint(0, 2**40, (3000,), generator=generator)
        back = live[torch.randperm(len(live), generator=generator)[: len(live) // 3]]
        ids = torch.cat([fresh, back])
        values = torch.randn(len(ids), 6, generator=generator)
        for store in stores.values():
            store.set(ids, values)
        live = torch.unique(torch.cat([live, ids]))
        gone = live[torch.randperm(len(live), generator=generator)[: len(live) * 3 // 5]]
        counts = [store.delete(gone) for store in stores.values()]
        assert counts[0] == counts[1] == len(gone)
        live = live[~torch.isin(live, gone)]
        if wave % 2:
            evicted = [store.evict(max_rows=len(live) - 100) for store in stores.values()]
            assert torch.equal(*evicted)
            live = live[~torch.isin(live, evicted[0])]
        ref, fast = stores["reference"], stores["torch"]
        assert torch.equal(ref.keys(), fast.keys()) and torch.equal(ref.keys(), live)
        probe = torch.cat([live[:500], gone[:500], torch.tensor([-1, 2**41])])
        assert same_bits(ref.get_rows(probe), fast.get_rows(probe)), f"wave {wave}: rows differ"
        assert same_bits(ref.get(probe), fast.get(probe)), f"wave {wave}: values differ"


FRESH_LOAD = """
import json, sys, torch, leanstate
store = leanstate.KVStore(128, optimizer_state_dim=1, backend="torch")
store.set(torch.tensor([7]), torch.zeros(1, 128))  # first-use allocations, then empty again
store.delete(torch.tensor([7]))
base = reset_peak()
leanstate.load_checkpoint(sys.argv[1], {"t": store})
print(json.dumps({"extra": peak_since(base), "store": store.memory_bytes(), "rows": len(store)}))
"""


def test_a_fresh_load_into_a_torch_store_holds_the_table_and_about_a_slice(tmp_path):
    """Reserved once from the manifest, and the rows set_rows inserts are not given initial
    weights first (they were: a dozen [n, dim] int64 temporaries per slice, ~90 MiB)."""

    from leanstate import save_checkpoint

    source = KVStore(128, optimizer_state_dim=1, backend="torch")
    for start in range(0, 100_000, 25_000):
        source.set(torch.arange(start, start + 25_000), torch.randn(25_000, 128))
    path = save_checkpoint(tmp_path / "c", {"t": source})
    result = run_probe(FRESH_LOAD, path)
    assert result["rows"] == 100_000
    assert result["extra"] - result["store"] < 40 * 2**20, result  # beyond the store: slices, not the table


def test_runs_of_colliding_ids_longer_than_a_probe_window_are_found_and_placed():
    from leanstate.accelerated._torch_id_table import _WINDOW, splitmix64

    def home(keys, capacity):
        return splitmix64(keys) & (capacity - 1)

    clock = FakeClock(100)
    stores = {name: KVStore(4, backend=name, clock=clock) for name in ("reference", "torch")}
    table = stores["torch"].engine._table
    capacity = len(table.keys)
    candidates = torch.arange(200_000)
    homes = home(candidates, capacity)
    # 5 windows' worth of ids sharing one home, and as many sharing the next slots
    crowded = torch.cat([candidates[homes == h][: 5 * _WINDOW // 2] for h in (7, 8)])
    assert len(crowded) == 5 * _WINDOW
    for store in stores.values():
        store.set(crowded, crowded[:, None].float().expand(-1, 4))
        store.delete(crowded[1::3])  # tombstones inside the runs
        store.set(crowded[::3] + 10**9, torch.ones(len(crowded[::3]), 4))  # new ids, reusing slots
    reference, mine = stores["reference"], stores["torch"]
    probe = torch.cat([crowded, crowded + 10**9, torch.tensor([-1, 5])])
    assert torch.equal(mine.contains(probe), reference.contains(probe))
    assert same_bits(mine.get(probe), reference.get(probe))
    assert torch.equal(mine.keys(), reference.keys())
    # every live key sits in its home's run: no empty slot between its home and its slot
    keys = table.keys
    slots = table.probe(mine.keys())[0]
    assert bool((slots >= 0).all())
    for key, slot in zip(mine.keys().tolist(), slots.tolist(), strict=True):
        start = int(home(torch.tensor([key]), capacity))
        path = torch.arange(start, start + (slot - start) % capacity + 1) % capacity
        assert bool((keys[path] != -1).all())
