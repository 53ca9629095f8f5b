"""The ``torch`` embedding engine: pooled forward and fused updates on the torch store's pool.

Same interface and bits as ``leanstate.reference.embedding.EmbeddingEngine``
(``spec/backends.md``), written on its own: torch ops only, on the device of the
store's pool. Forward reads the distinct ids' weights with one ``index_select`` and
pools them with one ``index_add_``; backward sums each distinct id's gradient, reads
``[weight | state]`` of every touched row with one ``index_select``, applies the rule
(``spec/embedding.md``: float32, each operation rounded once, square roots through
float64) and writes the rows and their headers back with one ``index_copy_``, under
the store's lock. It touches its stores only through their row-access interface.

On the CPU the sums run in position order, so the bits are the reference's. On CUDA,
``index_add_`` adds with atomics in no fixed order: pooled outputs and gradient sums of
ids that repeat in a batch agree with the reference within float32 rounding.
"""

from __future__ import annotations

import torch

from leanstate.accelerated.torch_kv_store import KVStoreEngine, stamp

DEVICES = ("cpu", "cuda")
AUTO_PRIORITY = {"cpu": 10, "cuda": 30}
BENCH_TARGETS: dict[str, tuple[str, float]] = {}


def _bags(offsets: torch.Tensor, length: int) -> torch.Tensor:
    """The bag of each of ``length`` positions, from bag boundaries ``offsets`` [B + 1]."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(
        torch.arange(len(lengths), device=offsets.device), lengths, output_size=length
    )


def _lengths(offsets: torch.Tensor) -> torch.Tensor:
    """float32 [B, 1] bag lengths, at least 1."""
    return (offsets[1:] - offsets[:-1]).clamp(min=1).to(torch.float32)[:, None]


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root (float64 sqrt, rounded once)."""
    return x.double().sqrt().float()


def _apply_rule(rule: str, w: torch.Tensor, st: torch.Tensor, g: torch.Tensor, hp: dict, step: int) -> None:
    """One rule of ``spec/embedding.md`` on float32 ``w`` [N, D], ``st`` [N, S] in place."""
    if hp["weight_decay"]:
        g = g + hp["weight_decay"] * w
    if rule == "sgd":
        w -= hp["lr"] * g
    elif rule == "rowwise_adagrad":
        squares = g * g
        total = torch.zeros(len(g), device=g.device)
        for c in range(g.shape[1]):  # left to right, as FBGEMM's row sum
            total = total + squares[:, c]
        st[:, 0] = st[:, 0] + total / g.shape[1]
        w -= hp["lr"] * (g / (_sqrt(st[:, 0]) + hp["eps"])[:, None])
    else:
        dim, beta1, beta2 = g.shape[1], hp["beta1"], hp["beta2"]
        m = beta1 * st[:, :dim] + (1 - beta1) * g
        v = beta2 * st[:, dim:] + (1 - beta2) * (g * g)
        st[:, :dim], st[:, dim:] = m, v
        step_size, root = hp["lr"] / (1 - beta1**step), (1 - beta2**step) ** 0.5
        w -= step_size * (m / (_sqrt(v) / root + hp["eps"]))


class EmbeddingEngine:
    """The torch embedding engine over torch store engines.

    Args:
        weights: the store engine holding the weights (and the state when offloaded).
        state: the store engine holding the optimizer state when not offloaded, else None.
        state_start: the first state column (from the start of the row) in its store.
        state_width: the state's columns in its store (float32 values as row elements).
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``.
    """

    backend = "torch"

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
                raise TypeError("the torch embedding engine needs torch store engines")
        self.weights, self.state = weights, state
        self.state_start, self.state_width = state_start, state_width
        self.rule = optimizer
        self.device = weights.device

    def pool_rows(self, rows, inverse, offsets, per_sample_weights, mean) -> torch.Tensor:
        """float32 [B, D]: each bag's rows (``rows[inverse[p]]``, weighted) summed in order."""
        contributions = rows.float()[inverse]
        if per_sample_weights is not None:
            contributions = contributions * per_sample_weights[:, None]
        pooled = torch.zeros(len(offsets) - 1, rows.shape[1], device=rows.device)
        pooled.index_add_(0, _bags(offsets, len(inverse)), contributions)
        return pooled / _lengths(offsets) if mean else pooled

    def row_gradients(
        self, unique_count, inverse, offsets, per_sample_weights, mean, grad_output
    ) -> torch.Tensor:
        """float32 [U, D]: each distinct id's gradient, its positions summed in order."""
        if mean:
            grad_output = grad_output / _lengths(offsets)
        contributions = grad_output[_bags(offsets, len(inverse))]
        if per_sample_weights is not None:
            contributions = contributions * per_sample_weights[:, None]
        grad = torch.zeros(unique_count, grad_output.shape[1], device=grad_output.device)
        return grad.index_add_(0, inverse, contributions)

    def pool(self, unique, inverse, offsets, per_sample_weights, mean) -> torch.Tensor:
        layout = self.weights.layout
        rows = self.weights.gather(unique, start=layout.weight_offset, width=layout.dim, initial=True)
        return self.pool_rows(rows, inverse, offsets, per_sample_weights, mean)

    def update(
        self, unique, inverse, offsets, per_sample_weights, mean, grad_output, *, hyperparameters, step, now
    ) -> None:
        layout = self.weights.layout
        grad = self.row_gradients(len(unique), inverse, offsets, per_sample_weights, mean, grad_output)
        dim, first, begin, width = layout.dim, layout.weight_offset, self.state_start, self.state_width
        with self.weights.writing():
            blocks = self.weights.locate(unique, insert=True)
            rows = self.weights.read_blocks(blocks)
            weights = rows[:, first : first + dim].float()
            if self.state is None:
                state = rows[:, begin : begin + width].contiguous().view(torch.float32)
                _apply_rule(self.rule, weights, state, grad, hyperparameters, step)
                rows[:, begin : begin + width] = state.view(rows.dtype)
            else:
                with self.state.writing():
                    state_blocks = self.state.locate(unique, insert=True)
                    state_rows = self.state.read_blocks(state_blocks)
                    state = state_rows[:, begin : begin + width]
                    _apply_rule(self.rule, weights, state, grad, hyperparameters, step)
                    stamp(state_rows, 1, now)
                    self.state.write_blocks(state_blocks, state_rows)
            rows[:, first : first + dim] = weights
            stamp(rows, 1, now)
            self.weights.write_blocks(blocks, rows)
