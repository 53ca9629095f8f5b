import copy
import gc

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from leanstate.reference.pinned_pool import PinnedMemoryPool, size_class
from leanstate.reference.wrappers import (
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    Copier,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)

D, T, B = 16, 6, 3


class Block(nn.Module):
    """A small transformer block with dropout, a buffer, and keyword-only arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Dropout(0.2), nn.Linear(4 * D, D))
        self.register_buffer("shift", torch.linspace(-1, 1, D))

    def forward(self, x, *, debug=False, use_reentrant=None, preserve_rng_state=None, context_fn=None):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm(x)) + self.shift
        if debug:  # a module kwarg that torch's checkpoint would have taken for itself
            x = x * 2
        return x


class Stack(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, 1)

    def forward(self, x, **kwargs):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, **kwargs)
        return self.head(x).sum()


def is_block(module):
    return isinstance(module, Block)


def grads(model, x, seed=0, **kwargs):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_(True)
    loss = model(x, **kwargs)
    loss.backward()
    named = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), x.grad, named


def variants(base):
    none = copy.deepcopy(base)
    ckpt = copy.deepcopy(base)
    apply_activation_checkpointing(ckpt, check_fn=is_block)
    reentrant = copy.deepcopy(base)
    apply_activation_checkpointing(
        reentrant, lambda m: checkpoint_wrapper(m, CheckpointImpl.REENTRANT), check_fn=is_block
    )
    offload = offload_wrapper(copy.deepcopy(base), min_offload_bytes=0)
    both = copy.deepcopy(base)
    apply_activation_checkpointing(both, check_fn=is_block)
    both = offload_wrapper(both, min_offload_bytes=0)
    return {"none": none, "checkpoint": ckpt, "reentrant": reentrant, "offload": offload, "both": both}


@pytest.fixture
def host_as_device(monkeypatch):
    """Run the offload copy path on the CPU (host tensors are treated as device ones)."""
    monkeypatch.setattr(OffloadWrapper, "_offload_host_tensors", True)


@pytest.mark.parametrize("copy_path", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"debug": True}])
def test_gradients_are_bitwise_equal_to_the_unwrapped_model(request, copy_path, kwargs):
    if copy_path:
        request.getfixturevalue("host_as_device")
    torch.manual_seed(1)
    base = Stack()
    x = torch.randn(B, T, D)
    expected = grads(variants(base)["none"], x, **kwargs)
    for name, model in variants(base).items():
        got = grads(model, x, **kwargs)
        assert torch.equal(got[0], expected[0]), name
        assert torch.equal(got[1], expected[1]), name
        assert got[2].keys() == expected[2].keys(), name
        for key in got[2]:
            assert torch.equal(got[2][key], expected[2][key]), (name, key)


def test_debug_kwarg_changes_the_result_so_it_reached_the_module():
    torch.manual_seed(0)
    model = variants(Stack())["checkpoint"]
    x = torch.randn(B, T, D)
    assert not torch.equal(grads(model, x, debug=True)[0], grads(model, x)[0])


class Signatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a, b=None, /, *rest, c, use_reentrant="mine", preserve_rng_state="mine", **extra):
        out = self.lin(a) + (0 if b is None else b) + sum(rest, torch.zeros(4))
        assert use_reentrant == "mine-too" and preserve_rng_state == 7
        return out * c + extra["context_fn"]


@pytest.mark.parametrize("impl", list(CheckpointImpl))
def test_any_kwarg_and_every_parameter_kind_reach_the_module(impl):
    wrapped = checkpoint_wrapper(Signatures(), impl)
    a = torch.randn(2, 4, requires_grad=True)
    c = torch.tensor(3.0, requires_grad=True)
    extra = torch.ones(4, requires_grad=True)
    kwargs = dict(c=c, use_reentrant="mine-too", preserve_rng_state=7, context_fn=extra)
    out = wrapped(a, torch.ones(4), torch.ones(4), **kwargs)
    out.sum().backward()
    plain = Signatures()
    plain.load_state_dict(wrapped.state_dict())
    a2, c2, e2 = (t.detach().clone().requires_grad_(True) for t in (a, c, extra))
    plain(a2, torch.ones(4), torch.ones(4), **dict(kwargs, c=c2, context_fn=e2)).sum().backward()
    for got, want in ((a.grad, a2.grad), (c.grad, c2.grad), (extra.grad, e2.grad)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("impl", list(CheckpointImpl))
@pytest.mark.parametrize("mode", ["no_grad", "eval"])
def test_kwargs_reach_the_module_when_nothing_is_checkpointed(impl, mode):
    for wrap in (lambda m: checkpoint_wrapper(m, impl), offload_wrapper):
        wrapped = wrap(Signatures())
        kwargs = dict(
            c=torch.tensor(2.0), use_reentrant="mine-too", preserve_rng_state=7, context_fn=torch.ones(4)
        )
        a = torch.randn(2, 4)
        if mode == "eval":
            wrapped.eval()
        with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
            out = wrapped(a, torch.ones(4), **kwargs)
        plain = Signatures()
        plain.load_state_dict(wrapped.state_dict())
        assert torch.equal(out, plain(a, torch.ones(4), **kwargs))


@pytest.mark.skipif(torch.cuda.is_available(), reason="states the CPU-only behaviour")
def test_offload_on_a_cpu_only_machine_says_it_offloads_nothing():
    wrapped = offload_wrapper(nn.Linear(64, 64), min_offload_bytes=0)
    wrapped(torch.randn(32, 64, requires_grad=True)).sum().backward()
    assert wrapped.stats.offloaded_bytes == 0
    text = repr(wrapped)
    assert "offloaded_bytes=0" in text and "CPU activations stay in place" in text


def wrapped_stack():
    """(plain Stack, the same checkpointed per block and offloaded, a parent holding it)."""
    torch.manual_seed(0)
    plain = Stack()
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, check_fn=is_block)
    wrapped = offload_wrapper(wrapped)
    parent = nn.ModuleDict({"model": wrapped})
    return plain, wrapped, parent


def test_modules_yield_each_wrapper_under_its_wrapped_modules_name():
    plain, wrapped, parent = wrapped_stack()
    found = [(name, m) for name, m in parent.named_modules() if isinstance(m, CheckpointWrapper)]
    assert [name for name, _ in found] == [f"model.layers.{i}" for i in range(3)]
    assert sum(isinstance(m, ActivationWrapper) for m in wrapped.modules()) == 4  # 3 + the offload root
    named = dict(parent.named_modules())
    assert all(isinstance(named[name], Block) for name, _ in found)  # the wrapped module keeps the name
    apply_activation_checkpointing(wrapped, check_fn=is_block)  # finding wrappers does not re-wrap
    assert sum(isinstance(m, CheckpointWrapper) for m in wrapped.modules()) == 3


def test_no_wrapper_prefix_anywhere_and_state_dicts_load_both_ways():
    plain, wrapped, parent = wrapped_stack()
    for listing in ("state_dict", "named_parameters", "named_buffers", "named_modules"):
        names = list(dict(getattr(wrapped, listing)()))
        assert names == list(dict(getattr(plain, listing)())), listing
        assert all("_checkpoint_wrapped_module" not in n for n in dict(getattr(parent, listing)())), listing
    assert [n for n, _ in parent.named_parameters()] == [f"model.{n}" for n, _ in plain.named_parameters()]
    # wrapped -> plain and plain -> wrapped
    fresh = Stack()
    fresh.load_state_dict(wrapped.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), plain.state_dict().values()))
    other = Stack()
    rewrapped = copy.deepcopy(other)
    apply_activation_checkpointing(rewrapped, check_fn=is_block)
    rewrapped = offload_wrapper(rewrapped)
    caller_dict = plain.state_dict()
    keys_before = list(caller_dict)
    rewrapped.load_state_dict(caller_dict)
    assert list(caller_dict) == keys_before  # the caller's dict is not renamed in place
    assert all(
        torch.equal(a, b) for a, b in zip(rewrapped.state_dict().values(), plain.state_dict().values())
    )


def test_attribute_and_index_access_forward():
    model = Stack()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.ModuleList))
    assert isinstance(model.layers, CheckpointWrapper)
    assert model.layers[1] is model.layers._checkpoint_wrapped_module[1] and len(model.layers) == 3
    wrapped = offload_wrapper(model)
    assert wrapped.head is model.head and wrapped.layers is model.layers


def test_applying_twice_does_not_double_wrap_and_the_root_is_never_wrapped():
    model = Stack()
    apply_activation_checkpointing(model)  # check_fn true for all: children wrapped, root not
    assert not isinstance(model, ActivationWrapper)
    assert all(isinstance(child, CheckpointWrapper) for child in model.children())
    before = [type(m).__name__ for m in model.modules()]
    apply_activation_checkpointing(model)
    assert [type(m).__name__ for m in model.modules()] == before
    assert not isinstance(model.layers._checkpoint_wrapped_module, ActivationWrapper)


def wrapper_tree(model: nn.Module) -> list[str]:
    """The qualified names of the wrapped modules, without the wrappers' own
    ``_checkpoint_wrapped_module`` step (leanstate's named_modules leaves it out, torch's shows it)."""
    names = [name for name, m in model.named_modules() if type(m).__name__ == "CheckpointWrapper"]
    return [name.replace("._checkpoint_wrapped_module", "") for name in names]


@pytest.mark.parametrize(
    "case",
    [
        "nested",  # check_fn matches a block and modules inside it: torch nests the wrappers
        "precedence",  # a policy with check_fn: the policy decides, check_fn is ignored
        "policy",
    ],
)
def test_the_wrapper_tree_and_gradients_are_torchs(case):
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers

    options = {
        "nested": {"check_fn": lambda m: isinstance(m, Block | nn.Linear)},
        "precedence": {"check_fn": lambda m: False, "auto_wrap_policy": ModuleWrapPolicy({Block})},
        "policy": {"auto_wrap_policy": ModuleWrapPolicy({nn.Sequential, Block})},
    }[case]
    torch.manual_seed(0)
    ours, theirs = Stack(), Stack()
    theirs.load_state_dict(ours.state_dict())
    apply_activation_checkpointing(ours, **options)
    torch_wrappers.apply_activation_checkpointing(theirs, **options)
    assert wrapper_tree(ours) == wrapper_tree(theirs) and wrapper_tree(ours), wrapper_tree(theirs)
    x = torch.randn(2, 5, D)
    for model in (ours, theirs):
        torch.manual_seed(1)
        model(x).backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    apply_activation_checkpointing(ours, **options)  # again: nothing changes
    assert wrapper_tree(ours) == wrapper_tree(theirs)


# -- saved-tensor accounting ---------------------------------------------------------


class Recorder:
    """An outer saved_tensors_hooks that records what reaches it."""

    def __init__(self):
        self.saved = []

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def pack(self, tensor):
        self.saved.append(tensor)
        return tensor


def test_a_checkpointed_region_keeps_only_its_inputs():
    block = checkpoint_wrapper(Block())
    x = torch.randn(B, T, D, requires_grad=True)
    with Recorder() as recorder:
        block(x).sum()
    storages = {t.untyped_storage().data_ptr() for t in recorder.saved}
    assert storages == {x.untyped_storage().data_ptr()}
    with Recorder() as unwrapped:
        Block()(x).sum()
    assert len(unwrapped.saved) > 10


def test_offload_skips_parameters_buffers_small_and_host_tensors(host_as_device):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    wrapped = offload_wrapper(model, min_offload_bytes=1024)
    x = torch.randn(32, 64, requires_grad=True)
    wrapped(x).sum().backward()
    activation = 32 * 64 * 4
    # saved: x (input), linear1 weight (kept), relu output (offloaded once: shared by
    # relu's and linear2's saves), linear2 weight (kept)
    assert wrapped.stats.offloaded_bytes == 2 * activation  # x and the relu output, once each
    assert wrapped.stats.kept_bytes >= 2 * 64 * 64 * 4
    small = offload_wrapper(copy.deepcopy(model), min_offload_bytes=10**9)
    small(x).sum().backward()
    assert small.stats.offloaded_bytes == 0


def test_offload_is_the_identity_for_host_tensors():
    wrapped = offload_wrapper(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), min_offload_bytes=0)
    x = torch.randn(4, 8, requires_grad=True)
    with Recorder():
        wrapped(x).sum().backward()
    assert wrapped.stats.offloaded_bytes == 0 and wrapped.pool.pooled_bytes == 0


def test_a_storage_shared_by_views_is_offloaded_once(host_as_device):
    class Views(nn.Module):
        def forward(self, x):
            base = x * 2
            return (base[:, :4].sin() * base[:, 4:].cos()).sum() + base.t().exp().sum()

    wrapped = offload_wrapper(Views(), min_offload_bytes=0)
    x = torch.randn(16, 8, requires_grad=True)
    wrapped(x).backward()
    expected = torch.func.grad(lambda t: Views()(t))(x.detach())
    assert torch.equal(x.grad, expected)
    # sin and cos save two views of base: its storage is copied once (512 bytes), then
    # the product saves the sin and cos outputs (256 each) and exp its output (512).
    assert wrapped.stats.offloaded_bytes == 512 + 256 + 256 + 512


def test_nothing_is_packed_under_no_grad_or_eval(host_as_device):
    wrapped = offload_wrapper(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), min_offload_bytes=0)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad():
        wrapped(x)
    wrapped.eval()
    wrapped(x).sum().backward()
    assert wrapped.stats.offloaded_bytes == 0 and wrapped.stats.kept_bytes == 0


# -- the pool ---------------------------------------------------------------------------


class CountingAllocator:
    def __init__(self):
        self.live = 0
        self.calls = 0

    def __call__(self, nbytes):
        self.calls += 1
        return torch.empty(nbytes, dtype=torch.uint8)


def test_pool_reuses_by_size_class_and_never_exceeds_its_cap():
    allocator = CountingAllocator()
    pool = PinnedMemoryPool(budget_bytes=64 * 1024, allocator=allocator)
    held = [pool.acquire(n) for n in (5000, 9000, 17000, 20000)]
    assert [h.data.numel() for h in held] == [5000, 9000, 17000, 20000]
    assert pool.pooled_bytes == 8192 + 16384 + 32768 and pool.fallback_bytes == 20000
    assert pool.pooled_bytes <= pool.budget_bytes
    for h in held:
        pool.release(h)
    assert pool.in_use_bytes == 0
    again = pool.acquire(6000)
    assert allocator.calls == 3 and again.pooled is not None and pool.in_use_bytes == 8192
    # a class that does not fit falls back to pageable memory; idle buffers are kept
    big = pool.acquire(40000)
    assert big.pooled is None and pool.fallback_bytes == 60000 and pool.pooled_bytes == 57344
    # the cap counts idle pooled buffers too, not only those in use
    pool.release(again)
    assert pool.in_use_bytes == 0
    still_big = pool.acquire(40000)
    assert still_big.pooled is None and pool.pooled_bytes == 57344 <= pool.budget_bytes
    assert size_class(1) == 4096 and size_class(4097) == 8192


def test_wrapper_pool_stays_under_its_cap_and_stops_growing_after_the_first_step(host_as_device):
    torch.manual_seed(0)
    allocator = CountingAllocator()
    budget = 96 * 1024
    pool = PinnedMemoryPool(budget_bytes=budget, allocator=allocator)
    model = offload_wrapper(Stack(), min_offload_bytes=0, pool=pool)
    x = torch.randn(B, T, D)
    grads(model, x)
    calls = allocator.calls
    pooled = pool.pooled_bytes
    assert calls > 0 and pool.fallback_bytes > 0  # the cap bit
    for seed in range(3):
        grads(model, x, seed=seed)
    assert allocator.calls == calls and pool.pooled_bytes == pooled
    assert pool.high_water_bytes <= budget and pool.pooled_bytes <= budget


def test_no_stash_is_left_behind(host_as_device):
    torch.manual_seed(0)
    pool = PinnedMemoryPool(allocator=CountingAllocator())
    model = offload_wrapper(Stack(), min_offload_bytes=0, pool=pool)
    x = torch.randn(B, T, D, requires_grad=True)
    first, second = model(x), model(x)  # two forwards before one backward
    assert pool.in_use_bytes > 0
    first.backward()
    del first
    second.backward(retain_graph=True)
    second.backward()  # a retain_graph double backward reads the offloaded copies twice
    del second
    gc.collect()
    assert pool.in_use_bytes == 0


class RecordingCopier(Copier):
    """The reference copier, logging each copy (the bytes still move synchronously)."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def to_host(self, source, buffer):
        self.log.append("to_host")
        return super().to_host(source, buffer)

    def to_device(self, buffer, device, after):
        self.log.append("to_device")
        return super().to_device(buffer, device, after)

    def ready(self, tensor, marker):
        self.log.append("ready")


def test_the_first_unpack_prefetches_most_of_that_forwards_storages_before_any_is_used(host_as_device):
    torch.manual_seed(3)
    copier = RecordingCopier()
    model = OffloadWrapper(Stack(), min_offload_bytes=0, copier=copier)
    plain = Stack()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(B, T, D)
    torch.manual_seed(0)
    out = model(x.clone().requires_grad_(True))
    copied = copier.log.count("to_host")
    assert copied > 1 and "to_device" not in copier.log  # nothing comes back before backward
    out.backward()
    # the forward's storages start coming back together, before the first is used (a storage
    # freed after its last use and wanted again by another view comes back again later)
    first_ready = copier.log.index("ready")
    prefetched = copier.log[copied:first_ready]
    assert set(prefetched) == {"to_device"} and len(prefetched) > copied // 2
    assert copier.log.count("to_device") >= copied
    del out
    gc.collect()
    assert model.pool.in_use_bytes == 0  # every buffer back in the pool once the graph is gone
    ours = {n: p.grad for n, p in model.named_parameters()}
    assert all(torch.equal(ours[n], g) for n, g in grads(plain, x)[2].items())


def test_size_classes_are_exact_for_powers_of_two():
    assert [size_class(n) for n in (1, 4096, 4097, 8192, 8193, 2**20)] == [
        4096,
        4096,
        8192,
        8192,
        16384,
        2**20,
    ]


def test_the_offload_threshold_keeps_only_tensors_strictly_below_it(host_as_device):
    """``min_offload_bytes``: a saved tensor of exactly that size is offloaded, one element
    less stays (the spec's strict ``nbytes < min_offload_bytes``)."""

    class Square(nn.Module):
        def forward(self, x):
            return x * x  # saves x for backward

    for elements, offloaded in ((64, True), (63, False)):
        wrapped = offload_wrapper(Square(), min_offload_bytes=64 * 4)
        x = torch.randn(elements, requires_grad=True)
        wrapped(x).sum().backward()
        assert (wrapped.stats.offloaded_bytes > 0) == offloaded, elements
        assert torch.equal(x.grad, 2 * x.detach())
