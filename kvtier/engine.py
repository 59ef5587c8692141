"""Both halves in one process: the tier manager plus its mover, driven synchronously.

This is what the tests, the benchmarks and the scripted demo drive, and what an in-process vLLM
engine amounts to. Each call plans with the manager, runs the job on the mover and completes it,
so when a call returns its effect is durable (for NVMe) and visible. With an NVMe tier the session
catalog is written after each operator action and on ``close``; ``write_behind`` is the worker's
background durability step, run on demand here.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from kvtier.jobs import Job, JobResult
from kvtier.layout import ModelFingerprint, adapter_for
from kvtier.move.mover import Mover
from kvtier.plan.index import Tier
from kvtier.plan.manager import TierManager
from kvtier.tiers.dram import DramArena
from kvtier.tiers.nvme.drives import open_nvme, primary_dir

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.plan.costmodel import CostModel
    from kvtier.tiers.shared.store import SharedConfig

__all__ = ["TierEngine"]


class TierEngine:
    def __init__(
        self,
        fingerprint: ModelFingerprint,
        dram_bytes: int,
        nvme_dir: str | Path | None = None,
        nvme_bytes: int = 0,
        policy: str = "lru",
        kv_layers: "Sequence[torch.Tensor] | None" = None,
        layout: str = "cpu",
        io_threads: int = 8,
        direct_io: str = "auto",
        high_watermark: float = 0.90,
        low_watermark: float = 0.75,
        warm_codec: str = "none",
        cold_codec: str = "none",
        catalog: bool = True,
        rank: int = 0,
        shared: "SharedConfig | None" = None,
        box: str | None = None,
        cost: "CostModel | None" = None,
        wall_clock: Callable[[], float] = time.time,
    ):
        # with tensor parallelism (``fingerprint.shards`` > 1) this is one rank's engine: the manager
        # plans for the whole engine, the mover moves (and its files carry) the rank's own shard
        fingerprint = fingerprint.engine
        self.fingerprint = fingerprint
        self.nvme = open_nvme(nvme_dir, nvme_bytes, io_threads, direct_io, rank=rank) \
            if nvme_dir and nvme_bytes else None
        records = self.nvme.scan() if self.nvme is not None else []
        self.catalog = None
        if catalog and self.nvme is not None:
            from kvtier.persist.catalog import Catalog

            self.catalog = Catalog(primary_dir(nvme_dir), fingerprint)
        self.manager = TierManager(fingerprint, dram_bytes, nvme_bytes if self.nvme is not None else 0, policy,
                                   high_watermark, low_watermark, records, warm_codec, cold_codec,
                                   nvme_removed_at_start=self.nvme.removed_at_scan if self.nvme is not None else 0,
                                   catalog=self.catalog, cost=cost, wall_clock=wall_clock)
        self.arena = DramArena.for_allocator(self.manager.table.slots)
        adapter = adapter_for(layout, fingerprint.geometry) if kv_layers is not None else None
        shard = fingerprint.for_rank(rank) if fingerprint.shards > 1 else fingerprint
        self.shared = None  # the shared tier (another box's blocks, and this one's for them)
        self.box = box
        shared_kwargs = {}
        if shared is not None:
            from kvtier.codecs import resolve_codec
            from kvtier.tiers.shared.store import SharedStore

            self.shared = SharedStore(shared, rank)
            self.manager.catalog_log.share_sessions()
            shared_kwargs = dict(shared=self.shared, shared_policy=shared.policy,
                                 shared_codec=resolve_codec(shared.codec, fingerprint.geometry, "shared"))
        self.mover = Mover(shard, self.arena, self.nvme, adapter, kv_layers, rank=rank, shards=fingerprint.shards,
                           **shared_kwargs)

    def execute(self, job: Job | None) -> JobResult | None:
        if job is None:  # slots freed without a job (a drop of DRAM-only blocks) are forgotten too
            self.mover.ledger.forget(self.manager.table.slots.drain_freed())
            return None
        result = self.mover.jobs.run(job)
        self.manager.complete(result)
        self.mover.ledger.forget(self.manager.table.slots.drain_freed())
        return result

    def maintain(self, force: bool = False) -> None:
        """Run the watermark demotions (``force``: even below the high watermark)."""
        for job in self.manager.maintenance(force):
            self.execute(job)

    # ---- the data path ------------------------------------------------------------------------
    def store(self, session_id: str, namespace: bytes, keys: Sequence[bytes], device_blocks: Sequence[int],
              num_tokens: int = 0, token_ids: Sequence[int] | None = None) -> int:
        """Store the session's blocks not yet held; returns how many were stored. ``token_ids`` (as
        vLLM's scheduler half records them) let a snapshot of the session be restored: a restore
        recomputes every key from them."""
        self.manager.planner.record_session(session_id, namespace, keys, num_tokens, token_ids=token_ids)
        stored = 0
        while True:
            job = self.manager.prepare_store(session_id, namespace, keys, device_blocks)
            result = self.execute(job)
            if job is None or result is None:
                break
            stored += len(job.moves) - len(result.failed_positions(job))
            before = self.manager.table.slots.free_slots
            self.maintain(force=self.manager.table.slots.free_slots == 0)
            if self.manager.table.slots.free_slots <= before:  # no room could be made: store no more
                break
        if self.manager.table.sessions[session_id].pinned is not None and self.nvme is not None:
            self.execute(self.manager.pressure.flush(session_id))  # a pinned session is written through
        return stored

    def load(self, namespace: bytes, keys: Sequence[bytes], device_blocks: Sequence[int]) -> int:
        """Load the longest stored prefix of ``keys`` into HBM blocks; returns blocks loaded."""
        rows = self.manager.table.lookup(namespace, keys)
        job = self.manager.prepare_load(rows, device_blocks[: len(rows)])
        result = self.execute(job)
        if job is None or result is None:
            return 0
        if not result.ok and not result.failed:  # the whole job failed
            return 0
        return min(result.failed) if result.failed else len(job.moves)

    # ---- the shared tier ------------------------------------------------------------------------
    def fetch(self, namespace: bytes, keys: Sequence[bytes], tier: Tier = Tier.DRAM) -> int:
        """Bring the longest prefix of ``keys`` that the shared store holds (beyond what this engine
        holds) into DRAM (or NVMe); returns the blocks fetched. A store that is down fetches nothing."""
        from kvtier.tiers.shared.store import SharedUnavailable

        if self.shared is None:
            return 0
        have = len(self.manager.table.peek(namespace, keys))
        try:
            sizes = self.shared.blocks.lengths(namespace, keys[have:], self.fingerprint.shards)
        except SharedUnavailable:
            return 0
        found = self.shared.blocks.stored_prefix(sizes)
        job = self.manager.planner.prepare_fetch(namespace, keys[have : have + found], sizes[:found], tier, start=have)
        result = self.execute(job)
        if job is None or result is None:
            return 0
        return len(job.moves) - len(result.failed_positions(job))

    def publish(self, timeout: float = 30.0) -> int:
        """Wait for the blocks offered to the shared store, then publish the changed sessions'
        entries; returns the entries published (0 when the store is down)."""
        from kvtier.tiers.shared.store import SharedUnavailable

        if self.shared is None or self.mover.publisher is None:
            return 0
        self.mover.publisher.drain(timeout)
        entries = self.manager.catalog_log.shared_batch(self.box)
        try:
            return self.shared.sessions.publish_sessions(self.fingerprint.digest, entries)
        except SharedUnavailable:
            self.manager.catalog_log.requeue_shared(e["session_id"] for e in entries)
            return 0

    # ---- operator actions ---------------------------------------------------------------------
    def pin(self, session_id: str, tier: Tier = Tier.DRAM, for_s: float | None = None) -> None:
        self.execute(self.manager.planner.pin(session_id, tier, for_s))
        self.maintain()
        self.manager.catalog_log.sync_catalog()

    def unpin(self, session_id: str) -> None:
        self.manager.planner.unpin(session_id)
        self.manager.catalog_log.sync_catalog()

    def evict(self, session_id: str, to: Tier | None) -> None:
        self.execute(self.manager.planner.evict(session_id, to))
        self.manager.catalog_log.sync_catalog()

    def flush(self, session_id: str | None = None) -> JobResult | None:
        """Copy DRAM-only blocks (all, or one session's) to NVMe now."""
        return self.execute(self.manager.pressure.flush(session_id))

    def write_behind(self, max_age_s: float = 0.0, max_blocks: int = 1 << 30) -> int:
        """The worker's write-behind step: DRAM-only blocks at least ``max_age_s`` old get an NVMe
        copy. Returns how many were written."""
        if self.nvme is not None:
            self.nvme.check_present()
        written, error = self.mover.behind.write_behind(max_age_s, max_blocks, self.manager.table.cold_codec)
        self.execute(self.manager.pressure.note_written_behind(written, error, self.mover.disk_moves.take_recreated()))
        return len(written)

    def snapshot(self, session_id: str, path: str | Path) -> JobResult:
        return self.execute(self.manager.planner.prepare_snapshot(session_id, str(path)))

    def restore(self, path: str | Path, tier: Tier = Tier.DRAM) -> JobResult | None:
        from kvtier.persist.snapshot import open_snapshot

        result = self.execute(self.manager.planner.prepare_restore(open_snapshot(path), tier))
        self.manager.catalog_log.sync_catalog()
        return result

    def close(self, write_back: bool = True) -> None:
        """Stop; with ``write_back``, DRAM-only blocks go to the NVMe tier first (a restart finds them)."""
        self.mover.close()
        if write_back:
            self.mover.ledger.forget(self.manager.table.slots.drain_freed())
            self.mover.behind.write_back(self.manager.table.cold_codec)
        if self.catalog is not None:
            self.manager.catalog_log.sync_catalog()
            self.catalog.close()
        if self.nvme is not None:
            self.nvme.close()
        if self.shared is not None:
            self.shared.close()
