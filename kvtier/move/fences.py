"""Store fences: DRAM slot -> an event set once the store filling it is done.

Owns the fences and their lock. The job runner fences a store batch's slots when it queues it and
releases them when it is done; a handler that reads a slot (a load, a demotion, a snapshot) waits
on its fence first, on a mover thread (a wait on the step path is counted by the ``CopyStream``).
"""
from __future__ import annotations

import threading
from typing import Sequence

from kvtier.move.stream import CopyStream

__all__ = ["SlotFences"]


class SlotFences:
    """DRAM slot -> an event set once the store filling it is done."""

    def __init__(self, stream: CopyStream):
        self.stream = stream
        self._fences: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def fence(self, slots: Sequence[int]) -> threading.Event:
        fence = threading.Event()
        with self._lock:
            for slot in slots:
                self._fences[slot] = fence
        return fence

    def release(self, slots: Sequence[int], fence: threading.Event) -> None:
        with self._lock:
            for slot in slots:
                if self._fences.get(slot) is fence:
                    del self._fences[slot]
        fence.set()

    def wait(self, slots: Sequence[int]) -> None:
        """Wait (on a mover thread) for stores still filling any of these DRAM slots."""
        with self._lock:
            fences = {id(f): f for s in slots if (f := self._fences.get(s)) is not None}
        for fence in fences.values():
            if not fence.is_set():
                self.stream.note_sync()
                fence.wait()
