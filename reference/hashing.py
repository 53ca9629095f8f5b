"""Hashes that fix where an id lives and what its initial row is.

Both are stated twice: once per id in plain Python integers (the definition, easy to
check against ``spec/kv_store.md``), once over a whole tensor of ids with numpy uint64
arithmetic (which wraps modulo 2**64 exactly as the definition does). Tests hold the
second to the first. numpy is imported inside the functions that use it, so that
``import leanstate`` (ZeRO, the wrappers) needs torch alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np

MASK64 = 2**64 - 1
FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
SPLITMIX_GOLDEN = 0x9E3779B97F4A7C15
SPLITMIX_MIX1 = 0xBF58476D1CE4E5B9
SPLITMIX_MIX2 = 0x94D049BB133111EB
INIT_BITS = 24  # mantissa bits drawn per value: exact in float32, float16 rounds


def fnv64_broken(key: int) -> int:
    """FNV-1 64 over the 8 little-endian bytes of ``key``, each byte sign-extended.

    This is folly's ``fnv64_buf_BROKEN``, which FBGEMM's DRAM KV backend shards by.
    """
    h = FNV64_OFFSET
    for byte in (key & MASK64).to_bytes(8, "little"):
        h = (h * FNV64_PRIME) & MASK64
        h ^= (byte - 256 if byte >= 128 else byte) & MASK64
    return h


def shard_of(key: int, num_shards: int) -> int:
    """Shard of one id: the high 64 bits of ``num_shards * fnv64_broken(key)``."""
    return (num_shards * fnv64_broken(key)) >> 64


def splitmix64(x: int) -> int:
    """SplitMix64's output function of state ``x`` (increment, then mix)."""
    z = (x + SPLITMIX_GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * SPLITMIX_MIX1) & MASK64
    z = ((z ^ (z >> 27)) * SPLITMIX_MIX2) & MASK64
    return z ^ (z >> 31)


def init_bits(seed: int, key: int, column: int) -> int:
    """64 random bits for weight ``column`` of id ``key``: a pure function of the three."""
    return splitmix64(splitmix64(splitmix64(seed & MASK64) ^ (key & MASK64)) ^ column)


def init_value(seed: int, key: int, column: int, low: float, high: float) -> float:
    """Initial weight as a float32 value: ``low + (high - low) * u``, u in [0, 1).

    u is the top ``INIT_BITS`` bits of :func:`init_bits` over 2**INIT_BITS; each of the
    two operations is rounded to float32. The store then casts to its dtype.
    """
    import numpy as np

    f32 = np.float32
    u = f32((init_bits(seed, key, column) >> (64 - INIT_BITS)) / 2**INIT_BITS)
    span = f32(f32(high) - f32(low))
    return float(f32(f32(span * u) + f32(low)))


# Vectorised restatements -------------------------------------------------------------


def _u64(x: int) -> np.uint64:
    import numpy as np

    return np.uint64(x & MASK64)


def _ids_u64(ids: torch.Tensor) -> np.ndarray:
    import numpy as np

    return ids.detach().cpu().numpy().astype(np.int64, copy=False).view(np.uint64)


def shards_of(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """:func:`shard_of` for every id of a 1-D int64 tensor, as an int64 tensor."""
    import numpy as np

    keys = _ids_u64(ids)
    h = np.full(keys.shape, FNV64_OFFSET, dtype=np.uint64)
    for i in range(8):
        byte = ((keys >> np.uint64(8 * i)) & np.uint64(0xFF)).astype(np.uint8)
        h = h * _u64(FNV64_PRIME)
        h ^= byte.view(np.int8).astype(np.int64).view(np.uint64)  # sign extension
    # High 64 bits of num_shards * h with 32-bit limbs; num_shards < 2**32.
    n = _u64(num_shards)
    low_limb = h & np.uint64(0xFFFFFFFF)
    high_limb = h >> np.uint64(32)
    high = (n * high_limb + ((n * low_limb) >> np.uint64(32))) >> np.uint64(32)
    return torch.from_numpy(high.astype(np.int64))


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    import numpy as np

    z = x + _u64(SPLITMIX_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * _u64(SPLITMIX_MIX1)
    z = (z ^ (z >> np.uint64(27))) * _u64(SPLITMIX_MIX2)
    return z ^ (z >> np.uint64(31))


def initial_weights(
    ids: torch.Tensor, dim: int, *, seed: int, low: float, high: float, dtype: torch.dtype
) -> torch.Tensor:
    """[len(ids), dim] tensor of :func:`init_value` for columns ``0..dim-1``, in ``dtype``."""
    import numpy as np

    keys = _ids_u64(ids)
    seeded = _splitmix64_np(np.array([seed & MASK64], dtype=np.uint64))[0]
    per_key = _splitmix64_np(keys ^ seeded)
    columns = np.arange(dim, dtype=np.uint64)
    bits = _splitmix64_np(per_key[:, None] ^ columns[None, :])
    u = torch.from_numpy((bits >> np.uint64(64 - INIT_BITS)).astype(np.float32)) / 2**INIT_BITS
    span = torch.tensor(high, dtype=torch.float32) - torch.tensor(low, dtype=torch.float32)
    return (u * span + torch.tensor(low, dtype=torch.float32)).to(dtype)
