"""Order transfers after the device work that writes the KV blocks they touch, on streams.

On an accelerator, the forward (and vLLM's zeroing and copying of blocks before it)
is queued on the engine thread's stream and runs after the call that queued it
returns. Nothing here makes a host thread wait for that work. Instead:

* the engine thread records an event (a *marker*) on its stream where a transfer
  must come after the work queued so far (``before_loads``, ``forward_done``);
* each transfer thread queues its copies on a stream of its own
  (``enter_transfer_thread``), made to wait for that marker (``after``:
  ``stream.wait_event``) before the first copy that touches a block;
* a save records a marker on its transfer stream once its copies out of the blocks
  are queued (``blocks_read``), and the save barrier makes the engine's stream wait
  for it (``before_block_writes``) before the next step's zeroing, block copies and
  forward are queued.

A transfer thread waits (on the host) only for its own stream, before it hands its
staging buffer to Mooncake or reports a load done. The engine thread never calls
``synchronize``. On the CPU nothing is queued: no markers, no waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Marker(Protocol):
    """A point in a device stream's queue of work (a ``torch.Event``)."""

    def synchronize(self) -> None: ...


class DeviceQueues:
    """An accelerator's streams and events, through torch's device-neutral API."""

    def __init__(self, device: Any):
        self.device = device

    def record(self) -> Marker:
        """A marker after the work queued so far on the calling thread's current stream."""
        import torch

        event: Any = torch.Event(device=self.device)
        event.record(torch.accelerator.current_stream(self.device))
        return event

    def current_stream_waits(self, marker: Marker) -> None:
        """Work queued after this on the calling thread's current stream runs after ``marker``
        (the host does not wait)."""
        import torch

        torch.accelerator.current_stream(self.device).wait_event(marker)

    def enter_transfer_thread(self) -> None:
        """Give the calling thread a stream of its own, as its current stream."""
        import torch

        torch.accelerator.set_stream(torch.Stream(device=self.device))


def accelerator_queues() -> DeviceQueues | None:
    """The current accelerator's queues; None on the CPU (nothing is ever queued)."""
    import torch

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type == "cpu":
        return None
    return DeviceQueues(accelerator)


_DEFAULT: Any = object()


class TransferOrder:
    """Where a worker's transfers are ordered after device work, at fixed points of a step.

    ``queues``: the accelerator's (default: the current one; None on the CPU);
    ``drain_saves``: a step's saves must have queued their reads of the blocks before the
    step ends (a model runner that writes blocks before vLLM's first connector call of the
    next step).
    """

    def __init__(self, *, queues: DeviceQueues | None = _DEFAULT, drain_saves: bool = False):
        self.queues: DeviceQueues | None = accelerator_queues() if queues is _DEFAULT else queues
        self.drain_saves = drain_saves

    # --- the engine thread -------------------------------------------------------------
    def before_loads(self, loads: Sequence[Any]) -> Marker | None:
        """At the start of ``start_loads``: a marker after the device work queued before the
        loads (vLLM zeroing and copying this step's blocks); the loads write after it."""
        return self.queues.record() if loads and self.queues is not None else None

    def forward_done(self) -> Marker | None:
        """In ``start_saves``, before starting them: a marker after the step's forward."""
        return self.queues.record() if self.queues is not None else None

    def before_block_writes(self, blocks_read: Sequence[Marker]) -> None:
        """In the save barrier: device work queued from now on (the next step's zeroing,
        block copies and forward) runs after the saves' reads of their blocks."""
        if self.queues is not None:
            for marker in blocks_read:
                self.queues.current_stream_waits(marker)

    # --- a transfer thread ---------------------------------------------------------------
    def enter_transfer_thread(self) -> None:
        """Once per transfer thread, before its first copy: a stream of its own."""
        if self.queues is not None:
            self.queues.enter_transfer_thread()

    def after(self, marker: Marker | None) -> None:
        """This thread's copies from now on run after ``marker`` (no host wait)."""
        if self.queues is not None and marker is not None:
            self.queues.current_stream_waits(marker)

    def blocks_read(self) -> Marker | None:
        """A marker after this thread's copies queued so far (a save's reads of its blocks)."""
        return self.queues.record() if self.queues is not None else None
