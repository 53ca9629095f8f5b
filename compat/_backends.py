"""Backend registry and selection, per component, at import time.

A component (``"kv_store"``, ...) maps backend names to the module that implements it
(``spec/backends.md``). Adding a backend is one file and one line in ``_IMPLEMENTATIONS``;
``backend_info()``, the differential tests, the CLI and the benchmarks enumerate it. Selection reads
``LEANSTATE_BACKEND`` (``auto`` by default, or a backend name): under ``auto`` a CUDA
machine prefers ``torch``, others ``numba`` then ``torch``, and everything ends at
``reference``. A
missing or broken optional dependency never breaks ``import leanstate``: the choice
falls back, and the reason is kept for :func:`backend_info`.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

BACKENDS = ("reference", "numba", "numba-cuda", "torch")
ENV_VAR = "LEANSTATE_BACKEND"

# component -> backend -> module holding the implementation classes.
_IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    "kv_store": {
        "reference": "leanstate.reference.kv_store",
        "numba": "leanstate.accelerated.numba_kv_store",
        "torch": "leanstate.accelerated.torch_kv_store",
    },
    "embedding": {
        "reference": "leanstate.reference.embedding",
        "numba": "leanstate.accelerated.numba_embedding",
        "torch": "leanstate.accelerated.torch_embedding",
    },
    "checkpoint": {
        "reference": "leanstate.reference.checkpoint",
        "numba": "leanstate.accelerated.numba_checkpoint",
    },
    "wrappers": {
        "reference": "leanstate.reference.wrappers",
    },
    "zero": {
        "reference": "leanstate.reference.zero",
        "torch": "leanstate.accelerated.torch_zero",
    },
}


def _probe(backend: str) -> str | None:
    """None when the backend's dependencies work here, else why not."""
    try:
        if backend == "numba":
            importlib.import_module("numba")
        elif backend == "numba-cuda":
            cuda = importlib.import_module("numba.cuda")
            if not cuda.is_available():
                return "numba.cuda reports no usable CUDA device"
        elif backend == "torch":
            importlib.import_module("torch")
    except Exception as exc:  # a broken install raises more than ImportError
        return f"cannot import its dependency ({type(exc).__name__}: {exc})"
    return None


def _cuda_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _auto_order() -> tuple[str, ...]:
    return ("torch", "numba", "reference") if _cuda_present() else ("numba", "torch", "reference")


@dataclass
class BackendInfo:
    """What was chosen for each component and why; ``str()`` gives a readable report."""

    requested: str
    chosen: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, list[str]] = field(default_factory=dict)
    dependencies: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"leanstate backends ({ENV_VAR}={self.requested})"]
        for component, backend in self.chosen.items():
            lines.append(f"  {component}: {backend}")
            lines.extend(f"    - {reason}" for reason in self.reasons[component])
        lines.append("  dependencies:")
        lines.extend(f"    {name}: {state}" for name, state in self.dependencies.items())
        return "\n".join(lines)


def select(component: str, requested: str) -> tuple[str, list[str]]:
    """Pick the backend for ``component`` given a request; returns (backend, reasons)."""
    reasons: list[str] = []
    available = _IMPLEMENTATIONS[component]
    if requested == "auto":
        order = _auto_order()
        reasons.append(f"auto order here: {' > '.join(order)}")
    elif requested in BACKENDS:
        order = (requested, *(b for b in _auto_order() if b != requested))
    else:
        reasons.append(f"unknown backend {requested!r} (known: {', '.join(BACKENDS)}); using auto")
        order = _auto_order()
    for backend in order:
        if backend not in available:
            reasons.append(f"{backend}: no {backend} implementation of {component} yet")
            continue
        problem = _probe(backend)
        if problem is not None:
            reasons.append(f"{backend}: {problem}")
            continue
        reasons.append(f"chose {backend}")
        return backend, reasons
    raise AssertionError("the reference backend is always available")  # pragma: no cover


def resolve(component: str, backend: str | None) -> tuple[str, str]:
    """(backend name, module) implementing ``component``: the import-time choice or an explicit one.

    An explicit ``backend=`` that cannot serve raises ``ValueError`` saying why.
    """
    if backend is None:
        name = _CHOSEN.chosen[component]
        return name, _IMPLEMENTATIONS[component][name]
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend not in _IMPLEMENTATIONS[component]:
        have = ", ".join(_IMPLEMENTATIONS[component])
        raise ValueError(f"backend={backend!r} has no implementation of {component}; available: {have}")
    problem = _probe(backend)
    if problem is not None:
        raise ValueError(f"backend={backend!r} is unavailable here: {problem}")
    return backend, _IMPLEMENTATIONS[component][backend]


def _select_all() -> BackendInfo:
    requested = os.environ.get(ENV_VAR, "auto").strip() or "auto"
    info = BackendInfo(requested=requested)
    for component in _IMPLEMENTATIONS:
        info.chosen[component], info.reasons[component] = select(component, requested)
    return info


def backend_info() -> BackendInfo:
    """Which backend each component uses, why, and the state of the optional dependencies.

    Example::

        >>> print(leanstate.backend_info())  # doctest: +SKIP
        leanstate backends (LEANSTATE_BACKEND=auto)
          kv_store: reference
            - auto order here: numba > torch > reference
            - numba: no numba implementation of kv_store yet
            - chose reference
          ...
    """
    for backend in BACKENDS[1:]:
        problem = _probe(backend)
        _CHOSEN.dependencies[backend] = "available" if problem is None else problem
    _CHOSEN.dependencies["cuda"] = "present" if _cuda_present() else "absent"
    return _CHOSEN


_CHOSEN = _select_all()
