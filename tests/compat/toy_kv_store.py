"""A toy store backend: the one file a new backend adds (the test registers it in one line).

It keeps the reference engine's rows inside and passes every call through, so the
machinery around it (registry, selection, ``backend_info``, the differential machine,
the bench) is what the test exercises.
"""

from __future__ import annotations

from leanstate.reference.kv_store import KVStoreEngine as _Inner

DEVICES = ("cpu",)
AUTO_PRIORITY: dict[str, int] = {}  # never picked by auto: only by name
BENCH_TARGETS = {"get": (">=", 0.0)}


class KVStoreEngine:
    """Every engine call passed through to a reference engine held inside."""

    backend = "toy"

    def __init__(self, layout, *, num_shards, init_range, seed, device=None) -> None:
        self.layout = layout
        self.inner = _Inner(layout, num_shards=num_shards, init_range=init_range, seed=seed)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
