"""What the dashboard renders: frozen snapshots, built by the collector (or read back from a
recording) and never changed afterwards. Widgets only ever look at the latest one.

A recording (``kvtier top --record FILE``) is one snapshot per line, as JSON.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["GpuRow", "InstanceRow", "Tier", "Link", "SessionRow", "JobRow", "Snapshot", "SNAPSHOT_VERSION"]

SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class Tier:
    name: str  # hbm | dram | nvme
    used_bytes: int | None
    capacity_bytes: int | None
    blocks: int | None
    codec: str
    tokens_per_gib: int | None = None

    @property
    def fraction(self) -> float | None:
        if self.used_bytes is None or not self.capacity_bytes:
            return None
        return min(1.0, self.used_bytes / self.capacity_bytes)


@dataclass(frozen=True)
class Link:
    name: str  # a short label: "HBM→DRAM", "disk read"...
    source: str  # where the figure comes from: kvtier | nvml | psutil
    bytes_per_s: float | None  # None: not measurable here (no GPU, first sample)
    history: tuple[float, ...] = ()


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    state: str
    tokens: int
    blocks: int
    blocks_dram: int
    blocks_nvme: int
    bytes_dram: int
    bytes_nvme: int
    pinned: str | None
    last_use: float  # unix time; idle time is the snapshot's ``taken`` minus this
    job: int | None
    codec_dram: str
    codec_nvme: str
    decision: str | None = None  # the cost model's choice for its next turn: load | recompute
    restore_s: float | None = None
    recompute_s: float | None = None
    instance: str | None = None  # set in the all-instances view
    pin_expires_at: float | None = None  # unix time a timed pin ends (None: no pin, or pinned until unpinned)
    retain_expires_at: float | None = None  # unix time a request's retention hint ends (None: none live)
    retain_priority: int | None = None
    bytes_hbm: int | None = None  # its blocks in vLLM's prefix cache (None: the engine publishes no KV events)
    stored_note: str | None = None  # why nothing is held in DRAM or on NVMe (None: something is)


@dataclass(frozen=True)
class InstanceRow:
    """One ``kvtier serve`` on the box, as the box view lists it."""

    name: str
    port: int
    model: str
    gpus: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES; None: not set
    connected: bool
    sessions: int = 0
    dram_used: int | None = None
    dram_capacity: int | None = None
    nvme_used: int | None = None
    nvme_capacity: int | None = None


@dataclass(frozen=True)
class GpuRow:
    """One GPU of the box, from NVML."""

    index: int
    name: str
    hbm_used: float | None
    hbm_total: float | None
    pcie_to_gpu: float | None
    pcie_from_gpu: float | None
    instances: tuple[str, ...] = ()  # the instances that use it


@dataclass(frozen=True)
class JobRow:
    id: int
    kind: str
    session_id: str | None
    state: str
    progress: float
    bytes: int
    seconds: float | None
    error: str | None
    path: str | None = None


@dataclass(frozen=True)
class Snapshot:
    taken: float
    connected: bool
    banners: tuple[str, ...] = ()
    model: str | None = None
    snapshot_dir: str | None = None
    tiers: tuple[Tier, ...] = ()
    links: tuple[Link, ...] = ()
    hit_rates: tuple[tuple[str, float | None], ...] = ()  # tier -> share of admitted prompt tokens
    sessions: tuple[SessionRow, ...] = ()
    jobs: tuple[JobRow, ...] = ()
    gpu: str | None = None
    dirty_bytes: int | None = None  # DRAM KV with no NVMe copy yet (a crash would lose it)
    dirty_age_s: float | None = None  # age of the oldest such block
    instance: str | None = None  # the instance shown (several may run on the box)
    instances: tuple[InstanceRow, ...] = ()
    gpus: tuple[GpuRow, ...] = ()
    all_sessions: bool = False  # sessions of every instance, each row naming its own
    sessions_total: int | None = None  # sessions on the server (the rows are its most recent ones)
    session_states: tuple[tuple[str, int], ...] = ()  # every session's state, counted by the server
    version: int = field(default=SNAPSHOT_VERSION)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "Snapshot":
        if doc.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"recorded snapshot version {doc.get('version')!r}, expected {SNAPSHOT_VERSION}")
        known = {f.name for f in fields(cls)}
        doc = {k: v for k, v in doc.items() if k in known}
        doc["banners"] = tuple(doc.get("banners", ()))
        doc["tiers"] = tuple(Tier(**t) for t in doc.get("tiers", ()))
        doc["links"] = tuple(Link(**{**link, "history": tuple(link.get("history", ()))}) for link in doc.get("links",
                                                                                                             ()))
        doc["hit_rates"] = tuple((name, rate) for name, rate in doc.get("hit_rates", ()))
        doc["session_states"] = tuple((state, n) for state, n in doc.get("session_states", ()))
        doc["sessions"] = tuple(SessionRow(**s) for s in doc.get("sessions", ()))
        doc["jobs"] = tuple(JobRow(**j) for j in doc.get("jobs", ()))
        doc["instances"] = tuple(InstanceRow(**{**i, "gpus": None if i.get("gpus") is None else tuple(i["gpus"])})
                                 for i in doc.get("instances", ()))
        doc["gpus"] = tuple(GpuRow(**{**g, "instances": tuple(g.get("instances", ()))}) for g in doc.get("gpus", ()))
        return cls(**doc)

    @classmethod
    def from_json(cls, line: str) -> "Snapshot":
        return cls.from_dict(json.loads(line))
