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
(``stream.step.active``) are counted in ``stream.syncs``; serving should leave it at zero.

Every job ends in exactly one ``JobResult`` (``jobs.poll`` / ``jobs.run``): a failure is reported with the
positions that failed, never swallowed. Bytes moved are counted per link for telemetry.

``Mover`` owns the wiring of the worker half's parts and ``close``; callers hold the part that
owns what they need:

================  =====================================================================
``jobs``          the job runner: ``submit``, ``submit_stores``, ``run``, ``poll``, ``post``,
                  ``wait_jobs``, ``in_flight`` (pools, fences, jobs in flight, results)
``copies``        HBM<->DRAM copies (the layout ``adapter`` and ``kv_layers``)
``disk_moves``    DRAM<->NVMe moves (``take_recreated``: the NVMe directory was made again)
``behind``        write-behind and the shutdown write-back (``batch_bytes``)
``snapshots``     snapshot files; ``fetches``: shared-tier fetches; ``publisher``: publishing
``ledger``        what each DRAM slot holds and which are dirty (``forget``, ``due_count``)
``stream``        the copy stream (``device``; ``step.active`` and the step path's ``syncs``)
``links``         bytes moved per link (``counts``); ``disk``: the disk's health (``Backoff``)
================  =====================================================================
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from kvtier.jobs import JobKind
from kvtier.move.behind import WriteBehind
from kvtier.move.device import DeviceCopies
from kvtier.move.disk import DiskMoves
from kvtier.move.fences import SlotFences
from kvtier.move.fetch import SharedFetches
from kvtier.move.files import SnapshotFiles
from kvtier.move.ledger import SlotLedger
from kvtier.move.links import LinkBytes
from kvtier.move.publish import Publisher, SharedTier
from kvtier.move.runner import JobRunner
from kvtier.move.staging import StagingPool
from kvtier.move.stream import CopyStream
from kvtier.tiers.base import DiskStore
from kvtier.tiers.health import Backoff, Clock

if TYPE_CHECKING:  # pragma: no cover

    import torch

    from kvtier.layout import LayoutAdapter, ModelFingerprint
    from kvtier.tiers.dram import DramArena

__all__ = ["Mover"]


class Mover:
    """The worker half's parts, wired (the module docstring says which owns what)."""

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

    def close(self) -> None:
        self.jobs.close()
        if self.publisher is not None:
            self.publisher.close()
