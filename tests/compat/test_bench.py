"""The checkpoint rows of the bench table, each beside its peer with its target, in a tiny
run (the wrapper benchmark's saved-bytes claims are tested beside the wrappers, in
``test_wrappers.py``)."""

import numpy as np
import pytest
import torch

import leanstate
from leanstate import _backends
from leanstate._tools import bench
from leanstate._tools.bench import CEILING
from leanstate._tools.load_workloads import TablesLoad, sharded_load_comparison

# -- the checkpoint rows: each beside its peer from the same rounds, with its stated target

ROWS = 2000
V2_ROWS = 200  # 200 buckets of one id: a version-2 file has a chunk per bucket


def _rows_of(lines: list[tuple]) -> dict[tuple[str, str], dict]:
    return {(row["measure"], row["peer"]): row for row in (dict(zip(bench.FIELDS, line)) for line in lines)}


def _ratio_of_its_sides(row: dict) -> None:
    # one round: the median ratio is that round's, peer time / leanstate time
    assert row["ratios"] == [row["ratio"]]
    assert row["ratio"] == row["peer value"] / row["leanstate"]


@pytest.fixture(scope="module")
def checkpoint_rows():
    if "numba" not in _backends.available("kv_store"):
        pytest.skip("the numba store is not available here")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the two-table row's target holds where there are threads to use
    try:
        return _rows_of(bench.checkpoint_figures(ROWS, 8, ["numba"], rounds=1))
    finally:
        torch.set_num_threads(threads)


def test_dcp_save_and_load_beside_the_whole_row_ones_with_their_own_targets(checkpoint_rows):
    for op, target in (("save", ">= 0.85"), ("load", ">= 0.8")):
        row = checkpoint_rows[(f"dcp {op} {ROWS} rows s", f"whole-row {op}")]
        assert row["target"] == target, op
        _ratio_of_its_sides(row)
        # the peer is the whole-row figure of the same rounds, not a second measurement
        peer = "plain write+fsync" if op == "save" else CEILING
        assert row["peer value"] == checkpoint_rows[(f"{op} {ROWS} rows s", peer)]["leanstate"]


def test_the_load_at_dim_16_is_beside_a_plain_read_of_its_bytes(checkpoint_rows):
    narrow = checkpoint_rows[(f"load {ROWS} rows s, dim 16", CEILING)]
    assert narrow["target"] == ">= 0.6"
    _ratio_of_its_sides(narrow)
    wide = checkpoint_rows[(f"load {ROWS} rows s", CEILING)]  # the table's dim, beside it
    assert wide["target"] == ">= 0.8"
    assert list(checkpoint_rows).index((f"load {ROWS} rows s, dim 16", CEILING)) == (
        list(checkpoint_rows).index((f"load {ROWS} rows s", CEILING)) + 1
    )


def test_two_tables_on_torchs_threads_beside_one_thread(checkpoint_rows):
    row = checkpoint_rows[(f"load 2 tables x {ROWS // 2} rows s, 2 threads", "torch.set_num_threads(1)")]
    assert row["target"] == ">= 1.5"
    _ratio_of_its_sides(row)


def test_the_two_table_load_fills_every_table_and_restores_the_thread_count():
    tables = TablesLoad(2, 300, 8, None)
    try:
        threads = torch.get_num_threads()
        for loaded in (tables.load(), tables.load_one_thread()):
            assert sorted(loaded) == ["t0", "t1"]
            assert [len(store) for store in loaded.values()] == [300, 300]
            assert torch.get_num_threads() == threads
    finally:
        tables.close()


def test_each_ranks_v2_load_is_beside_a_v1_load_of_the_same_rows():
    ranks = sharded_load_comparison(V2_ROWS, 8, None, rounds=1)
    assert len(ranks) == 2
    # each rank holds its share (the worker checks that both loads left exactly it)
    assert sum(r["rows"] for r in ranks) == V2_ROWS and all(0 < r["rows"] < V2_ROWS for r in ranks)
    rows = _rows_of(bench._sharded_load_lines(ranks, V2_ROWS, "numba"))
    for rank, r in enumerate(ranks):
        row = rows[
            (f"v2 load s, rank {rank} of 2 ({r['rows']} of {V2_ROWS} rows)", "v1 load of its rows, 1 process")
        ]
        assert row["target"] == ">= 0.8"
        assert row["leanstate"] == r["times"]["v2"][0] and row["peer value"] == r["times"]["v1"][0]
        _ratio_of_its_sides(row)


def test_the_tracking_row_is_the_step_with_tracking_on_beside_the_same_step_off():
    backend = "numba" if "numba" in _backends.available("embedding") else "reference"
    row = dict(zip(bench.FIELDS, bench.tracking_figure(300, 8, backend, rounds=1)))
    assert (row["component"], row["backend"], row["peer"]) == ("embedding", backend, "tracking off")
    assert row["target"] == ">= 0.95"
    _ratio_of_its_sides(row)  # throughput on / off: the step's time off / on


def test_the_delta_rows_put_each_figure_beside_its_peer():
    from leanstate._tools.delta_workloads import delta_figures

    rows = _rows_of(delta_figures(2000, 8, "reference", 1, bench._line))
    share = "1% of 2000 rows"
    expected = {
        (f"delta save s, {share} touched", "full save"): ">= 20",
        (f"delta bytes, {share} touched", "changed rows + removed ids"): ">= 0.952",
        (f"load full + 10 deltas of {share} s", "full load of the same rows"): ">= 0.769",
        (f"compact full + 10 deltas of {share} s", "full save of the result"): ">= 0.8",
    }
    assert {key: row["target"] for key, row in rows.items()} == expected
    for row in rows.values():
        _ratio_of_its_sides(row)
    # a delta holds the changed rows and the removed ids, and its manifest: a little more
    size = rows[(f"delta bytes, {share} touched", "changed rows + removed ids")]
    assert size["peer value"] < size["leanstate"] < size["peer value"] + 4096


def test_a_chain_of_the_delta_workload_loads_and_compacts_to_its_final_rows():
    from leanstate._tools.delta_workloads import DeltaChain

    chain = DeltaChain(
        3000, 8, "numba" if "numba" in _backends.available("kv_store") else "reference", links=3
    )
    try:
        loaded = chain.fresh_store()
        leanstate.load_checkpoint(chain.chain, {"t": loaded})
        keys = chain.loaded.keys()
        assert torch.equal(loaded.keys(), keys) and torch.equal(
            loaded.get_rows(keys), chain.loaded.get_rows(keys)
        )
        chain.compact()
        chain.save_final()
        for name in ("manifest.json", "t.rows"):
            assert (chain.folder / "compacted" / name).read_bytes() == (
                chain.folder / "final-again" / name
            ).read_bytes()
    finally:
        chain.close()


def test_the_loads_ceiling_is_the_fastest_plain_read_with_the_others_labelled(checkpoint_rows):
    """The load's peer is the faster of a readinto into a faulted buffer and an mmap copy,
    round by round; np.fromfile (fresh pages) and a memcpy of the bytes are shown beside it
    without a target, so neither passes for the ceiling."""
    ceiling = checkpoint_rows[(f"load {ROWS} rows s", CEILING)]
    fresh = checkpoint_rows[(f"load {ROWS} rows s", "np.fromfile (fresh pages: not the ceiling)")]
    memcpy = checkpoint_rows[(f"load {ROWS} rows s", "memcpy of as many bytes (the memory limit)")]
    assert ceiling["target"] == ">= 0.8" and fresh["target"] == memcpy["target"] == "-"
    assert ceiling["leanstate"] == fresh["leanstate"] == memcpy["leanstate"]  # one load, three peers


def test_the_plain_reads_read_exactly_the_files_bytes(tmp_path):
    from leanstate._tools.workloads import faulted, mmap_copy, read_into

    data = np.arange(3 * 2**20 + 5, dtype=np.uint64).astype(np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    for read in (read_into, mmap_copy):
        buffer = faulted(len(data))
        read(tmp_path / "f", buffer)
        assert np.array_equal(buffer, data), read
    with pytest.raises(EOFError):
        read_into(tmp_path / "f", faulted(len(data) + 1))


def test_the_follower_rows_measure_applies_readers_and_memory_beside_their_peers():
    from leanstate._tools.bench import _line
    from leanstate._tools.follower_workloads import PAUSE_BUDGET_S, follower_figures

    backend = "numba" if "numba" in _backends.available("kv_store") else "reference"
    lines = follower_figures(20_000, 8, backend, 5, _line)
    rows = {line[1]: line for line in lines}
    assert len(rows) == 4 and all(line[0] == "follower" for line in lines)
    apply = rows["apply a delta of 1% of 20000 rows s"]
    assert len(apply[7]) == 3  # deltas 2..4 timed: the first warms up, the last (5) is traced
    assert apply[4] == "full load of the table" and apply[5] > 0
    pause = rows["longest reader get during applies s"]
    assert pause[5] == PAUSE_BUDGET_S and pause[3] >= rows["reader p99 of a 4096-id get during applies s"][3]
    memory = rows["extra memory of applying a delta of 1% of 20000 rows bytes"]
    assert memory[5] > 200 * 8 * 4  # the delta's files hold its 200 rows
    assert memory[3] >= 200 * 4 * (4 + 8 + 4)  # the staged rows are held, at least
