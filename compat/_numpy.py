"""numpy, which reading and writing checkpoints needs and ``import leanstate`` does not.

torch needs no numpy, and neither do ZeRO, the activation wrappers and the torch store:
without numpy installed, ``import leanstate`` works, and a checkpoint call says what to
install (:func:`require`). The checkpoint modules import ``np`` from here, at the top,
like any module: nothing of leanstate is imported on first use, so the import graph
reads as it runs.
"""

try:
    import numpy as np
except ImportError as _missing:
    _reason: ImportError | None = _missing

    class _NoNumpy:
        """Stands in for numpy where it is not installed: any use names the fix."""

        def __getattr__(self, name: str):
            raise ModuleNotFoundError(
                f"leanstate: checkpoints need numpy (numpy.{name}), which is not installed: pip install numpy"
            ) from _reason

        def __repr__(self) -> str:
            return "<numpy: not installed>"

    np = _NoNumpy()
else:
    _reason = None


def require(method: str) -> None:
    """Raise ``ModuleNotFoundError`` naming ``method`` and the fix unless numpy is installed:
    before a checkpoint call touches a file."""
    if _reason is not None:
        raise ModuleNotFoundError(
            f"{method}: checkpoints need numpy, which is not installed: pip install numpy"
        ) from _reason


__all__ = ["np", "require"]
