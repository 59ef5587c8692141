"""The copy stream and the step-path sync counter, shared by the job runner and the device copies.

It owns the CUDA stream device<->host copies run on (None on CPU), the thread-local ``step`` flag
(``step.active``: this thread is in one of vLLM's step calls) and ``syncs``, the blocking waits
for transfers made on the step path. Serving should leave ``syncs`` at zero.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, ContextManager

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CopyStream"]


class CopyStream:
    def __init__(self, device: "torch.device"):
        import torch

        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.step = threading.local()  # ``step.active``: this thread is in one of vLLM's step calls
        self.syncs = 0  # blocking waits for transfers on the step path (fences on preemption only)

    @property
    def cuda(self) -> bool:
        return self.stream is not None

    def note_sync(self) -> None:
        """Count a blocking wait if it is made on the step path."""
        if getattr(self.step, "active", False):
            self.syncs += 1

    def record(self) -> Any:
        """An event on the compute stream, recorded when a job is submitted (None on CPU): the
        job's copies wait for it, so a store never reads KV the forward pass is still writing."""
        if self.stream is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_for(self, ready: Any) -> None:
        """Make the copy stream wait for ``ready`` (from ``record``)."""
        if self.stream is not None:
            self.stream.wait_event(ready)

    def on_stream(self) -> ContextManager:
        import torch

        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def sync(self) -> None:
        """Wait for this job's copies on the copy stream (a mover thread's wait, never the step's)."""
        if self.stream is not None:
            self.note_sync()
            self.stream.synchronize()
