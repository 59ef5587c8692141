"""Builds ``Snapshot``s from the admin API and local telemetry (psutil, NVML). No widget code.

Rates are differences between two polls of monotonic counters: kvtier's bytes per link (from the
server), the host's disk IO (psutil) and, where NVML is present, the GPU's PCIe throughput and
memory. Anything that cannot be measured here is ``None`` (shown as N/A) with a banner saying why.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterator

from kvtier.control.client import AdminClient
from kvtier.control.gpu import gpu_link, open_gpus, select_gpus
from kvtier.errors import KvtierError, NoServerError
from kvtier.tui.model import GpuRow, InstanceRow, JobRow, Link, SessionRow, Snapshot, Tier

__all__ = ["BoxCollector", "Collector", "Nvml", "replay"]

# kvtier's byte counter per link -> the label the dashboard shows
KVTIER_LINKS = (("load", "DRAM→HBM"), ("store", "HBM→DRAM"), ("demote", "DRAM→NVMe"),
                ("promote", "NVMe→DRAM"), ("snapshot", "snapshot"), ("restore", "restore"))
HISTORY = 60
SESSION_ROWS = 1000  # rows asked for each poll, most recent first: 100k sessions cost what 1,000 do


class Nvml:
    """GPU telemetry through nvidia-ml-py, when a GPU and its driver are there: the GPUs of one
    instance (``devices``: its ``CUDA_VISIBLE_DEVICES``; None: every GPU), summed, and every GPU of
    the box one by one."""

    def __init__(self, devices: list[str] | tuple[str, ...] | None = None, opened: tuple | None = None) -> None:
        self.nvml, self.handles, why = opened if opened is not None else open_gpus()
        self.indexes = select_gpus(self.nvml, self.handles, devices) if self.handles else []
        if self.handles and not self.indexes:
            why = f"CUDA_VISIBLE_DEVICES={','.join(devices or ())} names no GPU NVML sees"
        self.reason = f"{why}: HBM and PCIe show N/A" if why else None
        self.handle = self.handles[self.indexes[0]] if self.indexes else None
        self.name = None
        if self.handle is not None:
            link = gpu_link(self.nvml, self.handle)
            self.name = link.get("name")
            if link.get("gen"):
                self.name = f"{self.name} (PCIe gen{link['gen']} x{link['width']})"
            if len(self.indexes) > 1:
                self.name = f"{len(self.indexes)}× {self.name}"

    def _one(self, handle: Any) -> dict[str, float]:
        nvml = self.nvml
        tx = nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES) * 1024.0
        rx = nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES) * 1024.0
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return {"pcie_to_gpu": rx, "pcie_from_gpu": tx, "hbm_used": float(memory.used),
                "hbm_total": float(memory.total)}

    def sample(self) -> dict[str, float] | None:
        """PCIe bytes/s each way (NVML's own 20 ms window) and HBM bytes in use, summed over the
        selected GPUs."""
        if not self.indexes:
            return None
        try:
            total: dict[str, float] = {}
            for index in self.indexes:
                for key, value in self._one(self.handles[index]).items():
                    total[key] = total.get(key, 0.0) + value
            return total
        except Exception:  # noqa: BLE001 - a GPU that went away must not stop the dashboard
            return None

    def per_gpu(self) -> list[dict[str, Any]]:
        """Every GPU of the box: index, name and the figures of :meth:`sample` (None when unreadable)."""
        rows = []
        for index, handle in enumerate(self.handles):
            try:
                name = self.nvml.nvmlDeviceGetName(handle)
                row: dict[str, Any] = {"index": index, "name": name.decode() if isinstance(name, bytes) else name,
                                       **self._one(handle)}
            except Exception:  # noqa: BLE001
                row = {"index": index, "name": "?", "pcie_to_gpu": None, "pcie_from_gpu": None,
                       "hbm_used": None, "hbm_total": None}
            rows.append(row)
        return rows


class Collector:
    """One ``poll()`` = one snapshot. Keeps the previous counters to turn them into rates."""

    def __init__(self, client: AdminClient, nvml: Nvml | None = None, disk: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.time):
        self.client = client
        self.nvml = nvml if nvml is not None else Nvml()
        self.clock = clock
        if disk is None:
            import psutil

            disk = psutil.disk_io_counters
        self.disk = disk
        self._last: dict[str, tuple[float, float]] = {}  # counter -> (time, value)
        self._rows: dict[str, tuple[dict, SessionRow]] = {}  # session -> (its last answer, its row)
        self._history: dict[str, deque] = {}

    def _rate(self, name: str, now: float, value: float | None) -> float | None:
        if value is None:
            return None
        before = self._last.get(name)
        self._last[name] = (now, value)
        if before is None or now <= before[0] or value < before[1]:  # first sample, or a restart
            return None
        return (value - before[1]) / (now - before[0])

    def _link(self, name: str, source: str, rate: float | None) -> Link:
        history = self._history.setdefault(name, deque(maxlen=HISTORY))
        if rate is not None:
            history.append(rate)
        return Link(name, source, rate, tuple(history))

    def poll(self) -> Snapshot:
        now = self.clock()
        banners: list[str] = []
        status = sessions = jobs = None
        total = None
        try:
            status = self.client.get("/v1/status")
            page = self.client.get("/v1/sessions", limit=SESSION_ROWS)
            sessions, total = page["sessions"], page.get("total")
            jobs = self.client.get("/v1/jobs")["jobs"]
        except NoServerError as exc:
            banners.append(f"no kvtier server: {exc.message}; {exc.hint or ''} (retrying)")
        except KvtierError as exc:
            banners.append(f"admin API error: {exc.message} (retrying)")
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a broken answer must not stop the dashboard
            status = None
            banners.append(f"admin API error: {type(exc).__name__}: {exc} (retrying)")
        gpu = self.nvml.sample()
        if gpu is None and self.nvml.reason:
            banners.append(self.nvml.reason)
        links = self._links(now, status, gpu)
        if status is None:
            return Snapshot(taken=now, connected=False, banners=tuple(banners), links=links,
                            gpu=self.nvml.name)
        banners.extend(f"{tier}: {warning}" for tier, warning in status.get("warnings", {}).items())
        return Snapshot(
            taken=now, connected=True, banners=tuple(banners), model=status.get("model"),
            snapshot_dir=status.get("snapshot_dir"), tiers=_tiers(status["tiers"], status.get("shared")), links=links,
            hit_rates=_hit_rates(status.get("counters", {}), int(status.get("block_tokens") or 0),
                                 shared=status.get("shared") is not None),
            sessions=self._sessions(sessions), jobs=tuple(_job(j) for j in jobs[:50]),
            gpu=self.nvml.name, dirty_bytes=(status.get("dirty") or {}).get("dirty_bytes"),
            dirty_age_s=(status.get("dirty") or {}).get("dirty_age_s"),
            sessions_total=total, session_states=tuple((status.get("sessions") or {}).items()),
        )

    def _sessions(self, answer: list[dict]) -> tuple[SessionRow, ...]:
        """Rows for the session list; a session whose answer did not change keeps its row object
        (1,000 sessions a second: building them all again was a quarter of top's CPU)."""
        previous, rows, out = self._rows, {}, []
        for doc in answer:
            doc.pop("idle_seconds", None)  # derived from last_use; it changes every poll
            session_id = doc["session_id"]
            cached = previous.get(session_id)
            row = cached[1] if cached is not None and cached[0] == doc else _session(doc)
            rows[session_id] = (doc, row)
            out.append(row)
        self._rows = rows
        return tuple(out)

    def _links(self, now: float, status: dict | None, gpu: dict | None) -> tuple[Link, ...]:
        links = []
        counters = (status or {}).get("links", {})
        for key, label in KVTIER_LINKS:
            links.append(self._link(label, "kvtier", self._rate(key, now, counters.get(key)) if status else None))
        shared = (status or {}).get("shared")
        if shared:  # the shared tier's two directions, when the server has one
            links.append(self._link("shared→DRAM", "kvtier", self._rate("fetch", now, counters.get("fetch"))))
            links.append(self._link("DRAM→shared", "kvtier",
                                    self._rate("published", now, shared.get("published_bytes"))))
        links.append(self._link("PCIe →GPU", "nvml", gpu["pcie_to_gpu"] if gpu else None))
        links.append(self._link("PCIe GPU→", "nvml", gpu["pcie_from_gpu"] if gpu else None))
        try:
            disk = self.disk()
        except Exception:  # noqa: BLE001 - containers without /proc/diskstats
            disk = None
        links.append(self._link("disk read", "psutil", self._rate("disk_read", now, disk.read_bytes if disk else None)))
        links.append(self._link("disk write", "psutil",
                                self._rate("disk_write", now, disk.write_bytes if disk else None)))
        return tuple(links)


def _tiers(tiers: dict, shared: dict | None = None) -> tuple[Tier, ...]:
    hbm = tiers.get("hbm", {})
    out = [Tier("hbm", hbm.get("used_bytes"), hbm.get("capacity_bytes"), hbm.get("blocks"),
                hbm.get("kv_dtype", "?"), hbm.get("tokens_per_gib"))]
    for name in ("dram", "nvme"):
        t = tiers.get(name, {})
        out.append(Tier(name, t.get("used_bytes"), t.get("capacity_bytes"), t.get("blocks"), t.get("codec", "none"),
                        t.get("tokens_per_gib")))
    if shared:  # the store's own memory figures (every box's blocks); no cap: maxmemory 0
        server = shared.get("server") or {}
        out.append(Tier("shared", server.get("used_memory"), server.get("maxmemory") or None,
                        shared.get("published_blocks"), shared.get("codec", "none")))
    return tuple(out)


def _hit_rates(counters: dict, block_tokens: int, shared: bool = False) -> tuple[tuple[str, float | None], ...]:
    """Share of admitted prompt tokens served by each tier, since the server started (the shared
    tier's: the blocks fetched from it, which then load from DRAM)."""
    prompt = counters.get("prompt_tokens", 0)
    names = ("hbm", "dram", "nvme") + (("shared",) if shared else ())
    if not prompt:
        return tuple((name, None) for name in names)
    rates = (("hbm", counters.get("hbm_hit_tokens", 0) / prompt),
             ("dram", counters.get("hit_dram_blocks", 0) * block_tokens / prompt),
             ("nvme", counters.get("hit_nvme_blocks", 0) * block_tokens / prompt))
    if shared:
        rates += (("shared", counters.get("fetched_blocks", 0) * block_tokens / prompt),)
    return rates


def _session(row: dict) -> SessionRow:
    return SessionRow(row["session_id"], row["state"], row["tokens"], row["blocks"], row["blocks_dram"],
                      row["blocks_nvme"], row["bytes_dram"], row["bytes_nvme"], row.get("pinned"),
                      float(row.get("last_use", 0.0)), row.get("job"),
                      row.get("codec_dram", "none"), row.get("codec_nvme", "none"), row.get("decision"),
                      row.get("restore_s"), row.get("recompute_s"), pin_expires_at=row.get("pin_expires_at"),
                      retain_expires_at=row.get("retain_expires_at"), retain_priority=row.get("retain_priority"),
                      bytes_hbm=row.get("bytes_hbm"), stored_note=row.get("stored_note"))


def _job(doc: dict) -> JobRow:
    return JobRow(doc["id"], doc["kind"], doc.get("session_id"), doc["state"], float(doc.get("progress", 0.0)),
                  int(doc.get("bytes") or 0), doc.get("seconds"), doc.get("error"), doc.get("path"))


def replay(path: str) -> Iterator[Snapshot]:
    """The snapshots of a recording, in order."""
    from kvtier.errors import UsageError

    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read recording {path}: {exc.strerror}", hint="record one with --record FILE") \
            from None
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield Snapshot.from_json(line)
            except (ValueError, TypeError, KeyError) as exc:
                raise UsageError(f"{path}:{number}: not a kvtier top recording ({exc})",
                                 hint="record one with `kvtier top --record FILE`") from None


class BoxCollector:
    """Every ``kvtier serve`` instance of the box (the registry), one :class:`Collector` each.

    ``poll()`` returns the selected instance's snapshot with the box around it: every instance's
    tiers and sessions count, every GPU's HBM and PCIe (with the instances that use it), and -- in
    the all-sessions view -- every instance's sessions, each row naming its instance."""

    def __init__(self, selected: str | None = None, nvml_opened: tuple | None = None,
                 list_instances: Callable[[], list] | None = None, disk: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.time):
        from kvtier.control.instances import list_instances as registered

        self._list = list_instances or registered
        self._opened = nvml_opened if nvml_opened is not None else open_gpus()
        self._box = Nvml(None, self._opened)
        self._disk, self._clock = disk, clock
        self.selected = selected
        self.all_sessions = False
        self._collectors: dict[str, tuple[Any, Collector]] = {}  # name -> (its record, its collector)

    def names(self) -> list[str]:
        return sorted(self._collectors)

    def client(self, name: str | None) -> AdminClient | None:
        entry = self._collectors.get(name or self.selected or "")
        return entry[1].client if entry else None

    def select(self, selector: str | None) -> str | None:
        """Show the instance named ``selector`` (or listening on that port); None: the first."""
        self._refresh()
        for name, (inst, _collector) in self._collectors.items():
            if selector in (name, str(inst.port)):
                self.selected = name
        return self.selected

    def cycle(self, step: int = 1) -> str | None:
        """Select the next instance (by name)."""
        names = self.names()
        if names:
            at = names.index(self.selected) if self.selected in names else -1
            self.selected = names[(at + step) % len(names)]
        return self.selected

    def _refresh(self) -> None:
        live = {inst.name: inst for inst in self._list()}
        for name in list(self._collectors):
            record, collector = self._collectors[name]
            if name not in live or live[name].pid != record.pid:
                collector.client.close()
                del self._collectors[name]
        for name, inst in live.items():
            if name not in self._collectors:
                client = AdminClient(inst.admin_socket, timeout=2.0)
                nvml = Nvml(inst.gpus, self._opened)
                self._collectors[name] = (inst, Collector(client, nvml=nvml, disk=self._disk, clock=self._clock))
        if self.selected not in self._collectors:
            names = self.names()
            self.selected = names[0] if names else self.selected

    def poll(self) -> Snapshot:
        from dataclasses import replace

        self._refresh()
        if not self._collectors:
            now = self._clock()
            return Snapshot(taken=now, connected=False, banners=("no kvtier instance is running on this box "
                                                                 "(start one with `kvtier serve`; retrying)",))
        snapshots = {name: collector.poll() for name, (_inst, collector) in sorted(self._collectors.items())}
        rows = []
        for name, snap in snapshots.items():
            inst = self._collectors[name][0]
            tiers = {t.name: t for t in snap.tiers}
            dram, nvme = tiers.get("dram"), tiers.get("nvme")
            rows.append(InstanceRow(name, inst.port, snap.model or inst.model,
                                    None if inst.gpus is None else tuple(inst.gpus), snap.connected,
                                    snap.sessions_total if snap.sessions_total is not None else len(snap.sessions),
                                    dram.used_bytes if dram else None,
                                    dram.capacity_bytes if dram else None, nvme.used_bytes if nvme else None,
                                    nvme.capacity_bytes if nvme else None))
        users: dict[int, list[str]] = {}
        for name, (_inst, collector) in self._collectors.items():
            for index in collector.nvml.indexes:
                users.setdefault(index, []).append(name)
        gpus = tuple(GpuRow(g["index"], g["name"], g["hbm_used"], g["hbm_total"], g["pcie_to_gpu"],
                            g["pcie_from_gpu"], tuple(sorted(users.get(g["index"], ()))))
                     for g in self._box.per_gpu())
        shown = snapshots[self.selected]
        sessions = shown.sessions
        if self.all_sessions:
            sessions = tuple(replace(row, instance=name) for name, snap in snapshots.items() for row in snap.sessions)
        return replace(shown, instance=self.selected, instances=tuple(rows), gpus=gpus, sessions=sessions,
                       all_sessions=self.all_sessions)
