"""KV get/set beside torch.index_select / index_copy_ on a dense table (a perfect hash)."""

from leanstate._bench import KVGetSet, best_time

ROWS, DIM, BATCH = 200_000, 128, 16_384


class KVStoreGetSet:
    params = (["reference", "numba"],)
    param_names = ["backend"]
    timeout = 300

    def setup(self, backend):
        self.work = KVGetSet(ROWS, DIM, BATCH, backend)

    def time_get(self, backend):
        self.work.get()

    def time_set(self, backend):
        self.work.set()

    def time_peer_index_select(self, backend):
        self.work.dense_get()

    def time_peer_index_copy(self, backend):
        self.work.dense_set()

    def track_get_cost_vs_index_select(self, backend):
        """Time of get / time of index_select, measured in the same run (smaller is better)."""
        return best_time(self.work.get) / best_time(self.work.dense_get)

    track_get_cost_vs_index_select.unit = "ratio"

    def track_set_cost_vs_index_copy(self, backend):
        """Time of set / time of index_copy_, measured in the same run (smaller is better)."""
        return best_time(self.work.set) / best_time(self.work.dense_set)

    track_set_cost_vs_index_copy.unit = "ratio"
