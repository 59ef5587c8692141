"""The worker half: runs the manager's jobs and moves bytes. It decides nothing.

Links: HBM (vLLM's per-layer KV tensors, through a layout adapter) <-> the DRAM arena <-> the NVMe
store, plus snapshot files and the shared store. Stores run in order on one copy thread (the host
side of a copy stream), everything else on a small thread pool (CPU copies, NVMe syscalls and
checksums release the GIL); NVMe reads and writes within a job fan out over the store's own IO
threads. With CUDA, device<->host copies go through pinned DRAM slots on a dedicated stream that
first waits for an event recorded on the compute stream when the job was submitted, so stores
never read KV the forward pass is still writing, and the step that submitted them never waits.

Nothing here blocks the thread that submits: a job that reads a DRAM slot a store is still
filling waits for that store's fence on a mover thread. Blocking waits made on vLLM's step path
(``step.active``) are counted in ``step_syncs``; serving should leave it at zero.

Every job ends in exactly one ``JobResult`` (``poll`` / ``wait``): a failure is reported with the
positions that failed, never swallowed. Bytes moved are counted per link for telemetry.

``Mover`` is a facade over parts that each own their state: the job runner (``jobs``: pools,
fences, jobs in flight, results), one handler per kind of move (``copies``: HBM<->DRAM,
``disk_moves``: DRAM<->NVMe, ``behind``: write-behind, ``snapshots``: snapshot files,
``fetches``: shared-tier fetches), the slot ledger (``ledger``), the staging pool, the link
counters and the disk's health (``disk``, a ``Backoff``).
"""
from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Sequence

from kvtier.jobs import Job, JobKind, JobResult
from kvtier.move.behind import WRITE_BEHIND_BYTES, WriteBehind, Written
from kvtier.move.device import DeviceCopies
from kvtier.move.disk import DiskMoves
from kvtier.move.fences import SlotFences
from kvtier.move.fetch import SharedFetches
from kvtier.move.files import SnapshotFiles
from kvtier.move.ledger import SlotLedger, SlotOwner
from kvtier.move.links import LinkBytes
from kvtier.move.publish import Publisher, SharedTier
from kvtier.move.runner import JobRunner, OnDone
from kvtier.move.staging import StagingPool
from kvtier.move.stream import CopyStream
from kvtier.tiers.base import DiskStore
from kvtier.tiers.health import Backoff, Clock

if TYPE_CHECKING:  # pragma: no cover
    import threading

    import torch

    from kvtier.layout import LayoutAdapter, ModelFingerprint
    from kvtier.tiers.dram import DramArena

__all__ = ["Mover"]


class Mover:
    def __init__(
        self,
        fingerprint: "ModelFingerprint",
        arena: "DramArena",
        store: DiskStore | None = None,
        adapter: "LayoutAdapter | None" = None,
        kv_layers: "Sequence[torch.Tensor] | None" = None,
        threads: int = 2,
        rank: int = 0,
        shards: int = 1,
        shared: SharedTier | None = None,
        shared_policy: str = "write-through",
        shared_codec: str = "none",
        clock: Clock = time.monotonic,
    ):
        import torch

        self.fingerprint = fingerprint
        self.rank, self.shards = rank, shards  # tensor parallelism: this rank's shard of every block
        self.arena, self.store, self.shared = arena, store, shared
        layers = list(kv_layers) if kv_layers is not None else None
        self.stream = CopyStream(layers[0].device if layers else torch.device("cpu"))
        self.links = LinkBytes()
        # what each DRAM slot holds as this worker wrote it, and which hold a block with no NVMe copy
        self.ledger = SlotLedger(store.has if store is not None else None, clock)
        self.staging = StagingPool(arena)
        self.fences = SlotFences(self.stream)
        # the last NVMe write failed, and when one last did: write-behind probes the disk until it is back
        self.disk = Backoff(1.0, 30.0, clock)
        self.publisher: Publisher | None = None
        if shared is not None:
            self.publisher = Publisher(self.ledger, arena, self.links, fingerprint, shared, shared_policy, shared_codec)
        on_cold = self.publisher.went_cold if self.publisher is not None else None
        self.disk_moves = DiskMoves(store, fingerprint, arena, self.ledger, self.links, self.fences, self.staging,
                                    self.disk, on_cold)
        self.behind = WriteBehind(store, fingerprint, arena, self.ledger, self.links, self.disk, on_cold)
        self.copies = DeviceCopies(fingerprint, arena, adapter, layers, self.stream, self.ledger, self.links,
                                   self.fences, self.disk_moves, self.staging)
        self.snapshots = SnapshotFiles(fingerprint, arena, self.ledger, self.disk_moves, self.fences, self.links,
                                       rank, shards)
        self.fetches = SharedFetches(shared, fingerprint, arena, self.ledger, self.disk_moves, self.staging,
                                     self.links)
        handlers = {
            JobKind.STORE: self.copies.store,
            JobKind.LOAD: self.copies.load,
            JobKind.PROMOTE: self.disk_moves.promote,
            JobKind.DEMOTE: self.disk_moves.demote,
            JobKind.FLUSH: self.disk_moves.demote,
            JobKind.DROP: self.disk_moves.drop,
            JobKind.SNAPSHOT: self.snapshots.snapshot,
            JobKind.RESTORE: self.snapshots.restore,
            JobKind.FETCH: self.fetches.fetch,
        }
        self.jobs = JobRunner(handlers, self.stream, self.fences, rank, threads,
                              self.publisher.stored if self.publisher is not None else None)

    # ---- the parts' state, as the mover always showed it ---------------------------------------
    @property
    def adapter(self) -> "LayoutAdapter | None":
        return self.copies.adapter

    @property
    def kv_layers(self) -> "list[torch.Tensor] | None":
        return self.copies.kv_layers

    @property
    def device(self) -> "torch.device":
        return self.stream.device

    @property
    def step(self) -> "threading.local":
        """``step.active``: this thread is in one of vLLM's step calls."""
        return self.stream.step

    @property
    def step_syncs(self) -> int:
        """Blocking waits for transfers on the step path (fences on preemption only)."""
        return self.stream.syncs

    @property
    def link_bytes(self) -> Counter[str]:
        return self.links.counts

    @property
    def slot_owner(self) -> dict[int, SlotOwner]:
        return self.ledger.slot_owner

    @property
    def dirty(self) -> dict[int, float]:
        return self.ledger.dirty

    @property
    def write_back_bytes(self) -> int:
        """Bytes per group commit of the shutdown write-back."""
        return self.behind.batch_bytes

    @write_back_bytes.setter
    def write_back_bytes(self, value: int) -> None:
        self.behind.batch_bytes = value

    # ---- running jobs -------------------------------------------------------------------------
    def submit(self, job: Job, on_done: OnDone | None = None) -> Future:
        return self.jobs.submit(job, on_done)

    def submit_stores(self, jobs: Sequence[Job], on_done: OnDone | None = None, post: bool = True) -> Future:
        return self.jobs.submit_stores(jobs, on_done, post)

    def in_flight(self, job_ids: Sequence[int]) -> list[int]:
        return self.jobs.in_flight(job_ids)

    def wait_jobs(self, job_ids: Sequence[int]) -> int:
        return self.jobs.wait_jobs(job_ids)

    def run(self, job: Job) -> JobResult:
        return self.jobs.run(job)

    def poll(self) -> list[JobResult]:
        return self.jobs.poll()

    def post(self, result: JobResult) -> None:
        self.jobs.post(result)

    def close(self) -> None:
        self.jobs.close()
        if self.publisher is not None:
            self.publisher.close()

    # ---- DRAM slots and write-behind ----------------------------------------------------------
    def forget_slots(self, slots: Sequence[int]) -> None:
        """The manager freed these slots: a dropped block stays dropped (never written behind)."""
        self.ledger.forget(slots)

    def dirty_due(self, max_age_s: float) -> int:
        return self.ledger.due_count(max_age_s)

    def write_behind(self, max_age_s: float, max_blocks: int = 64, cold_codec: str = "none",
                     room: Callable[[int], bool] | None = None,
                     max_bytes: int = WRITE_BEHIND_BYTES) -> tuple[Written, str | None]:
        return self.behind.write_behind(max_age_s, max_blocks, cold_codec, room, max_bytes)

    def write_back(self, cold_codec: str = "none") -> int:
        return self.behind.write_back(cold_codec)

    def take_recreated(self) -> bool:
        """Whether the NVMe directory vanished and was made again since the last call."""
        return self.disk_moves.take_recreated()
