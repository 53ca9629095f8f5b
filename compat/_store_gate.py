"""A store's gate: many calls at once, or one thread's block of calls alone.

Every row call of a ``KVStore`` passes the gate *shared*: calls from many threads run
together, as before (the engine's own locks keep each call whole). ``KVStore.atomic()``
passes it *exclusive*: the calls its thread makes inside the block run while no other
thread's call does, so another thread sees all of the block's writes or none. A waiting
exclusive block goes before calls that arrive after it (a steady stream of readers
cannot starve it), and its own thread passes the gate freely while it holds it.

The gate is not reentrant for shared calls: a row call never makes another one while
inside the gate (a waiting exclusive block would then wait for it, and it for the block).
"""

from __future__ import annotations

import threading


class Gate:
    """Shared entries (``with gate.shared:``) or one exclusive holder (``with gate.exclusive:``)."""

    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._inside = 0  # shared calls now inside
        self._owner: int | None = None  # the exclusive holder's thread
        self._depth = 0  # its nested exclusive blocks
        self._waiting = 0  # exclusive blocks waiting: later shared calls queue behind them
        self.shared = _Shared(self)
        self.exclusive = _Exclusive(self)

    def _enter_shared(self) -> bool:
        """Enter shared; False when this thread holds the gate exclusively (nothing to undo)."""
        me = threading.get_ident()
        with self._condition:
            if self._owner == me:
                return False
            while self._owner is not None or self._waiting:
                self._condition.wait()
            self._inside += 1
            return True

    def _exit_shared(self) -> None:
        with self._condition:
            self._inside -= 1
            if not self._inside:
                self._condition.notify_all()

    def _enter_exclusive(self) -> None:
        me = threading.get_ident()
        with self._condition:
            if self._owner == me:
                self._depth += 1
                return
            self._waiting += 1
            try:
                while self._owner is not None or self._inside:
                    self._condition.wait()
            finally:
                self._waiting -= 1
            self._owner, self._depth = me, 1

    def _exit_exclusive(self) -> None:
        with self._condition:
            self._depth -= 1
            if not self._depth:
                self._owner = None
                self._condition.notify_all()


class _Shared:
    __slots__ = ("_gate", "_entered")

    def __init__(self, gate: Gate) -> None:
        self._gate = gate
        self._entered = threading.local()

    def __enter__(self) -> None:
        self._entered.value = self._gate._enter_shared()

    def __exit__(self, *exc) -> None:
        if self._entered.value:
            self._gate._exit_shared()


class _Exclusive:
    __slots__ = ("_gate",)

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    def __enter__(self) -> None:
        self._gate._enter_exclusive()

    def __exit__(self, *exc) -> None:
        self._gate._exit_exclusive()
