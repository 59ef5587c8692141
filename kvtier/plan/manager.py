"""The scheduler half: every tiering decision, as jobs for the mover. No IO, no torch.

``TierManager`` owns the block index, the sessions, the DRAM slot allocator, the NVMe byte budget
and one eviction policy per tier. It answers lookups, and turns stores, loads, watermark pressure
and operator actions (pin, evict, snapshot, restore) into ``Job`` objects. The mover runs them and
hands back ``JobResult`` objects to ``complete``, which is the only place where a block becomes
visible, changes tier, or is forgotten. Blocks named by an unfinished job hold a reference and
are never chosen as victims.

Pressure: when DRAM slot use passes the high watermark, the policy's victims are demoted to NVMe
(or their DRAM copy is simply released when NVMe already holds them) down to the low watermark;
NVMe likewise drops its victims. With a cost model (``self.cost``), a victim whose longest stored
prefix would restore from NVMe slower than it recomputes is dropped instead of demoted
(``kvtier.plan.decide.worth_keeping``): writing it would cost disk bandwidth and never pay off. A store
that finds DRAM full of pinned or busy blocks stores what fits and skips the rest: normal pressure,
not an error; vLLM recomputes what was not kept.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from kvtier.codecs import get_codec, resolve_codec
from kvtier.errors import NotFoundError, UsageError
from kvtier.jobs import BlockMove, Job, JobKind, JobResult
from kvtier.layout import ModelFingerprint
from kvtier.plan.catalog_log import CatalogSync
from kvtier.plan.index import (
    FIRST,
    IN_DRAM,
    IN_NVME,
    PENDING,
    BlockIndex,
    Session,
    Tier,
    chain_block_hashes,
    validate_session_id,
)
from kvtier.plan.policy import make_policy
from kvtier.plan.pressure import PressureOps
from kvtier.plan.reasons import DropLog, TurnLog
from kvtier.plan.sessions import SessionOps
from kvtier.tiers.dram import SlotAllocator
from kvtier.tiers.nvme.store import file_bytes_for

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.persist.catalog import Catalog
    from kvtier.plan.costmodel import CostModel

__all__ = ["TierManager"]


class TierManager(SessionOps, PressureOps, CatalogSync):
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
    ):
        """``nvme_records``: the blocks an NVMe scan found; ``nvme_removed_at_start``: the damaged
        files that scan deleted (counted, and a lasting warning); ``catalog``: the session catalog
        to read sessions back from and to keep up to date (``sync_catalog``); ``cost``: the
        connector's cost model (demotion asks it whether a victim is worth writing); ``block_keys``:
        how block keys are computed from token ids (vLLM's own hash in the connector; restores
        recompute keys with it and never trust a file's), a sha256 chain when None."""
        self.fingerprint = fingerprint
        self.geometry = fingerprint.geometry
        self.warm_codec = resolve_codec(warm_codec, self.geometry, "warm")
        self.cold_codec = resolve_codec(cold_codec, self.geometry, "cold")
        self.slots = SlotAllocator(dram_bytes, get_codec(self.warm_codec).max_bytes(self.geometry))
        self.nvme_capacity = int(nvme_bytes)
        self.high, self.low = high_watermark, low_watermark
        self.index = BlockIndex()
        self.sessions: dict[str, Session] = {}
        # session id -> (its keys list, index.added or -1 if every key was found, index.removed, rows)
        self._rows_cache: dict[str, tuple[list[bytes], int, int, np.ndarray]] = {}
        per_block = file_bytes_for(self.geometry.block_bytes)
        self.policies = {
            Tier.DRAM: make_policy(policy, self.slots.num_slots),
            Tier.NVME: make_policy(policy, max(1, self.nvme_capacity // per_block)),
        }
        self.jobs: dict[int, Job] = {}
        self.queued: list[Job] = []  # planned jobs that ship with the next maintenance
        self._job_ids = itertools.count(1)
        self._nvme_used = 0  # bytes on NVMe plus bytes reserved by unfinished demotions
        self.counters: Counter[str] = Counter()
        self.warnings: dict[str, str] = {}
        self.cost = cost
        self.block_keys: Callable[[list[int], str | None], list[bytes]] = block_keys or (
            lambda tokens, _salt: chain_block_hashes(tokens, self.geometry.block_tokens))
        self.turns = TurnLog()  # the last turns of each session: what was found, loaded, and why not more
        self.drops = DropLog()  # recently dropped blocks, with when and why (a later turn's miss names them)
        self._nvme_retry_at = 0.0  # after a failed NVMe write: victims are dropped until then
        self._nvme_backoff = 0.0
        for record in nvme_records:
            self._adopt_nvme_block(record.namespace, record.key, record.nbytes)
        if nvme_removed_at_start:
            self.counters["nvme_removed_at_start"] = nvme_removed_at_start
            self._warn_bad_nvme_blocks()
        self.catalog = catalog
        self._catalog_dirty: set[str] = set()  # sessions changed since the last sync_catalog
        self._catalog_gone: set[str] = set()  # sessions dropped since then
        self._catalog_order = threading.Lock()  # one batch copied and written at a time
        self.publish_sessions = False  # a shared tier is on: changed sessions are published (shared_batch)
        self._shared_dirty: set[str] = set()
        if catalog is not None:
            self._read_catalog(catalog)

    # ---- small helpers ------------------------------------------------------------------------
    def new_job_id(self) -> int:
        """A job id no job has had (the admin API numbers its no-op answers from the same sequence)."""
        return next(self._job_ids)

    def _new_job(self, kind: JobKind, **fields) -> Job:
        job = Job(job_id=next(self._job_ids), kind=kind, **fields)
        self.jobs[job.job_id] = job
        return job

    @property
    def key_scheme(self) -> str:
        """Names the hash ``block_keys`` computes (a snapshot records it: keys of the same scheme must
        match the recomputed ones)."""
        return str(getattr(self.block_keys, "scheme", "kvtier:sha256-chain"))

    @property
    def nvme_used(self) -> int:
        """Bytes the NVMe tier holds, plus those reserved by demotions still under way."""
        return self._nvme_used

    def _move(self, row: int, **fields) -> BlockMove:
        namespace, key = self.index.key_of(row)
        return BlockMove(row=row, namespace=namespace, key=key, **fields)

    def _adopt_nvme_block(self, namespace: bytes, key: bytes, nbytes: int) -> None:
        row = self.index.add(namespace, key, IN_NVME)
        self.index.now_in_nvme(row, nbytes, "none")  # (the scan reads sizes; a load learns the codec)
        self._nvme_used += file_bytes_for(nbytes)
        self.policies[Tier.NVME].on_insert(row, (namespace, key))

    def _forget_if_homeless(self, row: int, cause: str | None = None) -> None:
        """Forget a block no tier holds any more; ``cause`` (a ``kvtier.plan.reasons.DROP_CAUSES`` key)
        names a drop, remembered for the turn that misses it."""
        if not self.index.col["flags"][row] & (IN_DRAM | IN_NVME | PENDING):
            if cause is not None:
                namespace, key = self.index.key_of(row)
                self.drops.note(namespace, key, cause)
            self.index.remove(row)

    def _release_dram(self, row: int, evicted: bool) -> None:
        self.slots.free(self.index.left_dram(row))
        self.policies[Tier.DRAM].on_remove(row, self.index.key_of(row), evicted)

    def _release_nvme(self, row: int, evicted: bool) -> BlockMove:
        nbytes = self.index.left_nvme(row)
        move = self._move(row, nbytes=nbytes)
        self._nvme_used -= file_bytes_for(nbytes)
        self.policies[Tier.NVME].on_remove(row, self.index.key_of(row), evicted)
        return move

    # ---- lookups ------------------------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to one of the counters the admin plane and ``kvtier top`` read (the engine's
        halves count their own events here: prompt tokens, decisions, lookups, refreshes)."""
        self.counters[name] += n

    def warn(self, name: str, message: str | None) -> None:
        """Set (or, with None, clear) a lasting warning that ``kvtier status`` and ``top`` show."""
        if message:
            self.warnings[name] = message
        else:
            self.warnings.pop(name, None)

    def share_sessions(self) -> None:
        """A shared tier is on: from now on, changed sessions are queued for publishing (``shared_batch``)."""
        self.publish_sessions = True

    def peek(self, namespace: bytes, keys: Sequence[bytes]) -> np.ndarray:
        """Rows of the longest stored prefix of ``keys``, with no side effect (recency untouched:
        vLLM asks again each step until it admits the request)."""
        return self.index.lookup(namespace, keys)

    def in_dram(self, rows: np.ndarray) -> np.ndarray:
        """Per row of ``rows`` (from ``peek``/``lookup``): True when its block has a DRAM copy."""
        return (self.index.col["flags"][rows] & IN_DRAM) != 0

    def first_unstored(self, namespace: bytes, keys: Sequence[bytes], first: int, end: int) -> int:
        """The first position in ``keys[first:end]`` whose block the index does not hold (``end``
        when it holds them all)."""
        return next((i for i in range(first, end) if self.index.row_of(namespace, keys[i]) is None), end)

    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> list[int]:
        """Rows of the longest stored prefix of ``keys`` (a hit refreshes their recency)."""
        rows = self.index.lookup(namespace, keys)
        if len(rows):
            self.index.touch(rows)
            in_dram = self.in_dram(rows)
            self.policies[Tier.DRAM].on_access(rows[in_dram])
            self.policies[Tier.NVME].on_access(rows[~in_dram])
        return rows.tolist()

    def record_session(self, session_id: str, namespace: bytes, keys: Sequence[bytes], num_tokens: int,
                       token_ids: Sequence[int] | None = None) -> Session:
        """Note the latest prompt of a session (its blocks, in order, and the token ids they cover)."""
        validate_session_id(session_id)
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(session_id, namespace)
        old = session.keys
        if len(keys) >= len(old):
            grows = not old or keys[len(old) - 1] == old[-1]  # chained hashes: same last key, same prefix
            session.keys = list(keys)
            if token_ids is not None:
                self._record_tokens(session, token_ids, extends=grows)
        session.num_tokens = max(num_tokens, len(session.keys) * self.geometry.block_tokens)
        session.last_use = time.time()
        self._mark_changed(session_id)
        rows = self.session_row_array(session)
        if len(rows):  # every stored block of the session is on a prefix at least this long
            reach = self.index.col["reach"]
            reach[rows] = np.maximum(reach[rows], min(session.num_tokens, 0xFFFFFFFF))
        return session

    def _record_tokens(self, session: Session, token_ids: Sequence[int], extends: bool) -> None:
        """Keep the token ids of the session's full blocks (appending only the new ones as it grows)."""
        wanted = len(session.keys) * self.geometry.block_tokens
        have = session.token_ids
        if have is not None and extends and len(have) >= wanted:
            return
        start = len(have) if have is not None and extends else 0
        if len(token_ids) < wanted:  # the caller knows fewer tokens than its blocks cover: keep what we had
            return
        new = np.asarray(token_ids[start:wanted], dtype=np.uint32)
        session.token_ids = new if start == 0 else np.concatenate([have, new])
        session.tokens_dirty = True

    def session_tokens(self, session: Session) -> np.ndarray | None:
        """The token ids of the session's full blocks: held in memory, else read from the catalog."""
        if session.token_ids is None and self.catalog is not None:
            from kvtier.persist.catalog import decode_tokens

            data = self.catalog.token_ids(session.session_id)
            if data is not None:
                session.token_ids = decode_tokens(data)
        return session.token_ids

    def session(self, session_id: str) -> Session:
        validate_session_id(session_id)
        try:
            return self.sessions[session_id]
        except KeyError:
            raise NotFoundError(f"no session {session_id!r}", hint="`kvtier sessions` lists them") from None

    def session_rows(self, session: Session) -> list[int]:
        return self.session_row_array(session).tolist()

    def session_row_array(self, session: Session) -> np.ndarray:
        """Rows of the session's stored blocks, in order (cached: a key's row changes only when the
        index removes it, and a missing key can appear only when the index adds a row)."""
        index = self.index
        cached = self._rows_cache.get(session.session_id)
        if cached is not None:
            keys, added, removed, rows = cached
            if keys is session.keys and removed == index.removed and added in (-1, index.added):
                return rows
        get = index._maps.get(session.namespace, {}).get
        found = [r for r in map(get, session.keys) if r is not None]
        rows = np.asarray(found, dtype=np.int64)
        added = -1 if len(found) == len(session.keys) else index.added
        if len(self._rows_cache) > 2 * len(self.sessions) + 64:  # forget dropped sessions
            self._rows_cache = {k: v for k, v in self._rows_cache.items() if k in self.sessions}
        self._rows_cache[session.session_id] = (session.keys, added, index.removed, rows)
        return rows

    # ---- DRAM slots -----------------------------------------------------------------------
    def _allocate_slot(self) -> int | None:
        """A free DRAM slot, freeing one at once if that costs no data movement.

        A victim whose block NVMe also holds just loses its DRAM copy. Without an NVMe tier the
        victim is dropped (vLLM would recompute it). With one, nothing is dropped here: the caller
        stores or loads fewer blocks and the watermark demotion makes room.
        """
        slot = self.slots.allocate()
        if slot is None and self._free_one_dram_slot():
            slot = self.slots.allocate()
        return slot

    def _free_one_dram_slot(self) -> bool:
        victims = self.policies[Tier.DRAM].order(self.index, self.index.candidates(Tier.DRAM))
        if not len(victims):
            return False
        flags = self.index.col["flags"]
        on_nvme = [row for row in victims if flags[row] & IN_NVME]
        if not on_nvme and self.nvme_capacity:
            return False
        row = int(on_nvme[0] if on_nvme else victims[0])
        self._release_dram(row, evicted=True)
        if not on_nvme:
            self.counters["dram_dropped_blocks"] += 1
        self._forget_if_homeless(row, "dram_full")
        return True

    # ---- stores -------------------------------------------------------------------------------
    def prepare_store(self, session_id: str, namespace: bytes, keys: Sequence[bytes],
                      device_blocks: Sequence[int], start: int = 0) -> Job | None:
        """A STORE job for the blocks of ``keys`` not yet held (None when there is nothing to do).

        ``start`` is the position of ``keys[0]`` in its sequence (0: it is the first block).
        """
        moves = []
        codec = get_codec(self.warm_codec)
        session = self.sessions.get(session_id)
        durable = session is not None and session.pinned is not None and self.nvme_capacity > 0
        for position, (key, device_block) in enumerate(zip(keys, device_blocks), start):
            row = self.index.row_of(namespace, key)
            if row is not None:
                self.index.touch([row])
                continue
            slot = self._allocate_slot()
            if slot is None:
                self.counters["store_deferred_blocks"] += 1
                break
            first = position == 0
            row = self.index.add(namespace, key, PENDING | IN_DRAM | (FIRST if first else 0), dram_slot=slot,
                                 reach=(start + len(keys)) * self.geometry.block_tokens)
            moves.append(self._move(row, dram_slot=slot, nbytes=codec.nbytes_for(self.geometry, first) or 0,
                                    device_block=device_block, codec=self.warm_codec, first=first,
                                    durable=durable))
        if not moves:
            return None
        return self._new_job(JobKind.STORE, moves=moves, session_id=session_id)

    def _complete_store(self, job: Job, result: JobResult) -> None:
        failed = result.failed_positions(job)
        session = self.sessions.get(job.session_id) if job.session_id else None
        pinned = session.pinned if session is not None else None
        for i, move in enumerate(job.moves):
            row = move.row
            if i in failed:
                self.slots.free(move.dram_slot)
                self.index.abandon(row)
                continue
            self.index.settled(row)
            self.index.now_in_dram(row, move.dram_slot, move.nbytes, move.codec, dirty=True)
            if pinned is not None:  # a pinned session's new blocks are pinned too
                self.index.pin_at_least(row, pinned)
            self.policies[Tier.DRAM].on_insert(row, (move.namespace, move.key))
            self.counters["stored_blocks"] += 1

    # ---- loads --------------------------------------------------------------------------------
    def prepare_load(self, rows: Sequence[int], device_blocks: Sequence[int]) -> Job | None:
        """A LOAD job for ``rows`` into HBM blocks.

        NVMe-only blocks are promoted into free DRAM slots while there are some; the rest stream
        from NVMe through the mover's own buffer without taking a slot.
        """
        col = self.index.col
        moves = []
        for row, device_block in zip(rows, device_blocks):
            if col["flags"][row] & IN_DRAM:
                move = self._move(row, dram_slot=int(col["dram_slot"][row]), nbytes=int(col["dram_nbytes"][row]),
                                  device_block=device_block, codec=self.index.codecs[col["dram_codec"][row]])
            else:  # promote into a free DRAM slot if there is one (and it fits), else stream it
                fits = int(col["nvme_nbytes"][row]) <= self.slots.slot_bytes
                slot = self.slots.allocate() if fits else None
                move = self._move(row, dram_slot=-1 if slot is None else slot, device_block=device_block,
                                  from_nvme=True, nbytes=int(col["nvme_nbytes"][row]),
                                  codec=self.index.codecs[col["nvme_codec"][row]])
            self.index.ref([row], +1)
            moves.append(move)
        if not moves:
            return None
        self.index.touch(m.row for m in moves)
        return self._new_job(JobKind.LOAD, moves=moves)

    def _complete_staged(self, job: Job, result: JobResult, tier_hit: str) -> None:
        """Shared by LOAD and PROMOTE: staged NVMe reads become DRAM copies, bad ones are dropped.

        ``result.failed`` lists the blocks that did not reach their destination; of those,
        ``result.bad_reads`` could not be read back from NVMe (the store removed them).
        """
        not_delivered = result.failed_positions(job)
        bad_reads = set(result.bad_reads)
        for i, move in enumerate(job.moves):
            row = move.row
            self.index.ref([row], -1)
            if i not in not_delivered:
                self.counters[f"{tier_hit}_{'nvme' if move.from_nvme else 'dram'}_blocks"] += 1
            if not move.from_nvme:
                continue
            if i in bad_reads or (i in not_delivered and not result.encoded):
                if move.dram_slot >= 0:
                    self.slots.free(move.dram_slot)
                self._release_nvme(row, evicted=False)
                self._forget_if_homeless(row, "bad_read")
                self.counters["nvme_failed_reads"] += 1
                self._warn_bad_nvme_blocks()
                continue
            if move.dram_slot < 0:  # streamed straight through, not promoted
                continue
            self.index.now_in_dram(row, move.dram_slot, move.nbytes, move.codec)
            self.policies[Tier.DRAM].on_insert(row, (move.namespace, move.key))

    def _warn_bad_nvme_blocks(self) -> None:
        """A lasting warning (not cleared by later successes: the operator should know the disk
        lost or damaged data), with the running count."""
        bad = self.counters["nvme_failed_reads"] + self.counters["nvme_removed_at_start"]
        self.warnings["nvme_reads"] = (f"{bad} NVMe blocks were missing or corrupt: dropped, and vLLM recomputed "
                                       "them (check the disk, and that nothing else writes to the NVMe dir)")

    # ---- completion ---------------------------------------------------------------------------
    def complete(self, result: JobResult) -> None:
        """Apply a finished job; the only place block state changes after a job was emitted."""
        job = self.jobs.pop(result.job_id, None)
        if job is None:
            raise UsageError(f"job {result.job_id} is not pending")
        for i, (nbytes, codec) in result.encoded.items():  # what the mover wrote
            job.moves[int(i)].nbytes, job.moves[int(i)].codec = int(nbytes), str(codec)
        handler = {
            JobKind.STORE: self._complete_store,
            JobKind.LOAD: lambda j, r: self._complete_staged(j, r, "hit"),
            JobKind.PROMOTE: lambda j, r: self._complete_staged(j, r, "promoted"),
            JobKind.DEMOTE: self._complete_demote,
            JobKind.FLUSH: self._complete_demote,
            JobKind.DROP: lambda j, r: None,
            JobKind.SNAPSHOT: self._complete_snapshot,
            JobKind.RESTORE: self._complete_restore,
            JobKind.FETCH: self._complete_restore,
        }[job.kind]
        handler(job, result)
        self.counters[f"jobs_{job.kind.value}_{'ok' if result.ok else 'failed'}"] += 1
        self.counters[f"bytes_{job.kind.value}"] += result.bytes_moved
