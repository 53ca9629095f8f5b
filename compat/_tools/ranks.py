"""Local gloo ranks (and other short-lived processes) for the demo, the bench, verify and the tests.

A rank started with ``spawn`` is a fresh interpreter that imports torch again: about 4 s of
CPU each on a small machine, most of a short run's cost. The ranks here are forked from a
``forkserver`` that imported torch, torch.distributed and leanstate once; like ``spawn``,
each rank starts from that clean server, not from a copy of the caller.
"""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable

import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "leanstate"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forked(fn: Callable) -> multiprocessing.context.BaseContext:
    """The context whose processes run ``fn``: the forkserver, which imports torch,
    torch.distributed, leanstate and ``fn``'s module when it starts (spawn where there is no
    forkserver, as on Windows).

    The server starts with the first process and reads the environment then: a variable
    ``fn`` needs from a later change must be set by ``fn`` itself (as ``MASTER_PORT`` is).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*_PRELOAD, fn.__module__])  # ignored once the server runs
    return context


def start_ranks(fn: Callable, args: tuple, world: int, *, join: bool = True) -> mp.ProcessContext | None:
    """Run ``fn(rank, *args)`` in ``world`` processes of :func:`forked`, as
    ``torch.multiprocessing.start_processes`` does."""
    method = forked(fn).get_start_method()
    return mp.start_processes(fn, args=args, nprocs=world, join=join, start_method=method)
