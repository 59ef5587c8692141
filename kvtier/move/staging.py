"""Host buffers for blocks that have no DRAM slot to land in (NVMe reads and shared fetches that
stream to HBM, or are re-encoded into a slot after): page-aligned, pinned with CUDA so their
host-to-device copy is asynchronous, and reused across jobs.

Owns the free list (and its lock); knows the DRAM arena only to tell its slots from its buffers.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterable

from kvtier.jobs import BlockMove

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.tiers.dram import DramArena

__all__ = ["StagingPool"]

KEEP = 8  # buffers kept for reuse at most


class StagingPool:
    def __init__(self, arena: "DramArena"):
        self.arena = arena
        self._free: list["torch.Tensor"] = []
        self._lock = threading.Lock()

    def landing(self, move: BlockMove) -> "torch.Tensor":
        """Where a block read from NVMe or the shared store lands: its DRAM slot when it keeps its
        codec there, else a staging buffer (streamed to HBM, or re-encoded into the slot after)."""
        if move.dram_slot >= 0 and not move.to_codec:
            return self.arena.slot(move.dram_slot)
        return self.take(max(self.arena.slot_bytes, move.nbytes))

    def take(self, nbytes: int) -> "torch.Tensor":
        """A page-aligned buffer of at least ``nbytes`` (pinned with CUDA)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
        from kvtier.tiers.dram import aligned_empty

        return aligned_empty(nbytes, pin=self.arena.pinned)

    def give(self, buffers: Iterable["torch.Tensor"]) -> None:
        """Take back the staging buffers among ``buffers`` (arena slots are not staging buffers)."""
        base = self.arena.buffer.data_ptr()
        end = base + self.arena.buffer.numel()
        with self._lock:
            for buf in buffers:
                if not base <= buf.data_ptr() < end and len(self._free) < KEEP:
                    self._free.append(buf)
