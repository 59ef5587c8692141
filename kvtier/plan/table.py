"""The block table: where every block is held and what each tier has room for.

``BlockTable`` owns the sessions (id -> ``Session``), the block index, one eviction policy per
tier, the DRAM slot allocator, the NVMe byte budget (``NvmeBudget``: the one count of NVMe bytes,
written only through it), the tiers' codecs, the per-session rows cache and the log of recently
dropped blocks (forgetting a block notes its drop), and what time limits its sessions carry: the
timed pins and the live retention hints (``kvtier.plan.retention``), which order victims. It plans
nothing by itself: the other parts ask it for slots, room, rows and victims, and tell it when a block
arrives in or leaves a tier.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import numpy as np

from kvtier.codecs import get_codec
from kvtier.errors import NotFoundError
from kvtier.jobs import BlockMove
from kvtier.layout import KVGeometry
from kvtier.plan.index import IN_DRAM, IN_NVME, PENDING, BlockIndex, Session, Tier, validate_session_id
from kvtier.plan.policy import make_policy
from kvtier.plan.reasons import DropLog
from kvtier.plan.retention import DEFAULT_PRIORITY
from kvtier.plan.telemetry import Telemetry
from kvtier.tiers.dram import SlotAllocator
from kvtier.tiers.nvme.store import file_bytes_for

__all__ = ["BlockTable", "NvmeBudget"]


class NvmeBudget:
    """The NVMe byte budget: bytes of the files on NVMe plus bytes reserved by unfinished writes
    (their worst case, settled to the real size when the write lands)."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.used = 0

    def reserve(self, n: int) -> int:
        """Hold ``n`` bytes for a write under way; returns ``n`` (what to settle or release later)."""
        self.used += n
        return n

    def settle(self, reserved: int, actual: int) -> None:
        """A write landed: its reservation becomes the file's real size."""
        self.used += actual - reserved

    def release(self, n: int) -> None:
        """A file was dropped, or a reserved write failed."""
        self.used -= n

    def adopt(self, n: int) -> None:
        """A file already on NVMe (found at start, or written behind) joins the budget."""
        self.used += n

    @property
    def free(self) -> int:
        return self.capacity - self.used


class BlockTable:
    """The index of blocks and the room of each tier (see the module docstring)."""

    def __init__(self, geometry: KVGeometry, dram_bytes: int, nvme_bytes: int, policy: str,
                 warm_codec: str, cold_codec: str, telemetry: Telemetry, wall_clock: Callable[[], float] = time.time):
        """``warm_codec`` and ``cold_codec``: resolved codec names of DRAM and NVMe (a DRAM slot fits the warm one's
        largest block); ``wall_clock``: the time pins and retention hints expire by (a test moves it)."""
        self.geometry = geometry
        self.warm_codec, self.cold_codec = warm_codec, cold_codec
        self.slots = SlotAllocator(dram_bytes, get_codec(warm_codec).max_bytes(geometry))
        self.nvme = NvmeBudget(nvme_bytes)
        self.index = BlockIndex()
        per_block = file_bytes_for(geometry.block_bytes)
        self.policies = {
            Tier.DRAM: make_policy(policy, self.slots.num_slots),
            Tier.NVME: make_policy(policy, max(1, self.nvme.capacity // per_block)),
        }
        self.drops = DropLog()  # recently dropped blocks, with when and why (a later turn's miss names them)
        self.sessions: dict[str, Session] = {}
        self._telemetry = telemetry
        # session id -> (its keys list, index.added or -1 if every key was found, index.removed, rows)
        self._rows_cache: dict[str, tuple[list[bytes], int, int, np.ndarray]] = {}
        self.wall_clock = wall_clock
        self.timed_pins: set[str] = set()  # sessions whose pin ends at their pin_expires
        self.retained: dict[str, Session] = {}  # sessions under a live retention hint
        self._retain_due = math.inf  # no retention ends before this (wall clock)

    # ---- blocks arriving and leaving ----------------------------------------------------------
    def move(self, row: int, **fields) -> BlockMove:
        """A ``BlockMove`` of the block at ``row``."""
        namespace, key = self.index.key_of(row)
        return BlockMove(row=row, namespace=namespace, key=key, **fields)

    def adopt_nvme_block(self, namespace: bytes, key: bytes, nbytes: int) -> None:
        """A block an NVMe scan found at start."""
        row = self.index.add(namespace, key, IN_NVME)
        self.index.now_in_nvme(row, nbytes, "none")  # (the scan reads sizes; a load learns the codec)
        self.nvme.adopt(file_bytes_for(nbytes))
        self.policies[Tier.NVME].on_insert(row, (namespace, key))

    def written_to_nvme(self, row: int, nbytes: int, codec: str) -> None:
        """A DRAM block the worker wrote to NVMe on its own: it now has an NVMe copy too."""
        self.index.now_in_nvme(row, nbytes, codec)
        self.nvme.adopt(file_bytes_for(int(nbytes)))
        self.policies[Tier.NVME].on_insert(row, self.index.key_of(row))

    def forget_if_homeless(self, row: int, cause: str | None = None) -> None:
        """Forget a block no tier holds any more; ``cause`` (a ``kvtier.plan.reasons.DROP_CAUSES`` key)
        names a drop, remembered for the turn that misses it."""
        if not self.index.col["flags"][row] & (IN_DRAM | IN_NVME | PENDING):
            if cause is not None:
                namespace, key = self.index.key_of(row)
                self.drops.note(namespace, key, cause)
            self.index.remove(row)

    def release_dram(self, row: int, evicted: bool) -> None:
        self.slots.free(self.index.left_dram(row))
        self.policies[Tier.DRAM].on_remove(row, self.index.key_of(row), evicted)

    def release_nvme(self, row: int, evicted: bool) -> BlockMove:
        """Take the block's NVMe copy off the budget; returns the move that deletes its file."""
        nbytes = self.index.left_nvme(row)
        move = self.move(row, nbytes=nbytes)
        self.nvme.release(file_bytes_for(nbytes))
        self.policies[Tier.NVME].on_remove(row, self.index.key_of(row), evicted)
        return move

    # ---- DRAM slots ---------------------------------------------------------------------------
    def allocate_slot(self) -> int | None:
        """A free DRAM slot, freeing one at once if that costs no data movement.

        A victim whose block NVMe also holds just loses its DRAM copy. Without an NVMe tier the
        victim is dropped (vLLM would recompute it). With one, nothing is dropped here: the caller
        stores or loads fewer blocks and the watermark demotion makes room.
        """
        slot = self.slots.allocate()
        if slot is None and self.free_one_dram_slot():
            slot = self.slots.allocate()
        return slot

    def free_one_dram_slot(self) -> bool:
        victims = self.victims(Tier.DRAM)
        if not len(victims):
            return False
        flags = self.index.col["flags"]
        on_nvme = [row for row in victims if flags[row] & IN_NVME]
        if not on_nvme and self.nvme.capacity:
            return False
        row = int(on_nvme[0] if on_nvme else victims[0])
        self.release_dram(row, evicted=True)
        if not on_nvme:
            self._telemetry.count("dram_dropped_blocks")
        self.forget_if_homeless(row, "dram_full")
        return True

    # ---- lookups ------------------------------------------------------------------------------
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

    # ---- victims and retention hints -----------------------------------------------------------
    def victims(self, tier: Tier) -> np.ndarray:
        """The blocks that may leave ``tier``, in the order they should: the tier policy's order, with
        the blocks of sessions under a live retention hint moved last, lowest priority first (a stable
        re-ordering: the policy's order holds within each group)."""
        order = self.policies[tier].order(self.index, self.index.candidates(tier))
        if not self.retained or not len(order):
            return order
        self.expire_retention()
        value = self.index.col["retain"][order]
        return order[np.argsort(value, kind="stable")] if value.any() else order

    def retain(self, session: Session, until: float | None, priority: int = DEFAULT_PRIORITY) -> None:
        """Keep ``session``'s blocks last among victims until ``until`` (wall clock) at ``priority``;
        ``until`` None or past ends its retention. A block shared by several sessions takes the
        strongest live retention among them."""
        old = session.retain_priority + 1 if session.session_id in self.retained else 0
        live = until is not None and until > self.wall_clock()
        session.retain_until, session.retain_priority = (until, priority) if live else (None, 0)
        if live:
            self.retained[session.session_id] = session
            self._retain_due = min(self._retain_due, until)
        elif not old:
            return  # it had none: no block counts it
        else:
            del self.retained[session.session_id]
        rows = self.session_row_array(session)
        if live and priority + 1 >= old:
            self.index.retain_at_least(rows, priority + 1)
        else:
            self._recompute_retain(rows)

    def note_retained(self, session: Session | None) -> None:
        """Blocks that joined a retained session (stored, or named by a longer prompt) take its retention."""
        if session is not None and session.session_id in self.retained:
            self.index.retain_at_least(self.session_row_array(session), session.retain_priority + 1)

    def expire_retention(self) -> None:
        """Retention hints whose time is up stop counting (their blocks take what is left)."""
        now = self.wall_clock()
        if now < self._retain_due:
            return
        ended = [session for session in self.retained.values() if session.retain_until <= now]
        for session in ended:
            del self.retained[session.session_id]
            session.retain_until, session.retain_priority = None, 0
        self._retain_due = min((s.retain_until for s in self.retained.values()), default=math.inf)
        if ended:
            self._recompute_retain(np.concatenate([self.session_row_array(s) for s in ended]))

    def _recompute_retain(self, rows: np.ndarray) -> None:
        """``rows`` take the strongest retention of the live retained sessions holding them (0: none)."""
        retain = self.index.col["retain"]
        retain[rows] = 0
        if not len(rows) or not self.retained:
            return
        wanted = np.zeros(len(retain), np.bool_)
        wanted[rows] = True
        for other in self.retained.values():
            theirs = self.session_row_array(other)
            self.index.retain_at_least(theirs[wanted[theirs]], other.retain_priority + 1)
