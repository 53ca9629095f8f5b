"""A module's tables and its dense extra state, saved and restored together.

``checkpoint_tables()`` of a bag or a collection returns :class:`ModuleTables`: the
tables ``save_checkpoint`` / ``load_checkpoint`` take, which also know their module. A
save of them writes the module's ``extra_state()`` (its optimizer step: Adam's bias
correction counts it) beside the caller's ``extra``, and a load restores it, so
``save_checkpoint(path, ebc.checkpoint_tables())`` alone resumes exactly.
"""

from __future__ import annotations

from collections.abc import Mapping


class ModuleTables(dict):
    """``name -> table`` of one module, which ``owner`` saves and restores its extra state for."""

    def __init__(self, tables: Mapping, owner) -> None:
        super().__init__(tables)
        self.owner = owner


def with_module_extra(tables: object, extra: Mapping | None, method: str) -> Mapping | None:
    """``extra`` to save for ``tables``: with a module's tables, the module's extra state and
    the caller's ``extra`` (a key of both must hold the same value)."""
    if not isinstance(tables, ModuleTables):
        return extra
    mine = tables.owner.extra_state()
    if extra is None:
        return mine
    if not isinstance(extra, Mapping):
        return extra  # refused, naming extra, by the save's own check
    clash = [key for key in mine if key in extra and extra[key] != mine[key]]
    if clash:
        raise ValueError(
            f"{method}: extra[{clash[0]!r}] is {extra[clash[0]]!r}, but the module whose checkpoint_tables() "
            f"these are holds {mine[clash[0]]!r} there (its extra state is saved with its tables): "
            "leave that key out of extra"
        )
    return {**mine, **extra}


def restore_module_extra(tables: object, extra: Mapping) -> None:
    """After a load of a module's tables: its extra state from ``extra`` (a checkpoint saved
    without it leaves the module's as it was)."""
    if isinstance(tables, ModuleTables) and all(key in extra for key in tables.owner.extra_state()):
        tables.owner.load_extra_state(extra)
