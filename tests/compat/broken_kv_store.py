"""A store backend with one bug (its ids listed newest-first): what ``verify`` must catch."""

from __future__ import annotations

from tests.compat.toy_kv_store import AUTO_PRIORITY, DEVICES  # noqa: F401
from tests.compat.toy_kv_store import KVStoreEngine as _Toy

BENCH_TARGETS: dict = {}


class KVStoreEngine(_Toy):
    backend = "broken"

    def keys(self):
        return self.inner.keys().flip(0)
