"""DRAM -> NVMe, for the ``Mover``: demotions and flushes (one group commit per job), dropped NVMe
copies, and write-behind: DRAM blocks that have had no NVMe copy for a while get one,
copied out of their slot under the slot lock (a slot the manager freed and a new store reuses is
never written under the old key); the clean shutdown's write-back is the same with no age limit.
A mixin of ``Mover``."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Sequence

from kvtier.jobs import BlockMove, Job, JobResult

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.move.mover import Mover

__all__ = ["WriteBehind", "WRITE_BEHIND_BYTES"]  # (demotions too: everything the mover writes to NVMe)

log = logging.getLogger("kvtier.move.mover")

WRITE_BEHIND_BYTES = 8 << 20  # one write-behind group commit at most


class WriteBehind:
    def _write_behind_buffer(self: "Mover", max_bytes: int) -> "torch.Tensor":
        """A page-aligned buffer for one write-behind batch (at least one slot), kept between calls."""
        size = max(self.arena.slot_bytes, max_bytes)
        buffer = getattr(self, "_wb_buffer", None)
        if buffer is None or buffer.numel() < size:
            from kvtier.tiers.dram import aligned_empty

            buffer = self._wb_buffer = aligned_empty(size)
        return buffer

    def dirty_due(self: "Mover", max_age_s: float) -> int:
        """How many dirty slots are at least ``max_age_s`` old (pinned sessions' blocks: at once)."""
        cutoff = time.monotonic() - max_age_s
        with self._slots_lock:
            return sum(1 for since in self.dirty.values() if since <= cutoff)

    def write_behind(self: "Mover", max_age_s: float, max_blocks: int = 64, cold_codec: str = "none",
                     room: Callable[[int], bool] | None = None,
                     max_bytes: int = WRITE_BEHIND_BYTES) -> tuple[list[tuple[bytes, bytes, int, str]], str | None]:
        """Write up to ``max_blocks`` DRAM blocks (``max_bytes`` at most) that have had no NVMe copy
        for ``max_age_s`` seconds (oldest first) to the NVMe tier as one group commit, keeping them
        in DRAM. Returns (namespace, key, nbytes, codec) of each block written, for the manager
        (``TierManager.note_written_behind``), and the error that stopped it (a full, read-only or
        missing disk), if any.

        Each slot is copied out under the slot lock, after checking it still holds the same block:
        a slot the manager freed and a new store reuses is never written under the old key.
        ``room(nbytes)`` says whether the tier may take that many more bytes of records (the
        caller's watermark).
        """
        if self.store is None:
            return [], None
        from kvtier.errors import CapacityError
        from kvtier.tiers.dram import round_up
        from kvtier.tiers.records import file_bytes_for

        cutoff = time.monotonic() - max_age_s
        with self._slots_lock:
            due = sorted((since, slot) for slot, since in self.dirty.items() if since <= cutoff)[:max_blocks]
        buffer = self._write_behind_buffer(max_bytes)
        batch: list[tuple[int, tuple, BlockMove, "torch.Tensor"]] = []
        used = planned = 0
        for _, slot in due:
            with self._slots_lock:
                owner = self.slot_owner.get(slot)
                if owner is None or slot not in self.dirty:
                    continue
                namespace, key, nbytes, codec, first = owner
                if batch and used + round_up(nbytes) > buffer.numel():
                    break  # the next call takes the rest
                payload = buffer[used : used + nbytes]  # page-aligned: written with O_DIRECT, no second copy
                payload.copy_(self.arena.slot(slot, nbytes))
            used += round_up(nbytes)
            move = BlockMove(row=-1, namespace=namespace, key=key, dram_slot=slot, nbytes=nbytes, codec=codec,
                             first=first, to_codec="" if codec == cold_codec else cold_codec)
            if move.to_codec:
                payload = self._transcoded(move, payload)
            if room is not None and not room(planned + file_bytes_for(len(payload))):
                break
            planned += file_bytes_for(len(payload))
            batch.append((slot, owner, move, payload))
        outcomes = self.store.write_batch([(m.namespace, m.key, p, m.codec) for _s, _o, m, p in batch],
                                          self.fingerprint.digest) if batch else []
        written: list[tuple[bytes, bytes, int, str]] = []
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
            with self._slots_lock:
                if self.slot_owner.get(slot) == owner:
                    self.dirty.pop(slot, None)
            with self._lock:
                self.link_bytes["dram->nvme"] += move.nbytes
            written.append((move.namespace, move.key, move.nbytes, move.codec))
        if self.publisher is not None and written:
            done = {(namespace, key) for namespace, key, _n, _c in written}
            self.publisher.went_cold([m for _s, _o, m, _p in batch if (m.namespace, m.key) in done])
        if error:
            self.disk_failing, self.disk_failed_at = True, time.monotonic()
        elif written:
            self.disk_failing = False
        return written, error

    def write_back(self: "Mover", cold_codec: str = "none") -> int:
        """Clean shutdown: write every DRAM block that has no NVMe copy to the NVMe tier, so a
        restart finds it (write-behind with no age limit). Stops quietly when the tier is full or the
        disk fails. Returns the blocks written."""
        total = 0
        while True:  # one group commit per batch, until nothing is left or the disk says no
            written, error = self.write_behind(0.0, len(self.dirty), cold_codec, max_bytes=self.write_back_bytes)
            total += len(written)
            if error:
                log.warning("kvtier: write-back stopped after %d blocks: %s", total, error)
            if error or not written:
                break
        if total:
            log.info("kvtier: wrote %d DRAM-only blocks to the NVMe tier before shutting down", total)
        return total

    def _demote(self: "Mover", job: Job, result: JobResult) -> None:
        self._await_slots([m.dram_slot for m in job.moves])
        self._drop(job, result)
        store = self._need_store()
        blocks = []
        for i, move in enumerate(job.moves):
            move.nbytes = self._own_nbytes(move)
            payload = self.arena.slot(move.dram_slot, move.nbytes)
            if move.to_codec:  # the cold tier's codec differs from the warm one
                payload = self._transcoded(move, payload)
            self._note(result, i, move)
            blocks.append((move.namespace, move.key, payload, move.codec))
        # one group commit: durable (and in the tier's index) when it returns
        self._collect_writes(store.write_batch(blocks, self.fingerprint.digest), job.moves, result, "dram->nvme")
        failed = set(result.failed)
        with self._slots_lock:
            for i, move in enumerate(job.moves):
                if i not in failed:
                    self.dirty.pop(move.dram_slot, None)
        if self.publisher is not None:
            self.publisher.went_cold([m for i, m in enumerate(job.moves) if i not in failed])
        if self.take_recreated():
            result.nvme_recreated = True  # the directory had vanished: what it held is gone
        result.disk_free = store.free_bytes()

    def take_recreated(self: "Mover") -> bool:
        """Whether the NVMe directory vanished and was made again since the last call."""
        if self.store is None or self.store.recreated <= self._recreated_seen:
            return False
        self._recreated_seen = self.store.recreated
        return True

    def _collect_writes(self: "Mover", outcomes: Sequence, moves: Sequence[BlockMove], result: JobResult,
                        link: str) -> None:
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                result.failed.append(i)
                result.error = str(outcome)
                self.disk_failing, self.disk_failed_at = True, time.monotonic()
                continue
            self.disk_failing = False
            self._count(link, moves[i].nbytes, result)

    def _drop(self: "Mover", job: Job, result: JobResult) -> None:
        if job.drops:
            self._need_store().delete_many([(move.namespace, move.key) for move in job.drops])
