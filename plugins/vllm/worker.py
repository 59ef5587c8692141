"""The connector's worker half: vLLM's KV tensors, the DRAM arena, the NVMe store and the mover.

Runs in the worker process (the same process when vLLM runs in-process). It executes the jobs in
each step's metadata and decides nothing:
* loads run in ``start_load_kv``, before the forward pass that needs them;
* stores run in ``wait_for_save``, after the forward pass that computed the blocks: on the CPU a
  memcpy-speed copy into DRAM slots, so no later step can overwrite a block before it is saved;
* everything else (demotions to NVMe, promotions, drops) runs on the mover's threads, off the
  forward path;
* write-behind: a thread of its own gives every DRAM block that has had no NVMe copy for
  ``write_behind`` seconds one (a pinned session's at once), whether or not the engine steps, so
  a crash -- or a vLLM shutdown that kills this process before ``shutdown`` runs -- loses at most
  that window of new KV (twice it while forward passes run back to back: the disk and the cores are
  theirs first). It decides nothing either: it copies what the mover knows it holds.
Results go back to the scheduler half in the worker metadata of the step that finishes them.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any

from kvtier.config import write_behind_seconds
from kvtier.jobs import Job, JobKind, JobResult
from kvtier.layout import ModelFingerprint, adapter_for
from kvtier.mover import Mover
from kvtier.codecs import get_codec, resolve_codec
from kvtier.tiers.dram import DramArena, SlotAllocator
from kvtier.tiers.nvme import NvmeStore, file_bytes_for
from kvtier.plugins.vllm.geometry import layout_name

__all__ = ["KVTierWorker"]

QUIET_S = 0.2  # no forward pass for this long: the engine is idle, write-behind may use the disk

log = logging.getLogger("kvtier.connector")


def _layer_index(name: str) -> int:
    numbers = re.findall(r"\d+", name)
    return int(numbers[0]) if numbers else 0


class KVTierWorker:
    def __init__(self, fingerprint: ModelFingerprint, extra: dict):
        self.fingerprint = fingerprint
        self.extra = extra
        self.mover: Mover | None = None
        self.nvme: NvmeStore | None = None
        self._results: list[JobResult] = []
        self._load_errors: set[int] = set()
        self._applied = None
        from kvtier.costmodel import parse_link_caps

        self._caps = parse_link_caps(extra.get("link_gbps"))  # an emulated slow link (demos, benchmarks)
        self._stopping = threading.Event()
        self._writer: threading.Thread | None = None
        self.write_behind_paused = threading.Event()  # `kvtier bench restart`: the same engine with it off
        self._in_step, self._step_ended = False, 0.0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        layers = [kv_caches[name] for name in names]
        geometry = self.fingerprint.geometry
        warm = get_codec(resolve_codec(str(self.extra.get("warm_codec", "none")), geometry))
        slots = SlotAllocator(int(self.extra.get("dram_bytes", 4 << 30)), warm.max_bytes(geometry))  # as the scheduler
        arena = DramArena.for_allocator(slots)
        nvme_dir, nvme_bytes = self.extra.get("nvme_dir"), int(self.extra.get("nvme_bytes", 0))
        if nvme_dir and nvme_bytes:
            self.nvme = NvmeStore(nvme_dir, nvme_bytes, int(self.extra.get("io_threads", 8)),
                                  str(self.extra.get("direct_io", "auto")))
            self.nvme.scan()
        adapter = adapter_for(layout_name(layers[0]), geometry)
        self.mover = Mover(self.fingerprint, arena, self.nvme, adapter, layers)
        log.info("kvtier worker: %d KV layers (%s layout), DRAM arena %d MiB%s", len(layers), adapter.name,
                 arena.buffer.numel() >> 20, " (pinned)" if arena.pinned else "")
        window = write_behind_seconds(self.extra.get("write_behind", "10")) if self.nvme is not None else None
        if window is not None:
            self._writer = threading.Thread(target=self._write_behind, args=(window,), name="kvtier-write-behind",
                                            daemon=True)
            self._writer.start()

    def _write_behind(self, window: float) -> None:
        """Every tick, write the blocks that are due (in batches, oldest first); tell the scheduler
        half what was written with the next step's results."""
        cold = resolve_codec(str(self.extra.get("cold_codec", "none")), self.fingerprint.geometry, "cold")
        high = float(self.extra.get("high_watermark", 0.90))
        store = self.nvme
        assert store is not None and self.mover is not None

        def room(nbytes: int) -> bool:  # stay under the NVMe watermark: demotion owns the rest
            return store.used_bytes + file_bytes_for(nbytes) <= high * store.capacity_bytes

        try:  # the cores are the forward pass's: this thread runs in what it leaves (Linux: per-thread nice)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        tick = min(1.0, max(0.05, window / 4))
        backoff = 0.0  # after a failed write (the disk is full, read-only, gone): wait longer, up to 30 s
        while not self._stopping.wait(tick + backoff):
            try:
                if store.check_present() and self.mover.take_recreated():  # wiped: what it held is lost
                    self.mover.post(JobResult(job_id=-1, kind=JobKind.FLUSH, ok=True,
                                              extra={"written_behind": [], "nvme_recreated": True}))
                while not self._stopping.is_set() and not self.write_behind_paused.is_set():
                    # the disk and the cores are the forward pass's while it runs: a busy engine only
                    # gets the blocks past twice the window (and pinned sessions' at once), in small
                    # batches; an idle one everything due
                    idle = self.idle_for() >= QUIET_S
                    age = window if idle else 2 * window
                    due = self.mover.dirty_due(age)
                    # nothing to write, but a write failed lately: probe, so the warning can clear
                    # (the scheduler half ends it only past its own back-off, at most 30 s)
                    recovering = self.mover.disk_failing or time.monotonic() - self.mover.disk_failed_at < 35
                    if not due and not recovering:
                        break
                    if due:
                        written, error = self.mover.write_behind(age, 32 if idle else 4, cold, room)
                    else:
                        written, error = [], store.probe()
                        self.mover.disk_failing = error is not None
                        if error:
                            self.mover.disk_failed_at = time.monotonic()
                    if written or error or not due:
                        self.mover.post(JobResult(job_id=-1, kind=JobKind.FLUSH, ok=error is None, error=error,
                                                  extra={"written_behind": written, "disk_ok": error is None,
                                                         "nvme_recreated": self.mover.take_recreated(),
                                                         "disk_free": store.free_bytes()}))
                    backoff = min(30.0, max(1.0, 2 * backoff)) if error else 0.0
                    if error or not written:
                        break
            except Exception as exc:  # noqa: BLE001 - never let durability kill the worker
                log.warning("kvtier: write-behind failed: %s", exc)

    def apply(self, meta) -> None:
        """Once per step, before its jobs: forget the DRAM slots the manager released."""
        if meta is self._applied or self.mover is None:
            return
        self._applied = meta
        self.mover.forget_slots(meta.freed_slots)

    def idle_for(self) -> float:
        """Seconds since the last forward pass ended; 0 while one runs."""
        return 0.0 if self._in_step else time.monotonic() - self._step_ended

    def start_load_kv(self, jobs: list[Job], missing: list[int]) -> None:
        self._in_step = True
        self._load_errors.update(missing)
        for job in jobs:
            if job.kind == JobKind.LOAD:
                self._run_now(job)

    def wait_for_save(self, jobs: list[Job]) -> None:
        synchronous = bool(self.extra.get("synchronous", False))  # tests and debugging: no background IO
        for job in jobs:
            if job.kind == JobKind.STORE or (synchronous and job.kind != JobKind.LOAD):
                self._run_now(job)
            elif job.kind != JobKind.LOAD:
                self.mover.submit(job)
        self._in_step, self._step_ended = False, time.monotonic()

    def _run_now(self, job: Job) -> None:
        started = time.perf_counter()
        result = self.mover.run(job)
        if job.kind == JobKind.LOAD and self._caps:
            self._pace(job, result, time.perf_counter() - started)
            result.seconds = time.perf_counter() - started  # what the capped link cost, as the cost model sees it
        if job.kind == JobKind.LOAD and not result.ok:
            failed = result.failed or range(len(job.moves))
            self._load_errors.update(job.moves[i].device_block for i in failed)
            log.warning("kvtier: %d blocks failed to load (%s); vLLM recomputes them", len(failed), result.error)
        self._results.append(result)

    def _pace(self, job: Job, result: JobResult, took: float) -> None:
        """With ``link_gbps`` set, a load takes at least as long as it would on the capped link, so
        the slow-link case is real on a fast machine, not only in the cost model's numbers."""
        nvme = sum(1 for move in job.moves if move.from_nvme)
        share = nvme / len(job.moves) if job.moves else 0.0
        floor = 0.0
        if "pcie" in self._caps:
            floor += result.bytes_moved / (self._caps["pcie"] * 1e9)
        if "nvme" in self._caps:
            floor += result.bytes_moved * share / (self._caps["nvme"] * 1e9)
        if floor > took:
            time.sleep(floor - took)

    def take_results(self) -> list[JobResult]:
        results, self._results = self._results, []
        if self.mover is not None:
            results.extend(self.mover.poll())
        return results

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._stopping.set()
        if self._writer is not None:
            self._writer.join(timeout=10)
        if self.mover is not None:
            self.mover.close()
            if self.nvme is not None:  # keep DRAM-only blocks across the restart
                cold = resolve_codec(str(self.extra.get("cold_codec", "none")), self.fingerprint.geometry, "cold")
                self.mover.write_back(cold)
        if self.nvme is not None:
            self.nvme.close()
