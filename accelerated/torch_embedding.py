"""The ``torch`` embedding engine: pooled forward and fused updates on the torch store's pool.

Same interface and bits as ``leanstate.reference.embedding.EmbeddingEngine``
(``spec/backends.md``). Forward reads the distinct ids' weights with one
``index_select`` on the pool (initial rows for missing ids) and pools them; backward
sums each distinct id's gradient, reads ``[weight | state]`` of every touched row with
one ``index_select``, applies the reference's rule (the arithmetic is the rule's own
torch ops, so the bits are the reference's) and writes the rows and their headers back
with one ``index_copy_``, all under the store's lock. Device-agnostic: the tensors live
where the store's pool does.
"""

from __future__ import annotations

import torch

from leanstate.accelerated.torch_kv_store import KVStoreEngine, stamp
from leanstate.reference.embedding import RULES, pool_rows, row_gradients, state_elements


class EmbeddingEngine:
    """The torch embedding engine over torch store engines.

    Args:
        weights: the store engine holding the weights (and the state when offloaded).
        state: the store engine holding the optimizer state when not offloaded, else None.
        state_start: the first state column (from the start of the row) in its store.
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``.
    """

    backend = "torch"

    def __init__(
        self, weights: KVStoreEngine, state: KVStoreEngine | None, *, state_start: int, optimizer: str
    ) -> None:
        for engine in (weights, state):
            if engine is not None and not isinstance(engine, KVStoreEngine):
                raise TypeError("the torch embedding engine needs torch store engines")
        self.weights, self.state, self.state_start = weights, state, state_start
        self.rule = RULES[optimizer]
        holder = weights if state is None else state
        self.state_width = state_elements(optimizer, weights.layout.dim, holder.layout.dtype)

    def pool_rows(self, rows, inverse, offsets, per_sample_weights, mean) -> torch.Tensor:
        """``pool_rows`` on given rows [U, D] (e.g. rows received from their owners)."""
        return pool_rows(rows, inverse, offsets, per_sample_weights, mean)

    def row_gradients(
        self, unique_count, inverse, offsets, per_sample_weights, mean, grad_output
    ) -> torch.Tensor:
        """``row_gradients``: each distinct id's gradient [U, D]."""
        return row_gradients(unique_count, inverse, offsets, per_sample_weights, mean, grad_output)

    def pool(self, unique, inverse, offsets, per_sample_weights, mean) -> torch.Tensor:
        layout = self.weights.layout
        rows = self.weights.gather(unique, start=layout.weight_offset, width=layout.dim, initial=True)
        return pool_rows(rows, inverse, offsets, per_sample_weights, mean)

    def update(
        self, unique, inverse, offsets, per_sample_weights, mean, grad_output, *, hyperparameters, step, now
    ) -> None:
        layout = self.weights.layout
        grad = row_gradients(len(unique), inverse, offsets, per_sample_weights, mean, grad_output)
        dim, first = layout.dim, layout.weight_offset
        with self.weights.lock:
            blocks = self.weights._blocks_for(unique)
            rows = self.weights.pool.index_select(0, blocks)
            weights = rows[:, first : first + dim].float()
            if self.state is None:
                columns = rows[:, self.state_start : self.state_start + self.state_width].contiguous()
                state = columns.view(torch.float32) if self.state_width else torch.zeros(len(rows), 0)
                self.rule(weights, state, grad, step=step, **hyperparameters)
                if self.state_width:
                    rows[:, self.state_start : self.state_start + self.state_width] = state.view(rows.dtype)
            else:
                with self.state.lock:
                    state_blocks = self.state._blocks_for(unique)
                    state_rows = self.state.pool.index_select(0, state_blocks)
                    state = state_rows[:, self.state_start : self.state_start + self.state_width]
                    self.rule(weights, state, grad, step=step, **hyperparameters)
                    stamp(state_rows, 1, now)
                    self.state.pool.index_copy_(0, state_blocks, state_rows)
            rows[:, first : first + dim] = weights
            stamp(rows, 1, now)
            self.weights.pool.index_copy_(0, blocks, rows)
