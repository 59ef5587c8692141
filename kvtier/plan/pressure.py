"""Pressure and durability, for ``TierManager``: watermark demotion (what goes down to NVMe, what is
dropped because a restore would not pay), room on the NVMe tier, flushes, the worker's write-behind
reconciled into the index, and the disk's health. A mixin of ``TierManager`` (it plans on the
manager's index, slots and budgets); the mover does the IO."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable

import numpy as np

from kvtier.codecs import get_codec
from kvtier.errors import UsageError
from kvtier.jobs import BlockMove, Job, JobKind, JobResult
from kvtier.plan.decide import worth_keeping
from kvtier.plan.index import (
    FIRST,
    IN_DRAM,
    IN_NVME,
    PENDING,
    Tier,
)
from kvtier.tiers.nvme.store import file_bytes_for

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.plan.manager import TierManager

__all__ = ["PressureOps"]


class PressureOps:
    # ---- pressure -----------------------------------------------------------------------------
    def maintenance(self: "TierManager", force: bool = False) -> list[Job]:
        """Jobs that bring DRAM back under its low watermark once past the high one (or ``force``).

        NVMe room for the demoted blocks is made inside, by dropping NVMe victims past its own
        high watermark.
        """
        queued, self.queued = self.queued, []
        if self.slots.used_slots <= self.high * self.slots.num_slots and not force:
            return queued
        target = int(self.low * self.slots.num_slots)
        order = self.policies[Tier.DRAM].order(self.index, self.index.candidates(Tier.DRAM))
        need = self.slots.used_slots - target
        return queued + [job for job in [self._demote_rows(order[:need])] if job is not None]

    def _demote_rows(self: "TierManager", rows: Iterable[int], by_cost: bool = True, keep_dram: bool = False,
                     session_id: str | None = None) -> Job | None:
        """Demote DRAM blocks to NVMe (``by_cost``: drop those not worth a disk write; an
        operator's ``evict --to nvme`` is carried out as asked). ``keep_dram``: copy them to NVMe
        and keep them in DRAM (a FLUSH job: durability, never pressure)."""
        col = self.index.col
        moves, drops = [], []
        # the disk just failed a write (full, read-only, gone): keep DRAM turning over instead of
        # retrying every step; a later demotion tries again
        disk_failing = by_cost and time.monotonic() < self._nvme_retry_at
        for row in map(int, rows):
            if col["flags"][row] & IN_NVME:  # already on disk: releasing the DRAM copy is enough
                if not keep_dram:
                    self._release_dram(row, evicted=True)
                continue
            drop_because = None
            if col["pin"][row] == Tier.NVME:  # pinned: never dropped, written even when it won't pay
                if disk_failing:
                    continue  # stays in DRAM until the disk takes it
            elif disk_failing:
                drop_because = "demote_skipped_nvme_failing_blocks"
            elif by_cost and not worth_keeping(int(col["reach"][row]), self.cost, on_nvme=True):
                # restoring it from NVMe would be slower than recomputing it: not worth the write
                drop_because = "demote_unprofitable_blocks"
            if drop_because:
                self._release_dram(row, evicted=True)
                self._forget_if_homeless(row, "nvme_failing" if disk_failing else "not_worth_nvme")
                self.counters["dram_dropped_blocks"] += 1
                self.counters[drop_because] += 1
                continue
            codec = self.index.codecs[col["dram_codec"][row]]
            to_codec = "" if codec == self.cold_codec else self.cold_codec
            nbytes = int(col["dram_nbytes"][row])
            size = file_bytes_for(get_codec(to_codec).max_bytes(self.geometry) if to_codec else nbytes)
            if self.nvme_capacity and self._make_nvme_room(size, drops):
                self._nvme_used += size
                self.index.ref([row], +1)
                moves.append(self._move(row, dram_slot=int(col["dram_slot"][row]), nbytes=nbytes, codec=codec,
                                        to_codec=to_codec, first=bool(col["flags"][row] & FIRST), reserved=size))
            elif keep_dram:  # a flush that finds no room keeps the block where it is
                self.counters["flush_no_room_blocks"] += 1
            else:  # nowhere colder to keep it: let it go, vLLM recomputes it if it comes back
                self._release_dram(row, evicted=True)
                self._forget_if_homeless(row, "nvme_full" if self.nvme_capacity else "dram_full")
                self.counters["dram_dropped_blocks"] += 1
        if not moves and not drops:
            return None
        return self._new_job(JobKind.FLUSH if keep_dram else JobKind.DEMOTE, moves=moves, drops=drops,
                             session_id=session_id)

    # ---- durability ---------------------------------------------------------------------------
    def flush(self: "TierManager", session_id: str | None = None) -> Job | None:
        """A FLUSH job copying DRAM-only blocks (all, or one session's) to NVMe, keeping them in DRAM."""
        if not self.nvme_capacity:
            raise UsageError("no NVMe tier is configured: there is nowhere to flush to",
                             hint="start kvtier serve with --nvme-dir and --nvme")
        if session_id is None:
            rows = self.index.dirty_rows()
        else:
            flags = self.index.col["flags"]
            rows = [r for r in self.session_rows(self.session(session_id))
                    if flags[r] & (IN_DRAM | IN_NVME | PENDING) == IN_DRAM]
        order = np.argsort(self.index.col["dirty_since"][rows], kind="stable") if len(rows) else []
        return self._demote_rows(np.asarray(rows)[order], by_cost=False, keep_dram=True, session_id=session_id)

    def dirty_stats(self: "TierManager") -> dict[str, float]:
        """What a crash would lose now: DRAM-only blocks, their bytes, and the oldest one's age (s)."""
        rows = self.index.dirty_rows()
        if not len(rows):
            return {"dirty_blocks": 0, "dirty_bytes": 0, "dirty_age_s": 0.0}
        col = self.index.col
        return {"dirty_blocks": int(len(rows)), "dirty_bytes": int(col["dram_nbytes"][rows].sum()),
                "dirty_age_s": round(max(0.0, self.index.now() - float(col["dirty_since"][rows].min())), 3)}

    def note_written_behind(self: "TierManager", records: Iterable[tuple[bytes, bytes, int, str]],
                            error: str | None = None, recreated: bool = False, disk_ok: bool = False,
                            disk_free: int | None = None) -> Job | None:
        """The worker wrote these DRAM blocks to NVMe on its own (write-behind): they are clean now.

        A block the manager forgot meanwhile (dropped, evicted) had its file written too late: a DROP
        job deletes it, so a dropped session stays dropped. ``error``: why the worker stopped (a full,
        read-only or missing disk): the NVMe warning, as for a failed demotion; ``recreated``: the
        NVMe directory had vanished (a lasting warning, as for a demotion that found it gone);
        ``disk_ok``: the worker's probe found the disk taking writes again; ``disk_free``: the bytes
        its filesystem has free.
        """
        if recreated:
            self._warn_nvme_lost()
        col = self.index.col
        drops = []
        records = list(records)
        for namespace, key, nbytes, codec in records:
            row = self.index.row_of(namespace, key)
            if row is None or not col["flags"][row] & IN_DRAM:
                if row is None or not col["flags"][row] & IN_NVME:
                    drops.append(BlockMove(row=-1, namespace=namespace, key=key, nbytes=int(nbytes)))
                continue
            if col["flags"][row] & IN_NVME:
                continue  # a demotion or flush wrote it too
            self.index.now_in_nvme(row, nbytes, codec)
            self._nvme_used += file_bytes_for(int(nbytes))
            self.policies[Tier.NVME].on_insert(row, (namespace, key))
            self.counters["written_behind_blocks"] += 1
        if error:
            self.counters["write_behind_failures"] += 1
            self._nvme_write_failed(error)
        elif records or disk_ok:
            self._nvme_write_ok(disk_free)
        if drops:
            self.counters["written_behind_dropped"] += len(drops)
            return self._new_job(JobKind.DROP, drops=drops)
        return None

    def _make_nvme_room(self: "TierManager", size: int, drops: list[BlockMove]) -> bool:
        """Drop NVMe victims (into ``drops``) so ``size`` more bytes fit under the high watermark."""
        if self._nvme_used + size <= self.high * self.nvme_capacity:
            return True
        target = self.low * self.nvme_capacity - size
        order = self.policies[Tier.NVME].order(self.index, self.index.candidates(Tier.NVME))
        for row in map(int, order):
            if self._nvme_used <= target:
                break
            drops.append(self._release_nvme(row, evicted=True))
            self._forget_if_homeless(row, "nvme_budget")
            self.counters["nvme_dropped_blocks"] += 1
        return self._nvme_used + size <= self.nvme_capacity

    def _complete_demote(self: "TierManager", job: Job, result: JobResult) -> None:
        col = self.index.col
        failed = result.failed_positions(job)
        keep = job.kind == JobKind.FLUSH
        for i, move in enumerate(job.moves):
            row = move.row
            self.index.ref([row], -1)
            if i in failed:
                self._nvme_used -= move.reserved
                self.counters["demote_failed_blocks"] += 1
                continue
            if col["flags"][row] & IN_NVME:  # written behind meanwhile: already counted
                self._nvme_used -= move.reserved
                if col["flags"][row] & IN_DRAM and not keep and col["pin"][row] != Tier.DRAM:
                    self._release_dram(row, evicted=True)
                continue
            self._nvme_used += file_bytes_for(move.nbytes) - move.reserved  # the codec's real size
            self.index.now_in_nvme(row, move.nbytes, move.codec)
            self.policies[Tier.NVME].on_insert(row, (move.namespace, move.key))
            if keep:
                self.counters["flushed_blocks"] += 1
                continue
            if col["flags"][row] & IN_DRAM and col["pin"][row] != Tier.DRAM:
                self._release_dram(row, evicted=True)
            self.counters["demoted_blocks"] += 1
        if result.nvme_recreated:
            self._warn_nvme_lost()
        if result.error:  # full, read-only, removed...: blocks stay in DRAM, requests go on
            self._nvme_write_failed(result.error)
        elif result.ok and job.moves:
            self._nvme_write_ok(result.disk_free)

    def _warn_nvme_lost(self: "TierManager") -> None:
        """Lasting, like lost blocks found by reads; every session goes back into the catalog (it
        lived in that directory too)."""
        self.warnings["nvme_lost"] = ("the NVMe directory vanished while serving and was recreated: the "
                                      "blocks it held are gone and will be recomputed")
        self._catalog_dirty.update(self.sessions)

    def _nvme_write_failed(self: "TierManager", error: str) -> None:
        """A demotion, flush or write-behind failed: warn, and back off (1 s doubling to 30 s)."""
        self.warnings["nvme"] = error
        self._nvme_backoff = min(30.0, max(1.0, 2 * self._nvme_backoff))
        self._nvme_retry_at = time.monotonic() + self._nvme_backoff

    def full_disk_margin(self: "TierManager") -> int:
        """The free bytes a disk that ran out of space needs before its warning ends, budget spent or
        not: 1% of the budget, at least 1 MiB (never more than the budget)."""
        return min(self.nvme_capacity, max(1 << 20, self.nvme_capacity // 100))

    def _nvme_write_ok(self: "TierManager", disk_free: int | None = None) -> None:
        """A write succeeded: once the back-off is over, the disk counts as healthy again. A full disk
        also needs room for what the NVMe budget still promises (``disk_free``): writes that slip into
        space kvtier's own drops just freed do not end its warning. Even with the budget full, a disk
        with less than a small margin free stays "full": every write then races whoever filled it."""
        warning = self.warnings.get("nvme")
        if warning is None or time.monotonic() < self._nvme_retry_at:
            return
        if "no space left" in warning and disk_free is not None \
                and disk_free < max(self.nvme_capacity - self._nvme_used, self.full_disk_margin()):
            return
        self.warnings.pop("nvme", None)
        self._nvme_backoff = 0.0

