"""Backend registry and selection, per component, at import time.

``REGISTRY`` holds one line per (component, backend): the module that implements it
(``spec/backends.md``). Only components with more than one backend are here: the
store, the embedding updates and the offload copier (``offload``); the checkpoint I/O,
ZeRO and the wrappers are one implementation each. ``leanstate.register_backend`` is
the public hook that adds a line. Each engine module describes itself:

- ``DEVICES``: the device types it runs on (``("cpu",)``, ``("cuda",)``, ...);
- ``AUTO_PRIORITY``: device type -> priority under ``auto`` (higher first; a device it
  does not name is one where ``auto`` never picks it);
- ``BENCH_TARGETS``: figure -> (``">="`` or ``"<="``, ratio) for ``leanstate bench``;
- ``unavailable()`` (optional): why it cannot run here, or None.

The reference engines, being textbooks, declare none of these: :data:`REFERENCE_DEVICES`
says where they run, and ``auto`` ends every order with them.

A module that fails to import (its optional dependency is missing or broken) is
unavailable, with the error as the reason. Adding a backend is one file and one line
here; ``backend_info()``, the differential tests, ``leanstate bench`` and the asv
suites enumerate the registry. Selection reads ``LEANSTATE_BACKEND`` (``auto`` by
default, or a backend name): a name is tried first, then the ``auto`` order of this
machine, which always ends at ``reference``. A component's choice is made the first
time it is needed (``LEANSTATE_BACKEND`` is read at import), so importing leanstate
loads no engine module. A missing backend never fails: the choice falls back, and the
reason is kept for :func:`backend_info`.
"""

from __future__ import annotations

import copy
import importlib
import os
import warnings
from dataclasses import dataclass, field
from types import ModuleType

ENV_VAR = "LEANSTATE_BACKEND"

REGISTRY: dict[tuple[str, str], str] = {
    ("kv_store", "reference"): "leanstate.reference.kv_store",
    ("kv_store", "numba"): "leanstate.accelerated.numba_kv_store",
    ("kv_store", "numba-cuda"): "leanstate.accelerated.numba_cuda_kv_store",
    ("kv_store", "torch"): "leanstate.accelerated.torch_kv_store",
    ("embedding", "reference"): "leanstate.reference.embedding",
    ("embedding", "numba"): "leanstate.accelerated.numba_embedding",
    ("embedding", "numba-cuda"): "leanstate.accelerated.numba_cuda_embedding",
    ("embedding", "torch"): "leanstate.accelerated.torch_embedding",
    ("offload", "reference"): "leanstate.reference.wrappers",
    ("offload", "torch"): "leanstate.accelerated.torch_wrappers",
}


# The reference engines are textbooks and say nothing of the registry: what it needs to
# know of them is said here (they run wherever torch runs their device; ``auto`` ends
# every order with them; the bench reports them beside the peers, without targets).
REFERENCE_DEVICES = {"kv_store": ("cpu",), "embedding": ("cpu",), "offload": ("cpu", "cuda")}


def devices(component: str, backend: str, module: ModuleType) -> tuple[str, ...]:
    """The device types ``backend``'s engine of ``component`` runs on."""
    return REFERENCE_DEVICES[component] if backend == "reference" else module.DEVICES


def components() -> list[str]:
    """The registered components, in registry order."""
    return list(dict.fromkeys(component for component, _ in REGISTRY))


def backends() -> list[str]:
    """Every registered backend name, in registry order."""
    return list(dict.fromkeys(backend for _, backend in REGISTRY))


def implementations(component: str) -> list[str]:
    """The backends registered for ``component``, in registry order."""
    return [backend for c, backend in REGISTRY if c == component]


def available(component: str) -> list[str]:
    """The backends registered for ``component`` that load here, in registry order."""
    return [backend for backend in implementations(component) if load(component, backend)[1] is None]


def register(component: str, backend: str, module: str) -> None:
    """Add (or replace) one registry line and redo the import-time selection.

    The hook a new backend (or a test's toy backend) uses; :func:`unregister` undoes it.
    """
    REGISTRY[(component, backend)] = module
    _PROBED.pop(module, None)
    CHOSEN.reselect()


def unregister(component: str, backend: str) -> None:
    """Remove one registry line and redo the import-time selection."""
    _PROBED.pop(REGISTRY.pop((component, backend)), None)
    CHOSEN.reselect()


_PROBED: dict[str, tuple[ModuleType | None, str | None]] = {}


def load(component: str, backend: str) -> tuple[ModuleType | None, str | None]:
    """(module, None) when ``backend`` of ``component`` works here, else (None, why not)."""
    name = REGISTRY[(component, backend)]
    if name not in _PROBED:
        try:
            module = importlib.import_module(name)
            problem = module.unavailable() if hasattr(module, "unavailable") else None
        except Exception as exc:  # a broken install raises more than ImportError
            module, problem = None, f"cannot import its dependency ({type(exc).__name__}: {exc})"
        _PROBED[name] = (None, problem) if problem else (module, None)
    return _PROBED[name]


def cuda_present() -> bool:
    """Whether torch sees a CUDA device."""
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def device_type() -> str:
    """The device type ``auto`` prefers on this machine: ``"cuda"`` or ``"cpu"``."""
    return "cuda" if cuda_present() else "cpu"


def auto_order(component: str) -> list[str]:
    """``component``'s backends that ``auto`` may pick on this machine, best first.

    The order follows each module's ``AUTO_PRIORITY`` for this device; a module that
    cannot be imported is ranked by the registry alone (its reason is reported anyway).
    """
    device = device_type()
    ranked = []
    for index, backend in enumerate(implementations(component)):
        module, _ = load(component, backend)
        priority = getattr(module, "AUTO_PRIORITY", {}).get(device) if module else 0
        if backend == "reference":
            priority = -1  # the end of every order
        if priority is not None:
            ranked.append((-priority, index, backend))
    return [backend for *_, backend in sorted(ranked)]


@dataclass
class BackendInfo:
    """What was chosen for each component and why; ``str()`` gives a readable report.

    ``registered`` maps each component to its registered backends; ``dependencies``
    says, per backend, whether its modules load here.
    """

    requested: str
    chosen: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, list[str]] = field(default_factory=dict)
    registered: dict[str, list[str]] = field(default_factory=dict)
    dependencies: dict[str, str] = field(default_factory=dict)

    def choice(self, component: str) -> str:
        """The backend chosen for ``component``, selected on first use (so ``import leanstate``
        loads no engine module, and a program using only ZeRO never imports numba)."""
        if component not in self.chosen:
            self.registered[component] = implementations(component)
            self.chosen[component], self.reasons[component] = select(component, self.requested)
        return self.chosen[component]

    def reselect(self) -> None:
        """Forget every selection (after the registry changed); each is redone on first use."""
        self.chosen.clear()
        self.reasons.clear()
        self.registered.clear()

    def __str__(self) -> str:
        lines = [f"leanstate backends ({ENV_VAR}={self.requested})"]
        for component, backend in self.chosen.items():
            lines.append(f"  {component}: {backend} (registered: {', '.join(self.registered[component])})")
            lines.extend(f"    - {reason}" for reason in self.reasons[component])
        lines.append("  dependencies:")
        lines.extend(f"    {name}: {state}" for name, state in self.dependencies.items())
        return "\n".join(lines)


def select(component: str, requested: str) -> tuple[str, list[str]]:
    """Pick the backend for ``component`` given a request; returns (backend, reasons)."""
    reasons: list[str] = []
    order = auto_order(component)
    known = backends()
    if requested == "auto":
        reasons.append(f"auto order here ({device_type()}): {' > '.join(order)}")
    elif requested in known:
        order = [requested, *(b for b in order if b != requested)]
    else:
        reasons.append(f"unknown backend {requested!r} (known: {', '.join(known)}); using auto")
    for backend in order:
        if backend not in implementations(component):
            reasons.append(f"{backend}: no {backend} implementation of {component}")
            continue
        _, problem = load(component, backend)
        if problem is not None:
            reasons.append(f"{backend}: {problem}")
            continue
        reasons.append(f"chose {backend}")
        return backend, reasons
    raise AssertionError("the reference backend is always available")  # pragma: no cover


def resolve(component: str, backend: str | None) -> tuple[str, ModuleType]:
    """(backend name, module) implementing ``component``: the import-time choice or an explicit one.

    An explicit ``backend=`` that cannot serve raises ``ValueError`` saying why.
    """
    if backend is None:
        backend = CHOSEN.choice(component)
    elif backend not in backends():
        raise ValueError(f"backend={backend!r} is not one of {', '.join(backends())}")
    elif backend not in implementations(component):
        have = ", ".join(implementations(component))
        raise ValueError(f"backend={backend!r} has no implementation of {component}; available: {have}")
    module, problem = load(component, backend)
    if problem is not None:
        raise ValueError(f"backend={backend!r} is unavailable here: {problem}")
    return backend, module


def backend_info() -> BackendInfo:
    """Which backend each component uses, why, and which backends load here: a snapshot
    (changing it changes nothing; the selection itself is made once per component).

    Example::

        >>> print(leanstate.backend_info())  # doctest: +SKIP
        leanstate backends (LEANSTATE_BACKEND=auto)
          kv_store: numba (registered: reference, numba, numba-cuda, torch)
            - auto order here (cpu): numba > torch > reference
            - chose numba
          ...
    """
    for component in components():
        CHOSEN.choice(component)
    for table in (CHOSEN.chosen, CHOSEN.reasons, CHOSEN.registered):  # registry order
        ordered = {c: table.pop(c) for c in components()}
        table.update(ordered)
    CHOSEN.dependencies.clear()
    for (component, backend), _ in REGISTRY.items():
        problem = load(component, backend)[1]
        state = "available" if problem is None else problem
        if CHOSEN.dependencies.get(backend, "available") == "available":
            CHOSEN.dependencies[backend] = state
    CHOSEN.dependencies["cuda"] = "present" if cuda_present() else "absent"
    return copy.deepcopy(CHOSEN)


CHOSEN = BackendInfo(requested=os.environ.get(ENV_VAR, "auto").strip() or "auto")
if CHOSEN.requested != "auto" and CHOSEN.requested not in backends():
    warnings.warn(
        f"{ENV_VAR}={CHOSEN.requested!r} is not a backend (one of auto, {', '.join(backends())}); "
        "choosing as for auto (leanstate.backend_info() says what was chosen)",
        stacklevel=2,
    )
