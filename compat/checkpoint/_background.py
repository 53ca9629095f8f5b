"""The checkpoint core's background work, in one place: every thread a save or a load
starts comes from here.

- :func:`produced_on_a_thread` and :func:`one_buffer_ahead`: a generator run on a reader
  thread, its items handed over in order (the chunk reader reads slice k+1 while the
  caller applies slice k);
- :class:`Behind`: tasks run one at a time on one thread, at most one in flight behind
  the caller (the pipelined writer writes chunk k while the caller gathers chunk k+1;
  the DCP reader applies chunk k while it reads chunk k+1);
- :func:`in_parallel`: calls spread over a few threads, every one run to its end (the
  load's tables);
- :func:`remove_later` and :func:`finish_removals`: deletions that may outlive the save
  that asked for them (the previous copy of a checkpoint), waited for at exit.

Every helper waits for its threads before it returns or raises, also on Ctrl-C, so no
background write outlives the call that owns its memory. What the in-place load's
threads may touch is written in ``leanstate.checkpoint._load``.
"""

from __future__ import annotations

import atexit
import queue
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path


class Stopped(Exception):
    """Raised inside a producer whose caller stopped reading: its thread ends quietly."""


_DONE = object()


def produced_on_a_thread(
    produce: Callable[[], Iterator], stop: threading.Event, idle: Callable[[], bool] | None = None
) -> Iterator:
    """``produce()``'s items, produced on a thread and yielded here in order; what the
    thread raises is raised here, after the items before it. While no item is ready,
    ``idle()`` runs here (until it returns False) before waiting. Leaving early sets
    ``stop`` (``produce`` checks it, raising :class:`Stopped`) and waits for the thread."""
    ready: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            for item in produce():
                ready.put(item)
        except Stopped:
            return
        except BaseException as error:  # noqa: BLE001 - handed to the caller, raised there
            ready.put(error)
            return
        ready.put(_DONE)

    thread = threading.Thread(target=run, name="leanstate-checkpoint-reader", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = ready.get_nowait()
            except queue.Empty:
                if idle is not None and idle():
                    continue
                item = ready.get()
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def one_buffer_ahead(
    produce: Callable[[Callable[[], bytearray]], Iterator], buffers: list[bytearray]
) -> Iterator:
    """``produce(next_buffer)``'s items (tuples whose last field is a slice of a buffer, or
    None) from a thread that fills one buffer ahead of the caller: the caller hands back
    the buffer of the item it held when it asks for the next."""
    free: queue.Queue = queue.Queue()
    for buffer in buffers:
        free.put(buffer)
    stop = threading.Event()
    filled: list[bytearray] = []  # the thread's buffers, in the order it filled them

    def next_buffer() -> bytearray:
        buffer = free.get()
        if stop.is_set():
            raise Stopped
        filled.append(buffer)
        return buffer

    def tagged() -> Iterator:
        for item in produce(next_buffer):
            yield item, filled.pop(0) if item[-1] is not None else None

    items = produced_on_a_thread(tagged, stop)
    held = None
    try:
        for item, buffer in items:
            if held is not None:
                free.put(held)
            held = buffer
            yield item
    finally:
        stop.set()
        free.put(bytearray(0))  # wakes a thread waiting for a buffer: it sees ``stop`` and ends
        items.close()  # then waits for the thread


class Behind:
    """Tasks run one at a time on one thread, at most one in flight behind the caller.

    :meth:`submit` first waits for the task before it (raising its failure), so tasks
    finish in order and a task's inputs may be reused once the next is submitted;
    :meth:`settle` waits for the last; :meth:`close` waits and stops the thread.
    """

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: Future | None = None

    def submit(self, fn: Callable, *args) -> None:
        self.settle()
        self._pending = self._pool.submit(fn, *args)

    def settle(self) -> None:
        """Wait for the task in flight, raising its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def failure(self) -> BaseException | None:
        """The failure of the task in flight, once it has ended (None if it succeeded)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def in_parallel(calls: Sequence[Callable[[], object]], threads: int) -> list:
    """Each call's result, the calls run on up to ``threads`` threads; every call runs to
    its end (also when one fails, or on Ctrl-C) before the first failure, in ``calls``
    order, is raised."""
    if threads < 2 or len(calls) < 2:
        return [call() for call in calls]
    pool = ThreadPoolExecutor(max_workers=min(threads, len(calls)), thread_name_prefix="leanstate-load")
    futures = [pool.submit(call) for call in calls]
    try:
        wait(futures)
    finally:  # also on Ctrl-C: no call may still write once the caller undoes its work
        for future in futures:
            future.cancel()
        pool.shutdown(wait=True)
    return [future.result() for future in futures]


_removals: dict[Path, threading.Thread] = {}
_removals_lock = threading.Lock()


def remove_later(key: Path, folders: list[Path]) -> None:
    """Delete ``folders`` on a background thread, known by ``key`` (the caller first waits,
    with :func:`finish_removals`, for a removal still running under it)."""
    if not folders:
        return
    thread = threading.Thread(
        target=lambda: [shutil.rmtree(folder, ignore_errors=True) for folder in folders],
        name=f"leanstate-remove-{key.name}",
        daemon=True,
    )
    with _removals_lock:
        _removals[key] = thread
    thread.start()


def finish_removals(key: Path | None = None) -> None:
    """Wait until the folders being deleted under ``key`` (default: every key) are gone;
    also run at exit."""
    with _removals_lock:
        running = list(_removals.values()) if key is None else [_removals.get(key)]
        if key is None:
            _removals.clear()
        else:
            _removals.pop(key, None)
    for thread in running:
        if thread is not None:
            thread.join()


atexit.register(finish_removals)
