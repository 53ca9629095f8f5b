"""Activation wrappers: checkpoint (recompute) and offload (move saved activations to host).

Torch's names and behaviour (``torch.distributed.algorithms._checkpoint.
checkpoint_wrapper``), with these fixes:

- module kwargs always reach the module, whatever their name (torch's checkpoint
  swallows ``debug``, ``preserve_rng_state``, ``use_reentrant``, ``context_fn``...);
- the wrapper is invisible in names: ``state_dict``, ``named_parameters``,
  ``named_buffers`` and ``named_modules`` of the wrapper or of any parent are those of
  the unwrapped model;
- applying checkpointing twice does not wrap twice; the root is never wrapped;
- offload never copies parameters, buffers, tensors below ``min_offload_bytes`` or
  tensors already on the host; a storage shared by several saved views is copied once;
  host memory comes from a :class:`PinnedMemoryPool` bounded by ``pinned_budget_bytes``.

Composition, as with torch: checkpoint the blocks, then offload the rest::

    >>> apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    >>> model = offload_wrapper(model)

See ``spec/wrappers.md``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from enum import Enum, auto

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from leanstate.reference.pinned_pool import HostBuffer, PinnedMemoryPool

WRAPPED = "_checkpoint_wrapped_module"
DEFAULT_MIN_OFFLOAD_BYTES = 2**16


class CheckpointImpl(Enum):
    """Which ``torch.utils.checkpoint`` implementation a :class:`CheckpointWrapper` uses."""

    REENTRANT = auto()
    NO_REENTRANT = auto()


class ActivationWrapper(nn.Module):
    """Base of the wrappers: holds the module and hides itself from names.

    Attribute and index access fall through to the wrapped module.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module
        self._register_load_state_dict_pre_hook(_add_wrapped_prefix)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules[WRAPPED], name)

    def __getitem__(self, index):
        return self._checkpoint_wrapped_module[index]

    def __len__(self) -> int:
        return len(self._checkpoint_wrapped_module)

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True) -> Iterator:
        # The wrapper is listed under its wrapped module's name, then the wrapped module
        # takes its place: ``isinstance(m, CheckpointWrapper) for m in model.modules()``
        # finds the wrappers, while parameter, buffer and module names never show the
        # wrapper's attribute (the wrapper holds no parameters or buffers of its own).
        if memo is None:
            memo = set()
        if self not in memo or not remove_duplicate:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
        yield from self._checkpoint_wrapped_module.named_modules(memo, prefix, remove_duplicate)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        return self._checkpoint_wrapped_module.state_dict(
            *args, destination=destination, prefix=prefix, keep_vars=keep_vars
        )


def _add_wrapped_prefix(state_dict, prefix, *_):
    """Load pre-hook: ``<prefix>x`` -> ``<prefix>_checkpoint_wrapped_module.x``."""
    inner = f"{prefix}{WRAPPED}."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


class CheckpointWrapper(ActivationWrapper):
    """Recompute the wrapped module in backward instead of keeping its activations.

    Args:
        module: the module to checkpoint.
        checkpoint_impl: ``NO_REENTRANT`` (default) or ``REENTRANT``.
        checkpoint_fn: a ``checkpoint(function, *args, **kwargs)``-like function;
            default ``torch.utils.checkpoint.checkpoint`` with ``use_reentrant`` set
            from ``checkpoint_impl``.
        **checkpoint_fn_kwargs: passed to ``checkpoint_fn`` (e.g. ``preserve_rng_state``).

    The module's own kwargs are passed to it by closure, never to ``checkpoint_fn``.
    """

    def __init__(
        self,
        module: nn.Module,
        checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
        checkpoint_fn: Callable | None = None,
        **checkpoint_fn_kwargs,
    ) -> None:
        super().__init__(module)
        self.checkpoint_impl = checkpoint_impl
        if checkpoint_fn is None:
            reentrant = checkpoint_impl == CheckpointImpl.REENTRANT
            checkpoint_fn = functools.partial(torch_checkpoint, use_reentrant=reentrant)
        self.checkpoint_fn = functools.partial(checkpoint_fn, **checkpoint_fn_kwargs)

    def forward(self, *args, **kwargs):
        module = self._checkpoint_wrapped_module
        if not torch.is_grad_enabled():
            return module(*args, **kwargs)
        names, count = tuple(kwargs), len(args)

        def run(*flat):
            return module(*flat[:count], **dict(zip(names, flat[count:], strict=True)))

        # Kwarg values travel positionally, so the reentrant implementation also
        # computes their gradients; the names stay in the closure.
        return self.checkpoint_fn(run, *args, *kwargs.values())


class Copier:
    """How offloaded bytes move: the reference copies synchronously on the current stream.

    An accelerated copier (``leanstate.accelerated.torch_wrappers.Copier``) has the same
    four methods and moves the bytes on a side stream, ordered by events. A marker is
    whatever ``wait``/``ready`` need to know a copy is done (None here: it is).
    """

    def to_host(self, source: torch.Tensor, buffer: torch.Tensor) -> object | None:
        """Copy ``source`` (device bytes) into the host ``buffer``; a marker of the copy."""
        buffer.copy_(source)
        return None

    def to_device(self, buffer: torch.Tensor, device: torch.device, after: object | None):
        """Start copying the host ``buffer`` back to ``device`` once ``after`` is done:
        (the device tensor, a marker of the copy)."""
        return buffer.to(device), None

    def ready(self, tensor: torch.Tensor, marker: object | None) -> None:
        """Make the current stream wait for the copy that produced ``tensor``."""

    def wait(self, marker: object | None) -> None:
        """Block the host until the copy of ``marker`` is done (before a buffer is reused)."""


class _HostCopy:
    """One offloaded storage: its bytes on the host, returned to the pool when unused."""

    def __init__(
        self, buffer: HostBuffer, pool: PinnedMemoryPool, device: torch.device, copier: Copier, copied
    ) -> None:
        self.buffer = buffer
        self.pool = pool
        self.device = device
        self.copier = copier
        self.copied = copied  # marker of the device -> host copy
        self.prefetched = None  # (device tensor, marker) of a copy back started early
        self.restored: weakref.ref | None = None  # the device copy, shared by its views

    def prefetch(self) -> None:
        """Start the copy back to the device now (backward will want it soon)."""
        restored = self.restored() if self.restored is not None else None
        if restored is None and self.prefetched is None:
            self.prefetched = self.copier.to_device(self.buffer.data, self.device, self.copied)

    def to_device(self) -> torch.Tensor:
        restored = self.restored() if self.restored is not None else None
        if restored is None:
            self.prefetch()
            restored, marker = self.prefetched
            self.prefetched = None
            self.copier.ready(restored, marker)
            self.restored = weakref.ref(restored)
        return restored

    def __del__(self) -> None:
        self.copier.wait(self.copied)  # no copy may still read or write the buffer
        if self.prefetched is not None:
            self.copier.wait(self.prefetched[1])
        self.pool.release(self.buffer)


class _Packed:
    """A saved tensor whose storage is offloaded: how to rebuild the view."""

    __slots__ = ("copy", "dtype", "shape", "stride", "offset")

    def __init__(self, copy: _HostCopy, tensor: torch.Tensor) -> None:
        self.copy = copy
        self.dtype = tensor.dtype
        self.shape = tensor.shape
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()


class OffloadStats:
    """Counters of an :class:`OffloadWrapper`, in bytes."""

    def __init__(self) -> None:
        self.offloaded_bytes = 0  # storage bytes copied to the host
        self.kept_bytes = 0  # saved tensors left in place (parameters, small, on host)

    def __repr__(self) -> str:
        return f"OffloadStats(offloaded_bytes={self.offloaded_bytes}, kept_bytes={self.kept_bytes})"


class OffloadWrapper(ActivationWrapper):
    """Move the wrapped module's saved activations to host memory until backward.

    Activations already on the CPU are kept where they are: on a CPU-only machine this
    wrapper offloads nothing (``stats.offloaded_bytes`` stays 0) and says so in its repr.

    Args:
        module: the module whose forward is wrapped.
        pin_memory: page-locked host buffers (``"auto"``: when CUDA is available).
        min_offload_bytes: saved tensors smaller than this stay where they are.
        pinned_budget_bytes: cap of the host-buffer pool; past it, pageable memory.
        pool: a pool to use instead of a new one (e.g. shared, or with a test allocator).
        copier: how the bytes move (default :class:`Copier`, synchronous);
            ``leanstate.offload_wrapper`` passes the chosen backend's (on CUDA: a side
            stream with events).

    In backward, the first saved tensor of a forward to be needed brings all of that
    forward's offloaded storages back at once (a prefetch: the later ones are then in
    flight while the first is used).
    """

    # Treat host tensors as if they were on a device (so the copy path runs without a GPU).
    _offload_host_tensors = False

    def __init__(
        self,
        module: nn.Module,
        *,
        pin_memory: bool | str = "auto",
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        pinned_budget_bytes: int | None = None,
        pool: PinnedMemoryPool | None = None,
        copier: Copier | None = None,
    ) -> None:
        super().__init__(module)
        self.copier = copier or Copier()
        if min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be >= 0; got {min_offload_bytes}")
        self.min_offload_bytes = min_offload_bytes
        self.pool = pool or PinnedMemoryPool(pinned_budget_bytes, pin=pin_memory)
        self.stats = OffloadStats()

    def extra_repr(self) -> str:
        where = "" if torch.cuda.is_available() else ", no accelerator: CPU activations stay in place"
        return (
            f"min_offload_bytes={self.min_offload_bytes}, offloaded_bytes={self.stats.offloaded_bytes}, "
            f"pinned_budget_bytes={self.pool.budget_bytes}{where}"
        )

    def _module_storages(self) -> set[int]:
        module = self._checkpoint_wrapped_module
        tensors = [*module.parameters(), *module.buffers()]
        return {t.untyped_storage().data_ptr() for t in tensors}

    def forward(self, *args, **kwargs):
        module = self._checkpoint_wrapped_module
        if not (torch.is_grad_enabled() and self.training):
            return module(*args, **kwargs)
        keep = self._module_storages()
        # This forward's offloaded storages by address, with a weak reference to the
        # storage: an address is only trusted while that storage lives (once freed, a
        # new tensor may get the same address).
        copies: dict[int, tuple[weakref.ref, _HostCopy]] = {}

        def pack(tensor: torch.Tensor):
            nbytes = tensor.numel() * tensor.element_size()
            storage = tensor.untyped_storage()
            on_host = tensor.device.type == "cpu" and not self._offload_host_tensors
            if on_host or nbytes < self.min_offload_bytes or storage.data_ptr() in keep:
                self.stats.kept_bytes += nbytes
                return tensor
            alive, copy = copies.get(storage.data_ptr(), (None, None))
            if alive is None or alive() is not storage:
                buffer = self.pool.acquire(storage.nbytes())
                source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
                copied = self.copier.to_host(source, buffer.data)
                copy = _HostCopy(buffer, self.pool, tensor.device, self.copier, copied)
                copies[storage.data_ptr()] = (weakref.ref(storage), copy)
                self.stats.offloaded_bytes += storage.nbytes()
            return _Packed(copy, tensor)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            if packed.copy.restored is None and packed.copy.prefetched is None:
                for _, other in copies.values():  # the first one back: bring the rest too
                    other.prefetch()
            storage = packed.copy.to_device().untyped_storage()
            view = torch.empty(0, dtype=packed.dtype, device=packed.copy.device)
            return view.set_(storage, packed.offset, packed.shape, packed.stride)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return module(*args, **kwargs)


def checkpoint_wrapper(
    module: nn.Module,
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
    checkpoint_fn: Callable | None = None,
    **checkpoint_fn_kwargs,
) -> CheckpointWrapper:
    """Wrap ``module`` in a :class:`CheckpointWrapper` (torch's signature).

    Example::

        >>> block = checkpoint_wrapper(nn.Linear(4, 4))
        >>> block(torch.randn(2, 4, requires_grad=True)).sum().backward()
    """
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


def offload_wrapper(module: nn.Module, **options) -> OffloadWrapper:
    """Wrap ``module`` in an :class:`OffloadWrapper`, whose keywords ``options`` are (a no-op
    for CPU activations: see there).

    Example::

        >>> model = offload_wrapper(model, pinned_budget_bytes=2**30)
    """
    return OffloadWrapper(module, **options)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Callable | None = None,
) -> None:
    """Wrap, in place, the submodules of ``model`` chosen by ``auto_wrap_policy`` or, without
    one, by ``check_fn``, as torch's ``apply_activation_checkpointing`` does.

    The policy takes precedence (``check_fn`` is then ignored); it is called as torch's
    policies are, ``policy(module=m, recurse=..., nonwrapped_numel=...)`` (``ModuleWrapPolicy``
    works). The tree is walked depth first: a module's children are wrapped before the
    module itself, so when a match holds matches inside it the wrappers nest. The root is
    never wrapped, and modules already wrapped are left alone, so applying twice changes
    nothing.
    """
    if auto_wrap_policy is not None and not callable(auto_wrap_policy):
        raise TypeError(
            f"apply_activation_checkpointing: auto_wrap_policy must be callable as torch's policies are; "
            f"got {type(auto_wrap_policy).__name__}"
        )

    def by_check_fn(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else bool(check_fn(module))

    policy = auto_wrap_policy if auto_wrap_policy is not None else by_check_fn

    def wrap(module: nn.Module, only_children: bool) -> tuple[nn.Module, int]:
        """(the module, wrapped or not; how many of its parameters sit in wrappers)."""
        if isinstance(module, ActivationWrapper):
            return module, _numel(module)
        numel = _numel(module)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return module, 0
        inside = 0
        for name, child in list(module.named_children()):
            if child is None:
                continue
            wrapped, count = wrap(child, only_children=False)
            if wrapped is not child:
                setattr(module, name, wrapped)
            inside += count
        if not only_children and policy(module=module, recurse=False, nonwrapped_numel=numel - inside):
            return checkpoint_wrapper_fn(module), numel
        return module, inside

    wrap(
        model._checkpoint_wrapped_module if isinstance(model, ActivationWrapper) else model,
        only_children=True,
    )
