"""The ``numba`` embedding engine: pooled forward and fused optimizer updates in the rows.

Same interface and bits as ``leanstate.reference.embedding.EmbeddingEngine``
(``spec/backends.md``). Forward is one kernel that reads each bag's rows straight from
the store's pool and pools them; backward is one kernel that sums each distinct id's
gradient (its positions in ascending order, as the reference's ``index_add_``), applies
the optimizer rule to the weights and state where they lie in the pool, and stamps the
header: no gather -> math -> scatter round trip. The rules are ``spec/embedding.md``'s,
written per element with the same float32 operations in the same order as the
reference (numba compiles without fast-math, so nothing is contracted into a fused
multiply-add). It touches its stores only through their row-access interface
(``reading``/``writing``, ``locate``, ``rows``, ``read_blocks``/``write_blocks``).

Numba has no float16 arithmetic on the CPU, so 16-bit rows run the same kernels on a
float32 copy of the touched rows (``[weight | state]`` widened once, each new weight
rounded once on the way back): still one compiled call per step, plus one gather and
one scatter of the touched rows.
"""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import torch
from numba import njit, prange

from leanstate.accelerated import _host_buffers
from leanstate.accelerated._numba_runtime import use_threads
from leanstate.accelerated._widened_rows import WidenedRows
from leanstate.accelerated.numba_kv_store import KVStoreEngine
from leanstate.reference.row_format import COUNT_MAX

DEVICES = ("cpu",)
AUTO_PRIORITY = {"cpu": 20, "cuda": 10}
BENCH_TARGETS = {"sgd": (">=", 0.9), "rowwise_adagrad": (">=", 4.0)}

_SGD, _ADAGRAD, _ADAM = 0, 1, 2
_UPDATE_CHUNK = 256  # distinct ids per task of the update
_RULE_IDS = {"sgd": _SGD, "rowwise_adagrad": _ADAGRAD, "adam": _ADAM}
_USED = np.int64(-(2**63))
_COUNT_MAX = np.int64(COUNT_MAX)


@njit(nogil=True, cache=True, parallel=True)
def _pool(rows, blocks, initial, slot_of_missing, start, inverse, offsets, scales, mean, out):
    """``out[b]``: the sum over bag b's positions p of ``scales[p] * row(unique[inverse[p]])``.

    ``scales`` empty: unweighted. A mean divides the sum by the bag's length.
    """
    dim = out.shape[1]
    for b in prange(out.shape[0]):
        for c in range(dim):
            out[b, c] = 0.0
        for p in range(offsets[b], offsets[b + 1]):
            u = inverse[p]
            block = blocks[u]
            if block >= 0:
                row = rows[block, start : start + dim]
            else:
                row = initial[slot_of_missing[u]]
            if scales.shape[0] > 0:
                for c in range(dim):
                    out[b, c] = out[b, c] + row[c] * scales[p]
            else:
                for c in range(dim):
                    out[b, c] = out[b, c] + row[c]
        if mean and offsets[b + 1] > offsets[b]:
            length = np.float32(offsets[b + 1] - offsets[b])
            for c in range(dim):
                out[b, c] = out[b, c] / length


@njit(nogil=True, cache=True)
def _positions_by_id(inverse, unique_count, offsets):
    """CSR of positions per distinct id, each list ascending; and the bag of each position."""
    starts = np.zeros(unique_count + 1, dtype=np.int64)
    for p in range(inverse.shape[0]):
        starts[inverse[p] + 1] += 1
    for u in range(unique_count):
        starts[u + 1] += starts[u]
    fill = starts[:-1].copy()
    positions = np.empty(inverse.shape[0], dtype=np.int64)
    for p in range(inverse.shape[0]):
        positions[fill[inverse[p]]] = p
        fill[inverse[p]] += 1
    bag_of = np.empty(inverse.shape[0], dtype=np.int64)
    for b in range(offsets.shape[0] - 1):
        for p in range(offsets[b], offsets[b + 1]):
            bag_of[p] = b
    return starts, positions, bag_of


@njit(nogil=True, cache=True)
def _sum_gradient(g, u, starts, positions, bag_of, offsets, scales, mean, grad_output):
    """``g``: distinct id ``u``'s gradient, its positions' contributions summed in order from zero."""
    dim = grad_output.shape[1]
    for c in range(dim):
        g[c] = 0.0
    for k in range(starts[u], starts[u + 1]):
        p = positions[k]
        bag = bag_of[p]
        length = np.float32(max(offsets[bag + 1] - offsets[bag], 1))
        for c in range(dim):
            contribution = grad_output[bag, c] / length if mean else grad_output[bag, c]
            if scales.shape[0] > 0:
                contribution = contribution * scales[p]
            g[c] = g[c] + contribution


@njit(nogil=True, cache=True, parallel=True)
def _row_gradients(inverse, offsets, scales, mean, grad_output, grad):
    """Every distinct id's gradient into ``grad`` [U, D], as the update kernel sums it."""
    starts, positions, bag_of = _positions_by_id(inverse, grad.shape[0], offsets)
    for u in prange(grad.shape[0]):
        _sum_gradient(grad[u], u, starts, positions, bag_of, offsets, scales, mean, grad_output)


@njit(nogil=True, cache=True)
def _stamp(words, block, now):
    meta = words[block, 1]
    count = min(((meta >> 32) & _COUNT_MAX) + 1, _COUNT_MAX)
    words[block, 1] = np.int64(now) | (count << 32) | _USED


@njit(nogil=True, cache=True, parallel=True)
def _update(
    rows,
    words,
    blocks,
    start,
    state_rows,
    state_words,
    state_blocks,
    state_start,
    separate_state,
    rule,
    inverse,
    offsets,
    scales,
    mean,
    grad_output,
    lr,
    eps,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    weight_decay,
    step_size,
    root_correction,
    now,
):
    dim = grad_output.shape[1]
    starts, positions, bag_of = _positions_by_id(inverse, blocks.shape[0], offsets)
    n = blocks.shape[0]
    for chunk in prange((n + _UPDATE_CHUNK - 1) // _UPDATE_CHUNK):
        # one scratch row per task, not a [U, dim] gradient array: that was 40 MB of fresh
        # memory per 4096 x 20 step, two thirds of the step in page faults
        g = np.empty(dim, dtype=np.float32)
        end = min(n, (chunk + 1) * _UPDATE_CHUNK)
        for u in range(chunk * _UPDATE_CHUNK, end):
            _update_one(rows, words, blocks, start, state_rows, state_words, state_blocks, state_start,
                        separate_state, rule, starts, positions, bag_of, offsets, scales, mean, grad_output,
                        g, u, lr, eps, beta1, one_minus_beta1, beta2, one_minus_beta2, weight_decay,
                        step_size, root_correction, now)  # fmt: skip


@njit(nogil=True, cache=True)
def _update_one(
    rows, words, blocks, start, state_rows, state_words, state_blocks, state_start, separate_state, rule,
    starts, positions, bag_of, offsets, scales, mean, grad_output, g, u, lr, eps, beta1, one_minus_beta1,
    beta2, one_minus_beta2, weight_decay, step_size, root_correction, now,
):  # fmt: skip
    """Distinct id ``u``'s gradient summed into ``g``, its rule applied in place, its rows stamped."""
    dim = grad_output.shape[1]
    _sum_gradient(g, u, starts, positions, bag_of, offsets, scales, mean, grad_output)
    w = rows[blocks[u], start : start + dim]
    st = state_rows[state_blocks[u], state_start:]
    if weight_decay != 0.0:
        for c in range(dim):
            g[c] = g[c] + weight_decay * w[c]
    if rule == _SGD:
        for c in range(dim):
            w[c] = w[c] - lr * g[c]
    elif rule == _ADAGRAD:
        total = np.float32(0.0)
        for c in range(dim):
            total = total + g[c] * g[c]
        st[0] = st[0] + total / np.float32(dim)
        denominator = np.sqrt(st[0]) + eps
        for c in range(dim):
            w[c] = w[c] - lr * (g[c] / denominator)
    else:
        for c in range(dim):
            m = beta1 * st[c] + one_minus_beta1 * g[c]
            v = beta2 * st[dim + c] + one_minus_beta2 * (g[c] * g[c])
            st[c] = m
            st[dim + c] = v
            w[c] = w[c] - step_size * (m / (np.sqrt(v) / root_correction + eps))
    _stamp(words, blocks[u], now)
    if separate_state:
        _stamp(state_words, state_blocks[u], now)


class EmbeddingEngine:
    """The numba embedding engine over numba store engines.

    Args:
        weights: the store engine holding the weights (and the state when offloaded).
        state: the store engine holding the optimizer state when not offloaded, else None.
        state_start: the first state column (from the start of the row) in its store.
        state_width: the state's columns in its store (float32 values as row elements).
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``.
    """

    backend = "numba"

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
                raise TypeError("the numba embedding engine needs numba store engines")
        self.weights, self.state = weights, state
        self.state_start, self.state_width = state_start, state_width
        self.rule = _RULE_IDS[optimizer]

    @staticmethod
    def _scales(per_sample_weights: torch.Tensor | None) -> np.ndarray:
        if per_sample_weights is None:
            return np.empty(0, dtype=np.float32)
        return per_sample_weights.contiguous().numpy()

    def pool_rows(self, rows, inverse, offsets, per_sample_weights, mean) -> torch.Tensor:
        """Pool given rows [U, D] of any float dtype (e.g. rows received from their owners)."""
        rows = rows.to(torch.float32).contiguous()
        use_threads(len(inverse) * rows.shape[1])
        out = _host_buffers.empty((len(offsets) - 1, rows.shape[1]), torch.float32)
        _pool(
            rows.numpy(),
            np.arange(len(rows), dtype=np.int64),
            np.empty((0, rows.shape[1]), dtype=np.float32),
            np.full(len(rows), -1, dtype=np.int64),
            0,
            inverse.numpy(),
            offsets.numpy(),
            self._scales(per_sample_weights),
            mean,
            out.numpy(),
        )
        return out

    def row_gradients(
        self, unique_count, inverse, offsets, per_sample_weights, mean, grad_output
    ) -> torch.Tensor:
        """Each distinct id's gradient [U, D], summed exactly as ``update`` sums it."""
        grad = _host_buffers.empty((unique_count, grad_output.shape[1]), torch.float32)
        use_threads(len(inverse) * grad_output.shape[1])
        _row_gradients(
            inverse.numpy(), offsets.numpy(), self._scales(per_sample_weights), mean,
            grad_output.contiguous().numpy(), grad.numpy(),
        )  # fmt: skip
        return grad

    def pool(
        self,
        unique: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mean: bool,
    ) -> torch.Tensor:
        store = self.weights
        layout = store.layout
        if layout.dtype != torch.float32:
            rows = store.gather(unique, start=layout.weight_offset, width=layout.dim, initial=True)
            return self.pool_rows(rows, inverse, offsets, per_sample_weights, mean)
        out = _host_buffers.empty((len(offsets) - 1, layout.dim), torch.float32)
        with store.reading():
            blocks = store.locate(unique).numpy()
            use_threads(len(inverse) * layout.dim)
            missing = np.flatnonzero(blocks == -1)
            slot_of_missing = np.full(len(unique), -1, dtype=np.int64)
            slot_of_missing[missing] = np.arange(len(missing))
            initial = store.initial_rows(unique[torch.from_numpy(missing)])
            first = layout.weight_offset
            _pool(
                store.rows.numpy(),
                blocks,
                initial[:, first : first + layout.dim].contiguous().numpy(),
                slot_of_missing,
                first,
                inverse.numpy(),
                offsets.numpy(),
                self._scales(per_sample_weights),
                mean,
                out.numpy(),
            )
        return out

    def update(
        self,
        unique: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mean: bool,
        grad_output: torch.Tensor,
        *,
        hyperparameters: dict[str, float],
        step: int,
        now: int,
    ) -> None:
        weights, state = self.weights, self.state
        f32 = np.float32
        lr, eps = hyperparameters["lr"], hyperparameters["eps"]
        beta1, beta2 = hyperparameters["beta1"], hyperparameters["beta2"]
        scalars = (
            f32(lr),
            f32(eps),
            f32(beta1),
            f32(1 - beta1),
            f32(beta2),
            f32(1 - beta2),
            f32(hyperparameters["weight_decay"]),
            f32(lr / (1 - beta1**step)) if self.rule == _ADAM else f32(0.0),
            f32((1 - beta2**step) ** 0.5) if self.rule == _ADAM else f32(1.0),
            now,
        )
        gradient = (inverse.numpy(), offsets.numpy(), self._scales(per_sample_weights), mean,
                    grad_output.contiguous().numpy())  # fmt: skip
        with ExitStack() as locks:
            for engine in (weights, state):
                if engine is not None:
                    locks.enter_context(engine.writing())
            blocks = weights.locate(unique, insert=True)
            state_blocks = state.locate(unique, insert=True) if state is not None else blocks
            use_threads(len(inverse) * weights.layout.dim)
            if weights.layout.dtype == torch.float32:
                holder = state if state is not None else weights
                _update(
                    weights.rows.numpy(), weights.rows.view(torch.int64).numpy(), blocks.numpy(),
                    weights.layout.weight_offset, holder.rows.numpy(), holder.rows.view(torch.int64).numpy(),
                    state_blocks.numpy(), self.state_start, state is not None, self.rule,
                    *gradient, *scalars,
                )  # fmt: skip
            else:
                self._update_widened(blocks, state_blocks, gradient, scalars)

    def _update_widened(self, blocks, state_blocks, gradient, scalars) -> None:
        """``update`` for 16-bit rows: the kernel on float32 copies, each value rounded once back."""
        weights, state = self.weights, self.state
        wide = WidenedRows(
            weights.read_blocks(blocks), weights.layout, self.state_start, self.state_width, state is None
        )
        own = np.arange(len(blocks), dtype=np.int64)
        if state is None:
            target, target_words, target_blocks, target_start = (
                wide.values,
                wide.header,
                own,
                weights.layout.dim,
            )
        else:
            target, target_words = state.rows, state.rows.view(torch.int64)
            target_blocks, target_start = state_blocks.numpy(), self.state_start
        _update(
            wide.values.numpy(), wide.header.numpy(), own, 0, target.numpy(), target_words.numpy(),
            target_blocks, target_start, state is not None, self.rule, *gradient, *scalars,
        )  # fmt: skip
        weights.write_blocks(blocks, wide.rounded_rows())
