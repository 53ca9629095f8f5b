"""KV embedding bags, reference engine: pooled lookups and the fused optimizer rules.

``leanstate.KVEmbeddingBag`` (the front module) validates its input, deduplicates the
ids and calls two engine methods per step (``spec/backends.md``):

- ``pool``: gather the distinct ids' weights and pool them into bags;
- ``update``: in backward, sum each distinct id's gradient and apply the optimizer to
  its weights and state **in the store**, with no separate ``optimizer.step()``, as
  FBGEMM's table-batched embeddings do.

The update rules are plain functions with one signature (the ``torch/optim/adam.py``
model): ``rule(weights, state, grad, *, lr, eps, beta1, beta2, weight_decay, step)``
updates ``weights`` [N, D] and ``state`` [N, S] in place. Each is written as a fixed
sequence of float32 operations, each rounded once (no fused multiply-add, row sums
left to right, square roots correctly rounded), so an accelerated engine can restate
it bit for bit. See
``spec/embedding.md``.

Example::

    >>> weights = torch.ones(2, 3); state = torch.zeros(2, 0)
    >>> sgd(weights, state, torch.ones(2, 3), lr=0.5, eps=0.0, beta1=0.0, beta2=0.0, weight_decay=0.0, step=1)
    >>> weights
    tensor([[0.5000, 0.5000, 0.5000],
            [0.5000, 0.5000, 0.5000]])
"""

from __future__ import annotations

import torch

from leanstate.reference.kv_store import KVStoreEngine

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")


def state_fields(optimizer: str, dim: int) -> dict[str, tuple[int, int]]:
    """Optimizer-state fields: name -> (first state column, width), float32 each."""
    if optimizer == "rowwise_adagrad":
        return {"momentum1": (0, 1)}
    if optimizer == "adam":
        return {"exp_avg": (0, dim), "exp_avg_sq": (dim, dim)}
    return {}


def state_elements(optimizer: str, dim: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` holding the optimizer's float32 state: its bytes (two 16-bit
    elements per value)."""
    return sum(width for _, width in state_fields(optimizer, dim).values()) * 4 // dtype.itemsize


def _decayed(weights: torch.Tensor, grad: torch.Tensor, weight_decay: float) -> torch.Tensor:
    """L2 weight decay in torch.optim's form: ``g + weight_decay * w``."""
    return grad + weight_decay * weights if weight_decay else grad


def sgd(weights, state, grad, *, lr, eps, beta1, beta2, weight_decay, step) -> None:
    """``w = w - lr * g``."""
    grad = _decayed(weights, grad, weight_decay)
    weights.sub_(lr * grad)


def _row_sum_left_to_right(values: torch.Tensor) -> torch.Tensor:
    """Sum of each row, accumulated column by column from the left, in float32."""
    total = torch.zeros(values.shape[0], dtype=values.dtype)
    for c in range(values.shape[1]):
        total = total + values[:, c]
    return total


def rowwise_adagrad(weights, state, grad, *, lr, eps, beta1, beta2, weight_decay, step) -> None:
    """FBGEMM's exact rowwise Adagrad: one accumulator per row, the mean of ``g * g``.

    ``m = m + sum(g * g) / D``; ``w = w - lr * (g / (sqrt(m) + eps))``.
    """
    grad = _decayed(weights, grad, weight_decay)
    momentum = state[:, 0]
    momentum.copy_(momentum + _row_sum_left_to_right(grad * grad) / weights.shape[1])
    denominator = _sqrt(momentum) + eps
    weights.sub_(lr * (grad / denominator[:, None]))


def adam(weights, state, grad, *, lr, eps, beta1, beta2, weight_decay, step) -> None:
    """Adam with bias correction by ``step`` (the module's backward count).

    ``m = b1 * m + (1 - b1) * g``; ``v = b2 * v + (1 - b2) * (g * g)``;
    ``w = w - (lr / (1 - b1^t)) * (m / (sqrt(v) / sqrt(1 - b2^t) + eps))``; the scalar
    factors are computed in double precision, then rounded to float32.
    """
    grad = _decayed(weights, grad, weight_decay)
    dim = weights.shape[1]
    exp_avg, exp_avg_sq = state[:, :dim], state[:, dim : 2 * dim]
    exp_avg.copy_(beta1 * exp_avg + (1 - beta1) * grad)
    exp_avg_sq.copy_(beta2 * exp_avg_sq + (1 - beta2) * (grad * grad))
    step_size = lr / (1 - beta1**step)
    root_correction = (1 - beta2**step) ** 0.5
    weights.sub_(step_size * (exp_avg / (_sqrt(exp_avg_sq) / root_correction + eps)))


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root (through float64: the double rounding is exact).

    torch's vectorised float32 ``sqrt`` may be off by one unit in the last place.
    """
    return torch.sqrt(x.double()).float()


RULES = {"sgd": sgd, "rowwise_adagrad": rowwise_adagrad, "adam": adam}


def bag_of_positions(offsets: torch.Tensor, length: int) -> torch.Tensor:
    """The bag index of each of ``length`` positions, from ``offsets`` [B + 1]."""
    return torch.repeat_interleave(torch.arange(len(offsets) - 1), torch.diff(offsets), output_size=length)


def bag_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """Positions per bag as float32 [B, 1], at least 1 (an empty bag's mean is zero)."""
    return torch.diff(offsets).clamp(min=1).to(torch.float32)[:, None]


def pool_rows(
    rows: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
) -> torch.Tensor:
    """float32 [B, D]: bag b sums ``rows[inverse[p]]`` (times ``per_sample_weights[p]``) over
    its positions p in order, from zero; a mean divides by the bag's length.

    ``rows`` [U, D] are the distinct ids' weights (any float dtype, read as float32).
    """
    contributions = rows.float()[inverse]
    if per_sample_weights is not None:
        contributions = contributions * per_sample_weights[:, None]
    pooled = torch.zeros(len(offsets) - 1, rows.shape[1])
    pooled.index_add_(0, bag_of_positions(offsets, len(inverse)), contributions)
    return pooled / bag_lengths(offsets) if mean else pooled


def row_gradients(
    unique_count: int,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    grad_output: torch.Tensor,
) -> torch.Tensor:
    """float32 [U, D]: each distinct id's gradient, summed over its positions in order from zero.

    A position's contribution is its bag's output gradient (divided by the bag's length
    for a mean, then times its per-sample weight).
    """
    if mean:
        grad_output = grad_output / bag_lengths(offsets)
    contributions = grad_output[bag_of_positions(offsets, len(inverse))]
    if per_sample_weights is not None:
        contributions = contributions * per_sample_weights[:, None]
    return torch.zeros(unique_count, grad_output.shape[1]).index_add_(0, inverse, contributions)


class EmbeddingEngine:
    """The reference embedding engine: gathers and scatters through the store engines.

    Args:
        weights: the store engine holding the weights (and the state when offloaded).
        state: the store engine holding the optimizer state when not offloaded, else None.
        state_start: the first state column (from the start of the row) in its store.
        state_width: the state's columns in its store (``state_elements`` of its dtype).
        optimizer: one of ``OPTIMIZERS``.
    """

    backend = "reference"

    def __init__(
        self,
        weights: KVStoreEngine,
        state: KVStoreEngine | None,
        *,
        state_start: int,
        state_width: int,
        optimizer: str,
    ) -> None:
        self.weights, self.state = weights, state
        self.state_start, self.state_width = state_start, state_width
        self.rule = RULES[optimizer]

    def pool_rows(self, rows, inverse, offsets, per_sample_weights, mean) -> torch.Tensor:
        """``pool_rows`` on given rows [U, D] (e.g. rows received from their owners)."""
        return pool_rows(rows, inverse, offsets, per_sample_weights, mean)

    def row_gradients(
        self, unique_count, inverse, offsets, per_sample_weights, mean, grad_output
    ) -> torch.Tensor:
        """``row_gradients``: each distinct id's gradient [U, D]."""
        return row_gradients(unique_count, inverse, offsets, per_sample_weights, mean, grad_output)

    def pool(
        self,
        unique: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mean: bool,
    ) -> torch.Tensor:
        """[B, D]: each bag's rows (``unique[inverse[p]]``), weighted, summed in position order.

        A mean divides the sum by the bag's length.
        """
        layout = self.weights.layout
        rows = self.weights.gather(unique, start=layout.weight_offset, width=layout.dim, initial=True)
        return pool_rows(rows, inverse, offsets, per_sample_weights, mean)

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
        """Sum each distinct id's gradient in position order, apply the rule, write the rows back.

        Missing ids are inserted from their initial rows; every updated row counts one
        more write and is stamped ``now``.
        """
        layout = self.weights.layout
        grad = row_gradients(len(unique), inverse, offsets, per_sample_weights, mean, grad_output)
        start, dim = layout.weight_offset, layout.dim
        if self.state is None:  # one read and one write of [weight | state] per row
            end = self.state_start + self.state_width if self.state_width else start + dim
            values = self.weights.gather(unique, start=start, width=end - start, initial=True)
            first = self.state_start - start
            # float32 rows are updated in place; 16-bit ones in float32 copies, rounded once back
            weights, state = values[:, :dim].float(), _state_floats(values[:, first:], self.state_width)
            self.rule(weights, state, grad, step=step, **hyperparameters)
            values[:, :dim] = weights
            if self.state_width:
                values[:, first : first + self.state_width] = state.view(values.dtype)
            self.weights.scatter(unique, values, start=start, now=now)
            return
        stored = self.weights.gather(unique, start=start, width=dim, initial=True)
        weights = stored.float()
        state = self.state.gather(unique, start=self.state_start, width=self.state_width, initial=True)
        self.rule(weights, state, grad, step=step, **hyperparameters)
        self.weights.scatter(unique, weights.to(stored.dtype), start=start, now=now)
        self.state.scatter(unique, state, start=self.state_start, now=now)


def _state_floats(columns: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` elements of ``columns`` read as float32 values (their bytes)."""
    state = columns[:, :width].contiguous()
    return state.view(torch.float32) if width else torch.zeros(len(columns), 0)
