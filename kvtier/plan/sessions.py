"""Sessions and the operator's actions on them: recording a session's latest prompt, pin (for good or
for a while), unpin, a request's retention hint, promote, evict, snapshot, restore, and fetches from
the shared store, with their completions.

``SessionPlanner`` owns no block state of its own: it plans on the block table (where sessions and
their blocks live), asks pressure for NVMe room and demotions, notes changed sessions in the
catalog log, and emits jobs into the job book. Like every part of the scheduler half it only
plans; the mover does the IO.
"""
from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from kvtier.codecs import get_codec
from kvtier.errors import CapacityError, FingerprintMismatchError, UsageError
from kvtier.jobs import Job, JobKind, JobResult
from kvtier.layout import ModelFingerprint
from kvtier.plan.catalog_log import CatalogLog
from kvtier.plan.index import FIRST, IN_DRAM, IN_NVME, PENDING, Session, Tier, validate_session_id
from kvtier.plan.jobbook import JobBook
from kvtier.plan.pressure import Pressure
from kvtier.plan.table import BlockTable
from kvtier.plan.telemetry import Telemetry
from kvtier.tiers.nvme.store import file_bytes_for

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.persist.snapshot import SnapshotInfo

__all__ = ["SessionPlanner"]

BlockKeys = Callable[[list[int], "str | None"], list[bytes]]


class SessionPlanner:
    def __init__(self, table: BlockTable, jobs: JobBook, telemetry: Telemetry, pressure: Pressure,
                 catalog_log: CatalogLog, fingerprint: ModelFingerprint, block_keys: BlockKeys, key_scheme: str):
        """``block_keys``: how block keys are computed from token ids (restores recompute them and
        never trust a file's); ``key_scheme``: the name of that hash (a snapshot records it)."""
        self.table, self.jobs, self.telemetry = table, jobs, telemetry
        self.pressure, self.catalog_log = pressure, catalog_log
        self.fingerprint, self.geometry = fingerprint, fingerprint.geometry
        self.block_keys, self.key_scheme = block_keys, key_scheme

    # ---- a session's prompt -------------------------------------------------------------------
    def record_session(self, session_id: str, namespace: bytes, keys: Sequence[bytes], num_tokens: int,
                       token_ids: Sequence[int] | None = None) -> Session:
        """Note the latest prompt of a session (its blocks, in order, and the token ids they cover)."""
        validate_session_id(session_id)
        sessions = self.table.sessions
        session = sessions.get(session_id)
        if session is None:
            session = sessions[session_id] = Session(session_id, namespace)
        old = session.keys
        if len(keys) >= len(old):
            grows = not old or keys[len(old) - 1] == old[-1]  # chained hashes: same last key, same prefix
            session.keys = list(keys)
            if token_ids is not None:
                self._record_tokens(session, token_ids, extends=grows)
        session.num_tokens = max(num_tokens, len(session.keys) * self.geometry.block_tokens)
        session.last_use = time.time()
        self.catalog_log.mark_changed(session_id)
        rows = self.table.session_row_array(session)
        if len(rows):  # every stored block of the session is on a prefix at least this long
            reach = self.table.index.col["reach"]
            reach[rows] = np.maximum(reach[rows], min(session.num_tokens, 0xFFFFFFFF))
        self.table.note_retained(session)  # blocks another session stored may have joined it
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

    # ---- pins ---------------------------------------------------------------------------------
    def pin(self, session_id: str, tier: Tier = Tier.DRAM, for_s: float | None = None) -> Job | None:
        """Pin a session at ``tier``: never dropped, never below ``tier``, and durable: its DRAM-only
        blocks are written to NVMe now (a FLUSH job) and as it grows (stores marked ``durable``).
        ``for_s``: the pin ends that many seconds from now (``expire``: as an unpin does); None: until
        unpinned (a pin again replaces the time limit). Returns the PROMOTE job a DRAM pin needs (the
        flush then follows with the next maintenance), else the FLUSH job."""
        if tier not in (Tier.DRAM, Tier.NVME):
            raise UsageError(f"cannot pin to {tier.name.lower()}", hint="pin to dram or nvme")
        if for_s is not None and not (isinstance(for_s, (int, float)) and math.isfinite(for_s) and for_s > 0):
            raise UsageError(f"cannot pin for {for_s!r} seconds", hint="a pin lasts more than 0 seconds")
        session = self.table.session(session_id)
        rows = self.table.session_rows(session)
        flags = self.table.index.col["flags"]
        to_promote = [r for r in rows if tier == Tier.DRAM and not flags[r] & IN_DRAM]
        if to_promote:
            spare = self.table.slots.free_slots + len(set(self.table.index.candidates(Tier.DRAM).tolist()) - set(rows))
            if len(to_promote) > spare:
                need = len(to_promote) * self.table.slots.slot_bytes
                raise CapacityError(
                    f"session {session_id} needs {need} more bytes of DRAM than can be freed",
                    hint="raise --dram, unpin another session, or pin it to nvme",
                )
        session.pinned = tier
        session.pin_expires = None if for_s is None else self.table.wall_clock() + for_s
        if for_s is None:
            self.table.timed_pins.discard(session_id)
        else:
            self.table.timed_pins.add(session_id)
        self._recompute_pins(rows)
        self.catalog_log.mark_changed(session_id)
        flush = self.pressure.flush(session_id) if self.table.nvme.capacity else None
        if not to_promote:
            return flush
        if flush is not None:
            self.jobs.queue(flush)
        return self._promote_rows(to_promote, session_id)

    def unpin(self, session_id: str) -> None:
        session = self.table.session(session_id)
        session.pinned, session.pin_expires = None, None
        self.table.timed_pins.discard(session_id)
        self._recompute_pins(self.table.session_rows(session))
        self.catalog_log.mark_changed(session_id)

    def expire(self) -> list[str]:
        """End what ran out of time (wall clock): timed pins are unpinned (exactly as ``unpin``),
        retention hints stop counting. Returns the sessions whose pin ended."""
        self.table.expire_retention()
        now, sessions = self.table.wall_clock(), self.table.sessions
        ended = [sid for sid in self.table.timed_pins if sid not in sessions or sessions[sid].pin_expires is None
                 or sessions[sid].pin_expires <= now]
        for session_id in ended:
            self.table.timed_pins.discard(session_id)
            if session_id in sessions and sessions[session_id].pinned is not None:
                self.unpin(session_id)
                self.telemetry.count("pins_expired")
        return ended

    def retain(self, session_id: str, seconds: float, priority: int) -> None:
        """A request's retention hint (``kvtier.plan.retention``): the session's blocks leave their tier
        last for ``seconds`` from now (0: no longer), after those of lower ``priority``."""
        session = self.table.session(session_id)
        self.table.retain(session, self.table.wall_clock() + seconds if seconds > 0 else None, priority)
        self.catalog_log.mark_changed(session_id)

    def _recompute_pins(self, rows: list[int]) -> None:
        """A block's pin is the hottest tier of any pinned session that contains it."""
        pin = self.table.index.col["pin"]
        pin[rows] = 0
        wanted = set(rows)
        for other in self.table.sessions.values():
            if other.pinned is None:
                continue
            for row in wanted.intersection(self.table.session_rows(other)):
                pin[row] = other.pinned if pin[row] == 0 else min(pin[row], other.pinned)

    def promote(self, session_id: str) -> Job | None:
        """Bring a session's NVMe-only blocks back into DRAM, as far as free slots allow."""
        flags = self.table.index.col["flags"]
        rows = [r for r in self.table.session_rows(self.table.session(session_id))
                if not flags[r] & (IN_DRAM | PENDING)]
        return self._promote_rows(rows, session_id) if rows else None

    def _promote_rows(self, rows: list[int], session_id: str | None) -> Job | None:
        col = self.table.index.col
        moves = []
        for row in rows:
            self.table.index.ref([row], +1)
            slot = self.table.allocate_slot()
            if slot is None:
                self.table.index.ref([row], -1)
                break
            nbytes = int(col["nvme_nbytes"][row])
            moves.append(self.table.move(row, dram_slot=slot, from_nvme=True, nbytes=nbytes,
                                    codec=self.table.index.codecs[col["nvme_codec"][row]],
                                    to_codec=self.table.warm_codec if nbytes > self.table.slots.slot_bytes else "",
                                    first=bool(col["flags"][row] & FIRST)))
        return self.jobs.new_job(JobKind.PROMOTE, moves=moves, session_id=session_id) if moves else None

    # ---- evict --------------------------------------------------------------------------------
    def evict(self, session_id: str, to: Tier | None) -> Job | None:
        """Move a session's blocks down to NVMe (``to=Tier.NVME``) or drop them (``to=None``).

        Blocks that another session shares or that a job is using stay where they are.
        """
        session = self.table.session(session_id)
        if session.pinned is not None:
            raise UsageError(f"session {session_id} is pinned", hint=f"`kvtier unpin {session_id}` first")
        if to not in (Tier.NVME, None):
            raise UsageError("evict moves a session to nvme or drops it", hint="use --to nvme or --to drop")
        if to == Tier.NVME and not self.table.nvme.capacity:
            raise UsageError("no NVMe tier is configured", hint="start kvtier serve with --nvme-dir and --nvme")
        rows = self._evictable_rows(session)
        session.hot = False
        if to == Tier.NVME:
            in_dram = [r for r in rows if self.table.index.col["flags"][r] & IN_DRAM]
            return self.pressure.demote_rows(in_dram, by_cost=False)
        drops = []
        for row in rows:
            flags = self.table.index.col["flags"]
            if flags[row] & IN_DRAM:
                self.table.release_dram(row, evicted=False)
            if flags[row] & IN_NVME:
                drops.append(self.table.release_nvme(row, evicted=False))
            self.table.forget_if_homeless(row, "operator")
        self.table.retain(session, None)
        del self.table.sessions[session_id]
        self.catalog_log.mark_gone(session_id)
        return self.jobs.new_job(JobKind.DROP, drops=drops, session_id=session_id) if drops else None

    def _evictable_rows(self, session: Session) -> list[int]:
        shared: set[bytes] = set()
        for other in self.table.sessions.values():
            if other is not session and other.namespace == session.namespace:
                shared.update(other.keys)
        col = self.table.index.col
        return [r for r in self.table.session_rows(session)
                if col["refs"][r] == 0 and col["pin"][r] == 0 and not col["flags"][r] & PENDING
                and self.table.index.key_of(r)[1] not in shared]

    # ---- snapshot / restore -------------------------------------------------------------------
    def prepare_snapshot(self, session_id: str, path: str, in_place: bool = False) -> Job:
        """A SNAPSHOT job writing the session's stored prefix to ``path`` (``in_place``: a file a client
        handed over, written as it is -- see ``snapshot.SnapshotWriter``)."""
        session = self.table.session(session_id)
        rows = self.table.index.lookup(session.namespace, session.keys).tolist()
        if not rows:
            raise UsageError(f"session {session_id} has no stored blocks to snapshot",
                             hint="run a turn of the session first, or restore it from a snapshot")
        col = self.table.index.col
        moves = []
        for position, row in enumerate(rows):
            in_dram = bool(col["flags"][row] & IN_DRAM)
            nbytes = int(col["dram_nbytes"][row] if in_dram else col["nvme_nbytes"][row])
            codec_col = "dram_codec" if in_dram else "nvme_codec"
            moves.append(self.table.move(row, dram_slot=int(col["dram_slot"][row]) if in_dram else -1, nbytes=nbytes,
                                    from_nvme=not in_dram, codec=self.table.index.codecs[col[codec_col][row]],
                                    first=position == 0))
        # one codec per snapshot file: the blocks' own when they share one, else the cold tier's
        # (without its lossless layer, so every size is known before the file is laid out)
        codecs = {m.codec for m in moves}
        target = codecs.pop() if len(codecs) == 1 else self.table.cold_codec.partition("+")[0]
        sizes = []  # as written to the file
        for move in moves:
            if move.codec != target:
                move.to_codec = target
            sizes.append(get_codec(target).nbytes_for(self.geometry, move.first) if move.to_codec else move.nbytes)
        self.table.index.ref(rows, +1)
        tokens = min(session.num_tokens, len(rows) * self.geometry.block_tokens)
        token_ids = self.catalog_log.session_tokens(session)
        covered = len(rows) * self.geometry.block_tokens
        header = {"session_id": session_id, "namespace": session.namespace, "num_tokens": tokens,
                  "codec": target, "sizes": sizes, "key_scheme": self.key_scheme, "in_place": in_place,
                  "token_ids": token_ids[:covered].tolist() if token_ids is not None and len(token_ids) >= covered
                  else []}
        return self.jobs.new_job(JobKind.SNAPSHOT, moves=moves, session_id=session_id, path=str(path), header=header)

    def complete_snapshot(self, job: Job, result: JobResult) -> None:
        self.table.index.ref([m.row for m in job.moves], -1)

    def max_snapshot_header(self) -> int:
        """The largest snapshot header a session of this server can need (see ``snapshot.header_cap``)."""
        from kvtier.persist.snapshot import header_cap

        blocks = self.table.slots.num_slots + self.table.nvme.capacity // max(1, self.geometry.block_bytes)
        return header_cap(blocks, self.geometry.block_tokens)

    def trusted_keys(self, info: "SnapshotInfo", cache_salt: str | None = None) -> list[bytes]:
        """The keys a snapshot's blocks go under here, recomputed from its token ids (see
        ``prepare_restore``); SnapshotError when the file cannot be trusted."""
        from kvtier.errors import SnapshotError
        from kvtier.plan.index import namespace_of

        def refuse(why: str, hint: str) -> SnapshotError:
            self.telemetry.count("restores_refused_untrusted")
            return SnapshotError(f"snapshot {info.path} refused: {why}", hint=hint, path=str(info.path))

        if info.namespace != namespace_of(self.fingerprint.digest, cache_salt):
            raise refuse("its namespace is not this engine's for " + ("this cache salt" if cache_salt else
                                                                     "requests without a cache salt"),
                         "restore it with the cache salt of the tenant it was taken for, on the same model")
        needed = len(info.blocks) * self.geometry.block_tokens
        if len(info.token_ids) < needed:
            raise refuse(f"its token ids cover {len(info.token_ids)} of the {needed} tokens its blocks hold, "
                         "so their keys cannot be recomputed", "take the snapshot again with this kvtier version")
        keys = self.block_keys(list(info.token_ids[:needed]), cache_salt)
        if len(keys) != len(info.blocks):
            raise refuse("its token ids do not make its number of blocks", "take the snapshot again")
        if (info.meta or {}).get("key_scheme") == self.key_scheme:  # same hash: the file's keys must agree
            for position, (entry, key) in enumerate(zip(info.blocks, keys)):
                if entry.key != key:
                    raise refuse(f"block {position}'s key is not the hash of its tokens (forged or damaged)",
                                 "restore only snapshots taken by a kvtier server; take a new one")
        return keys

    def shared_entry_keys(self, entry: dict, cache_salt: str | None = None) -> tuple[bytes, list[bytes]]:
        """(namespace, block keys) for a session another box published, the keys recomputed from its
        token ids with this engine's hash -- as for a snapshot, nothing the store says decides where
        KV goes. An entry of another tenant or model, without the token ids of its blocks, or whose
        keys disagree with the recomputed ones under the same hash scheme, is refused."""
        from kvtier.plan.index import namespace_of

        session_id = validate_session_id(str(entry.get("session_id", "")))
        namespace = namespace_of(self.fingerprint.digest, cache_salt)
        if entry.get("namespace") != namespace:
            raise FingerprintMismatchError(
                f"shared session {session_id} was published under another namespace (another tenant's cache "
                "salt, or another model revision)", hint="restore it with the --cache-salt its requests carry")
        bt = self.geometry.block_tokens
        blocks = int(entry.get("blocks") or 0)
        tokens = list(entry.get("token_ids") or [])
        if len(tokens) < blocks * bt:
            raise FingerprintMismatchError(f"shared session {session_id}: its entry holds {len(tokens)} token ids, "
                                           f"its {blocks} blocks need {blocks * bt}",
                                           hint="the box that published it runs an older kvtier; serve the turn there")
        keys = self.block_keys(tokens[: blocks * bt], cache_salt)
        if entry.get("key_scheme") == self.key_scheme and list(entry.get("keys") or []) != keys:
            raise FingerprintMismatchError(f"shared session {session_id}: its keys are not the hash of its tokens "
                                           "(forged or damaged entry)", hint="it is ignored; its next turn recomputes")
        return namespace, keys

    def prepare_restore(self, info: "SnapshotInfo", tier: Tier = Tier.DRAM,
                        cache_salt: str | None = None, require_signed: bool = False) -> Job | None:
        """A RESTORE job bringing a snapshot's missing blocks into DRAM (overflow: NVMe) or NVMe.

        Nothing in the file is trusted for where blocks go: the namespace is this engine's own (its
        fingerprint and the tenant's ``cache_salt``), and every block key is recomputed from the
        file's token ids with this engine's hash (``block_keys``). A file whose namespace is not
        this engine's, whose token ids do not cover its blocks, or whose keys disagree with the
        recomputed ones although it says it used the same hash, is refused -- before any slot,
        row or byte of NVMe is taken."""
        why = self.fingerprint.mismatch(info.fingerprint.engine)
        if why:
            raise FingerprintMismatchError(
                f"snapshot {info.path} cannot be restored here: {why}",
                hint="restore it on a server running the same model, KV dtype, block size and tensor-parallel size",
                path=str(info.path),
            )
        validate_session_id(info.session_id)  # before anything is taken: a refused file leaks nothing
        keys = self.trusted_keys(info, cache_salt)
        from kvtier.persist.snapshot import shard_path

        for rank in range(1, self.fingerprint.shards):  # a sharded snapshot is one file per rank
            sibling = shard_path(info.path, rank, self.fingerprint.shards)
            if not os.path.exists(sibling):
                raise FingerprintMismatchError(
                    f"snapshot {info.path} was taken at tensor-parallel size {self.fingerprint.shards}, and its "
                    f"rank-{rank} shard {sibling} is missing",
                    hint="copy every <snapshot>.rank<N> file along with the snapshot", path=str(info.path))
        namespace = info.namespace  # checked equal to this engine's own by trusted_keys
        moves, drops = self._plan_incoming(namespace, keys, [entry.nbytes for entry in info.blocks], info.codec, tier)
        self.record_session(info.session_id, namespace, keys, info.num_tokens, token_ids=info.token_ids or None)
        if not moves and not drops:
            return None
        # require_signed: every rank's file must be signed by a trusted key (the admin API checked
        # rank 0's; the worker checks its own shard before reading it)
        return self.jobs.new_job(JobKind.RESTORE, moves=moves, drops=drops, session_id=info.session_id,
                             path=str(info.path), header={"require_signed": require_signed})

    def _plan_incoming(self, namespace: bytes, keys: Sequence[bytes], sizes: Sequence[int],
                       codec: str, tier: Tier, start: int = 0, shared: bool = False) -> tuple[list, list]:
        """Moves bringing blocks this engine lacks into DRAM (overflow: NVMe) or NVMe, their rows
        added PENDING (a snapshot's or the shared store's: ``shared``); stops where neither has room.
        ``start``: the position of ``keys[0]`` in its sequence."""
        moves, drops = [], []
        for position, (key, nbytes) in enumerate(zip(keys, sizes)):
            if self.table.index.row_of(namespace, key) is not None:
                continue
            fits = nbytes <= self.table.slots.slot_bytes
            slot = self.table.allocate_slot() if tier == Tier.DRAM and (fits or not self.table.nvme.capacity) else None
            to_nvme = slot is None
            to_codec = self.table.warm_codec if not to_nvme and not fits else ""  # re-encoded to fit a slot
            size = 0
            if to_nvme:
                size = file_bytes_for(nbytes)
                if not self.table.nvme.capacity or not self.pressure.make_nvme_room(size, drops):
                    break
                self.table.nvme.reserve(size)
            first = start + position == 0
            flags = PENDING | (IN_NVME if to_nvme else IN_DRAM) | (FIRST if first else 0)
            row = self.table.index.add(namespace, key, flags, dram_slot=-1 if to_nvme else slot)
            moves.append(self.table.move(row, dram_slot=-1 if to_nvme else slot, nbytes=nbytes, codec=codec,
                                    to_nvme=to_nvme, position=position, first=first, to_codec=to_codec,
                                    reserved=size, from_shared=shared))
        return moves, drops

    def prepare_fetch(self, namespace: bytes, keys: Sequence[bytes], sizes: Sequence[int],
                      tier: Tier = Tier.DRAM, start: int = 0, session_id: str | None = None) -> Job | None:
        """A FETCH job bringing blocks another box published in the shared store into DRAM (overflow:
        NVMe) or NVMe. ``keys`` are this engine's own (a lookup of a request's prefix, or recomputed
        from a published session's token ids); ``sizes`` their payload bytes as stored there. The
        worker verifies every value (header, signature, checksum) before it counts."""
        moves, drops = self._plan_incoming(namespace, keys, sizes, "", tier, start=start, shared=True)
        if not moves and not drops:
            return None
        return self.jobs.new_job(JobKind.FETCH, moves=moves, drops=drops, session_id=session_id)

    def complete_restore(self, job: Job, result: JobResult) -> None:
        failed = result.failed_positions(job)
        for i, move in enumerate(job.moves):
            row = move.row
            if i in failed:
                if move.to_nvme:
                    self.table.nvme.release(move.reserved)
                else:
                    self.table.slots.free(move.dram_slot)
                self.table.index.abandon(row)
                continue
            self.table.index.settled(row)
            tier = Tier.NVME if move.to_nvme else Tier.DRAM
            if move.to_nvme:
                self.table.index.now_in_nvme(row, move.nbytes, move.codec)
            else:
                self.table.index.now_in_dram(row, move.dram_slot, move.nbytes, move.codec, dirty=True)
            self.table.policies[tier].on_insert(row, (move.namespace, move.key))
            self.telemetry.count("fetched_blocks" if job.kind == JobKind.FETCH else "restored_blocks")
