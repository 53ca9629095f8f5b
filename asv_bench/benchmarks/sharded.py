"""Sharded KV embeddings at 1, 2 and 3 gloo ranks on 127.0.0.1 (one table, D=64, rowwise
Adagrad, 16,384 lookups per rank per step).

Tracked as costs (smaller is better): seconds per million lookups+updates at each world
size; CPU seconds per lookup+update summed over all ranks over one rank's (target at 2
ranks <= 1.5: contention on a small machine can neither hide nor fake scaling); the
bytes exchanged per step over the minimum (distinct ids x (weight row + float32
gradient row)), target <= 1.1.
"""

from leanstate._tools.workloads import sharded_comparison

from ._profile import PROFILE, SIZES, rounded


class ShardedEmbedding:
    timeout = 900
    params = [1, 2, 3] if PROFILE == "full" else [1, 2]
    param_names = ["world"]

    def setup_cache(self):
        return {
            world: sharded_comparison(world, steps=SIZES["steps"], ids=SIZES["ids"]) for world in self.params
        }

    def track_seconds_per_million_lookups(self, results, world):
        """Step time per million lookups+updates over all ranks."""
        return rounded(results[world]["step"] / (world * SIZES["ids"]) * 1e6)

    track_seconds_per_million_lookups.unit = "seconds"

    def track_bytes_over_minimum(self, results, world):
        """Bytes every rank sent, over the minimum (target <= 1.1)."""
        return rounded(results[world]["bytes"] / results[world]["min_bytes"])

    track_bytes_over_minimum.unit = "ratio"

    def track_cpu_per_lookup_vs_one_rank(self, results, world):
        """CPU seconds per lookup+update over all ranks / one rank's (target at 2 ranks <= 1.5)."""
        return rounded(results[world]["cpu_per_id"] / results[1]["cpu_per_id"])

    track_cpu_per_lookup_vs_one_rank.unit = "ratio"
