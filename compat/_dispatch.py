"""Public classes that build the instance of the backend chosen for their component."""

from __future__ import annotations

import importlib
import sys

from leanstate import _backends


class BackendDispatch(type):
    """Metaclass: ``Cls(..., backend=None)`` builds the chosen backend's class of that name.

    ``isinstance(obj, Cls)`` holds for an instance of any backend's class.
    """

    _component: str

    def __call__(cls, *args, backend: str | None = None, **kwargs):
        return cls._implementation(backend)(*args, **kwargs)

    def _implementation(cls, backend: str | None) -> type:
        module = importlib.import_module(_backends.resolve(cls._component, backend)[1])
        return getattr(module, cls.__name__)

    def __instancecheck__(cls, obj: object) -> bool:
        for name in _backends._IMPLEMENTATIONS[cls._component].values():
            module = sys.modules.get(name)
            if module is not None and isinstance(obj, getattr(module, cls.__name__)):
                return True
        return False
