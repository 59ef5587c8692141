"""Jobs: what the scheduler half asks the worker half (the mover) to do, and what comes back.

A job is plain data so it can travel in vLLM's per-step connector metadata between processes.
Every job the manager emits holds a reference on its blocks until ``TierManager.complete``
receives its ``JobResult``; a failed block is reported by position, never dropped silently.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["JobKind", "BlockMove", "Job", "JobResult", "RankMerger"]


class JobKind(str, Enum):
    STORE = "store"  # HBM -> DRAM (write-through of newly computed blocks)
    LOAD = "load"  # DRAM (and NVMe via DRAM) -> HBM
    DEMOTE = "demote"  # DRAM -> NVMe
    FLUSH = "flush"  # DRAM -> NVMe, keeping the DRAM copy (durability: pins, kvtier flush)
    PROMOTE = "promote"  # NVMe -> DRAM
    DROP = "drop"  # delete NVMe copies
    SNAPSHOT = "snapshot"  # DRAM/NVMe -> snapshot file
    RESTORE = "restore"  # snapshot file -> DRAM or NVMe
    FETCH = "fetch"  # shared store (another box's blocks) -> DRAM or NVMe


@dataclass(slots=True)
class BlockMove:
    """One block's part of a job."""

    row: int
    namespace: bytes
    key: bytes
    dram_slot: int = -1  # source or destination slot in the DRAM arena
    nbytes: int = 0  # payload bytes (as stored, after the codec)
    codec: str = "none"  # codec of the payload as stored at the source (stores: the codec to write)
    to_codec: str = ""  # re-encode into this codec on the way ("" = keep ``codec``)
    first: bool = False  # first block of its sequence (codecs keep its attention sinks)
    reserved: int = 0  # NVMe bytes the manager reserved for this move's file
    device_block: int = -1  # vLLM block id in HBM for stores and loads
    from_nvme: bool = False  # loads: read from NVMe into dram_slot first
    from_shared: bool = False  # fetches: read from the shared store
    to_nvme: bool = False  # restores: write straight to NVMe instead of DRAM
    durable: bool = False  # stores: the worker writes the block behind to NVMe at once (pinned sessions)
    position: int = -1  # restores: the block's position in the snapshot file


@dataclass(slots=True)
class Job:
    job_id: int
    kind: JobKind
    moves: list[BlockMove] = field(default_factory=list)
    session_id: str | None = None
    path: str | None = None  # snapshot / restore file
    header: dict | None = None  # snapshot header fields (session, tokens, ...)
    drops: list[BlockMove] = field(default_factory=list)  # NVMe copies to delete first
    req_id: str | None = None  # the vLLM request a store or load serves (fences, finished transfers)


@dataclass(slots=True)
class JobResult:
    """What one rank's worker half did with a job (or, ``job_id < 0``, a report of its own).

    With tensor parallelism every rank runs every job on its own shard and reports it; the
    scheduler half ``merge``s the reports and applies the job once all ranks are in.
    """

    job_id: int
    kind: JobKind
    ok: bool
    failed: list[int] = field(default_factory=list)  # positions in Job.moves that failed
    error: str | None = None
    bytes_moved: int = 0
    seconds: float = 0.0
    rank: int = 0  # the tensor-parallel rank that reports it
    encoded: dict[int, tuple[int, str]] = field(default_factory=dict)  # move -> (nbytes, codec) as now stored
    bad_reads: list[int] = field(default_factory=list)  # moves whose NVMe copy was missing or corrupt
    path: str | None = None  # snapshots: the file written
    nvme_recreated: bool = False  # the NVMe directory had vanished and was made again
    disk_free: int | None = None  # bytes free on the NVMe disk after the job's writes
    written_behind: list[tuple[bytes, bytes, int, str]] | None = None  # write-behind reports: blocks written
    disk_ok: bool = True  # write-behind reports: the last write or probe succeeded
    shared: dict | None = None  # the worker's shared-tier report: its client's state and counters
    nvme_read_bytes: int = 0  # NVMe bytes this job (or a disk probe, job_id < 0) read, and how long the
    nvme_read_s: float = 0.0  # reads took: the scheduler half's cost model learns the disk's speed from them

    def failed_positions(self, job: "Job") -> set[int]:
        """Positions in ``job.moves`` that did not happen (all of them when the job failed as a whole)."""
        if self.ok:
            return set()
        return set(self.failed) if self.failed else set(range(len(job.moves)))

    def merge(self, other: "JobResult") -> "JobResult":
        """Fold another rank's report of the same job into this one: a move failed if it failed on
        any rank; sizes are the largest shard's (the budgets are per rank)."""
        self.ok = self.ok and other.ok
        self.failed = sorted(set(self.failed) | set(other.failed))
        self.error = self.error or other.error
        self.bytes_moved += other.bytes_moved
        self.seconds = max(self.seconds, other.seconds)
        for i, (nbytes, codec) in other.encoded.items():
            mine = self.encoded.get(i)
            self.encoded[i] = (max(nbytes, mine[0]), codec) if mine else (nbytes, codec)
        self.bad_reads = sorted(set(self.bad_reads) | set(other.bad_reads))
        if self.path is None or other.rank < self.rank:
            self.path = other.path or self.path
        self.nvme_recreated = self.nvme_recreated or other.nvme_recreated
        if other.disk_free is not None:
            self.disk_free = other.disk_free if self.disk_free is None else min(self.disk_free, other.disk_free)
        self.disk_ok = self.disk_ok and other.disk_ok
        self.nvme_read_bytes = max(self.nvme_read_bytes, other.nvme_read_bytes)  # per rank, as the budgets
        self.nvme_read_s = max(self.nvme_read_s, other.nvme_read_s)
        self.rank = min(self.rank, other.rank)
        return self


class RankMerger:
    """Tensor parallelism: every rank runs every job on its own shard and reports it. ``job``
    returns the merged result once all ``shards`` ranks have reported (None before); ``written``
    returns the blocks of a write-behind report that every rank has now written."""

    def __init__(self, shards: int):
        self.shards = shards
        self._partial: dict[int, tuple[JobResult, set[int]]] = {}
        self._written: dict[tuple[bytes, bytes], set[int]] = {}

    def job(self, result: JobResult) -> JobResult | None:
        if self.shards <= 1:
            return result
        merged, ranks = self._partial.get(result.job_id, (None, set()))
        merged = result if merged is None else merged.merge(result)
        ranks.add(result.rank)
        if len(ranks) < self.shards:
            self._partial[result.job_id] = (merged, ranks)
            return None
        del self._partial[result.job_id]
        return merged

    def written(self, result: JobResult) -> list[tuple[bytes, bytes, int, str]]:
        records = list(result.written_behind or ())
        if self.shards <= 1:
            return records
        done = []
        for record in records:
            ranks = self._written.setdefault(record[:2], set())
            ranks.add(result.rank)
            if len(ranks) == self.shards:
                del self._written[record[:2]]
                done.append(record)
        if len(self._written) > 1 << 20:  # a rank that never wrote a block (its slot was dropped first)
            self._written.clear()
        return done

    @property
    def waiting(self) -> int:
        """Jobs some ranks have reported and others not yet."""
        return len(self._partial)
