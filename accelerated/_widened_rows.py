"""16-bit rows widened to float32 for the numba and numba-cuda update kernels, shared by
both engines (neither imports the other)."""

from __future__ import annotations

import torch

from leanstate.reference.row_format import header_words


class WidenedRows:
    """Touched 16-bit rows widened for float32 kernels (numba has no 16-bit arithmetic).

    ``values`` is float32 ``[N, dim + state floats]``: the weights, then (when the state
    lives in the row) the state's float32 values; ``header`` the rows' int64 header words.
    A kernel updates both in place; ``rounded_rows()`` writes them back into the rows,
    each new weight rounded once. Shared by the numba and numba-cuda engines.
    """

    def __init__(
        self, rows: torch.Tensor, layout, state_start: int, state_width: int, state_in_row: bool
    ) -> None:
        self.rows, self.layout = rows, layout
        self.state = slice(state_start, state_start + state_width) if state_in_row and state_width else None
        dim, first = layout.dim, layout.weight_offset
        floats = state_width * rows.element_size() // 4 if self.state is not None else 0
        self.values = torch.empty(len(rows), dim + floats, device=rows.device)
        self.values[:, :dim] = rows[:, first : first + dim]
        if self.state is not None:
            self.values[:, dim:] = rows[:, self.state].contiguous().view(torch.float32)
        self.header = header_words(rows).contiguous()

    def rounded_rows(self) -> torch.Tensor:
        """The rows with the updated weights (rounded once), state bytes and headers."""
        rows, dim, first = self.rows, self.layout.dim, self.layout.weight_offset
        rows[:, first : first + dim] = self.values[:, :dim]
        if self.state is not None:
            rows[:, self.state] = self.values[:, dim:].view(rows.dtype)
        header_words(rows)[:] = self.header
        return rows
