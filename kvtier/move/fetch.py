"""Shared-tier fetches for the ``Mover``: another box's blocks into their DRAM slots (or NVMe
records), every value verified by the store before it counts.

Owns nothing but its collaborators: the shared store (a ``BlockStore``), the staging pool its
reads land in, the arena and slot ledger, the disk handler (for blocks bound for NVMe) and the
link counters.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.codecs import transcode
from kvtier.errors import KvtierError
from kvtier.jobs import Job, JobResult
from kvtier.move.disk import DiskMoves
from kvtier.move.ledger import SlotLedger
from kvtier.move.links import LinkBytes
from kvtier.move.recode import note
from kvtier.move.staging import StagingPool
from kvtier.tiers.base import BlockStore

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.layout import ModelFingerprint
    from kvtier.tiers.dram import DramArena

__all__ = ["SharedFetches"]


class SharedFetches:
    def __init__(self, shared: BlockStore | None, fingerprint: "ModelFingerprint", arena: "DramArena",
                 ledger: SlotLedger, disk: DiskMoves, staging: StagingPool, links: LinkBytes):
        self.shared, self.fingerprint, self.arena, self.ledger = shared, fingerprint, arena, ledger
        self.disk, self.staging, self.links = disk, staging, links

    def fetch(self, job: Job, result: JobResult) -> None:  # shared store -> DRAM or NVMe (both BlockStores)
        """Blocks from the shared store into their DRAM slots (or NVMe records): every value is
        verified (header, signature, checksum) by the store before it counts; a missing or refused
        one fails its move, and the manager forgets its row."""
        if self.shared is None:
            raise KvtierError("no shared tier is configured")
        moves = list(enumerate(job.moves))
        targets = {i: self.staging.landing(m) for i, m in moves}
        outcomes = self.shared.read_batch([(m.namespace, m.key, targets[i]) for i, m in moves], self.fingerprint.digest)
        to_nvme: list[int] = []
        for (i, move), outcome in zip(moves, outcomes):
            if isinstance(outcome, BaseException):
                result.failed.append(i)
                result.error = result.error or str(outcome)
                continue
            nbytes, codec = outcome
            move.nbytes, move.codec = nbytes, codec
            self.links.count("shared->dram" if not move.to_nvme else "shared->nvme", nbytes, result)
            if move.to_nvme:
                to_nvme.append(i)
                continue
            if move.to_codec and move.to_codec != codec:  # too big for a warm slot: re-encode to fit
                move.nbytes = transcode(targets[i][:nbytes], codec, move.to_codec, self.fingerprint.geometry,
                                        self.arena.slot(move.dram_slot), first=move.first or None)
                move.codec = move.to_codec
            elif move.to_codec:
                self.arena.slot(move.dram_slot, nbytes).copy_(targets[i][:nbytes])
            note(result, i, move)
            self.ledger.own(move)
        if to_nvme:
            store = self.disk.need_store()
            outcomes = store.write_batch([(job.moves[i].namespace, job.moves[i].key, targets[i][: job.moves[i].nbytes],
                                           job.moves[i].codec) for i in to_nvme], self.fingerprint.digest)
            for i, outcome in zip(to_nvme, outcomes):
                if isinstance(outcome, BaseException):
                    result.failed.append(i)
                    result.error = result.error or str(outcome)
                else:
                    note(result, i, job.moves[i])
        result.failed.sort()
        self.staging.give(targets.values())
