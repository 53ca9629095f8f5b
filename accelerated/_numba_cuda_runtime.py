"""The numba-cuda runtime that the numba-cuda engines share: whether kernels run in numba's
CUDA simulator, whether they can run here at all (``unavailable``), the one helper that
launches every kernel (``launch``: the tensors' device, torch's current stream there), and
the float32 arithmetic that is never contracted into a fused multiply-add (libdevice's
correctly rounded operations on a GPU), which the store's and the embedding's kernels use."""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import config, cuda

SIMULATED = bool(config.ENABLE_CUDASIM)
THREADS = 16 if SIMULATED else 256  # the simulator starts one Python thread per thread of a block
WARP = 4 if SIMULATED else 32  # lanes per item of a warp-per-item kernel (fewer Python threads simulated)
INSTALL_HINT = "pip install 'leanstate[cuda]' (numba-cuda with its CUDA toolkit: NVVM and libdevice)"


@cuda.jit(cache=True)
def _k_probe(out):
    out[0] = 1


@functools.cache
def unavailable() -> str | None:
    """Why this engine cannot run here, or None: a device, and a one-line kernel that
    compiles and runs on it (NVVM and libdevice come with the toolkit, not the driver)."""
    if not cuda.is_available():
        return "numba.cuda reports no usable CUDA device (NUMBA_ENABLE_CUDASIM=1 runs it in the simulator)"
    try:
        probe = torch.zeros(1, dtype=torch.int64, device="cpu" if SIMULATED else "cuda")
        launch(_k_probe, 1, probe)
        if int(probe[0]) != 1:
            return "numba-cuda ran a probe kernel that wrote nothing"
    except Exception as error:  # noqa: BLE001 - any failure to compile or run is the reason
        name = type(error).__name__
        if "Nvvm" in name or "NVVM" in str(error) or "libdevice" in str(error):
            return f"numba-cuda cannot compile kernels: NVVM or libdevice is missing ({name}); {INSTALL_HINT}"
        return f"numba-cuda cannot run a kernel here: {name}: {error}"
    return None


if SIMULATED:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray


def device_array(t: torch.Tensor):
    """A tensor as a kernel argument without a copy: its CUDA array interface, or (in the
    simulator, on the CPU) its memory wrapped as a simulated device array. A plain numpy
    argument would be copied in and back out, and two views of one pool (rows and
    headers) would then overwrite each other's writes.

    A tensor that requires grad is refused, in the simulator too, as torch's
    ``__cuda_array_interface__`` refuses it: ``launch`` passes detached tensors."""
    if t.requires_grad:
        raise RuntimeError(
            "a kernel argument requires grad; torch exports no such tensor to a kernel (detach() it)"
        )
    return cuda.as_cuda_array(t) if t.is_cuda else FakeCUDAArray(t.numpy())


def launch(kernel, n: int, *args, lanes: int = 1) -> None:
    """Run ``kernel`` over ``n`` items of ``lanes`` threads each (nothing when ``n`` is 0).

    Every numba-cuda kernel starts here. Tensors are passed detached, through
    ``device_array``; on a GPU the kernel runs in the context of the tensors' device and
    on torch's current stream there, so it is ordered with the torch ops around it (and
    with the caching allocator's reuse of their memory) inside ``torch.cuda.stream(s)``
    too. The simulator has one device and no streams."""
    if not n:
        return
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    args = tuple(device_array(a.detach()) if isinstance(a, torch.Tensor) else a for a in args)
    per_block = max(THREADS, lanes)
    blocks = (n * lanes + per_block - 1) // per_block
    device = tensors[0].device if tensors else torch.device("cpu")
    if device.type != "cuda":
        kernel[blocks, per_block](*args)
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cuda.gpus[index]:  # pragma: no cover - needs a GPU
        stream = cuda.external_stream(torch.cuda.current_stream(index).cuda_stream)
        kernel[blocks, per_block, stream](*args)


# -- arithmetic that is never contracted (the store and embedding kernels) ---------------

if SIMULATED:

    @cuda.jit(device=True)
    def mul(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    @cuda.jit(device=True)
    def add(a, b):
        return np.float32(np.float32(a) + np.float32(b))

    @cuda.jit(device=True)
    def div(a, b):
        return np.float32(np.float32(a) / np.float32(b))

    @cuda.jit(device=True)
    def sqrt(a):
        return np.float32(np.sqrt(np.float64(a)))

    @cuda.jit(device=True)
    def float_bits(a):
        return np.int64(np.float32(a).view(np.int32))

    @cuda.jit(device=True)
    def half_bits(a):
        return np.int64(np.float32(a).astype(np.float16).view(np.uint16))

else:  # pragma: no cover - needs a GPU
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def mul(a, b):
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True)
    def add(a, b):
        return libdevice.fadd_rn(a, b)

    @cuda.jit(device=True)
    def div(a, b):
        return libdevice.fdiv_rn(a, b)

    @cuda.jit(device=True)
    def sqrt(a):
        return libdevice.fsqrt_rn(a)

    @cuda.jit(device=True)
    def float_bits(a):
        return np.int64(libdevice.float_as_int(a))

    @cuda.jit(device=True)
    def half_bits(a):
        return np.int64(libdevice.float2half_rn(a))
