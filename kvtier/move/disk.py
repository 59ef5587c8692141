"""DRAM <-> NVMe for the ``Mover``: NVMe reads for loads and promotions (one batch, so adjacent
records come back in large reads), demotions and flushes (one group commit per job) and dropped
NVMe copies.

Owns the disk's health (``health``, a ``Backoff``: the last write failed, and when one last did)
and the count of NVMe directory re-creations already reported. Talks to the tier only through
``DiskStore``.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence

from kvtier.codecs import transcode
from kvtier.errors import KvtierError
from kvtier.jobs import BlockMove, Job, JobResult
from kvtier.move.fences import SlotFences
from kvtier.move.ledger import SlotLedger
from kvtier.move.links import LinkBytes
from kvtier.move.recode import note, transcoded
from kvtier.move.staging import StagingPool
from kvtier.tiers.base import DiskStore
from kvtier.tiers.health import Backoff

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.layout import ModelFingerprint
    from kvtier.tiers.dram import DramArena

__all__ = ["DiskMoves", "OnCold"]

OnCold = Callable[[Sequence[BlockMove]], None]  # blocks that just got an NVMe copy (the publisher's demote policy)


class DiskMoves:
    def __init__(self, store: DiskStore | None, fingerprint: "ModelFingerprint", arena: "DramArena",
                 ledger: SlotLedger, links: LinkBytes, fences: SlotFences, staging: StagingPool,
                 health: Backoff | None = None, on_cold: OnCold | None = None):
        self.store, self.fingerprint, self.arena = store, fingerprint, arena
        self.ledger, self.links, self.fences, self.staging = ledger, links, fences, staging
        self.health = health if health is not None else Backoff(1.0, 30.0)
        self.on_cold = on_cold
        self._recreated_seen = 0  # NVMe directory re-creations already reported

    def need_store(self) -> DiskStore:
        if self.store is None:
            raise KvtierError("no NVMe tier is configured")
        return self.store

    def take_recreated(self) -> bool:
        """Whether the NVMe directory vanished and was made again since the last call."""
        if self.store is None or self.store.recreated <= self._recreated_seen:
            return False
        self._recreated_seen = self.store.recreated
        return True

    # ---- NVMe -> DRAM -------------------------------------------------------------------------
    def read(self, job: Job, result: JobResult, positions: range | None = None) -> dict[int, "torch.Tensor"]:
        """Read the job's NVMe blocks (into their DRAM slot, or a buffer of their own); with
        ``positions``, only those of these moves (a pipelined load reads its job in parts)."""
        span = positions if positions is not None else range(len(job.moves))
        reads = [(i, job.moves[i]) for i in span if job.moves[i].from_nvme]
        if not reads:
            return {}
        store = self.need_store()
        targets = {i: self.staging.landing(m) for i, m in reads}
        # one batch: adjacent records (a session demoted together) come back in large reads
        started = time.perf_counter()
        outcomes = store.read_batch([(m.namespace, m.key, targets[i]) for i, m in reads], self.fingerprint.digest)
        result.nvme_read_s += time.perf_counter() - started  # the disk's live speed, for the cost model
        for (i, _m), outcome in zip(reads, outcomes):
            if isinstance(outcome, BaseException):
                result.failed.append(i)
                result.bad_reads.append(i)
                result.error = str(outcome)
                continue
            nbytes, codec = outcome
            result.nvme_read_bytes += nbytes
            move = job.moves[i]
            move.nbytes, move.codec = nbytes, codec
            self.links.count("nvme->dram", nbytes, result)
            if move.to_codec and move.dram_slot >= 0:  # re-encode to the warm codec to fit its slot
                move.nbytes = transcode(targets[i][:nbytes], codec, move.to_codec, self.fingerprint.geometry,
                                        self.arena.slot(move.dram_slot), first=move.first or None)
                move.codec = move.to_codec
                targets[i] = self.arena.slot(move.dram_slot)
            note(result, i, move)
            if move.dram_slot >= 0:
                self.ledger.own(move)
        result.failed.sort()
        return targets

    def promote(self, job: Job, result: JobResult) -> None:
        self.staging.give(self.read(job, result).values())

    # ---- DRAM -> NVMe -------------------------------------------------------------------------
    def demote(self, job: Job, result: JobResult) -> None:
        self.fences.wait([m.dram_slot for m in job.moves])
        self.drop(job, result)
        store = self.need_store()
        blocks = []
        for i, move in enumerate(job.moves):
            move.nbytes = self.ledger.nbytes_of(move)
            payload = self.arena.slot(move.dram_slot, move.nbytes)
            if move.to_codec:  # the cold tier's codec differs from the warm one
                payload = transcoded(move, payload, self.fingerprint.geometry)
            note(result, i, move)
            blocks.append((move.namespace, move.key, payload, move.codec))
        # one group commit: durable (and in the tier's index) when it returns
        self.collect_writes(store.write_batch(blocks, self.fingerprint.digest), job.moves, result, "dram->nvme")
        failed = set(result.failed)
        self.ledger.clean(move.dram_slot for i, move in enumerate(job.moves) if i not in failed)
        if self.on_cold is not None:
            self.on_cold([m for i, m in enumerate(job.moves) if i not in failed])
        if self.take_recreated():
            result.nvme_recreated = True  # the directory had vanished: what it held is gone
        result.disk_free = store.free_bytes()

    def collect_writes(self, outcomes: Sequence, moves: Sequence[BlockMove], result: JobResult, link: str) -> None:
        """Count a group commit's writes; a failed one fails its move and marks the disk failing
        (until a later write succeeds)."""
        failed_any = False
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                result.failed.append(i)
                result.error = str(outcome)
                failed_any = True
                continue
            self.links.count(link, moves[i].nbytes, result)
        if failed_any:
            self.health.failed()
        if outcomes and not isinstance(outcomes[-1], BaseException):
            self.health.succeeded()  # the last write went through: the disk is back

    def drop(self, job: Job, result: JobResult) -> None:
        if job.drops:
            self.need_store().delete_many([(move.namespace, move.key) for move in job.drops])
