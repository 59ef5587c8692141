"""Pressure and durability: watermark demotion (what goes down to NVMe, what is dropped because a
restore would not pay), room on the NVMe tier, flushes, the worker's write-behind reconciled into
the index, and the disk's health.

``Pressure`` owns the watermarks, the cost model it asks, and the NVMe write health (a
``kvtier.tiers.health.Backoff``: after a failed write, victims are dropped instead of demoted until
the back-off is over). It plans on the block table and emits jobs into the job book; the mover
does the IO.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np

from kvtier.codecs import get_codec
from kvtier.errors import UsageError
from kvtier.jobs import BlockMove, Job, JobKind, JobResult
from kvtier.layout import KVGeometry
from kvtier.plan.catalog_log import CatalogLog
from kvtier.plan.decide import worth_keeping
from kvtier.plan.index import FIRST, IN_DRAM, IN_NVME, PENDING, Tier
from kvtier.plan.jobbook import JobBook
from kvtier.plan.table import BlockTable
from kvtier.plan.telemetry import Telemetry
from kvtier.tiers.health import Backoff
from kvtier.tiers.nvme.store import file_bytes_for

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.plan.costmodel import CostModel

__all__ = ["Pressure"]

_NVME_LOST = "the NVMe directory vanished while serving and was recreated: the blocks it held are gone and " \
             "will be recomputed"


class Pressure:
    def __init__(self, table: BlockTable, jobs: JobBook, telemetry: Telemetry, catalog_log: CatalogLog,
                 geometry: KVGeometry, health: Backoff, high: float, low: float, cost: "CostModel | None" = None):
        """``health``: the NVMe tier's write back-off; ``high``/``low``: the watermarks (fractions of
        each tier); ``cost``: demotion asks it whether a victim is worth writing (None: always)."""
        self.table, self.jobs, self.telemetry, self.catalog_log = table, jobs, telemetry, catalog_log
        self.geometry, self.health = geometry, health
        self.high, self.low = high, low
        self.cost = cost

    # ---- pressure -----------------------------------------------------------------------------
    def maintenance(self, force: bool = False) -> list[Job]:
        """Jobs that bring DRAM back under its low watermark once past the high one (or ``force``).

        NVMe room for the demoted blocks is made inside, by dropping NVMe victims past its own
        high watermark.
        """
        queued = self.jobs.take_queued()
        slots = self.table.slots
        if slots.used_slots <= self.high * slots.num_slots and not force:
            return queued
        target = int(self.low * slots.num_slots)
        order = self.table.victims(Tier.DRAM)  # the policy's order, retained sessions' blocks last
        need = slots.used_slots - target
        return queued + [job for job in [self.demote_rows(order[:need])] if job is not None]

    def demote_rows(self, rows: Iterable[int], by_cost: bool = True, keep_dram: bool = False,
                    session_id: str | None = None) -> Job | None:
        """Demote DRAM blocks to NVMe (``by_cost``: drop those not worth a disk write; an
        operator's ``evict --to nvme`` is carried out as asked). ``keep_dram``: copy them to NVMe
        and keep them in DRAM (a FLUSH job: durability, never pressure)."""
        table, count = self.table, self.telemetry.count
        col = table.index.col
        moves, drops = [], []
        # the disk just failed a write (full, read-only, gone): keep DRAM turning over instead of
        # retrying every step; a later demotion tries again
        disk_failing = by_cost and self.health.waiting
        for row in map(int, rows):
            if col["flags"][row] & IN_NVME:  # already on disk: releasing the DRAM copy is enough
                if not keep_dram:
                    table.release_dram(row, evicted=True)
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
                table.release_dram(row, evicted=True)
                table.forget_if_homeless(row, "nvme_failing" if disk_failing else "not_worth_nvme")
                count("dram_dropped_blocks")
                count(drop_because)
                continue
            codec = table.index.codecs[col["dram_codec"][row]]
            to_codec = "" if codec == table.cold_codec else table.cold_codec
            nbytes = int(col["dram_nbytes"][row])
            size = file_bytes_for(get_codec(to_codec).max_bytes(self.geometry) if to_codec else nbytes)
            if table.nvme.capacity and self.make_nvme_room(size, drops):
                table.index.ref([row], +1)
                moves.append(table.move(row, dram_slot=int(col["dram_slot"][row]), nbytes=nbytes, codec=codec,
                                        to_codec=to_codec, first=bool(col["flags"][row] & FIRST),
                                        reserved=table.nvme.reserve(size)))
            elif keep_dram:  # a flush that finds no room keeps the block where it is
                count("flush_no_room_blocks")
            else:  # nowhere colder to keep it: let it go, vLLM recomputes it if it comes back
                table.release_dram(row, evicted=True)
                table.forget_if_homeless(row, "nvme_full" if table.nvme.capacity else "dram_full")
                count("dram_dropped_blocks")
        if not moves and not drops:
            return None
        return self.jobs.new_job(JobKind.FLUSH if keep_dram else JobKind.DEMOTE, moves=moves, drops=drops,
                                 session_id=session_id)

    def make_nvme_room(self, size: int, drops: list[BlockMove]) -> bool:
        """Drop NVMe victims (into ``drops``) so ``size`` more bytes fit under the high watermark."""
        table, budget = self.table, self.table.nvme
        if budget.used + size <= self.high * budget.capacity:
            return True
        target = self.low * budget.capacity - size
        order = table.victims(Tier.NVME)  # the policy's order, retained sessions' blocks last
        for row in map(int, order):
            if budget.used <= target:
                break
            drops.append(table.release_nvme(row, evicted=True))
            table.forget_if_homeless(row, "nvme_budget")
            self.telemetry.count("nvme_dropped_blocks")
        return budget.used + size <= budget.capacity

    # ---- durability ---------------------------------------------------------------------------
    def flush(self, session_id: str | None = None) -> Job | None:
        """A FLUSH job copying DRAM-only blocks (all, or one session's) to NVMe, keeping them in DRAM."""
        table = self.table
        if not table.nvme.capacity:
            raise UsageError("no NVMe tier is configured: there is nowhere to flush to",
                             hint="start kvtier serve with --nvme-dir and --nvme")
        if session_id is None:
            rows = table.index.dirty_rows()
        else:
            flags = table.index.col["flags"]
            rows = [r for r in table.session_rows(table.session(session_id))
                    if flags[r] & (IN_DRAM | IN_NVME | PENDING) == IN_DRAM]
        order = np.argsort(table.index.col["dirty_since"][rows], kind="stable") if len(rows) else []
        return self.demote_rows(np.asarray(rows)[order], by_cost=False, keep_dram=True, session_id=session_id)

    def note_written_behind(self, records: Iterable[tuple[bytes, bytes, int, str]], error: str | None = None,
                            recreated: bool = False, disk_ok: bool = False,
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
            self.warn_nvme_lost()
        index = self.table.index
        col = index.col
        drops = []
        records = list(records)
        for namespace, key, nbytes, codec in records:
            row = index.row_of(namespace, key)
            if row is None or not col["flags"][row] & IN_DRAM:
                if row is None or not col["flags"][row] & IN_NVME:
                    drops.append(BlockMove(row=-1, namespace=namespace, key=key, nbytes=int(nbytes)))
                continue
            if col["flags"][row] & IN_NVME:
                continue  # a demotion or flush wrote it too
            self.table.written_to_nvme(row, nbytes, codec)
            self.telemetry.count("written_behind_blocks")
        if error:
            self.telemetry.count("write_behind_failures")
            self.nvme_write_failed(error)
        elif records or disk_ok:
            self.nvme_write_ok(disk_free)
        if drops:
            self.telemetry.count("written_behind_dropped", len(drops))
            return self.jobs.new_job(JobKind.DROP, drops=drops)
        return None

    def complete_demote(self, job: Job, result: JobResult) -> None:
        """A DEMOTE or FLUSH finished: written blocks get their NVMe copy (and, demoted, lose the DRAM one)."""
        table, budget = self.table, self.table.nvme
        col = table.index.col
        failed = result.failed_positions(job)
        keep = job.kind == JobKind.FLUSH
        for i, move in enumerate(job.moves):
            row = move.row
            table.index.ref([row], -1)
            if i in failed:
                budget.release(move.reserved)
                self.telemetry.count("demote_failed_blocks")
                continue
            if col["flags"][row] & IN_NVME:  # written behind meanwhile: already counted
                budget.release(move.reserved)
                if col["flags"][row] & IN_DRAM and not keep and col["pin"][row] != Tier.DRAM:
                    table.release_dram(row, evicted=True)
                continue
            budget.settle(move.reserved, file_bytes_for(move.nbytes))  # the codec's real size
            table.index.now_in_nvme(row, move.nbytes, move.codec)
            table.policies[Tier.NVME].on_insert(row, (move.namespace, move.key))
            if keep:
                self.telemetry.count("flushed_blocks")
                continue
            if col["flags"][row] & IN_DRAM and col["pin"][row] != Tier.DRAM:
                table.release_dram(row, evicted=True)
            self.telemetry.count("demoted_blocks")
        if result.nvme_recreated:
            self.warn_nvme_lost()
        if result.error:  # full, read-only, removed...: blocks stay in DRAM, requests go on
            self.nvme_write_failed(result.error)
        elif result.ok and job.moves:
            self.nvme_write_ok(result.disk_free)

    # ---- the disk's health --------------------------------------------------------------------
    def warn_nvme_lost(self) -> None:
        """Lasting, like lost blocks found by reads; every session goes back into the catalog (it
        lived in that directory too)."""
        self.telemetry.warn("nvme_lost", _NVME_LOST)
        self.catalog_log.mark_all_changed()

    def nvme_write_failed(self, error: str) -> None:
        """A demotion, flush or write-behind failed: warn, and back off (1 s doubling to 30 s)."""
        self.telemetry.warn("nvme", error)
        self.health.failed()

    def full_disk_margin(self) -> int:
        """The free bytes a disk that ran out of space needs before its warning ends, budget spent or
        not: 1% of the budget, at least 1 MiB (never more than the budget)."""
        capacity = self.table.nvme.capacity
        return min(capacity, max(1 << 20, capacity // 100))

    def nvme_write_ok(self, disk_free: int | None = None) -> None:
        """A write succeeded: once the back-off is over, the disk counts as healthy again. A full disk
        also needs room for what the NVMe budget still promises (``disk_free``): writes that slip into
        space kvtier's own drops just freed do not end its warning. Even with the budget full, a disk
        with less than a small margin free stays "full": every write then races whoever filled it."""
        warning = self.telemetry.warning("nvme")
        if warning is None or self.health.waiting:
            return
        if "no space left" in warning and disk_free is not None \
                and disk_free < max(self.table.nvme.free, self.full_disk_margin()):
            return
        self.telemetry.warn("nvme", None)
        self.health.succeeded()
