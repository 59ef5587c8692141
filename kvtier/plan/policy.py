"""Eviction strategies: which blocks leave a tier first. Interchangeable, one per tier.

A policy only *orders* candidates; the tier manager decides how many must go (watermarks) and
which blocks may go at all (pins, jobs in flight). Policies read recency from the index's
``last_use`` column and keep whatever extra state they need themselves.

* ``lru``: least recently used first.
* ``arc``: Adaptive Replacement Cache (Megiddo & Modha, 2003): blocks seen once (T1) and blocks
  seen again (T2) compete for the tier; ghost lists of recently evicted keys (B1, B2) move the
  target size ``p`` of T1 towards whichever list would have kept a block that came back.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.plan.index import BlockIndex

__all__ = ["EvictionPolicy", "LRUPolicy", "ARCPolicy", "make_policy", "POLICIES"]


class EvictionPolicy:
    """Orders eviction candidates; subclasses may track inserts, hits and removals."""

    name = "abstract"

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = max(1, capacity_blocks)

    def on_insert(self, row: int, key: tuple[bytes, bytes]) -> None:
        """A block entered the tier."""

    def on_access(self, rows: np.ndarray) -> None:
        """Blocks in the tier were hit by a lookup."""

    def on_remove(self, row: int, key: tuple[bytes, bytes], evicted: bool) -> None:
        """A block left the tier (``evicted``: chosen by this policy, not deleted by a user)."""

    def order(self, index: "BlockIndex", candidates: np.ndarray) -> np.ndarray:
        """``candidates`` (rows) in the order they should leave the tier."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def order(self, index: "BlockIndex", candidates: np.ndarray) -> np.ndarray:
        return candidates[np.argsort(index.col["last_use"][candidates], kind="stable")]


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self.p = 0.0  # target number of T1 blocks
        self._frequent = np.zeros(1024, np.bool_)  # row in T2 (seen at least twice)
        self._ghost_recent: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()  # B1
        self._ghost_frequent: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()  # B2

    def _ensure(self, row: int) -> None:
        if row >= len(self._frequent):
            grown = np.zeros(max(row + 1, 2 * len(self._frequent)), np.bool_)
            grown[: len(self._frequent)] = self._frequent
            self._frequent = grown

    def on_insert(self, row: int, key: tuple[bytes, bytes]) -> None:
        self._ensure(row)
        b1, b2 = len(self._ghost_recent), len(self._ghost_frequent)
        if key in self._ghost_recent:  # T1 was too small: it would have kept this block
            self.p = min(float(self.capacity_blocks), self.p + max(b2 / max(b1, 1), 1.0))
            del self._ghost_recent[key]
            self._frequent[row] = True
        elif key in self._ghost_frequent:  # T2 was too small
            self.p = max(0.0, self.p - max(b1 / max(b2, 1), 1.0))
            del self._ghost_frequent[key]
            self._frequent[row] = True
        else:
            self._frequent[row] = False

    def on_access(self, rows: np.ndarray) -> None:
        if len(rows):
            self._ensure(int(rows.max()))
            self._frequent[rows] = True

    def on_remove(self, row: int, key: tuple[bytes, bytes], evicted: bool) -> None:
        self._ensure(row)
        if evicted:
            ghosts = self._ghost_frequent if self._frequent[row] else self._ghost_recent
            ghosts[key] = None
            while len(ghosts) > self.capacity_blocks:
                ghosts.popitem(last=False)
        self._frequent[row] = False

    def order(self, index: "BlockIndex", candidates: np.ndarray) -> np.ndarray:
        self._ensure(int(candidates.max(initial=0)))
        last_use = index.col["last_use"]
        frequent = self._frequent[candidates]
        recent_rows = candidates[~frequent]
        frequent_rows = candidates[frequent]
        recent_rows = recent_rows[np.argsort(last_use[recent_rows], kind="stable")]
        frequent_rows = frequent_rows[np.argsort(last_use[frequent_rows], kind="stable")]
        # Replay ARC's REPLACE: take from T1 while it is above its target size, else from T2.
        out, i, j, t1_size = [], 0, 0, len(recent_rows)
        while i < len(recent_rows) or j < len(frequent_rows):
            if j >= len(frequent_rows) or (i < len(recent_rows) and t1_size > self.p):
                out.append(recent_rows[i])
                i += 1
                t1_size -= 1
            else:
                out.append(frequent_rows[j])
                j += 1
        return np.asarray(out, dtype=candidates.dtype)


POLICIES = {cls.name: cls for cls in (LRUPolicy, ARCPolicy)}


def make_policy(name: str, capacity_blocks: int) -> EvictionPolicy:
    try:
        return POLICIES[name](capacity_blocks)
    except KeyError:
        raise UsageError(f"unknown eviction policy {name!r}", hint="one of: " + ", ".join(POLICIES)) from None
