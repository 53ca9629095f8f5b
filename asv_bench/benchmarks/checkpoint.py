"""Whole-row checkpoints beside plain sequential file I/O, and whole-row vs legacy memory.

Targets at 1M rows x 128 fp32 on the numba backend (store and checkpoint I/O): save and
load >= 0.5 x plain throughput (cost ratio <= 2), whole-row load extra memory
<= 2 x chunk_bytes + 64 MiB, legacy load extra memory >= the table; the same table
through ``leanstate.dcp`` >= 0.7 x the whole-row format's save and load throughput.
Every benchmark sets up all it reads (asv runs each in a fresh process).
"""

from leanstate._tools.workloads import CheckpointIO, best_time, load_peak_extra_bytes

from ._profile import REPEAT, ROUNDS, SIZES, backends, rounded

CHUNK = 16 * 2**20


class CheckpointThroughput:
    params = (backends("kv_store"),)
    param_names = ["backend"]
    timeout = 600
    number = 1
    repeat = REPEAT
    rounds = ROUNDS

    def setup(self, backend):
        self.io = CheckpointIO(SIZES["rows"], SIZES["dim"], backend)
        self.io.dcp_save()  # what time_dcp_load and the DCP ratios read

    def teardown(self, backend):
        self.io.close()

    def time_save(self, backend):
        self.io.save()

    def time_load(self, backend):
        self.io.load()

    def time_peer_plain_write(self, backend):
        self.io.write_plain()

    def time_peer_plain_read(self, backend):
        self.io.read_plain()

    def track_save_cost_vs_plain_write(self, backend):
        """Save time / plain write time in the same run (target <= 2)."""
        return rounded(best_time(self.io.save, 3) / best_time(self.io.write_plain, 3))

    track_save_cost_vs_plain_write.unit = "ratio"

    def track_load_cost_vs_plain_read(self, backend):
        """Load time / the fastest plain read of the same bytes (readinto a buffer faulted before
        timing) in the same run."""
        return rounded(best_time(self.io.load, 3) / best_time(self.io.read_plain, 3))

    track_load_cost_vs_plain_read.unit = "ratio"

    def time_dcp_save(self, backend):
        self.io.dcp_save()

    def time_dcp_load(self, backend):
        self.io.dcp_load()

    def track_dcp_save_cost_vs_native(self, backend):
        """leanstate.dcp save time / whole-row save time in the same run (target <= 1 / 0.7)."""
        return rounded(best_time(self.io.dcp_save, 3) / best_time(self.io.save, 3))

    track_dcp_save_cost_vs_native.unit = "ratio"

    def track_dcp_load_cost_vs_native(self, backend):
        """leanstate.dcp load time / whole-row load time in the same run (target <= 1 / 0.7)."""
        return rounded(best_time(self.io.dcp_load, 3) / best_time(self.io.load, 3))

    track_dcp_load_cost_vs_native.unit = "ratio"


class CheckpointLoadMemory:
    params = (["numba"],)
    param_names = ["backend"]
    timeout = 600

    def setup_cache(self):
        return load_peak_extra_bytes(SIZES["rows"], SIZES["dim"], "numba", CHUNK)

    def track_whole_row_load_extra_bytes(self, memory, backend):
        """Peak RSS a whole-row load adds to a live store (target <= 2 x chunk + 64 MiB)."""
        return memory["whole"]

    track_whole_row_load_extra_bytes.unit = "bytes"

    def track_whole_row_over_legacy_load_extra_bytes(self, memory, backend):
        """Peak RSS the whole-row load adds / the legacy load's (which holds the table)."""
        return rounded(memory["whole"] / memory["legacy"])

    track_whole_row_over_legacy_load_extra_bytes.unit = "ratio"
