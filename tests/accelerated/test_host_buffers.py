import gc

import torch

from leanstate.accelerated import _host_buffers

BIG = (1024, 1024)  # 4 MiB of float32: above the recycling threshold


def test_a_dropped_result_is_recycled():
    first = _host_buffers.empty(BIG, torch.float32)
    address = first.data_ptr()
    del first
    gc.collect()
    again = _host_buffers.empty(BIG, torch.float32)
    assert again.data_ptr() == address


def test_a_held_tensor_view_or_array_is_never_reused():
    for keep in (lambda t: t, lambda t: t[3:], lambda t: t.numpy(), lambda t: t.view(torch.int32)):
        first = _host_buffers.empty(BIG, torch.float32)
        first.fill_(7.0)
        address, held = first.data_ptr(), keep(first)
        del first
        gc.collect()
        other = _host_buffers.empty(BIG, torch.float32)
        assert other.data_ptr() != address
        other.fill_(0.0)
        assert bool((torch.as_tensor(held).view(torch.float32) == 7.0).all())
        del held, other
        gc.collect()


def test_shapes_dtypes_and_small_requests():
    for shape, dtype in (((3, 5), torch.float32), ((700, 1000), torch.bfloat16), ((513, 999), torch.int64)):
        t = _host_buffers.empty(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        t.fill_(1)
        assert bool((t == 1).all())
    # size classes: at most a quarter of a power of two of slack, never less than asked
    for n in (2**20, 2**20 + 1, 3 * 2**20 - 5, 2**25):
        size = _host_buffers._size_class(n)
        assert n <= size <= n * 1.25


def test_idle_buffers_are_bounded(monkeypatch):
    monkeypatch.setattr(_host_buffers, "KEEP_BYTES", 8 << 20)
    monkeypatch.setattr(_host_buffers, "_idle", {})
    monkeypatch.setattr(_host_buffers, "_idle_bytes", 0)
    held = [_host_buffers.empty(BIG, torch.float32) for _ in range(5)]  # 5 x 4 MiB
    del held
    gc.collect()
    assert _host_buffers._idle_bytes <= 8 << 20
    assert sum(b.nbytes for bs in _host_buffers._idle.values() for b in bs) == _host_buffers._idle_bytes
