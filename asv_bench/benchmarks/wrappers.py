"""Activation wrappers beside torch's checkpoint_wrapper / offload_wrapper.

6 x TransformerEncoderLayer, d=512, T=256, batch 8, on the CPU. Targets: checkpoint
step time <= 1.05 x torch's with equal saved bytes; offload saves exactly the
no-wrapper bytes (torch's offload_wrapper copies parameters and host tensors too).
"""

from leanstate._tools.workloads import WrapperStep, best_time

from ._profile import PROFILE, REPEAT, ROUNDS, rounded

# full: 6 layers, d=512, T=256, batch 8; quick: d=256, T=128, batch 4; tiny: 2 layers, d=32, T=16, batch 2
SHAPE = {"full": {}, "quick": dict(d=256, seq=128, batch=4), "tiny": dict(layers=2, d=32, seq=16, batch=2)}[
    PROFILE
]


class WrapperStepTime:
    params = (list(WrapperStep.VARIANTS),)
    param_names = ["variant"]
    timeout = 900
    number = 1
    repeat = REPEAT
    rounds = ROUNDS

    def setup(self, variant):
        self.work = WrapperStep(variant, **SHAPE)

    def time_step(self, variant):
        self.work.step()

    def track_saved_bytes(self, variant):
        """Bytes a forward leaves allocated for backward (smaller is better)."""
        return self.work.saved_bytes()

    track_saved_bytes.unit = "bytes"


class WrapperRatios:
    timeout = 1800

    def setup_cache(self):
        steps = {v: WrapperStep(v, **SHAPE) for v in ("none", "checkpoint", "torch_checkpoint", "offload")}
        return {
            "checkpoint_time": best_time(steps["checkpoint"].step, 2)
            / best_time(steps["torch_checkpoint"].step, 2),
            "offload_saved": steps["offload"].saved_bytes() / steps["none"].saved_bytes(),
        }

    def track_checkpoint_step_cost_vs_torch(self, ratios):
        """leanstate checkpoint step time / torch's, same run (target <= 1.05)."""
        return rounded(ratios["checkpoint_time"])

    track_checkpoint_step_cost_vs_torch.unit = "ratio"

    def track_offload_saved_bytes_vs_no_wrapper(self, ratios):
        """leanstate offload saved bytes / no-wrapper saved bytes on the CPU (target 1)."""
        return rounded(ratios["offload_saved"])

    track_offload_saved_bytes_vs_no_wrapper.unit = "ratio"
