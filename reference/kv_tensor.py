"""KVTensor: a 2-D, tensor-like view of rows of a KV store, read and written in chunks.

It never holds the table: ``narrow``/indexing read the rows asked for, ``set_range`` and
``copy_`` write them. With ``whole_rows=True`` rows include their 16-byte header and a
write takes each row's key from its header (the checkpoint path). With
``read_only=True`` every write is a no-op counted in ``ignored_writes``: the optimizer's
state-dict entries are such views, because whole rows already carried their state.
See ``spec/kv_tensor.md``.

Example::

    >>> store = KVStore(4)
    >>> store.set(torch.tensor([1, 2]), torch.ones(2, 4))
    >>> view = KVTensor(store)
    >>> view.shape
    torch.Size([2, 4])
    >>> view.narrow(0, 1, 1)
    tensor([[1., 1., 1., 1.]])
"""

from __future__ import annotations

import torch

from leanstate.reference.kv_store import SupportsRows

DEFAULT_CHUNK_ROWS = 8192


class KVTensor:
    """A ``[len(ids), width]`` view over ``store``.

    Args:
        store: the KV store viewed.
        ids: the row ids, in view order; default a snapshot of ``store.keys()``.
        whole_rows: columns count from the start of the row (header included) and
            writes are keyed by the header, not by ``ids``.
        width_offset: first column of the view.
        width: number of columns; default all columns from ``width_offset`` on.
        read_only: writes are ignored and counted in ``ignored_writes``.
    """

    def __init__(
        self,
        store: SupportsRows,
        *,
        ids: torch.Tensor | None = None,
        whole_rows: bool = False,
        width_offset: int = 0,
        width: int | None = None,
        read_only: bool = False,
    ) -> None:
        if ids is None:
            ids = store.keys()
        elif not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise TypeError("KVTensor: ids must be a 1-D torch.int64 tensor")
        total = store.layout.width if whole_rows else store.layout.value_width
        if not isinstance(width_offset, int) or not 0 <= width_offset <= total:
            raise ValueError(f"KVTensor: width_offset must be in [0, {total}]; got {width_offset!r}")
        if width is None:
            width = total - width_offset
        if not isinstance(width, int) or width < 0 or width_offset + width > total:
            raise ValueError(
                f"KVTensor: width_offset + width must be <= {total}; got {width_offset} + {width!r}"
            )
        self.store = store
        self.ids = ids.clone()
        self.whole_rows = whole_rows
        self.width_offset = width_offset
        self.width = width
        self.read_only = read_only
        self.ignored_writes = 0

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "KVTensor cannot be pickled (torch.save of a state_dict holding one): it is a view of a KV "
            "store, which may not fit in memory twice. Save the tables with "
            "leanstate.save_checkpoint(path, module.checkpoint_tables(), extra=module.extra_state()), "
            "or copy a small view out first with view[:]"
        )

    @property
    def shape(self) -> torch.Size:
        return torch.Size([len(self.ids), self.width])

    @property
    def dtype(self) -> torch.dtype:
        return self.store.dtype

    @property
    def ndim(self) -> int:
        return 2

    def size(self, dim: int | None = None) -> torch.Size | int:
        """Like ``Tensor.size``."""
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        flags = [f"width_offset={self.width_offset}"]
        if self.whole_rows:
            flags.append("whole_rows=True")
        if self.read_only:
            flags.append(f"read_only=True, ignored_writes={self.ignored_writes}")
        return f"KVTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {', '.join(flags)})"

    # -- reads ---------------------------------------------------------------------

    def _read(self, ids: torch.Tensor) -> torch.Tensor:
        if self.whole_rows:
            rows = self.store.get_rows(ids)
            return rows[:, self.width_offset : self.width_offset + self.width].clone()
        return self.store.get(ids, width_offset=self.width_offset, width=self.width)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows ``[start, start + length)`` as a tensor (only ``dim=0`` is supported)."""
        if dim != 0:
            raise ValueError(f"KVTensor.narrow: only dim=0 (rows) is supported; got dim={dim}")
        if not 0 <= start <= start + length <= len(self.ids):
            raise IndexError(
                f"KVTensor.narrow: rows [{start}, {start + length}) outside [0, {len(self.ids)})"
            )
        return self._read(self.ids[start : start + length])

    def __getitem__(self, index: int | slice) -> torch.Tensor:
        if isinstance(index, int):
            return self._read(self.ids[index : index + 1 or None])[0]
        if isinstance(index, slice) and index.step in (None, 1):
            return self._read(self.ids[index])
        raise TypeError(f"KVTensor indices must be an int or a row slice with step 1; got {index!r}")

    # -- writes --------------------------------------------------------------------

    def set_range(self, start: int, values: torch.Tensor) -> None:
        """Write ``values`` to rows ``[start, start + len(values))`` of the view."""
        n = values.shape[0] if isinstance(values, torch.Tensor) and values.dim() > 0 else -1
        if n < 0 or not 0 <= start <= start + n <= len(self.ids):
            raise IndexError(
                f"KVTensor.set_range: values must be a 2-D tensor whose rows fit in "
                f"[{start}, {len(self.ids)}); got start={start}, values of shape "
                f"{tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__}"
            )
        if self.read_only:
            self.ignored_writes += n
            return
        if values.dim() != 2 or values.shape[1] != self.width:
            raise ValueError(
                f"KVTensor.set_range: values must have width {self.width}; got {tuple(values.shape)}"
            )
        if self.whole_rows:
            if self.width_offset != 0 or self.width != self.store.layout.width:
                raise ValueError("KVTensor.set_range: a whole-row write needs the view's full width")
            self.store.set_rows(values)
        else:
            self.store.set(self.ids[start : start + n], values, width_offset=self.width_offset)

    def copy_(self, src: torch.Tensor | KVTensor, *, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> KVTensor:
        """Copy ``src`` (a tensor or KVTensor of the same shape) in, ``chunk_rows`` at a time."""
        if tuple(src.shape) != tuple(self.shape):
            raise ValueError(
                f"KVTensor.copy_: src has shape {tuple(src.shape)}, expected {tuple(self.shape)}"
            )
        if chunk_rows <= 0:
            raise ValueError(f"KVTensor.copy_: chunk_rows must be positive; got {chunk_rows}")
        for start in range(0, len(self.ids), chunk_rows):
            n = min(chunk_rows, len(self.ids) - start)
            self.set_range(start, src.narrow(0, start, n))
        return self
