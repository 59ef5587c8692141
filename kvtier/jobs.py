"""Jobs: what the scheduler half asks the worker half (the mover) to do, and what comes back.

A job is plain data so it can travel in vLLM's per-step connector metadata between processes.
Every job the manager emits holds a reference on its blocks until ``TierManager.complete``
receives its ``JobResult``; a failed block is reported by position, never dropped silently.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["JobKind", "BlockMove", "Job", "JobResult"]


class JobKind(str, Enum):
    STORE = "store"  # HBM -> DRAM (write-through of newly computed blocks)
    LOAD = "load"  # DRAM (and NVMe via DRAM) -> HBM
    DEMOTE = "demote"  # DRAM -> NVMe
    FLUSH = "flush"  # DRAM -> NVMe, keeping the DRAM copy (durability: pins, kvtier flush)
    PROMOTE = "promote"  # NVMe -> DRAM
    DROP = "drop"  # delete NVMe copies
    SNAPSHOT = "snapshot"  # DRAM/NVMe -> snapshot file
    RESTORE = "restore"  # snapshot file -> DRAM or NVMe


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
    to_nvme: bool = False  # restores: write straight to NVMe instead of DRAM
    durable: bool = False  # stores: the worker writes the block behind to NVMe at once (pinned sessions)


@dataclass(slots=True)
class Job:
    job_id: int
    kind: JobKind
    moves: list[BlockMove] = field(default_factory=list)
    session_id: str | None = None
    path: str | None = None  # snapshot / restore file
    header: dict | None = None  # snapshot header fields (session, tokens, ...)
    drops: list[BlockMove] = field(default_factory=list)  # NVMe copies to delete first


@dataclass(slots=True)
class JobResult:
    job_id: int
    kind: JobKind
    ok: bool
    failed: list[int] = field(default_factory=list)  # positions in Job.moves that failed
    error: str | None = None
    bytes_moved: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)  # e.g. a restore's per-block sizes
