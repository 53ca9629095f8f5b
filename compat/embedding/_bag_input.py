"""How a KV embedding bag checks and normalises a batch before any row moves: ids,
offsets and per-sample weights, each error naming the argument and the fix."""

from __future__ import annotations

import torch

from leanstate._host_reads import first_true, host_read


def check_ids(ids: object) -> torch.Tensor:
    """``ids`` if it is a dense int64 or int32 tensor (``nn.EmbeddingBag``'s id dtypes), else a
    ``TypeError`` saying how to fix it."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"KVEmbeddingBag: input must be a tensor of int64 ids; got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        how = " (convert them with ids.to(torch.int64))" if not ids.dtype.is_floating_point else ""
        raise TypeError(f"KVEmbeddingBag: input ids must be torch.int64 or torch.int32; got {ids.dtype}{how}")
    _check_dense("input", ids)
    return ids


def _check_dense(argument: str, tensor: torch.Tensor) -> None:
    """A strided tensor with data: sparse and meta tensors hold no values to look up."""
    if tensor.layout != torch.strided:
        raise TypeError(
            f"KVEmbeddingBag: {argument} must be a dense tensor; got layout {tensor.layout} (use .to_dense())"
        )
    if tensor.is_meta:
        raise TypeError(
            f"KVEmbeddingBag: {argument} is a meta tensor (shape only, no values); pass real data"
        )


def checked_batch(
    input,
    offsets,
    per_sample_weights,
    *,
    device: torch.device,
    num_embeddings: int | None,
    mode: str,
    include_last_offset: bool = False,
):
    """(1-D int64 ids, int64 offsets [B], float32 weights or None, the end of the last bag or
    None) on ``device``, every argument checked as ``KVEmbeddingBag.forward`` documents
    (``num_embeddings``, ``mode`` and ``include_last_offset`` are the bag's). With
    ``include_last_offset`` the given offsets' last entry is returned apart, as the end of
    the last bag (a 0-d tensor: reading it would wait for the device)."""
    ids = check_ids(input)
    if per_sample_weights is not None:
        if not isinstance(per_sample_weights, torch.Tensor):
            raise TypeError(
                f"KVEmbeddingBag: per_sample_weights must be a tensor; got {type(per_sample_weights).__name__}"
            )
        if not per_sample_weights.dtype.is_floating_point:
            raise TypeError(
                f"KVEmbeddingBag: per_sample_weights must be a real floating tensor; got {per_sample_weights.dtype}"
            )
        _check_dense("per_sample_weights", per_sample_weights)
    if ids.dim() == 2:
        if offsets is not None:
            raise ValueError("KVEmbeddingBag: offsets must be None for 2-D input (each row is one bag)")
        # bag b starts at b * L: [B, 0] input is B empty bags (zeros), as nn.EmbeddingBag gives
        offsets = torch.arange(ids.shape[0], dtype=torch.int64, device=ids.device) * ids.shape[1]
        if per_sample_weights is not None and per_sample_weights.shape != ids.shape:
            raise ValueError(
                f"KVEmbeddingBag: per_sample_weights has shape {tuple(per_sample_weights.shape)}; "
                f"input has {tuple(ids.shape)}"
            )
        ids = ids.reshape(-1)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
    elif ids.dim() == 1:
        if offsets is None:
            raise ValueError(
                "KVEmbeddingBag: offsets is required for 1-D input: the start of each bag, e.g. "
                "torch.tensor([0, 2]) for bags input[0:2] and input[2:]; or pass 2-D input [B, L]"
            )
        if (
            not isinstance(offsets, torch.Tensor)
            or offsets.dim() != 1
            or offsets.dtype.is_floating_point
            or offsets.dtype.is_complex
            or offsets.dtype == torch.bool
        ):
            raise TypeError(
                f"KVEmbeddingBag: offsets must be a 1-D integer tensor; got "
                f"{offsets.dtype if isinstance(offsets, torch.Tensor) else type(offsets).__name__}"
            )
        _check_dense("offsets", offsets)
    else:
        raise ValueError(f"KVEmbeddingBag: input must be 1-D or 2-D; got {ids.dim()}-D")
    ids, offsets = ids.to(device, torch.int64).contiguous(), offsets.to(device, torch.int64)
    end = None
    if include_last_offset and input.dim() == 1:  # nn.EmbeddingBag ignores the flag for 2-D input
        if not len(offsets):
            raise ValueError(
                "KVEmbeddingBag: include_last_offset=True needs B + 1 offsets (the last is the end of "
                "the last bag); got none"
            )
        offsets, end = offsets[:-1], offsets[-1]
    elif not len(offsets) and len(ids):
        raise ValueError(f"KVEmbeddingBag: offsets is empty but input holds {len(ids)} ids")
    if per_sample_weights is not None:
        if mode != "sum":
            raise ValueError("KVEmbeddingBag: per_sample_weights is only supported with mode='sum'")
        if not isinstance(per_sample_weights, torch.Tensor) or per_sample_weights.shape != ids.shape:
            raise ValueError(
                f"KVEmbeddingBag: per_sample_weights must be a tensor of input's shape {tuple(ids.shape)}"
            )
        # not detached: the weights' gradient (the rows of their ids) flows back to the caller
        per_sample_weights = per_sample_weights.to(device, torch.float32).contiguous()
    return ids, offsets, per_sample_weights, end


def batch_summary(
    ids: torch.Tensor, offsets: torch.Tensor, end: torch.Tensor | None, *, num_embeddings: int | None
) -> tuple[int, int]:
    """(padding ids among the bags' ids, how many leading ids the bags hold), after checking
    the values of ``ids``, ``offsets`` and ``end`` (offsets start at 0, never decrease and
    end within the input, ``end`` too; ids below ``num_embeddings``). ``end`` is the end of
    the last bag (``include_last_offset``), else the bags run to the end of the input; ids
    after it are in no bag, as ``nn.EmbeddingBag`` leaves them.

    Every value check and the padding count come back from the device in one read: on a
    GPU that is one wait per batch, not one per check."""
    if not len(ids) and not len(offsets):
        return 0, 0
    nothing = torch.zeros((), dtype=torch.bool, device=ids.device)
    last = torch.tensor(len(ids), device=ids.device) if end is None else end
    bad_offsets = (
        (
            (offsets[0] != 0) | (torch.diff(offsets) < 0).any() | (offsets[-1] > last)
            if len(offsets)
            else nothing
        )
        | (last < 0)
        | (last > len(ids))
    )
    outside = ids >= num_embeddings if num_embeddings is not None else torch.zeros_like(ids, dtype=torch.bool)
    in_bags = torch.arange(len(ids), device=ids.device) < last
    summary = torch.stack(
        [bad_offsets.to(torch.int64), first_true(outside), ((ids < 0) & in_bags).sum(), last]
    )
    offsets_wrong, outside_at, padding, length = host_read(summary.tolist)
    if offsets_wrong:
        given = offsets if end is None else torch.cat([offsets, end[None]])
        raise ValueError(
            f"KVEmbeddingBag: offsets must start at 0, never decrease and stay <= len(input)={len(ids)}; "
            f"got {given.tolist()[:8]}{'...' if len(given) > 8 else ''}"
        )
    if outside_at >= 0:
        raise ValueError(
            f"KVEmbeddingBag: id {int(ids[outside_at])} is outside [0, num_embeddings={num_embeddings}); "
            "pass num_embeddings=None for hashed ids (negative ids are padding)"
        )
    return padding, length
