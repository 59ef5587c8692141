"""Write-behind: DRAM blocks that have had no NVMe copy for a while get one, as one group commit,
copied out of their slot under the slot lock (``SlotLedger.copy_out``: a slot the manager freed
and a new store reuses is never written under the old key); the clean shutdown's write-back is
the same with no age limit.

Owns its page-aligned batch buffer (kept between calls) and the write-back batch size; reports
the disk's health to the ``Backoff`` it is given (the disk handler's).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from kvtier.jobs import BlockMove
from kvtier.move.ledger import SlotLedger, SlotOwner
from kvtier.move.links import LinkBytes
from kvtier.move.recode import transcoded
from kvtier.tiers.base import DiskStore
from kvtier.tiers.health import Backoff

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.layout import ModelFingerprint
    from kvtier.move.disk import OnCold
    from kvtier.tiers.dram import DramArena

__all__ = ["WriteBehind", "WRITE_BEHIND_BYTES"]

log = logging.getLogger("kvtier.move.mover")

WRITE_BEHIND_BYTES = 8 << 20  # one write-behind group commit at most

Written = list[tuple[bytes, bytes, int, str]]
Batch = list[tuple[int, SlotOwner, BlockMove, "torch.Tensor"]]


class WriteBehind:
    def __init__(self, store: DiskStore | None, fingerprint: "ModelFingerprint", arena: "DramArena",
                 ledger: SlotLedger, links: LinkBytes, health: Backoff, on_cold: "OnCold | None" = None):
        self.store, self.fingerprint, self.arena = store, fingerprint, arena
        self.ledger, self.links, self.health, self.on_cold = ledger, links, health, on_cold
        self.batch_bytes = WRITE_BEHIND_BYTES  # per group commit of the shutdown write-back
        self._buffer: "torch.Tensor | None" = None

    def buffer(self, max_bytes: int) -> "torch.Tensor":
        """A page-aligned buffer for one write-behind batch (at least one slot), kept between calls."""
        size = max(self.arena.slot_bytes, max_bytes)
        if self._buffer is None or self._buffer.numel() < size:
            from kvtier.tiers.dram import aligned_empty

            self._buffer = aligned_empty(size)
        return self._buffer

    def write_behind(self, max_age_s: float, max_blocks: int = 64, cold_codec: str = "none",
                     room: Callable[[int], bool] | None = None,
                     max_bytes: int = WRITE_BEHIND_BYTES) -> tuple[Written, str | None]:
        """Write up to ``max_blocks`` DRAM blocks (``max_bytes`` at most) that have had no NVMe copy
        for ``max_age_s`` seconds (oldest first) to the NVMe tier as one group commit, keeping them
        in DRAM. Returns (namespace, key, nbytes, codec) of each block written, for the manager
        (``Pressure.note_written_behind``), and the error that stopped it (a full, read-only or
        missing disk), if any.

        ``room(nbytes)`` says whether the tier may take that many more bytes of records (the
        caller's watermark).
        """
        if self.store is None:
            return [], None
        from kvtier.errors import CapacityError

        batch = self._gather(self.ledger.due(max_age_s, max_blocks), max_bytes, cold_codec, room)
        outcomes = self.store.write_batch([(m.namespace, m.key, p, m.codec) for _s, _o, m, p in batch],
                                          self.fingerprint.digest) if batch else []
        written: Written = []
        error = None
        for (slot, owner, move, _payload), outcome in zip(batch, outcomes):
            if isinstance(outcome, CapacityError):  # kvtier's own NVMe budget: demotion makes room, not an error
                log.info("kvtier: write-behind paused: %s", outcome)
                continue
            if isinstance(outcome, BaseException):  # the disk is full, read-only, gone...: tell the manager
                if error is None:
                    log.warning("kvtier: write-behind of block %s failed: %s", move.key.hex()[:16], outcome)
                error = str(outcome)
                continue
            self.ledger.clean([slot], owner)
            self.links.add("dram->nvme", move.nbytes)
            written.append((move.namespace, move.key, move.nbytes, move.codec))
        if self.on_cold is not None and written:
            done = {(namespace, key) for namespace, key, _n, _c in written}
            self.on_cold([m for _s, _o, m, _p in batch if (m.namespace, m.key) in done])
        if error:
            self.health.failed()
        elif written:
            self.health.succeeded()
        return written, error

    def _gather(self, due: list[int], max_bytes: int, cold_codec: str, room: Callable[[int], bool] | None) -> Batch:
        """Copy the due slots that still hold their dirty block into the batch buffer (re-encoded
        to the cold codec), while they fit it and ``room`` allows."""
        from kvtier.tiers.dram import round_up
        from kvtier.tiers.records import file_bytes_for

        buffer = self.buffer(max_bytes)
        batch: Batch = []
        used = planned = 0
        for slot in due:
            def copy(slot: int, owner: SlotOwner, used: int = used) -> "torch.Tensor | None":
                if batch and used + round_up(owner.nbytes) > buffer.numel():
                    return None  # the next call takes the rest
                payload = buffer[used : used + owner.nbytes]  # page-aligned: written with O_DIRECT, no second copy
                payload.copy_(self.arena.slot(slot, owner.nbytes))
                return payload

            got = self.ledger.copy_out(slot, copy, dirty=True)
            if got is None:
                continue
            owner, payload = got
            if payload is None:
                break
            used += round_up(owner.nbytes)
            move = BlockMove(row=-1, namespace=owner.namespace, key=owner.key, dram_slot=slot, nbytes=owner.nbytes,
                             codec=owner.codec, first=owner.first,
                             to_codec="" if owner.codec == cold_codec else cold_codec)
            if move.to_codec:
                payload = transcoded(move, payload, self.fingerprint.geometry)
            if room is not None and not room(planned + file_bytes_for(len(payload))):
                break
            planned += file_bytes_for(len(payload))
            batch.append((slot, owner, move, payload))
        return batch

    def write_back(self, cold_codec: str = "none") -> int:
        """Clean shutdown: write every DRAM block that has no NVMe copy to the NVMe tier, so a
        restart finds it (write-behind with no age limit). Stops quietly when the tier is full or the
        disk fails. Returns the blocks written."""
        total = 0
        while True:  # one group commit per batch, until nothing is left or the disk says no
            written, error = self.write_behind(0.0, len(self.ledger.dirty), cold_codec, max_bytes=self.batch_bytes)
            total += len(written)
            if error:
                log.warning("kvtier: write-back stopped after %d blocks: %s", total, error)
            if error or not written:
                break
        if total:
            log.info("kvtier: wrote %d DRAM-only blocks to the NVMe tier before shutting down", total)
        return total
