"""KVEmbeddingBag forward + backward + fused update beside nn.EmbeddingBag(sparse=True) + torch.optim.

Targets (numba, batch 4096 x 20 ids, dim 128, 1M rows): SGD >= 0.9x the peer's
throughput (cost ratio <= 1.11), rowwise Adagrad vs torch's Adagrad >= 4x (<= 0.25).
``ThreadsUnderLoad``: a 256 x 20 step and a 2-row ``set_rows`` beside a CPU-bound
process, against the same with ``NUMBA_NUM_THREADS=1`` (target cost <= 1.25).
"""

import statistics

from leanstate import _backends
from leanstate._tools.workloads import EmbeddingStep, best_times, threads_under_load

from ._profile import PROFILE, REPEAT, ROUNDS, SIZES, backends, rounded

PEERS = {"sgd": "sgd", "rowwise_adagrad": "adagrad"}
BATCH = 64 if PROFILE == "tiny" else 4096


class EmbeddingTrainingStep:
    params = (backends("embedding"), ["sgd", "rowwise_adagrad"])
    param_names = ["backend", "optimizer"]
    timeout = 900
    number = 1
    repeat = REPEAT
    rounds = ROUNDS

    def setup(self, backend, optimizer):
        rows, dim = SIZES["embedding_rows"], SIZES["dim"]
        self.ours = EmbeddingStep("kv", optimizer, rows, dim, batch=BATCH, backend=backend)
        self.peer = EmbeddingStep("dense", PEERS[optimizer], rows, dim, batch=BATCH)
        self.ours.step()
        self.peer.step()

    def time_step(self, backend, optimizer):
        self.ours.step()

    def time_peer_step(self, backend, optimizer):
        self.peer.step()

    def track_step_cost_vs_embedding_bag(self, backend, optimizer):
        """Step time / nn.EmbeddingBag(sparse) + torch optimizer step time, in the same run."""
        times = best_times({"ours": self.ours.step, "peer": self.peer.step}, 3)
        return rounded(times["ours"] / times["peer"])

    track_step_cost_vs_embedding_bag.unit = "ratio"


class ThreadsUnderLoad:
    params = ["step", "set_rows"]
    param_names = ["figure"]
    timeout = 900

    def setup_cache(self):
        rounds = 3 if PROFILE == "full" else 1
        return threads_under_load(rounds) if "numba" in _backends.available("embedding") else None

    def track_cost_vs_one_thread(self, result, figure):
        """Median time with numba's default threads / with NUMBA_NUM_THREADS=1, a CPU-bound
        process running beside both (target <= 1.25)."""
        if result is None:
            raise NotImplementedError("numba is not installed")
        return rounded(
            statistics.median(result[f"{figure} default"]) / statistics.median(result[f"{figure} one"])
        )

    track_cost_vs_one_thread.unit = "ratio"
