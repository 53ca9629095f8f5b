"""The store's gate (``KVStore.atomic``): another thread's calls wait while a block runs,
the block's own thread passes, and a waiting block goes before calls that come after it."""

from __future__ import annotations

import threading

import torch

from leanstate import KVStore
from leanstate._store_gate import Gate


def test_a_call_from_another_thread_waits_for_the_block_and_then_sees_all_of_it():
    store = KVStore(2)
    ids = torch.arange(8)
    store.set(ids, torch.zeros(8, 2))
    seen = []
    inside, reader_started = threading.Event(), threading.Event()

    def read() -> None:
        inside.wait()
        reader_started.set()
        seen.append(store.get(ids)[:, 0].clone())

    reader = threading.Thread(target=read)
    reader.start()
    with store.atomic():
        store.set(ids[:4], torch.ones(4, 2))  # this thread passes its own block
        inside.set()
        reader_started.wait()
        reader.join(timeout=0.2)
        assert reader.is_alive()  # held out while the block runs
        store.set(ids[4:], torch.ones(4, 2))
    reader.join()
    assert torch.equal(seen[0], torch.ones(8))  # all of the block, never half


def test_a_waiting_block_goes_before_calls_that_arrive_after_it():
    gate, order = Gate(), []
    first_in, writer_waiting = threading.Event(), threading.Event()
    release = threading.Event()

    def early_reader() -> None:
        with gate.shared:
            first_in.set()
            release.wait()
            order.append("early reader")

    def writer() -> None:
        writer_waiting.set()
        with gate.exclusive:
            order.append("writer")

    def late_reader() -> None:
        with gate.shared:
            order.append("late reader")

    threads = [threading.Thread(target=early_reader)]
    threads[0].start()
    first_in.wait()
    threads.append(threading.Thread(target=writer))
    threads[1].start()
    writer_waiting.wait()
    while not gate._waiting:  # the writer has queued (a state, not a sleep)
        threading.Event().wait(0.001)
    threads.append(threading.Thread(target=late_reader))
    threads[2].start()
    release.set()
    for thread in threads:
        thread.join()
    assert order == ["early reader", "writer", "late reader"]


def test_blocks_nest_and_shared_calls_inside_a_block_pass():
    gate = Gate()
    with gate.exclusive:
        with gate.exclusive:
            with gate.shared:
                pass
        with gate.shared:
            pass
    done = []
    thread = threading.Thread(
        target=lambda: (gate.shared.__enter__(), done.append(1), gate.shared.__exit__())
    )
    thread.start()
    thread.join(timeout=10)
    assert done == [1]  # released: another thread gets in
