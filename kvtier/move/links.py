"""Bytes moved per link (``"hbm->dram"``, ``"dram->nvme"``, ...), for telemetry.

Owns the counter and the lock that guards it: every mover thread, the write-behind thread and the
publisher add to it.
"""
from __future__ import annotations

import threading
from collections import Counter

from kvtier.jobs import JobResult

__all__ = ["LinkBytes"]


class LinkBytes:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, link: str, nbytes: int) -> None:
        with self._lock:
            self.counts[link] += nbytes

    def count(self, link: str, nbytes: int, result: JobResult) -> None:
        """Add ``nbytes`` to ``link`` and to the bytes ``result`` moved."""
        self.add(link, nbytes)
        result.bytes_moved += nbytes
