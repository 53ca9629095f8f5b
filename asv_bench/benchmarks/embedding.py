"""KVEmbeddingBag forward + backward + fused update beside nn.EmbeddingBag(sparse=True) + torch.optim.

Targets (numba, batch 4096 x 20 ids, dim 128, 1M rows): SGD >= 0.6x the peer's
throughput (cost ratio <= 1.67), rowwise Adagrad vs torch's Adagrad >= 1.0x (<= 1.0).
"""

from leanstate import _backends
from leanstate._bench import EmbeddingStep, best_times

ROWS = 1_000_000
PEERS = {"sgd": "sgd", "rowwise_adagrad": "adagrad"}


class EmbeddingTrainingStep:
    params = (sorted(_backends.available("embedding")), ["sgd", "rowwise_adagrad"])
    param_names = ["backend", "optimizer"]
    timeout = 900

    def setup(self, backend, optimizer):
        self.ours = EmbeddingStep("kv", optimizer, ROWS, backend=backend)
        self.peer = EmbeddingStep("dense", PEERS[optimizer], ROWS)
        self.ours.step()
        self.peer.step()

    def time_step(self, backend, optimizer):
        self.ours.step()

    def time_peer_step(self, backend, optimizer):
        self.peer.step()

    def track_step_cost_vs_embedding_bag(self, backend, optimizer):
        """Step time / nn.EmbeddingBag(sparse) + torch optimizer step time, in the same run."""
        times = best_times({"ours": self.ours.step, "peer": self.peer.step}, 3)
        return times["ours"] / times["peer"]

    track_step_cost_vs_embedding_bag.unit = "ratio"
