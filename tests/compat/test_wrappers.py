"""``leanstate.offload_wrapper`` and ``checkpoint_wrapper`` as the bench measures them: the
saved-bytes claims of the wrapper benchmark, as exact results on a small stack, and the
offload wrapper taking the chosen backend's copier."""

import pytest
import torch

import leanstate
from leanstate._tools.workloads import WrapperStep
from leanstate.reference.wrappers import Copier, OffloadWrapper


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


def test_offload_wrapper_takes_its_keywords_and_the_chosen_copier():
    wrapped = leanstate.offload_wrapper(torch.nn.Linear(4, 4), min_offload_bytes=0, pinned_budget_bytes=1024)
    assert isinstance(wrapped, OffloadWrapper) and isinstance(wrapped.copier, Copier)
    assert wrapped.min_offload_bytes == 0 and wrapped.pool.budget_bytes == 1024
    with pytest.raises(ValueError, match="min_offload_bytes must be >= 0"):
        leanstate.offload_wrapper(torch.nn.Linear(4, 4), min_offload_bytes=-1)
