"""ZeRO beside torch.distributed.optim.ZeroRedundancyOptimizer, interleaved in one run.

8 x Linear(1024, 1024), Adam, batch 32, 2 gloo ranks on 127.0.0.1, bucket views.
Targets: step time <= 1/1.05 x torch's; broadcasts per step = world size; consolidation of
~32 MiB of state per rank <= 0.1 s; state bytes per rank = total / world within one
parameter's state.
"""

from leanstate._tools.workloads import zero_comparison

from ._profile import SIZES, rounded


class ZeroVersusTorch:
    timeout = 900

    def setup_cache(self):
        return zero_comparison(world=2, steps=SIZES["steps"])

    def track_step_cost_vs_torch(self, result):
        """Median step time / torch's (target <= 1 / 1.05: 1.05x the throughput)."""
        return rounded(result["step"]["leanstate"] / result["step"]["torch"])

    track_step_cost_vs_torch.unit = "ratio"

    def track_broadcasts_per_step(self, result):
        """Collectives per step with bucket views (target: the world size, 2)."""
        return result["broadcasts"]

    track_broadcasts_per_step.unit = "collectives"

    def track_consolidate_seconds(self, result):
        """consolidate_state_dict of ~32 MiB per rank (target <= 0.1 s)."""
        return rounded(result["consolidate"]["leanstate"])

    track_consolidate_seconds.unit = "seconds"

    def track_torch_consolidate_seconds(self, result):
        """torch's consolidate_state_dict on the same state, for comparison."""
        return rounded(result["consolidate"]["torch"])

    track_torch_consolidate_seconds.unit = "seconds"

    def track_state_excess_bytes_on_rank0(self, result):
        """Rank 0's optimizer-state bytes minus total / world (target within one parameter)."""
        return abs(result["state_bytes"] - result["even_share"])

    track_state_excess_bytes_on_rank0.unit = "bytes"
