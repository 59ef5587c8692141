"""The DRAM slot ledger: what each slot holds as far as this worker wrote it, and which slots hold
a block that has no NVMe copy yet (dirty, and since when).

Owns ``slot_owner``, ``dirty`` and the slot lock that guards both. Write-behind and the publisher
copy a slot out only through ``copy_out``, under that lock, after checking the slot still holds
the same block: a slot the manager freed (``forget``) and a new store reuses is never written or
published under the old key.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, NamedTuple, Sequence, TypeVar

from kvtier.jobs import BlockMove
from kvtier.tiers.health import Clock

__all__ = ["SlotLedger", "SlotOwner"]

T = TypeVar("T")


class SlotOwner(NamedTuple):
    namespace: bytes
    key: bytes
    nbytes: int
    codec: str
    first: bool


class SlotLedger:
    def __init__(self, on_disk: Callable[[bytes, bytes], bool] | None = None, clock: Clock = time.monotonic):
        """``on_disk(namespace, key)``: whether the cold tier holds the block (None: there is no
        cold tier, so nothing is ever dirty)."""
        self.on_disk, self.clock = on_disk, clock
        # the manager's freed slots are forgotten (forget) so a dropped block stays dropped
        self.slot_owner: dict[int, SlotOwner] = {}
        # slots whose block has no NVMe copy yet -> when it became so (clock time; 0.0: due at once,
        # a pinned session's block)
        self.dirty: dict[int, float] = {}
        self._lock = threading.Lock()

    def own(self, move: BlockMove) -> None:
        """``move``'s block now sits in its DRAM slot."""
        with self._lock:
            self.slot_owner[move.dram_slot] = SlotOwner(move.namespace, move.key, move.nbytes, move.codec, move.first)
            if self.on_disk is not None and not self.on_disk(move.namespace, move.key):
                self.dirty[move.dram_slot] = 0.0 if move.durable else self.clock()
            else:
                self.dirty.pop(move.dram_slot, None)

    def nbytes_of(self, move: BlockMove) -> int:
        """The payload size of ``move``'s DRAM slot on this rank (with a data-dependent codec each
        rank's shard compresses differently; the manager knows the largest)."""
        owner = self.slot_owner.get(move.dram_slot)
        return owner.nbytes if owner is not None and owner.key == move.key else move.nbytes

    def forget(self, slots: Sequence[int]) -> None:
        """The manager freed these slots: a dropped block stays dropped (never written behind)."""
        if not slots:
            return
        with self._lock:  # waits for a write-behind copy of one of these slots to finish
            for slot in slots:
                self.slot_owner.pop(slot, None)
                self.dirty.pop(slot, None)

    def clean(self, slots: Iterable[int], owner: SlotOwner | None = None) -> None:
        """The blocks in ``slots`` have an NVMe copy now (only if a slot still holds ``owner``, when given)."""
        with self._lock:
            for slot in slots:
                if owner is None or self.slot_owner.get(slot) == owner:
                    self.dirty.pop(slot, None)

    def due_count(self, max_age_s: float) -> int:
        """How many dirty slots are at least ``max_age_s`` old (pinned sessions' blocks: at once)."""
        cutoff = self.clock() - max_age_s
        with self._lock:
            return sum(1 for since in self.dirty.values() if since <= cutoff)

    def due(self, max_age_s: float, limit: int) -> list[int]:
        """Up to ``limit`` dirty slots at least ``max_age_s`` old, oldest first."""
        cutoff = self.clock() - max_age_s
        with self._lock:
            return [slot for _since, slot in sorted((s, slot) for slot, s in self.dirty.items() if s <= cutoff)[:limit]]

    def copy_out(self, slot: int, copy: Callable[[int, SlotOwner], T], block: tuple[bytes, bytes] | None = None,
                 dirty: bool = False) -> tuple[SlotOwner, T] | None:
        """Under the slot lock: if ``slot`` still holds a block (``block`` = (namespace, key) when
        given; a dirty one when ``dirty``), ``(owner, copy(slot, owner))``; else None."""
        with self._lock:
            owner = self.slot_owner.get(slot)
            if owner is None or (dirty and slot not in self.dirty):
                return None
            if block is not None and (owner.namespace, owner.key) != block:
                return None
            return owner, copy(slot, owner)
