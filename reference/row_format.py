"""The row format shared by every store: ``[16-byte header | weight | optimizer state]``.

A row is one fixed-size block of ``width`` elements of one dtype (float32, float16 or
bfloat16). The header takes the first 16 bytes, ``16 / itemsize`` elements:

====== ===== =========================================================
bytes  type  meaning
====== ===== =========================================================
0-7    int64 key (the row's id), little-endian
8-11   u32   timestamp, seconds
12-15  u32   bits 0-30 ``count`` (saturating at 2**31 - 1), bit 31 ``used``
====== ===== =========================================================

Bytes 8-15 read as one int64 are the row's *eviction metadata*:
``timestamp | count << 32 | used << 63``. See ``spec/row_format.md``.

Example::

    >>> layout = RowLayout(dim=128, state_dim=1, dtype=torch.float32)
    >>> layout.width, layout.row_bytes
    (136, 544)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

HEADER_BYTES = 16
COUNT_MAX = 2**31 - 1
TIMESTAMP_MAX = 2**32 - 1
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_USED_BIT = -(2**63)  # bit 63 of an int64


def pad4(n: int) -> int:
    """Round ``n`` up to a multiple of 4 (FBGEMM pads dims this way)."""
    return (n + 3) // 4 * 4


def check_dtype(dtype: torch.dtype, argument: str = "dtype") -> None:
    """Raise ``TypeError`` unless ``dtype`` is a supported row dtype."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{argument} must be one of {names}; got {dtype}")


@dataclass(frozen=True)
class RowLayout:
    """Column offsets of one row, in elements of ``dtype``.

    ``dim`` weight elements are padded to ``pad4(dim)``; ``state_dim`` optimizer
    elements are padded to ``pad4(state_dim)`` (zero when there is no state). The
    derived fields are computed once, on first use (hot paths read them per call).
    """

    dim: int
    state_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        if not isinstance(self.dim, int) or self.dim <= 0:
            raise ValueError(f"dim must be a positive int; got {self.dim!r}")
        if not isinstance(self.state_dim, int) or self.state_dim < 0:
            raise ValueError(f"optimizer_state_dim must be an int >= 0; got {self.state_dim!r}")

    @classmethod
    def for_state_bytes(cls, dim: int, state_bytes: int, dtype: torch.dtype) -> RowLayout:
        """Layout whose optimizer state holds ``state_bytes`` bytes (rounded up to elements)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cls(dim, -(-state_bytes // itemsize), dtype)

    @cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @cached_property
    def header_elems(self) -> int:
        return HEADER_BYTES // self.itemsize

    @cached_property
    def padded_dim(self) -> int:
        return pad4(self.dim)

    @cached_property
    def padded_state_dim(self) -> int:
        return pad4(self.state_dim)

    @cached_property
    def weight_offset(self) -> int:
        """First weight column, counted from the start of the row."""
        return self.header_elems

    @cached_property
    def state_offset(self) -> int:
        """First optimizer-state column, counted from the start of the row."""
        return self.header_elems + self.padded_dim

    @cached_property
    def width(self) -> int:
        """Elements in one whole row, header included."""
        return self.header_elems + self.padded_dim + self.padded_state_dim

    @cached_property
    def value_width(self) -> int:
        """Elements after the header (what ``KVStore.get`` addresses)."""
        return self.width - self.header_elems

    @cached_property
    def row_bytes(self) -> int:
        return self.width * self.itemsize


def pack_metadata(timestamp: torch.Tensor, count: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """Eviction metadata ``timestamp | count << 32 | used << 63`` as int64."""
    meta = timestamp.to(torch.int64) | (count.to(torch.int64) << 32)
    return torch.where(used.to(torch.bool), meta | _USED_BIT, meta)


def unpack_metadata(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split int64 eviction metadata into (timestamp, count, used), all int64 but ``used``."""
    timestamp = meta & TIMESTAMP_MAX
    count = (meta >> 32) & COUNT_MAX
    return timestamp, count, meta < 0


def header_words(rows: torch.Tensor) -> torch.Tensor:
    """The headers of ``rows`` ([N, W]) as an int64 view [N, 2]: column 0 key, 1 metadata.

    It is a view: writing to it writes the rows' header bytes.
    """
    elems = HEADER_BYTES // rows.element_size()
    return rows[:, :elems].view(torch.int64)
