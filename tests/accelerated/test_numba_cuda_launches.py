"""The numba-cuda engines' boundary with the device, in numba's CUDA simulator: every kernel
starts through the one launch helper, no kernel argument requires grad, an engine that
cannot compile says why, and the hot paths wait for the device no more than
``spec/backends.md`` budgets (counted by ``host_read``)."""

from __future__ import annotations

import sys

import pytest
import torch

import leanstate
from leanstate import _backends
from leanstate._host_reads import host_reads
from leanstate.accelerated import _numba_cuda_kv_kernels as kernels
from leanstate.accelerated import _numba_cuda_runtime as runtime
from leanstate.accelerated import numba_cuda_embedding
from tests.harness import FakeClock

pytestmark = pytest.mark.cudasim


@pytest.fixture(autouse=True)
def _simulated():
    if "numba-cuda" not in _backends.available("kv_store"):
        pytest.fail("numba-cuda is unavailable: run with NUMBA_ENABLE_CUDASIM=1 (make test does)")


def every_kernel() -> dict[str, object]:
    """Every ``@cuda.jit`` kernel the two engines define, by name."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    found = {}
    for module in (runtime, kernels, numba_cuda_embedding):
        for name, value in vars(module).items():
            if isinstance(value, FakeCUDAKernel) and not value._device:
                found[name] = value
    return found


def a_workload_that_runs_every_kernel() -> None:
    clock = FakeClock(100)
    for dtype in (torch.float32, torch.bfloat16):
        store = leanstate.KVStore(5, optimizer_state_dim=2, dtype=dtype, clock=clock, backend="numba-cuda")
        store.set(torch.arange(40), torch.ones(40, 7, dtype=dtype))  # grows and rebuilds the table
        store.set_rows(store.get_rows(torch.tensor([3, 4])))
        store.get(torch.tensor([1, 99, -1]))
        store.metadata(torch.tensor([1, 99]))
        store.contains(torch.tensor([1]))
        store.keys()
        store.delete(torch.tensor([1, 2]))
        clock.now += 10
        store.evict(max_age_s=5, min_l2_norm=0.5, max_rows=3)
        store.engine.initial_rows(torch.tensor([7]))
        for optimizer in ("sgd", "rowwise_adagrad", "adam"):
            for offloading in (True, False):
                bag = leanstate.KVEmbeddingBag(
                    None, 6, optimizer=optimizer, dtype=dtype, optimizer_offloading=offloading,
                    return_whole_row=offloading, backend="numba-cuda", clock=clock,
                )  # fmt: skip
                bag(torch.tensor([1, 2, 2, -1]), torch.tensor([0, 2])).sum().backward()
        inverse, offsets = torch.tensor([0, 1, 1]), torch.tensor([0, 1, 3])
        bag.engine.pool_rows(torch.ones(2, 6), inverse, offsets, None, False)
        bag.engine.row_gradients(2, inverse, offsets, None, False, torch.ones(2, 6))


def test_no_kernel_is_launched_outside_the_helper(monkeypatch):
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    launched, outside = set(), []
    original = FakeCUDAKernel.__getitem__

    def recording(kernel, configuration):
        caller = sys._getframe(1).f_code
        launched.add(kernel.fn.__name__)
        if caller is not runtime.launch.__code__:
            outside.append(f"{kernel.fn.__name__} from {caller.co_filename}:{caller.co_name}")
        return original(kernel, configuration)

    monkeypatch.setattr(FakeCUDAKernel, "__getitem__", recording)
    a_workload_that_runs_every_kernel()
    runtime.launch(runtime._k_probe, 1, torch.zeros(1, dtype=torch.int64))
    assert outside == []
    # the workload reached every kernel, so the check above covers them all
    assert set(every_kernel()) - launched == set()


def test_a_kernel_argument_that_requires_grad_is_refused_as_torchs_interface_refuses_it():
    trainable = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        runtime.device_array(trainable)
    out = torch.zeros(1, dtype=torch.int64)
    runtime.launch(runtime._k_probe, 1, out)  # launch detaches: the helper never meets the refusal
    assert int(out[0]) == 1


def test_trainable_per_sample_weights_train_on_numba_cuda_as_on_the_reference():
    ids, offsets = torch.tensor([3, 5, 5, 9, -1, 3]), torch.tensor([0, 3])
    rows, grads = [], []
    for backend in ("numba-cuda", "reference"):
        bag = leanstate.KVEmbeddingBag(None, 4, optimizer="adam", lr=0.1, backend=backend, clock=FakeClock(1))
        weights = torch.linspace(0.5, 2.0, len(ids)).requires_grad_()
        for _ in range(3):
            bag(ids, offsets, per_sample_weights=weights).pow(2).sum().backward()
        grads.append(weights.grad)
        rows.append(bag.store.get_rows(torch.tensor([3, 5, 9])))
    assert torch.equal(rows[0].view(torch.int32), rows[1].view(torch.int32))
    assert torch.equal(grads[0], grads[1])


def test_a_missing_toolkit_is_named_as_the_reason(monkeypatch):
    class NvvmSupportError(Exception):
        pass

    def no_nvvm(*args, **kwargs):
        raise NvvmSupportError("libNVVM cannot be found")

    runtime.unavailable.cache_clear()
    with monkeypatch.context() as patched:
        patched.setattr(runtime, "launch", no_nvvm)
        reason = runtime.unavailable()
    runtime.unavailable.cache_clear()
    assert "NVVM or libdevice is missing" in reason and "leanstate[cuda]" in reason
    assert runtime.unavailable() is None  # the real probe compiles and runs in the simulator


def waits(call) -> int:
    before = host_reads()
    call()
    return host_reads() - before


def test_a_get_waits_for_nothing_and_a_set_twice_however_many_ids_are_new():
    store = leanstate.KVStore(6, optimizer_state_dim=1, backend="numba-cuda", clock=FakeClock(5))
    store.set(torch.arange(0, 100, 3), torch.ones(34, 7))
    probe = torch.tensor([0, 3, 4, -1, 2**63 - 1, 99])  # present, missing, padding
    assert waits(lambda: store.get(probe)) == 0
    assert waits(lambda: store.get(probe, width_offset=2, width=3, out=torch.empty(6, 3))) == 0
    assert waits(lambda: store.get_rows(probe)) == 0
    assert waits(lambda: store.metadata(probe)) == 0
    # 300 new ids: the table is rebuilt twice over and probes run long; still two waits
    batch = torch.cat([torch.arange(1000, 1300), torch.tensor([3, -1, 2**63 - 1, 1000])])
    assert waits(lambda: store.set(batch, torch.ones(len(batch), 7))) == 2
    assert waits(lambda: store.set(torch.tensor([3, 6]), torch.ones(2, 7))) == 2  # none new
    assert waits(lambda: store.set_rows(store.get_rows(torch.tensor([3, 5000])))) == 3  # + the key check
    assert len(store) == 34 + 300 + 1  # the missing id's zero row is keyed 0, present already
    assert torch.equal(store.get(torch.tensor([2**63 - 1]))[0, :6], torch.ones(6))


@pytest.mark.parametrize("offloading, budget", [(True, 3), (False, 4)])
def test_a_training_step_with_new_ids_waits_at_most_four_times(offloading, budget):
    bag = leanstate.KVEmbeddingBag(
        1000, 8, optimizer="rowwise_adagrad", optimizer_offloading=offloading, return_whole_row=offloading,
        backend="numba-cuda", clock=FakeClock(3),
    )  # fmt: skip
    for step in range(3):  # new ids every step, padding in every batch
        ids = torch.tensor([step * 10 + 1, step * 10 + 2, -1, step * 10 + 1, 500])
        assert waits(lambda ids=ids: bag(ids, torch.tensor([0, 2, 4])).sum().backward()) == budget
    assert len(bag.store) == 7
