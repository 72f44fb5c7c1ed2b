"""Order transfer threads after the device work that writes the KV blocks they touch.

On an accelerator, the forward (and vLLM's zeroing and copying of blocks before it)
is queued on a stream and runs after the call that queued it returns. A transfer
thread that reads blocks for a save, or writes blocks for a load, must first wait
until that queued work is done. :func:`forward_marker` records an event on the
current stream, through torch's accelerator-neutral API; the thread waits on it
(``synchronize``) before it touches a block. On the CPU there is nothing queued:
no event, no wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Marker(Protocol):
    """A point in the device's queue of work: ``synchronize`` returns once it is done."""

    def synchronize(self) -> None: ...


#: Records a marker after the work queued so far; None where nothing is queued (CPU).
RecordMarker = Callable[[], Marker | None]


def forward_marker() -> Marker | None:
    """An event recorded on the current accelerator stream, or None on the CPU."""
    import torch

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type == "cpu":
        return None
    event: Any = torch.Event(device=accelerator)
    event.record(torch.accelerator.current_stream(accelerator))
    return event


def wait_for(marker: Marker | None) -> None:
    """Return once the work before ``marker`` is done (at once without one)."""
    if marker is not None:
        marker.synchronize()


class TransferOrder:
    """Where a worker's transfers wait for device work, at fixed points of a step.

    ``record_marker`` records a marker after the work queued so far (``forward_marker``);
    ``drain_saves``: a step's saves must have read their blocks before the step ends (a
    model runner that writes blocks before vLLM's first connector call of the next step).
    """

    def __init__(self, *, record_marker: RecordMarker = forward_marker, drain_saves: bool = False):
        self.record_marker = record_marker
        self.drain_saves = drain_saves

    def before_loads(self, loads: Sequence[Any]) -> None:
        """At the start of ``start_loads``: loads write blocks only after the device work
        queued before them (vLLM zeroing and copying this step's blocks) is done."""
        if loads:
            wait_for(self.record_marker())

    def forward_done(self) -> Marker | None:
        """In ``start_saves``, before starting them: a marker after the step's forward."""
        return self.record_marker()
