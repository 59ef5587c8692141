"""Scheduler-side state: the block index, sessions and pins. Plain data structures, no IO.

Keys. A block is found by ``(namespace, block_hash)``: ``block_hash`` is vLLM's chained block hash
(it already covers every token before the block), ``namespace`` is a 16-byte digest of the model
fingerprint and the request's cache salt (``namespace_of``). Two models or two tenants therefore
never share a block, and a lookup needs no hashing of its own.

Memory. The index must stay small at millions of blocks, so per-block metadata lives in numpy
columns indexed by a row number (``BlockIndex.col``), and the only per-block Python objects are the
key and the dict entry that maps it to its row (about 180 bytes a block in all; see
``kvtier bench tiers``).

Two phases. ``refs`` counts jobs in flight on a block (loads, demotions, snapshots); a block with
``refs > 0`` is never chosen as a victim, and a block being stored is invisible to lookups until its
store completes.
"""
from __future__ import annotations

import hashlib
import re
import time
from enum import IntEnum
from typing import Iterable, Sequence

import numpy as np

from kvtier.errors import UsageError

__all__ = [
    "Tier",
    "IN_DRAM",
    "IN_NVME",
    "PENDING",
    "namespace_of",
    "chain_block_hashes",
    "validate_session_id",
    "Session",
    "BlockIndex",
]


class Tier(IntEnum):
    """Where KV lives; a lower value is hotter."""

    HBM = 0
    DRAM = 1
    NVME = 2

    @classmethod
    def parse(cls, name: str) -> "Tier":
        try:
            return cls[name.upper()]
        except KeyError:
            raise UsageError(f"unknown tier {name!r}", hint="one of: hbm, dram, nvme") from None


IN_DRAM = 1
IN_NVME = 2
PENDING = 4  # being stored: invisible to lookups, not yet a victim candidate
FIRST = 8  # the first block of its sequence (holds the attention sinks; int4-lc keeps them exact)

NO_SLOT = -1
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}$")


def namespace_of(fingerprint: bytes, cache_salt: str | None = None) -> bytes:
    """16-byte namespace of (model fingerprint, tenant cache salt)."""
    salt = (cache_salt or "").encode()
    return hashlib.blake2b(fingerprint + b"\0" + salt, digest_size=16).digest()


def chain_block_hashes(token_ids: Sequence[int], block_tokens: int, parent: bytes = b"") -> list[bytes]:
    """Chained sha256 hashes of each full block, as vLLM computes them (used without vLLM)."""
    hashes = []
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        chunk = np.asarray(token_ids[start : start + block_tokens], dtype=np.int64).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        hashes.append(parent)
    return hashes


def validate_session_id(session_id: str) -> str:
    """Session ids reach file names and URLs: allow a safe alphabet only."""
    if not isinstance(session_id, str) or not _SESSION_ID.match(session_id):
        raise UsageError(
            f"invalid session id {session_id!r}",
            hint="use 1-128 characters from A-Z a-z 0-9 . _ : @ + = - (not starting with a symbol)",
        )
    return session_id


class Session:
    """One conversation's KV: its ordered block keys, the token ids they cover, and how it is held.

    ``keys`` of a session read back from the catalog stay one bytes object until first used, so a
    restart with 100k sessions does not split millions of keys up front.
    """

    __slots__ = ("session_id", "namespace", "_keys", "_blob", "_key_len", "num_tokens", "last_use", "created",
                 "pinned", "hot", "token_ids", "tokens_dirty", "pin_expires", "retain_until", "retain_priority")

    def __init__(self, session_id: str, namespace: bytes, keys: list[bytes] | None = None, num_tokens: int = 0,
                 last_use: float | None = None, pinned: "Tier | None" = None, hot: bool = False,
                 created: float | None = None):
        self.session_id = session_id
        self.namespace = namespace
        self._keys: list[bytes] | None = list(keys) if keys is not None else []
        self._blob, self._key_len = b"", 0
        self.num_tokens = num_tokens
        self.last_use = time.time() if last_use is None else last_use
        self.created = self.last_use if created is None else created
        self.pinned = pinned
        self.hot = hot  # vLLM holds it in HBM (reported by the connector)
        self.token_ids = None  # numpy uint32 of the tokens its full blocks cover (None: not known here)
        self.tokens_dirty = False  # token_ids changed since the catalog last saved them
        self.pin_expires: float | None = None  # wall clock when a timed pin ends (None: pinned until unpinned)
        self.retain_until: float | None = None  # wall clock when a request's retention hint ends (None: none)
        self.retain_priority = 0  # that hint's priority (kvtier.plan.retention)

    @property
    def keys(self) -> list[bytes]:
        if self._keys is None:
            blob, n = self._blob, self._key_len
            self._keys = [blob[i : i + n] for i in range(0, len(blob), n)]
            self._blob = b""
        return self._keys

    @keys.setter
    def keys(self, value: list[bytes]) -> None:
        self._keys, self._blob = value, b""

    @property
    def num_blocks(self) -> int:
        return len(self._keys) if self._keys is not None else len(self._blob) // self._key_len

    def keys_blob(self) -> tuple[bytes, int]:
        """(the keys concatenated, their common length); length 0 if they differ in length."""
        if self._keys is None:
            return self._blob, self._key_len
        keys = self._keys
        if not keys:
            return b"", 32
        n = len(keys[0])
        return (b"".join(keys), n) if all(len(k) == n for k in keys) else (b"", 0)

    def __repr__(self) -> str:
        return f"Session({self.session_id!r}, blocks={self.num_blocks}, tokens={self.num_tokens}, pinned={self.pinned})"


class BlockIndex:
    """Blocks by key, with their metadata in numpy columns (see the module docstring)."""

    COLUMNS = {
        "flags": np.uint8,
        "dram_slot": np.int32,
        "dram_nbytes": np.uint32,
        "nvme_nbytes": np.uint32,
        "dram_codec": np.uint8,
        "nvme_codec": np.uint8,
        "refs": np.int32,
        "pin": np.uint8,  # 0: not pinned; else the coldest Tier the block may sink to
        "retain": np.uint32,  # 0: no live retention hint; else the strongest priority + 1 (leaves its tier last)
        "ns": np.uint16,
        "last_use": np.uint64,
        "reach": np.uint32,  # tokens of the longest stored prefix through this block (0: unknown)
        "dirty_since": np.float32,  # monotonic seconds since the index's epoch when its DRAM copy was made
    }

    def __init__(self, capacity: int = 1024):
        self._maps: dict[bytes, dict[bytes, int]] = {}
        self._namespaces: list[bytes] = []
        self._keys: list[bytes | None] = []
        self._free_rows: list[int] = []
        self.col = {name: np.zeros(capacity, dtype) for name, dtype in self.COLUMNS.items()}
        self.col["dram_slot"][:] = NO_SLOT
        self._clock = 0
        self.added = 0  # rows ever added / removed: lets callers cache key -> row lookups
        self.removed = 0
        self.codecs: list[str] = ["none"]  # codec id -> name, shared by both tiers
        self.epoch = time.monotonic()  # dirty_since counts from here

    def now(self) -> float:
        """Seconds since the index's epoch (the unit of ``dirty_since``)."""
        return time.monotonic() - self.epoch

    def dirty_rows(self) -> np.ndarray:
        """Complete DRAM blocks with no NVMe copy: what a crash would lose."""
        flags = self.col["flags"][: len(self._keys)]
        return np.flatnonzero((flags & (IN_DRAM | IN_NVME | PENDING)) == IN_DRAM)

    def storing_count(self) -> int:
        """Blocks on their way into DRAM (a store behind the step): dirty once it lands."""
        flags = self.col["flags"][: len(self._keys)]
        return int(np.count_nonzero((flags & (IN_DRAM | IN_NVME | PENDING)) == (IN_DRAM | PENDING)))

    # ---- rows -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._keys) - len(self._free_rows)

    @property
    def capacity(self) -> int:
        return len(self.col["flags"])

    def _grow(self) -> None:
        new = max(1024, self.capacity * 2)
        for name, column in self.col.items():
            grown = np.zeros(new, column.dtype)
            grown[: len(column)] = column
            if name == "dram_slot":
                grown[len(column) :] = NO_SLOT
            self.col[name] = grown

    def _ns_id(self, namespace: bytes) -> int:
        if namespace not in self._maps:
            self._maps[namespace] = {}
            self._namespaces.append(namespace)
        return self._namespaces.index(namespace)

    def codec_id(self, name: str) -> int:
        if name not in self.codecs:
            self.codecs.append(name)
        return self.codecs.index(name)

    def add(self, namespace: bytes, key: bytes, flags: int, dram_slot: int = NO_SLOT, reach: int = 0) -> int:
        """A new row for ``key`` (which must not be indexed yet); ``dram_slot``: the slot a pending
        block is being written to; ``reach``: the longest stored prefix through it, in tokens."""
        if self._free_rows:
            row = self._free_rows.pop()
            self._keys[row] = key
        else:
            row = len(self._keys)
            if row >= self.capacity:
                self._grow()
            self._keys.append(key)
        ns_id = self._ns_id(namespace)
        self._maps[namespace][key] = row
        for name in ("dram_nbytes", "nvme_nbytes", "dram_codec", "nvme_codec", "refs", "pin", "retain", "reach",
                     "dirty_since"):
            self.col[name][row] = 0
        self.col["dram_slot"][row] = dram_slot
        self.col["reach"][row] = reach
        self.col["flags"][row] = flags
        self.col["ns"][row] = ns_id
        self.added += 1
        self.touch([row])
        return row

    def remove(self, row: int) -> None:
        """Forget a row entirely (no tier holds it any more)."""
        namespace = self._namespaces[self.col["ns"][row]]
        del self._maps[namespace][self._keys[row]]
        self._keys[row] = None
        self.col["flags"][row] = 0
        self._free_rows.append(row)
        self.removed += 1

    # ---- named transitions: the only writes the manager makes to a row's tier state ----------------
    def now_in_dram(self, row: int, slot: int, nbytes: int, codec: str, dirty: bool = False) -> None:
        """The block's copy in DRAM slot ``slot`` is ``nbytes`` of ``codec`` (``dirty``: it has no
        NVMe copy yet, as of now)."""
        col = self.col
        col["flags"][row] |= IN_DRAM
        col["dram_slot"][row] = slot
        col["dram_nbytes"][row] = nbytes
        col["dram_codec"][row] = self.codec_id(codec)
        if dirty:
            col["dirty_since"][row] = self.now()

    def now_in_nvme(self, row: int, nbytes: int, codec: str) -> None:
        """The block has an NVMe record of ``nbytes`` of ``codec``."""
        col = self.col
        col["flags"][row] |= IN_NVME
        col["nvme_nbytes"][row] = nbytes
        col["nvme_codec"][row] = self.codec_id(codec)

    def left_dram(self, row: int) -> int:
        """The block's DRAM copy is gone; returns the slot it held."""
        col = self.col
        slot = int(col["dram_slot"][row])
        col["dram_slot"][row] = NO_SLOT
        col["flags"][row] &= ~np.uint8(IN_DRAM)
        return slot

    def left_nvme(self, row: int) -> int:
        """The block's NVMe record is gone; returns its payload bytes."""
        self.col["flags"][row] &= ~np.uint8(IN_NVME)
        return int(self.col["nvme_nbytes"][row])

    def settled(self, row: int) -> None:
        """A pending block (being stored, restored or fetched) is complete: lookups may see it."""
        self.col["flags"][row] &= ~np.uint8(PENDING)

    def abandon(self, row: int) -> None:
        """A pending block whose job failed: forgotten, as if never added."""
        self.col["flags"][row] = 0
        self.remove(row)

    def pin_at_least(self, row: int, tier: int) -> None:
        """The block takes the hottest pin of the sessions holding it (``tier``: a ``Tier`` value)."""
        pin = self.col["pin"]
        pin[row] = tier if pin[row] == 0 else min(int(pin[row]), tier)

    def retain_at_least(self, rows: np.ndarray, value: int) -> None:
        """The blocks take a session's retention (``value``: its priority + 1) unless theirs is stronger."""
        if len(rows) and value:
            retain = self.col["retain"]
            retain[rows] = np.maximum(retain[rows], value)

    def key_of(self, row: int) -> tuple[bytes, bytes]:
        key = self._keys[row]
        assert key is not None, f"row {row} is free"
        return self._namespaces[self.col["ns"][row]], key

    def row_of(self, namespace: bytes, key: bytes) -> int | None:
        return self._maps.get(namespace, {}).get(key)

    def touch(self, rows: Iterable[int] | np.ndarray) -> None:
        self._clock += 1
        index = rows if isinstance(rows, np.ndarray) else np.fromiter(rows, dtype=np.int64)
        self.col["last_use"][index] = self._clock

    def memory_bytes(self) -> int:
        """Bytes the index holds: dicts, keys, row numbers, the row list and the columns.

        Counted with ``sys.getsizeof`` (fast enough for telemetry at millions of blocks); a test
        checks it against tracemalloc.
        """
        import sys

        total = sys.getsizeof(self._maps) + sys.getsizeof(self._keys) + sys.getsizeof(self._free_rows)
        for table in self._maps.values():
            total += sys.getsizeof(table)
            # ints above 256 are objects of their own; smaller ones are interpreter singletons
            total += sum(28 for row in table.values() if row > 256)
        total += sum(sys.getsizeof(key) for key in self._keys if key is not None)
        return total + sum(column.nbytes for column in self.col.values())

    # ---- lookups ----------------------------------------------------------------------------
    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> np.ndarray:
        """Rows of the longest prefix of ``keys`` whose blocks are stored and complete."""
        table = self._maps.get(namespace)
        if not table:
            return np.zeros(0, np.int64)
        rows = []
        get = table.get
        for key in keys:
            row = get(key)
            if row is None:
                break
            rows.append(row)
        found = np.asarray(rows, dtype=np.int64)
        flags = self.col["flags"][found]
        usable = ((flags & PENDING) == 0) & ((flags & (IN_DRAM | IN_NVME)) != 0)
        if not usable.all():
            found = found[: int(np.argmin(usable))]
        return found

    # ---- victims ----------------------------------------------------------------------------
    def candidates(self, tier: Tier) -> np.ndarray:
        """Rows that hold a complete copy in ``tier``, have no job in flight, and may leave it.

        A DRAM copy may leave unless the block is pinned to DRAM; an NVMe copy may be dropped
        unless the block is pinned at all (pinned blocks are never dropped).
        """
        n = len(self._keys)
        flags, refs, pin = self.col["flags"][:n], self.col["refs"][:n], self.col["pin"][:n]
        bit = IN_DRAM if tier == Tier.DRAM else IN_NVME
        ok = ((flags & bit) != 0) & ((flags & PENDING) == 0) & (refs == 0)
        if tier == Tier.DRAM:
            ok &= pin != Tier.DRAM
        else:
            ok &= pin == 0
        return np.flatnonzero(ok)

    def ref(self, rows: Iterable[int], delta: int) -> None:
        refs = self.col["refs"]
        for row in rows:
            refs[row] += delta
            assert refs[row] >= 0, f"row {row}: reference count below zero"
