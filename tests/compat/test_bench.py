"""The saved-bytes claims of the wrapper benchmark, as exact results on a small stack."""

import pytest
import torch

from leanstate._tools.workloads import WrapperStep


@pytest.fixture(scope="module")
def saved():
    return {v: WrapperStep(v, layers=2, d=32, seq=16, batch=2).saved_bytes() for v in WrapperStep.VARIANTS}


def test_offload_on_the_host_saves_exactly_the_no_wrapper_bytes(saved):
    assert saved["offload"] == saved["none"]
    assert saved["torch_offload"] > saved["none"]  # torch's copies parameters and host tensors


def test_checkpoint_saves_what_torch_saves_and_far_less_than_no_wrapper(saved):
    assert saved["checkpoint"] == saved["torch_checkpoint"]
    activation = 2 * 16 * 32 * 4
    rng_state = torch.get_rng_state().numel()  # each region keeps the RNG state to replay dropout
    # the second layer's input and the output (the stack's input was allocated before)
    assert saved["checkpoint"] == 2 * activation + 2 * rng_state
    assert saved["checkpoint"] < saved["none"] / 4
