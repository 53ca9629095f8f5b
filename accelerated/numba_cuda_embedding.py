"""The ``numba-cuda`` embedding engine: fused pooled forward and fused backward on the device.

Same interface and bits as ``leanstate.reference.embedding.EmbeddingEngine``
(``spec/backends.md``). Forward is one kernel (a thread per bag and column) that reads
each distinct id's row where it lies in the store's pool (a missing id's initial weights
computed in the kernel) and pools the bag's positions in order. Backward is one kernel
with a warp per distinct id, its lanes over the columns: each lane sums its columns'
gradient over the id's positions in ascending order, the lanes apply the rule of
``spec/embedding.md`` to the weights and state in the pool (row-wise Adagrad's sum over
columns is one lane's, in column order), and one lane stamps the header. Every float32 operation is rounded once and none is contracted into a fused
multiply-add: on a GPU they are libdevice's ``__fmul_rn`` / ``__fadd_rn`` /
``__fdiv_rn`` / ``__fsqrt_rn`` (numba-cuda would otherwise let NVVM contract them), so
the rows are the reference's bit for bit. The per-id position lists and bag indices
are torch ops on the same device that never wait for the device: a training step's only
waits are the front class's (one for the batch checks, one for the distinct ids) and one
per store with new ids. It touches its stores only through their row-access
interface.

16-bit rows (the kernels read float32) run the same kernels on a float32 copy of the
touched rows, widened once, each new value rounded once on the way back, as the numba
CPU engine does.
"""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import torch
from numba import cuda

from leanstate.accelerated._numba_cuda_kv_kernels import initial_weight
from leanstate.accelerated._numba_cuda_runtime import WARP, add, div, launch, mul, sqrt, unavailable
from leanstate.accelerated._widened_rows import WidenedRows
from leanstate.accelerated.numba_cuda_kv_store import DEVICES, KVStoreEngine
from leanstate.reference.row_format import COUNT_MAX

AUTO_PRIORITY = {"cuda": 25}
BENCH_TARGETS = {"sgd": (">=", 0.5), "rowwise_adagrad": (">=", 1.0)}
__all__ = ["DEVICES", "EmbeddingEngine", "unavailable"]  # the store module's devices and availability

_SGD, _ADAGRAD, _ADAM = 0, 1, 2
_RULE_IDS = {"sgd": _SGD, "rowwise_adagrad": _ADAGRAD, "adam": _ADAM}
_USED = np.int64(-(2**63))
_COUNT_MAX = np.int64(COUNT_MAX)


@cuda.jit(cache=True)
def _k_pool(rows, blocks, ids, seeded, span, low, start, inverse, offsets, scales, mean, out):
    """``out[b, c]``: bag b's positions p summed in order, ``scales[p] * row(unique[inverse[p]])[c]``;
    a missing id's row (block -1) is its initial weights, computed here."""
    t = cuda.grid(1)
    dim = out.shape[1]
    if t >= out.shape[0] * dim:
        return
    b, c = t // dim, t % dim
    total = np.float32(0.0)
    for p in range(offsets[b], offsets[b + 1]):
        u = inverse[p]
        block = blocks[u]
        value = rows[block, start + c] if block >= 0 else initial_weight(ids[u], c, seeded, span, low)
        if scales.shape[0] > 0:
            value = mul(value, scales[p])
        total = add(total, value)
    if mean and offsets[b + 1] > offsets[b]:
        total = div(total, np.float32(offsets[b + 1] - offsets[b]))
    out[b, c] = total


@cuda.jit(device=True)
def _contribution(grad_output, bag, c, p, offsets, scales, mean):
    value = grad_output[bag, c]
    if mean:
        value = div(value, np.float32(max(offsets[bag + 1] - offsets[bag], 1)))
    if scales.shape[0] > 0:
        value = mul(value, scales[p])
    return value


@cuda.jit(cache=True)
def _k_row_gradients(starts, positions, bag_of, offsets, scales, mean, grad_output, grad):
    """``grad[u, c]``: id u's positions, in ascending order, summed from zero."""
    t = cuda.grid(1)
    dim = grad.shape[1]
    if t >= grad.shape[0] * dim:
        return
    u, c = t // dim, t % dim
    total = np.float32(0.0)
    for k in range(starts[u], starts[u + 1]):
        p = positions[k]
        total = add(total, _contribution(grad_output, bag_of[p], c, p, offsets, scales, mean))
    grad[u, c] = total


@cuda.jit(device=True)
def _stamp(words, block, now):
    meta = words[block, 1]
    count = min(((meta >> 32) & _COUNT_MAX) + 1, _COUNT_MAX)
    words[block, 1] = np.int64(now) | (count << 32) | _USED


@cuda.jit(cache=True)
def _k_update(
    rows, words, blocks, start, state_rows, state_words, state_blocks, state_start, separate_state, rule,
    starts, positions, bag_of, offsets, scales, mean, grad_output, grad,
    lr, eps, beta1, one_minus_beta1, beta2, one_minus_beta2, weight_decay, step_size, root_correction, now,
):  # fmt: skip
    """A warp per distinct id, its lanes over the columns: the gradient, the rule on the
    weights and state, the header. Every column's arithmetic is the reference's, in its
    order; the barriers are reached by every thread of the block."""
    t = cuda.grid(1)
    u, lane = t // WARP, t % WARP
    active = u < blocks.shape[0]
    dim = grad.shape[1]
    b = blocks[u] if active else 0
    sb = state_blocks[u] if active else 0
    if active:
        for c in range(lane, dim, WARP):
            total = np.float32(0.0)
            for k in range(starts[u], starts[u + 1]):
                p = positions[k]
                total = add(total, _contribution(grad_output, bag_of[p], c, p, offsets, scales, mean))
            if weight_decay != 0.0:
                total = add(total, mul(weight_decay, rows[b, start + c]))
            grad[u, c] = total
    cuda.syncthreads()
    if active and rule == _ADAGRAD and lane == 0:  # one sum over the columns, in their order
        total = np.float32(0.0)
        for c in range(dim):
            total = add(total, mul(grad[u, c], grad[u, c]))
        state_rows[sb, state_start] = add(state_rows[sb, state_start], div(total, np.float32(dim)))
    cuda.syncthreads()
    if active:
        if rule == _SGD:
            for c in range(lane, dim, WARP):
                rows[b, start + c] = add(rows[b, start + c], -mul(lr, grad[u, c]))
        elif rule == _ADAGRAD:
            denominator = add(sqrt(state_rows[sb, state_start]), eps)
            for c in range(lane, dim, WARP):
                rows[b, start + c] = add(rows[b, start + c], -mul(lr, div(grad[u, c], denominator)))
        else:
            for c in range(lane, dim, WARP):
                g = grad[u, c]
                m = add(mul(beta1, state_rows[sb, state_start + c]), mul(one_minus_beta1, g))
                v = add(mul(beta2, state_rows[sb, state_start + dim + c]), mul(one_minus_beta2, mul(g, g)))
                state_rows[sb, state_start + c] = m
                state_rows[sb, state_start + dim + c] = v
                step = mul(step_size, div(m, add(div(sqrt(v), root_correction), eps)))
                rows[b, start + c] = add(rows[b, start + c], -step)
        if lane == 0:
            _stamp(words, b, now)
            if separate_state:
                _stamp(state_words, sb, now)


class EmbeddingEngine:
    """The numba-cuda embedding engine over numba-cuda store engines.

    Args:
        weights: the store engine holding the weights (and the state when offloaded).
        state: the store engine holding the optimizer state when not offloaded, else None.
        state_start: the first state column (from the start of the row) in its store.
        state_width: the state's columns in its store (float32 values as row elements).
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``.
    """

    backend = "numba-cuda"

    def __init__(
        self,
        weights: KVStoreEngine,
        state: KVStoreEngine | None,
        *,
        state_start: int,
        state_width: int,
        optimizer: str,
    ) -> None:
        for engine in (weights, state):
            if engine is not None and not isinstance(engine, KVStoreEngine):
                raise TypeError("the numba-cuda embedding engine needs numba-cuda store engines")
        self.weights, self.state = weights, state
        self.state_start, self.state_width = state_start, state_width
        self.rule = _RULE_IDS[optimizer]
        self.device = weights.device

    def _scales(self, per_sample_weights: torch.Tensor | None) -> torch.Tensor:
        if per_sample_weights is None:
            return torch.empty(0, dtype=torch.float32, device=self.device)
        return per_sample_weights.contiguous()

    def _by_id(self, unique_count: int, inverse: torch.Tensor, offsets: torch.Tensor):
        """(starts [U + 1], positions grouped by id in ascending order, bag of each position),
        with no wait for the device (sizes come from the host, counts from a search)."""
        positions = torch.argsort(inverse, stable=True)
        every_id = torch.arange(unique_count + 1, device=self.device)
        starts = torch.searchsorted(inverse[positions], every_id)
        lengths = offsets[1:] - offsets[:-1]
        bags = torch.arange(len(lengths), device=self.device)
        bag_of = torch.repeat_interleave(bags, lengths, output_size=len(inverse))
        return starts, positions, bag_of

    def _pool(self, rows, blocks, unique, start, inverse, offsets, per_sample_weights, mean):
        store = self.weights
        out = torch.empty(len(offsets) - 1, store.layout.dim, device=self.device)
        launch(
            _k_pool, out.numel(), rows, blocks, unique, *store.initial_scalars, start,
            inverse, offsets, self._scales(per_sample_weights), mean, out,
        )  # fmt: skip
        return out

    def pool_rows(self, rows, inverse, offsets, per_sample_weights, mean) -> torch.Tensor:
        """Pool given rows [U, D] of any float dtype (e.g. rows received from their owners)."""
        rows = rows.to(torch.float32).contiguous()
        own = torch.arange(len(rows), device=self.device)
        return self._pool(rows, own, own, 0, inverse, offsets, per_sample_weights, mean)

    def row_gradients(
        self, unique_count, inverse, offsets, per_sample_weights, mean, grad_output
    ) -> torch.Tensor:
        """Each distinct id's gradient [U, D], summed exactly as ``update`` sums it."""
        grad = torch.empty(unique_count, grad_output.shape[1], device=self.device)
        launch(
            _k_row_gradients, grad.numel(), *self._by_id(unique_count, inverse, offsets), offsets,
            self._scales(per_sample_weights), mean, grad_output.contiguous(), grad,
        )  # fmt: skip
        return grad

    def pool(self, unique, inverse, offsets, per_sample_weights, mean) -> torch.Tensor:
        store = self.weights
        layout = store.layout
        if layout.dtype != torch.float32:
            rows = store.gather(unique, start=layout.weight_offset, width=layout.dim, initial=True)
            return self.pool_rows(rows, inverse, offsets, per_sample_weights, mean)
        with store.reading():
            blocks = store.locate(unique)
            return self._pool(
                store.rows, blocks, unique, layout.weight_offset, inverse, offsets, per_sample_weights, mean
            )

    def update(
        self, unique, inverse, offsets, per_sample_weights, mean, grad_output, *, hyperparameters, step, now
    ) -> None:
        f32 = np.float32
        lr, eps = hyperparameters["lr"], hyperparameters["eps"]
        beta1, beta2 = hyperparameters["beta1"], hyperparameters["beta2"]
        adam = self.rule == _ADAM
        scalars = (
            f32(lr), f32(eps), f32(beta1), f32(1 - beta1), f32(beta2), f32(1 - beta2),
            f32(hyperparameters["weight_decay"]),
            f32(lr / (1 - beta1**step)) if adam else f32(0.0),
            f32((1 - beta2**step) ** 0.5) if adam else f32(1.0),
            now,
        )  # fmt: skip
        grad = torch.empty(len(unique), self.weights.layout.dim, device=self.device)
        gradient = (
            *self._by_id(len(unique), inverse, offsets), offsets, self._scales(per_sample_weights), mean,
            grad_output.contiguous(), grad,
        )  # fmt: skip
        weights, state = self.weights, self.state
        with ExitStack() as locks:
            for engine in (weights, state):
                if engine is not None:
                    locks.enter_context(engine.writing())
            blocks = weights.locate(unique, insert=True)
            state_blocks = state.locate(unique, insert=True) if state is not None else blocks
            if weights.layout.dtype == torch.float32:
                holder = state if state is not None else weights
                launch(
                    _k_update, len(unique), weights.rows, weights.rows.view(torch.int64), blocks,
                    weights.layout.weight_offset, holder.rows, holder.rows.view(torch.int64), state_blocks,
                    self.state_start, state is not None, self.rule, *gradient, *scalars, lanes=WARP,
                )  # fmt: skip
            else:
                self._update_widened(blocks, state_blocks, gradient, scalars)

    def _update_widened(self, blocks, state_blocks, gradient, scalars) -> None:
        """``update`` for 16-bit rows: the kernel on float32 copies, each value rounded once back."""
        weights, state = self.weights, self.state
        wide = WidenedRows(
            weights.read_blocks(blocks), weights.layout, self.state_start, self.state_width, state is None
        )
        own = torch.arange(len(blocks), device=self.device)
        if state is None:
            target, target_words, target_blocks, target_start = (
                wide.values,
                wide.header,
                own,
                weights.layout.dim,
            )
        else:
            target, target_words = state.rows, state.rows.view(torch.int64)
            target_blocks, target_start = state_blocks, self.state_start
        launch(
            _k_update, len(blocks), wide.values, wide.header, own, 0, target, target_words, target_blocks,
            target_start, state is not None, self.rule, *gradient, *scalars, lanes=WARP,
        )  # fmt: skip
        weights.write_blocks(blocks, wide.rounded_rows())
