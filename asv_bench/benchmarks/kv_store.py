"""KV get/set/insert beside torch.index_select / index_copy_ on a dense table (a perfect hash).

Targets (numba, 1M rows x 128 fp32, batches of 65,536 ids): get >= 1.0x the throughput
of an allocating index_select, get into ``out=`` >= 0.8x of index_select into ``out=``,
set >= 0.6x, insert >= 0.6x and insert after ``reserve`` >= 0.8x of index_copy_,
memory per row <= 1.1x the row's bytes. The ``track_*_cost_*`` values are time ratios
(ours / peer, smaller is better): the throughput targets are their inverses. Each ratio
is the median of rounds in which leanstate's call and the peer's alternate in one
process, so a slower machine moves both sides alike.
"""

import statistics

from leanstate._tools.workloads import KVGetSet, samples

from ._profile import REPEAT, ROUNDS, SIZES, backends, rounded


class KVStoreGetSet:
    params = (backends("kv_store"),)
    param_names = ["backend"]
    timeout = 900
    number = 1
    repeat = REPEAT
    rounds = ROUNDS

    def setup(self, backend):
        self.work = KVGetSet(SIZES["rows"], SIZES["dim"], SIZES["batch"], backend)

    def time_get(self, backend):
        self.work.get()

    def time_set(self, backend):
        self.work.set()

    def time_insert(self, backend):
        self.work.insert()

    def time_peer_index_select(self, backend):
        self.work.dense_get()

    def time_peer_index_copy(self, backend):
        self.work.dense_set()

    def _cost(self, ours, peer):
        times = samples({"ours": ours, "peer": peer}, 5, inner=3)
        return rounded(statistics.median(o / p for o, p in zip(times["ours"], times["peer"], strict=True)))

    def track_get_out_cost_vs_index_select_out(self, backend):
        """Time of get(out=buf) / time of index_select(out=buf), measured in the same run."""
        return self._cost(self.work.get_out, self.work.dense_get_out)

    track_get_out_cost_vs_index_select_out.unit = "ratio"

    def track_reserved_insert_cost_vs_index_copy(self, backend):
        """Time of set (new ids, reserved untimed first) / time of index_copy_."""
        return self._cost((self.work.reserve_next, self.work.insert), self.work.dense_set)

    track_reserved_insert_cost_vs_index_copy.unit = "ratio"

    def track_get_cost_vs_index_select(self, backend):
        """Time of get / time of index_select, measured in the same run."""
        return self._cost(self.work.get, self.work.dense_get)

    track_get_cost_vs_index_select.unit = "ratio"

    def track_set_cost_vs_index_copy(self, backend):
        """Time of set (present ids) / time of index_copy_, measured in the same run."""
        return self._cost(self.work.set, self.work.dense_set)

    track_set_cost_vs_index_copy.unit = "ratio"

    def track_insert_cost_vs_index_copy(self, backend):
        """Time of set (new ids) / time of index_copy_, measured in the same run."""
        return self._cost(self.work.insert, self.work.dense_set)

    track_insert_cost_vs_index_copy.unit = "ratio"

    def track_memory_per_row_vs_row_bytes(self, backend):
        """memory_bytes() per row / the row's own bytes."""
        store = self.work.store
        return rounded(store.memory_bytes() / len(store) / store.layout.row_bytes)

    track_memory_per_row_vs_row_bytes.unit = "ratio"
