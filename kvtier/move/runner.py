"""Running jobs: the pools, the store fences, the jobs in flight and the results.

Stores run in order on one copy thread (the host side of the copy stream), NVMe writes (demotions,
flushes, drops) in order on a thread of their own, everything else on a small thread pool. Nothing
here blocks the thread that submits: a job that reads a DRAM slot a store is still filling waits
for that store's fence (``SlotFences``) on a mover thread. Every job ends in exactly one
``JobResult`` (``poll``): a failure is reported with the positions that failed, never swallowed.
What a job does is its handler's business (``handlers``, by kind).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

from kvtier.errors import KvtierError
from kvtier.jobs import BlockMove, Job, JobKind, JobResult
from kvtier.move.fences import SlotFences
from kvtier.move.stream import CopyStream
from kvtier.tiers.threads import off_forward_cores

__all__ = ["JobRunner", "Handler", "OnDone", "DISK_WRITES", "writes_disk"]

log = logging.getLogger("kvtier.move.mover")

Handler = Callable[[Job, JobResult], None]
DISK_WRITES = frozenset({JobKind.DEMOTE, JobKind.FLUSH, JobKind.DROP})  # jobs that only write the NVMe tier


def writes_disk(job: Job) -> bool:
    """Whether ``job`` writes or deletes NVMe records by name: those run in order on one thread, so a
    drop planned before a restore (or fetch) of the same key never deletes the copy it writes."""
    return job.kind in DISK_WRITES or bool(job.drops) or any(move.to_nvme for move in job.moves)
OnDone = Callable[[Job, JobResult], None]


class JobRunner:
    def __init__(self, handlers: Mapping[JobKind, Handler], stream: CopyStream, fences: SlotFences,
                 rank: int = 0, threads: int = 2,
                 on_stored: Callable[[Sequence[BlockMove], Sequence[int]], None] | None = None):
        """``on_stored(moves, failed)``: called after each store job (the publisher's write-through)."""
        self.handlers, self.stream, self.fences, self.rank = dict(handlers), stream, fences, rank
        self.on_stored = on_stored
        self._results: queue.Queue[JobResult] = queue.Queue()
        # off the forward pass's cores where vLLM's CPU backend binds it (kvtier.tiers.threads)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-mover",
                                       initializer=off_forward_cores)
        self.copy_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-copy",  # stores, in order
                                            initializer=off_forward_cores)
        # demotions, flushes and drops wait on the disk: their own thread, so a slow or failing disk
        # never queues a load (or anything else the next turn waits for) behind a write
        self.disk_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-disk-writes",
                                            initializer=off_forward_cores)
        self._inflight: dict[int, Future] = {}  # job id -> its future, until it is done
        self._lock = threading.Lock()

    # ---- submitting ---------------------------------------------------------------------------
    def submit(self, job: Job, on_done: OnDone | None = None) -> Future:
        """Run ``job`` in the background; its result arrives through ``poll`` (after ``on_done``,
        called on the mover thread). Never blocks: a STORE is queued on the copy thread."""
        if job.kind == JobKind.STORE:
            return self.submit_stores([job], on_done)
        ready = self.stream.record()
        pool = self.disk_pool if writes_disk(job) else self.pool
        return self._track([job], pool.submit(self._run_and_queue, job, ready, on_done))

    def submit_stores(self, jobs: Sequence[Job], on_done: OnDone | None = None, post: bool = True) -> Future:
        """Queue one step's STORE jobs as one batch on the copy thread: one gather for all their
        blocks (one batched copy per layer on CUDA), then a result per job. Their DRAM slots are
        fenced until it is done."""
        ready = self.stream.record()
        fence = self.fences.fence([move.dram_slot for job in jobs for move in job.moves])
        return self._track(jobs, self.copy_pool.submit(self._store_batch, list(jobs), ready, fence, on_done, post))

    def _track(self, jobs: Sequence[Job], future: Future) -> Future:
        with self._lock:
            for job in jobs:
                self._inflight[job.job_id] = future
        for job in jobs:
            future.add_done_callback(lambda _f, job_id=job.job_id: self._untrack(job_id))
        return future

    def _untrack(self, job_id: int) -> None:
        with self._lock:
            self._inflight.pop(job_id, None)

    def in_flight(self, job_ids: Sequence[int]) -> list[int]:
        """Those of ``job_ids`` still running or queued."""
        with self._lock:
            return [job_id for job_id in job_ids if job_id in self._inflight]

    def wait_jobs(self, job_ids: Sequence[int]) -> int:
        """Block until the given jobs are done (a fence: vLLM is about to reuse blocks they read).
        Returns how many had to be waited for."""
        with self._lock:
            futures = [self._inflight[j] for j in job_ids if j in self._inflight]
        waited = 0
        for future in futures:
            if not future.done():
                waited += 1
                self.stream.note_sync()
            future.exception()  # waits; a failed job is reported through its result
        return waited

    def run(self, job: Job) -> JobResult:
        """Run ``job`` now, in this thread; never raises for a failed job."""
        self.stream.note_sync()
        if job.kind == JobKind.STORE:
            result: list[JobResult] = []
            self.submit_stores([job], lambda _j, r: result.append(r), post=False).result()
            return result[0]
        return self._run(job, self.stream.record())

    # ---- results ------------------------------------------------------------------------------
    def poll(self) -> list[JobResult]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def post(self, result: JobResult) -> None:
        """Queue a result made outside a job (write-behind) for ``poll``."""
        self._results.put(result)

    def close(self) -> None:
        self.copy_pool.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        self.disk_pool.shutdown(wait=True)

    # ---- on the mover threads -----------------------------------------------------------------
    def _store_batch(self, jobs: list[Job], ready: Any, fence: threading.Event, on_done: OnDone | None,
                     post: bool = True) -> None:
        """One step's stores as one job (one gather), split back into a result per job."""
        try:
            whole = Job(job_id=-1, kind=JobKind.STORE, moves=[m for job in jobs for m in job.moves])
            merged = self._run(whole, ready)
        finally:
            self.fences.release([move.dram_slot for job in jobs for move in job.moves], fence)
        start = 0
        for job in jobs:
            end = start + len(job.moves)
            result = self._split(merged, job, start, end)
            if on_done is not None:
                on_done(job, result)
            if post:
                self._results.put(result)
            if self.on_stored is not None:
                self.on_stored(job.moves, result.failed)
            start = end

    def _split(self, merged: JobResult, job: Job, start: int, end: int) -> JobResult:
        """The part of a merged store result that is ``job``'s (its moves at ``start:end``)."""
        result = JobResult(job_id=job.job_id, kind=job.kind, ok=merged.ok, error=merged.error,
                           seconds=merged.seconds, rank=self.rank)
        result.failed = [i - start for i in merged.failed if start <= i < end]
        if not merged.ok and not merged.failed:
            result.failed = list(range(len(job.moves)))
        result.ok = not result.failed and merged.ok
        result.encoded = {i - start: v for i, v in merged.encoded.items() if start <= i < end}
        result.bytes_moved = sum(m.nbytes for i, m in enumerate(job.moves) if i not in result.failed)
        return result

    def _run_and_queue(self, job: Job, ready: Any, on_done: OnDone | None = None) -> JobResult:
        result = self._run(job, ready)
        if on_done is not None:
            on_done(job, result)
        self._results.put(result)
        return result

    def _run(self, job: Job, ready: Any) -> JobResult:
        result = JobResult(job_id=job.job_id, kind=job.kind, ok=True, rank=self.rank)
        start = time.perf_counter()
        try:
            self.stream.wait_for(ready)
            self.handlers[job.kind](job, result)
        except Exception as exc:  # reported, never swallowed: the manager rolls the job back
            log.warning("kvtier mover: %s job %d failed: %s", job.kind.value, job.job_id, exc)
            result.ok = False
            result.error = str(exc)
            if not isinstance(exc, KvtierError):
                log.debug("traceback", exc_info=True)
        if result.failed:
            result.ok = False
        result.seconds = time.perf_counter() - start
        return result
