"""The scheduler half: every tiering decision, as jobs for the mover. No IO, no torch.

``TierManager`` owns the wiring of the scheduler half's parts, the block keys (``block_keys``,
``key_scheme``), the plans of stores and loads, and ``complete``: the only place where a block
becomes visible, changes tier, or is forgotten once its job ran. Callers hold the part that owns
what they need:

==================  ===================================================================
``table``           sessions, the block index, eviction policies, DRAM slots, the NVMe
                    byte budget, recent drops; lookups (``peek``, ``lookup``, ``in_dram``)
``jobbook``         unfinished jobs, jobs queued for the next maintenance, job ids
``telemetry``       counters and lasting warnings (``count``, ``warn``)
``pressure``        watermarks, the cost model, demotions, flushes, write-behind reports
``planner``         the session plans: record, pin, retain, evict, snapshot, restore, fetch
``catalog_log``     the session catalog and the shared store's session entries
``views``           read-only answers: ``stats``, ``session_info``, overviews, state counts
``turns``           the last turns of each session (what was found, loaded, and why not more)
``nvme_health``     the NVMe write back-off (``pressure`` drops victims while it lasts)
==================  ===================================================================

The mover runs the jobs and hands back ``JobResult`` objects to ``complete``. Blocks named by an
unfinished job hold a reference and are never chosen as victims.

Pressure: when DRAM slot use passes the high watermark, the policy's victims are demoted to NVMe
(or their DRAM copy is simply released when NVMe already holds them) down to the low watermark;
NVMe likewise drops its victims. With a cost model (``pressure.cost``), a victim whose longest
stored prefix would restore from NVMe slower than it recomputes is dropped instead of demoted
(``kvtier.plan.decide.worth_keeping``): writing it would cost disk bandwidth and never pay off. A
store that finds DRAM full of pinned or busy blocks stores what fits and skips the rest: normal
pressure, not an error; vLLM recomputes what was not kept.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from kvtier.codecs import get_codec, resolve_codec
from kvtier.jobs import Job, JobKind, JobResult
from kvtier.layout import ModelFingerprint
from kvtier.plan.catalog_log import CatalogLog
from kvtier.plan.index import FIRST, IN_DRAM, PENDING, Tier, chain_block_hashes
from kvtier.plan.jobbook import JobBook
from kvtier.plan.pressure import Pressure
from kvtier.plan.reasons import TurnLog
from kvtier.plan.sessions import SessionPlanner
from kvtier.plan.table import BlockTable
from kvtier.plan.telemetry import Telemetry
from kvtier.plan.views import Views
from kvtier.tiers.health import Backoff, Clock

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.persist.catalog import Catalog
    from kvtier.plan.costmodel import CostModel

__all__ = ["TierManager"]


class TierManager:
    """The scheduler half's parts, wired (the module docstring says which owns what), and what
    joins them: store and load plans, completions, maintenance."""

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        dram_bytes: int,
        nvme_bytes: int = 0,
        policy: str = "lru",
        high_watermark: float = 0.90,
        low_watermark: float = 0.75,
        nvme_records: Iterable = (),
        warm_codec: str = "none",
        cold_codec: str = "none",
        nvme_removed_at_start: int = 0,
        catalog: "Catalog | None" = None,
        cost: "CostModel | None" = None,
        block_keys: Callable[[list[int], str | None], list[bytes]] | None = None,
        clock: Clock = time.monotonic,
        wall_clock: Clock = time.time,
    ):
        """``nvme_records``: the blocks an NVMe scan found; ``nvme_removed_at_start``: the damaged
        files that scan deleted (counted, and a lasting warning); ``catalog``: the session catalog
        to read sessions back from and to keep up to date (``catalog_log.sync_catalog``); ``cost``: the
        connector's cost model (demotion asks it whether a victim is worth writing); ``block_keys``:
        how block keys are computed from token ids (vLLM's own hash in the connector; restores
        recompute keys with it and never trust a file's), a sha256 chain when None; ``clock``: the
        clock of the NVMe write back-off, ``wall_clock`` the one timed pins and retention hints end by
        (a test moves them instead of sleeping)."""
        self.fingerprint = fingerprint
        self.geometry = geometry = fingerprint.geometry
        self.block_keys: Callable[[list[int], str | None], list[bytes]] = block_keys or (
            lambda tokens, _salt: chain_block_hashes(tokens, geometry.block_tokens))
        self.turns = TurnLog()  # the last turns of each session: what was found, loaded, and why not more
        self.telemetry = Telemetry()
        self.jobbook = JobBook()
        self.table = BlockTable(geometry, dram_bytes, nvme_bytes, policy, resolve_codec(warm_codec, geometry, "warm"),
                                resolve_codec(cold_codec, geometry, "cold"), self.telemetry, wall_clock)
        for record in nvme_records:
            self.table.adopt_nvme_block(record.namespace, record.key, record.nbytes)
        if nvme_removed_at_start:
            self.telemetry.counters["nvme_removed_at_start"] = nvme_removed_at_start
            self._warn_bad_nvme_blocks()
        self.catalog_log = CatalogLog(catalog, self.table, self.telemetry, geometry, self.key_scheme)
        self.nvme_health = Backoff(1.0, 30.0, clock)  # after a failed NVMe write: victims are dropped until over
        self.pressure = Pressure(self.table, self.jobbook, self.telemetry, self.catalog_log, geometry,
                                 self.nvme_health, high_watermark, low_watermark, cost)
        self.planner = SessionPlanner(self.table, self.jobbook, self.telemetry, self.pressure, self.catalog_log,
                                      fingerprint, self.block_keys, self.key_scheme)
        self.views = Views(self.table, self.jobbook, self.telemetry, fingerprint)

    @property
    def key_scheme(self) -> str:
        """Names the hash ``block_keys`` computes (a snapshot records it: keys of the same scheme must
        match the recomputed ones)."""
        return str(getattr(self.block_keys, "scheme", "kvtier:sha256-chain"))

    # ---- maintenance --------------------------------------------------------------------------
    def maintenance(self, force: bool = False) -> list[Job]:
        """Timed pins and retention hints that ran out end; then the jobs that bring DRAM back under its
        low watermark once past the high one (or ``force``)."""
        self.planner.expire()
        return self.pressure.maintenance(force)

    # ---- stores -------------------------------------------------------------------------------
    def prepare_store(self, session_id: str, namespace: bytes, keys: Sequence[bytes],
                      device_blocks: Sequence[int], start: int = 0) -> Job | None:
        """A STORE job for the blocks of ``keys`` not yet held (None when there is nothing to do).

        ``start`` is the position of ``keys[0]`` in its sequence (0: it is the first block).
        """
        moves = []
        codec = get_codec(self.table.warm_codec)
        session = self.table.sessions.get(session_id)
        durable = session is not None and session.pinned is not None and self.table.nvme.capacity > 0
        for position, (key, device_block) in enumerate(zip(keys, device_blocks), start):
            row = self.table.index.row_of(namespace, key)
            if row is not None:
                self.table.index.touch([row])
                continue
            slot = self.table.allocate_slot()
            if slot is None:
                self.telemetry.count("store_deferred_blocks")
                break
            first = position == 0
            row = self.table.index.add(namespace, key, PENDING | IN_DRAM | (FIRST if first else 0), dram_slot=slot,
                                 reach=(start + len(keys)) * self.geometry.block_tokens)
            moves.append(self.table.move(row, dram_slot=slot, nbytes=codec.nbytes_for(self.geometry, first) or 0,
                                         device_block=device_block, codec=self.table.warm_codec, first=first,
                                    durable=durable))
        if not moves:
            return None
        return self.jobbook.new_job(JobKind.STORE, moves=moves, session_id=session_id)

    def _complete_store(self, job: Job, result: JobResult) -> None:
        failed = result.failed_positions(job)
        session = self.table.sessions.get(job.session_id) if job.session_id else None
        pinned = session.pinned if session is not None else None
        for i, move in enumerate(job.moves):
            row = move.row
            if i in failed:
                self.table.slots.free(move.dram_slot)
                self.table.index.abandon(row)
                continue
            self.table.index.settled(row)
            self.table.index.now_in_dram(row, move.dram_slot, move.nbytes, move.codec, dirty=True)
            if pinned is not None:  # a pinned session's new blocks are pinned too
                self.table.index.pin_at_least(row, pinned)
            self.table.policies[Tier.DRAM].on_insert(row, (move.namespace, move.key))
            self.telemetry.count("stored_blocks")
        self.table.note_retained(session)  # a retained session's new blocks are retained too

    # ---- loads --------------------------------------------------------------------------------
    def prepare_load(self, rows: Sequence[int], device_blocks: Sequence[int]) -> Job | None:
        """A LOAD job for ``rows`` into HBM blocks.

        NVMe-only blocks are promoted into free DRAM slots while there are some; the rest stream
        from NVMe through the mover's own buffer without taking a slot.
        """
        col = self.table.index.col
        moves = []
        for row, device_block in zip(rows, device_blocks):
            if col["flags"][row] & IN_DRAM:
                move = self.table.move(row, dram_slot=int(col["dram_slot"][row]), nbytes=int(col["dram_nbytes"][row]),
                                  device_block=device_block, codec=self.table.index.codecs[col["dram_codec"][row]])
            else:  # promote into a free DRAM slot if there is one (and it fits), else stream it
                fits = int(col["nvme_nbytes"][row]) <= self.table.slots.slot_bytes
                slot = self.table.slots.allocate() if fits else None
                move = self.table.move(row, dram_slot=-1 if slot is None else slot, device_block=device_block,
                                  from_nvme=True, nbytes=int(col["nvme_nbytes"][row]),
                                  codec=self.table.index.codecs[col["nvme_codec"][row]])
            self.table.index.ref([row], +1)
            moves.append(move)
        if not moves:
            return None
        self.table.index.touch(m.row for m in moves)
        return self.jobbook.new_job(JobKind.LOAD, moves=moves)

    def _complete_staged(self, job: Job, result: JobResult, tier_hit: str) -> None:
        """Shared by LOAD and PROMOTE: staged NVMe reads become DRAM copies, bad ones are dropped.

        ``result.failed`` lists the blocks that did not reach their destination; of those,
        ``result.bad_reads`` could not be read back from NVMe (the store removed them).
        """
        not_delivered = result.failed_positions(job)
        bad_reads = set(result.bad_reads)
        for i, move in enumerate(job.moves):
            row = move.row
            self.table.index.ref([row], -1)
            if i not in not_delivered:
                self.telemetry.count(f"{tier_hit}_{'nvme' if move.from_nvme else 'dram'}_blocks")
            if not move.from_nvme:
                continue
            if i in bad_reads or (i in not_delivered and not result.encoded):
                if move.dram_slot >= 0:
                    self.table.slots.free(move.dram_slot)
                self.table.release_nvme(row, evicted=False)
                self.table.forget_if_homeless(row, "bad_read")
                self.telemetry.count("nvme_failed_reads")
                self._warn_bad_nvme_blocks(result.error)
                continue
            if move.dram_slot < 0:  # streamed straight through, not promoted
                continue
            self.table.index.now_in_dram(row, move.dram_slot, move.nbytes, move.codec)
            self.table.policies[Tier.DRAM].on_insert(row, (move.namespace, move.key))

    def _warn_bad_nvme_blocks(self, error: str | None = None) -> None:
        """A lasting warning (not cleared by later successes: the operator should know the disk
        lost or damaged data), with the running count and the last failure (it names the drive)."""
        counters = self.telemetry.counters
        bad = counters["nvme_failed_reads"] + counters["nvme_removed_at_start"]
        last = f"; last: {error}" if error else ""
        self.telemetry.warn("nvme_reads", f"{bad} NVMe blocks were missing or corrupt: dropped, and vLLM recomputed "
                             f"them (check the disk, and that nothing else writes to the NVMe dir){last}")

    # ---- completion ---------------------------------------------------------------------------
    def complete(self, result: JobResult) -> None:
        """Apply a finished job; the only place block state changes after a job was emitted."""
        job = self.jobbook.pop(result.job_id)
        for i, (nbytes, codec) in result.encoded.items():  # what the mover wrote
            job.moves[int(i)].nbytes, job.moves[int(i)].codec = int(nbytes), str(codec)
        handler = {
            JobKind.STORE: self._complete_store,
            JobKind.LOAD: lambda j, r: self._complete_staged(j, r, "hit"),
            JobKind.PROMOTE: lambda j, r: self._complete_staged(j, r, "promoted"),
            JobKind.DEMOTE: self.pressure.complete_demote,
            JobKind.FLUSH: self.pressure.complete_demote,
            JobKind.DROP: lambda j, r: None,
            JobKind.SNAPSHOT: self.planner.complete_snapshot,
            JobKind.RESTORE: self.planner.complete_restore,
            JobKind.FETCH: self.planner.complete_restore,
        }[job.kind]
        handler(job, result)
        self.telemetry.count(f"jobs_{job.kind.value}_{'ok' if result.ok else 'failed'}")
        self.telemetry.count(f"bytes_{job.kind.value}", result.bytes_moved)
