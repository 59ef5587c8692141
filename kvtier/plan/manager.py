"""The scheduler half: every tiering decision, as jobs for the mover. No IO, no torch.

``TierManager`` is the one facade over the parts that own the state: the block table (``table``:
sessions, block index, eviction policies, DRAM slots, the NVMe byte budget), the job book
(``jobbook``), telemetry (``telemetry``: counters and lasting warnings), pressure and the disk's
health (``pressure``), the session planner (``sessions``), the catalog change log
(``catalog_log``) and read-only views (``views``). It answers lookups and plans stores and loads
itself, and hands the rest to its parts. The mover runs the jobs and hands back ``JobResult``
objects to ``complete``, which is the only place where a block becomes visible, changes tier, or is
forgotten. Blocks named by an unfinished job hold a reference and are never chosen as victims.

Pressure: when DRAM slot use passes the high watermark, the policy's victims are demoted to NVMe
(or their DRAM copy is simply released when NVMe already holds them) down to the low watermark;
NVMe likewise drops its victims. With a cost model (``cost``), a victim whose longest stored
prefix would restore from NVMe slower than it recomputes is dropped instead of demoted
(``kvtier.plan.decide.worth_keeping``): writing it would cost disk bandwidth and never pay off. A store
that finds DRAM full of pinned or busy blocks stores what fits and skips the rest: normal pressure,
not an error; vLLM recomputes what was not kept.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

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
    from kvtier.persist.snapshot import SnapshotInfo
    from kvtier.plan.costmodel import CostModel
    from kvtier.plan.index import BlockIndex, Session

__all__ = ["TierManager"]


class TierManager:
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
        to read sessions back from and to keep up to date (``sync_catalog``); ``cost``: the
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

    # ---- state the callers read (owned by the parts) ------------------------------------------
    @property
    def counters(self):
        """The counters the admin plane and ``kvtier top`` read (a ``Counter``)."""
        return self.telemetry.counters

    @property
    def warnings(self) -> dict[str, str]:
        return self.telemetry.warnings

    @property
    def index(self) -> "BlockIndex":
        return self.table.index

    @index.setter
    def index(self, index: "BlockIndex") -> None:
        self.table.index = index

    @property
    def slots(self):
        return self.table.slots

    @property
    def policies(self):
        return self.table.policies

    @property
    def sessions(self) -> "dict[str, Session]":
        return self.table.sessions

    @property
    def drops(self):
        """Recently dropped blocks, with when and why (a later turn's miss names them)."""
        return self.table.drops

    @property
    def jobs(self) -> dict[int, Job]:
        return self.jobbook.jobs

    @property
    def queued(self) -> list[Job]:
        """Planned jobs that ship with the next maintenance."""
        return self.jobbook.queued

    @property
    def nvme_budget(self):
        """The NVMe byte budget (``NvmeBudget``): the one place NVMe bytes are counted."""
        return self.table.nvme

    @property
    def nvme_used(self) -> int:
        """Bytes the NVMe tier holds, plus those reserved by demotions still under way."""
        return self.table.nvme.used

    @property
    def nvme_capacity(self) -> int:
        return self.table.nvme.capacity

    @property
    def warm_codec(self) -> str:
        return self.table.warm_codec

    @warm_codec.setter
    def warm_codec(self, name: str) -> None:
        self.table.warm_codec = name

    @property
    def cold_codec(self) -> str:
        return self.table.cold_codec

    @cold_codec.setter
    def cold_codec(self, name: str) -> None:
        self.table.cold_codec = name

    @property
    def high(self) -> float:
        return self.pressure.high

    @high.setter
    def high(self, value: float) -> None:
        self.pressure.high = value

    @property
    def low(self) -> float:
        return self.pressure.low

    @low.setter
    def low(self, value: float) -> None:
        self.pressure.low = value

    @property
    def cost(self) -> "CostModel | None":
        return self.pressure.cost

    @cost.setter
    def cost(self, cost: "CostModel | None") -> None:
        self.pressure.cost = cost

    @property
    def catalog(self) -> "Catalog | None":
        return self.catalog_log.catalog

    @property
    def publish_sessions(self) -> bool:
        return self.catalog_log.publish_sessions

    @property
    def key_scheme(self) -> str:
        """Names the hash ``block_keys`` computes (a snapshot records it: keys of the same scheme must
        match the recomputed ones)."""
        return str(getattr(self.block_keys, "scheme", "kvtier:sha256-chain"))

    # ---- telemetry and job ids ----------------------------------------------------------------
    def new_job_id(self) -> int:
        """A job id no job has had (the admin API numbers its no-op answers from the same sequence)."""
        return self.jobbook.new_job_id()

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to one of the counters the admin plane and ``kvtier top`` read (the engine's
        halves count their own events here: prompt tokens, decisions, lookups, refreshes)."""
        self.telemetry.count(name, n)

    def warn(self, name: str, message: str | None) -> None:
        """Set (or, with None, clear) a lasting warning that ``kvtier status`` and ``top`` show."""
        self.telemetry.warn(name, message)

    # ---- lookups ------------------------------------------------------------------------------
    def peek(self, namespace: bytes, keys: Sequence[bytes]) -> np.ndarray:
        """Rows of the longest stored prefix of ``keys``, with no side effect (see ``BlockTable.peek``)."""
        return self.table.peek(namespace, keys)

    def in_dram(self, rows: np.ndarray) -> np.ndarray:
        """Per row of ``rows`` (from ``peek``/``lookup``): True when its block has a DRAM copy."""
        return self.table.in_dram(rows)

    def first_unstored(self, namespace: bytes, keys: Sequence[bytes], first: int, end: int) -> int:
        return self.table.first_unstored(namespace, keys, first, end)

    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> list[int]:
        """Rows of the longest stored prefix of ``keys`` (a hit refreshes their recency)."""
        return self.table.lookup(namespace, keys)

    # ---- sessions -----------------------------------------------------------------------------
    def record_session(self, session_id: str, namespace: bytes, keys: Sequence[bytes], num_tokens: int,
                       token_ids: Sequence[int] | None = None) -> "Session":
        """Note the latest prompt of a session (its blocks, in order, and the token ids they cover)."""
        return self.planner.record_session(session_id, namespace, keys, num_tokens, token_ids)

    def session(self, session_id: str) -> "Session":
        return self.table.session(session_id)

    def session_rows(self, session: "Session") -> list[int]:
        return self.table.session_rows(session)

    def session_row_array(self, session: "Session") -> np.ndarray:
        return self.table.session_row_array(session)

    def session_tokens(self, session: "Session") -> np.ndarray | None:
        """The token ids of the session's full blocks: held in memory, else read from the catalog."""
        return self.catalog_log.session_tokens(session)

    def pin(self, session_id: str, tier: Tier = Tier.DRAM, for_s: float | None = None) -> Job | None:
        """Pin a session at ``tier``, for ``for_s`` seconds or until unpinned (see ``SessionPlanner.pin``)."""
        return self.planner.pin(session_id, tier, for_s)

    def unpin(self, session_id: str) -> None:
        self.planner.unpin(session_id)

    def retain(self, session_id: str, seconds: float, priority: int) -> None:
        """A request's retention hint: see ``SessionPlanner.retain`` and ``kvtier.plan.retention``."""
        self.planner.retain(session_id, seconds, priority)

    def expire(self) -> list[str]:
        """End timed pins and retention hints whose time is up (maintenance does it too)."""
        return self.planner.expire()

    def promote(self, session_id: str) -> Job | None:
        return self.planner.promote(session_id)

    def evict(self, session_id: str, to: Tier | None) -> Job | None:
        return self.planner.evict(session_id, to)

    def prepare_snapshot(self, session_id: str, path: str, in_place: bool = False) -> Job:
        return self.planner.prepare_snapshot(session_id, path, in_place)

    def max_snapshot_header(self) -> int:
        return self.planner.max_snapshot_header()

    def trusted_keys(self, info: "SnapshotInfo", cache_salt: str | None = None) -> list[bytes]:
        return self.planner.trusted_keys(info, cache_salt)

    def shared_entry_keys(self, entry: dict, cache_salt: str | None = None) -> tuple[bytes, list[bytes]]:
        return self.planner.shared_entry_keys(entry, cache_salt)

    def prepare_restore(self, info: "SnapshotInfo", tier: Tier = Tier.DRAM, cache_salt: str | None = None,
                        require_signed: bool = False) -> Job | None:
        """A RESTORE job for a snapshot's missing blocks (see ``SessionPlanner.prepare_restore``)."""
        return self.planner.prepare_restore(info, tier, cache_salt, require_signed)

    def prepare_fetch(self, namespace: bytes, keys: Sequence[bytes], sizes: Sequence[int], tier: Tier = Tier.DRAM,
                      start: int = 0, session_id: str | None = None) -> Job | None:
        """A FETCH job from the shared store (see ``SessionPlanner.prepare_fetch``)."""
        return self.planner.prepare_fetch(namespace, keys, sizes, tier, start, session_id)

    # ---- views --------------------------------------------------------------------------------
    def session_info(self, session_id: str) -> dict[str, Any]:
        return self.views.sessions_overview([self.session(session_id).session_id])[0]

    def sessions_overview(self, session_ids: list[str] | None = None) -> list[dict[str, Any]]:
        """``session_info`` for many sessions at once (vectorised: 1,000 sessions in a few ms)."""
        return self.views.sessions_overview(session_ids)

    def session_state_counts(self) -> dict[str, int]:
        return self.views.session_state_counts()

    def session_state(self, session: "Session", in_dram: int, in_nvme: int) -> str:
        return self.views.session_state(session, in_dram, in_nvme)

    def tokens_per_gib(self) -> dict[str, int]:
        return self.views.tokens_per_gib()

    def dirty_stats(self) -> dict[str, float]:
        """What a crash would lose now: DRAM-only blocks, their bytes, and the oldest one's age (s)."""
        return self.views.dirty_stats()

    def stats(self) -> dict[str, Any]:
        return self.views.stats()

    # ---- pressure and the disk ----------------------------------------------------------------
    def maintenance(self, force: bool = False) -> list[Job]:
        """Timed pins and retention hints that ran out end; then the jobs that bring DRAM back under its
        low watermark once past the high one (or ``force``)."""
        self.planner.expire()
        return self.pressure.maintenance(force)

    def flush(self, session_id: str | None = None) -> Job | None:
        """A FLUSH job copying DRAM-only blocks (all, or one session's) to NVMe, keeping them in DRAM."""
        return self.pressure.flush(session_id)

    def note_written_behind(self, records: Iterable[tuple[bytes, bytes, int, str]], error: str | None = None,
                            recreated: bool = False, disk_ok: bool = False,
                            disk_free: int | None = None) -> Job | None:
        """The worker wrote these DRAM blocks to NVMe on its own (see ``Pressure.note_written_behind``)."""
        return self.pressure.note_written_behind(records, error, recreated, disk_ok, disk_free)

    def full_disk_margin(self) -> int:
        return self.pressure.full_disk_margin()

    # ---- the catalog and the shared store -----------------------------------------------------
    def share_sessions(self) -> None:
        """A shared tier is on: from now on, changed sessions are queued for publishing (``shared_batch``)."""
        self.catalog_log.share_sessions()

    def shared_batch(self, box: str | None = None) -> list[dict]:
        return self.catalog_log.shared_batch(box)

    def requeue_shared(self, session_ids: Iterable[str]) -> None:
        self.catalog_log.requeue_shared(session_ids)

    def catalog_batch(self) -> tuple[list, list[str]]:
        return self.catalog_log.catalog_batch()

    def write_catalog(self, batch: tuple[list, list[str]], lock=None) -> bool:
        return self.catalog_log.write_catalog(batch, lock)

    def sync_catalog(self, lock=None) -> bool:
        """Write the sessions that changed since the last call (see ``CatalogLog.sync_catalog``)."""
        return self.catalog_log.sync_catalog(lock)

    # ---- stores -------------------------------------------------------------------------------
    def prepare_store(self, session_id: str, namespace: bytes, keys: Sequence[bytes],
                      device_blocks: Sequence[int], start: int = 0) -> Job | None:
        """A STORE job for the blocks of ``keys`` not yet held (None when there is nothing to do).

        ``start`` is the position of ``keys[0]`` in its sequence (0: it is the first block).
        """
        moves = []
        codec = get_codec(self.warm_codec)
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
                                    device_block=device_block, codec=self.warm_codec, first=first,
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
