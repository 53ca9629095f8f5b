"""The ``torch`` copier of the offload wrapper: CUDA copies on a side stream, ordered by events.

Device -> host: the side stream waits for the compute stream (the activation is ready),
copies into the pinned buffer without blocking, and records an event; the activation's
memory is kept from reuse until the copy ran (``record_stream``). Host -> device (a
prefetch in backward): the side stream waits for the first copy's event, copies back
without blocking and records an event that the compute stream waits for before it uses
the tensor. A buffer goes back to the pool only after its copies are done, so the
pinned bytes stay under the pool's budget. As torchtune's ``OffloadActivations``.
"""

from __future__ import annotations

import torch

DEVICES = ("cuda",)
AUTO_PRIORITY = {"cuda": 10}
BENCH_TARGETS: dict[str, tuple[str, float]] = {}


def unavailable() -> str | None:
    """Why this copier cannot run here, or None."""
    return None if torch.cuda.is_available() else "no CUDA device (CPU activations are never offloaded)"


class Copier:
    """Copies on one side stream of the current CUDA device (see the module docstring)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def _recorded(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def to_host(self, source: torch.Tensor, buffer: torch.Tensor) -> torch.cuda.Event:
        """Copy ``source`` to the host ``buffer`` on the side stream; the copy's event."""
        self.stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(self.stream):
            buffer.copy_(source, non_blocking=True)
            done = self._recorded()
        source.record_stream(self.stream)
        return done

    def to_device(self, buffer: torch.Tensor, device: torch.device, after: torch.cuda.Event | None):
        """Start the copy back on the side stream once ``after`` is done: (tensor, event)."""
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            tensor = buffer.to(device, non_blocking=True)
            done = self._recorded()
        return tensor, done

    def ready(self, tensor: torch.Tensor, marker: torch.cuda.Event | None) -> None:
        """The compute stream waits for the copy; the tensor's memory belongs to it from now."""
        current = torch.cuda.current_stream(tensor.device)
        if marker is not None:
            current.wait_event(marker)
        tensor.record_stream(current)

    def wait(self, marker: torch.cuda.Event | None) -> None:
        """Block until the copy of ``marker`` is done."""
        if marker is not None:
            marker.synchronize()
