"""What the numba engines share of numba's runtime: how many threads a call runs on, and
the store's readers-writer lock (its kernels release the GIL, so reads run side by side)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numba
import torch

# -- threads -----------------------------------------------------------------------------

SERIAL_BELOW = 2**21
"""Elements moved by one call (ids x row columns) below which its kernels run on one thread.

Measured on 2 cores with a second CPU-bound process running: a parallel region waits for
its slowest thread, and a thread that lost its core costs a scheduler slice, so a 256 x 20
embedding step took 6.4 ms on 2 threads against 2.0 ms on one. Alone, 2 threads gain
little below this size (16,384 ids x 128: 1.8 ms serial, 1.3 ms parallel).
"""


_pool_started = False


def use_threads(work: int) -> None:
    """Set this thread's numba thread count for a call that moves ``work`` elements: one
    below ``SERIAL_BELOW``, else ``torch.get_num_threads()`` (so ``OMP_NUM_THREADS``,
    ``torch.set_num_threads`` and torchrun's setting apply), capped by numba's pool."""
    global _pool_started
    if not _pool_started:
        # Starting numba's OpenMP pool sets the OpenMP thread count of the whole process,
        # torch's included (it reached torch's libgomp here): torch.set_num_threads(1)
        # silently became 2, and 2 ranks on 2 cores spun 4 threads (3.7x the CPU per
        # lookup of 1 rank). Put torch's own setting back.
        wanted = torch.get_num_threads()
        numba.get_num_threads()
        torch.set_num_threads(wanted)
        _pool_started = True
    threads = 1 if work < SERIAL_BELOW else min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


class ReadersWriterLock:
    """Many readers or one writer; a waiting writer holds back new readers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def reading(self):
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def writing(self):
        with self._cond:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
