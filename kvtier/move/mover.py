"""The worker half: runs the manager's jobs and moves bytes. It decides nothing.

Links: HBM (vLLM's per-layer KV tensors, through a layout adapter) <-> the DRAM arena <-> the NVMe
store, plus snapshot files. Stores run in order on one copy thread (the host side of a copy
stream), everything else on a small thread pool (CPU copies, NVMe syscalls and checksums release
the GIL); NVMe reads and writes within a job fan out over the store's own IO threads. With CUDA,
device<->host copies go through pinned DRAM slots on a dedicated stream that first waits for an
event recorded on the compute stream when the job was submitted, so stores never read KV the
forward pass is still writing, and the step that submitted them never waits.

Nothing here blocks the thread that submits: a job that reads a DRAM slot a store is still
filling waits for that store's fence on a mover thread. Blocking waits made on vLLM's step path
(``step.active``) are counted in ``step_syncs``; serving should leave it at zero.

Every job ends in exactly one ``JobResult`` (``poll`` / ``wait``): a failure is reported with the
positions that failed, never swallowed. Bytes moved are counted per link for telemetry.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Sequence

from kvtier.codecs import get_codec, transcode
from kvtier.errors import KvtierError
from kvtier.jobs import BlockMove, Job, JobKind, JobResult
from kvtier.move.behind import WRITE_BEHIND_BYTES, WriteBehind
from kvtier.move.files import FileMoves

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.layout import LayoutAdapter, ModelFingerprint
    from kvtier.tiers.dram import DramArena
    from kvtier.tiers.nvme.store import NvmeStore
    from kvtier.tiers.shared.store import SharedStore

__all__ = ["Mover"]

log = logging.getLogger(__name__)



class Mover(WriteBehind, FileMoves):
    def __init__(
        self,
        fingerprint: "ModelFingerprint",
        arena: "DramArena",
        store: "NvmeStore | None" = None,
        adapter: "LayoutAdapter | None" = None,
        kv_layers: "Sequence[torch.Tensor] | None" = None,
        threads: int = 2,
        rank: int = 0,
        shards: int = 1,
        shared: "SharedStore | None" = None,
        shared_policy: str = "write-through",
        shared_codec: str = "none",
    ):
        import torch

        self.fingerprint = fingerprint
        self.rank, self.shards = rank, shards  # tensor parallelism: this rank's shard of every block
        self.arena = arena
        self._recreated_seen = 0  # NVMe directory re-creations already reported
        self.store = store
        self.adapter = adapter
        self.kv_layers = list(kv_layers) if kv_layers is not None else None
        self.link_bytes: Counter[str] = Counter()
        # what each DRAM slot holds, as far as this worker wrote it: (namespace, key, nbytes, codec,
        # first); the manager's freed slots are forgotten (forget_slots) so a dropped block stays dropped
        self.slot_owner: dict[int, tuple[bytes, bytes, int, str, bool]] = {}
        # write-behind: slots whose block has no NVMe copy yet -> when it became so (monotonic; 0.0:
        # due at once, a pinned session's block). Guarded by _slots_lock with slot_owner.
        self.dirty: dict[int, float] = {}
        # the last NVMe write failed, and when one last did: write-behind probes the disk until it is back
        self.disk_failing, self.disk_failed_at = False, -1e9
        self._slots_lock = threading.Lock()
        self._lock = threading.Lock()
        self._results: queue.Queue[JobResult] = queue.Queue()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-mover")
        self._copy = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-copy")  # stores, in order
        self._fences: dict[int, threading.Event] = {}  # DRAM slot -> set once the store filling it is done
        self._inflight: dict[int, Future] = {}  # job id -> its future, until it is done
        self.step = threading.local()  # ``step.active``: this thread is in one of vLLM's step calls
        self.step_syncs = 0  # blocking waits for transfers on the step path (fences on preemption only)
        self.write_back_bytes = WRITE_BEHIND_BYTES  # per group commit of the shutdown write-back
        self._staging_free: list["torch.Tensor"] = []  # page-aligned (pinned with CUDA) NVMe read buffers
        device = self.kv_layers[0].device if self.kv_layers else torch.device("cpu")
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._handlers: dict[JobKind, Callable[[Job, JobResult], None]] = {
            JobKind.STORE: self._store,
            JobKind.LOAD: self._load,
            JobKind.PROMOTE: self._promote,
            JobKind.DEMOTE: self._demote,
            JobKind.FLUSH: self._demote,
            JobKind.DROP: self._drop,
            JobKind.SNAPSHOT: self._snapshot,
            JobKind.RESTORE: self._restore,
            JobKind.FETCH: self._fetch,
        }
        self.shared = shared  # the shared store (kvtier.tiers.shared.store), or None
        self.publisher = None
        if shared is not None:
            from kvtier.move.publish import Publisher

            self.publisher = Publisher(self, shared, shared_policy, shared_codec)

    # ---- running jobs -------------------------------------------------------------------------
    def submit(self, job: Job, on_done: Callable[[Job, JobResult], None] | None = None) -> Future:
        """Run ``job`` in the background; its result arrives through ``poll`` (after ``on_done``,
        called on the mover thread). Never blocks: a STORE is queued on the copy thread."""
        if job.kind == JobKind.STORE:
            return self.submit_stores([job], on_done)
        ready = self._record_compute_event()
        return self._track([job], self._pool.submit(self._run_and_queue, job, ready, on_done))

    def submit_stores(self, jobs: Sequence[Job], on_done: Callable[[Job, JobResult], None] | None = None,
                      post: bool = True) -> Future:
        """Queue one step's STORE jobs as one batch on the copy thread: one gather for all their
        blocks (one batched copy per layer on CUDA), then a result per job. Their DRAM slots are
        fenced until it is done."""
        ready = self._record_compute_event()
        fence = threading.Event()
        with self._lock:
            for job in jobs:
                for move in job.moves:
                    self._fences[move.dram_slot] = fence
        return self._track(jobs, self._copy.submit(self._store_batch, list(jobs), ready, fence, on_done, post))

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
                self._note_sync()
            future.exception()  # waits; a failed job is reported through its result
        return waited

    def _note_sync(self) -> None:
        if getattr(self.step, "active", False):
            self.step_syncs += 1

    def run(self, job: Job) -> JobResult:
        """Run ``job`` now, in this thread; never raises for a failed job."""
        self._note_sync()
        if job.kind == JobKind.STORE:
            result: list[JobResult] = []
            self.submit_stores([job], lambda _j, r: result.append(r), post=False).result()
            return result[0]
        return self._run(job, self._record_compute_event())

    def _store_batch(self, jobs: list[Job], ready, fence: threading.Event, on_done, post: bool = True) -> None:
        """One step's stores as one job (one gather), split back into a result per job."""
        try:
            whole = Job(job_id=-1, kind=JobKind.STORE, moves=[m for job in jobs for m in job.moves])
            merged = self._run(whole, ready)
        finally:
            with self._lock:
                for job in jobs:
                    for move in job.moves:
                        if self._fences.get(move.dram_slot) is fence:
                            del self._fences[move.dram_slot]
            fence.set()
        start = 0
        for job in jobs:
            end = start + len(job.moves)
            result = JobResult(job_id=job.job_id, kind=job.kind, ok=merged.ok, error=merged.error,
                               seconds=merged.seconds, rank=self.rank)
            result.failed = [i - start for i in merged.failed if start <= i < end]
            if not merged.ok and not merged.failed:
                result.failed = list(range(len(job.moves)))
            result.ok = not result.failed and merged.ok
            result.encoded = {i - start: v for i, v in merged.encoded.items() if start <= i < end}
            result.bytes_moved = sum(m.nbytes for i, m in enumerate(job.moves) if i not in result.failed)
            if on_done is not None:
                on_done(job, result)
            if post:
                self._results.put(result)
            if self.publisher is not None:
                self.publisher.stored(job.moves, result.failed)
            start = end

    def _await_slots(self, slots: Sequence[int]) -> None:
        """Wait (on a mover thread) for stores still filling any of these DRAM slots."""
        with self._lock:
            fences = {id(f): f for s in slots if (f := self._fences.get(s)) is not None}
        for fence in fences.values():
            if not fence.is_set():
                self._note_sync()
                fence.wait()

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

    def _run_and_queue(self, job: Job, ready, on_done=None) -> JobResult:
        result = self._run(job, ready)
        if on_done is not None:
            on_done(job, result)
        self._results.put(result)
        return result

    def _run(self, job: Job, ready) -> JobResult:
        result = JobResult(job_id=job.job_id, kind=job.kind, ok=True, rank=self.rank)
        start = time.perf_counter()
        try:
            if self._stream is not None:
                self._stream.wait_event(ready)
            self._handlers[job.kind](job, result)
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

    def _record_compute_event(self):
        if self._stream is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _count(self, link: str, nbytes: int, result: JobResult) -> None:
        with self._lock:
            self.link_bytes[link] += nbytes
        result.bytes_moved += nbytes

    def close(self) -> None:
        self._copy.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        if self.publisher is not None:
            self.publisher.close()

    # ---- HBM <-> DRAM -------------------------------------------------------------------------
    def _staging(self, n: int) -> "torch.Tensor":
        import torch

        dtype = getattr(torch, self.fingerprint.geometry.dtype)
        return torch.empty((n, *self.fingerprint.geometry.block_shape), dtype=dtype, device=self.device)

    def _as_block(self, raw: "torch.Tensor") -> "torch.Tensor":
        """A uint8 buffer holding one block, viewed as ``[1, *block_shape]`` in the KV dtype."""
        import torch

        geometry = self.fingerprint.geometry
        return raw[: geometry.block_bytes].view(getattr(torch, geometry.dtype)).view(1, *geometry.block_shape)

    def _own_nbytes(self, move: BlockMove) -> int:
        """The payload size of ``move``'s DRAM slot on this rank (with a data-dependent codec each
        rank's shard compresses differently; the manager knows the largest)."""
        owner = self.slot_owner.get(move.dram_slot)
        return owner[2] if owner is not None and owner[1] == move.key else move.nbytes

    def _own(self, move: BlockMove) -> None:
        with self._slots_lock:
            self.slot_owner[move.dram_slot] = (move.namespace, move.key, move.nbytes, move.codec, move.first)
            if self.store is not None and not self.store.has(move.namespace, move.key):
                self.dirty[move.dram_slot] = 0.0 if move.durable else time.monotonic()
            else:
                self.dirty.pop(move.dram_slot, None)

    def forget_slots(self, slots: Sequence[int]) -> None:
        if not slots:
            return
        with self._slots_lock:  # waits for a write-behind copy of one of these slots to finish
            for slot in slots:
                self.slot_owner.pop(slot, None)
                self.dirty.pop(slot, None)

    @staticmethod
    def _note(result: JobResult, index: int, move: BlockMove) -> None:
        """Report what was written for one move (the manager may run in another process)."""
        result.encoded[index] = (move.nbytes, move.codec)

    def _store(self, job: Job, result: JobResult) -> None:
        assert self.adapter is not None and self.kv_layers is not None, "mover has no KV tensors"
        plain = all(get_codec(m.codec).raw for m in job.moves)
        if self._stream is None and plain:  # CPU: gather each block straight into its DRAM slot
            for move in job.moves:
                self.adapter.gather(self.kv_layers, [move.device_block],
                                    self._as_block(self.arena.slot(move.dram_slot)))
                self._own(move)
                self._count("hbm->dram", move.nbytes, result)
            return
        staging = self._staging(len(job.moves))  # one gather, then per block: encode (and D2H)
        with self._on_stream():
            self.adapter.gather(self.kv_layers, [m.device_block for m in job.moves], staging)
            for i, move in enumerate(job.moves):
                codec = get_codec(move.codec)
                if self._stream is not None and plain:
                    move.nbytes = self.arena.put(move.dram_slot, staging[i])
                elif self._stream is None or codec.host_unpack:
                    move.nbytes = codec.encode(staging[i], self.arena.slot(move.dram_slot), first=move.first)
                else:  # CUDA: encode on the device, then copy the smaller payload to the pinned slot
                    import torch

                    scratch = torch.empty(codec.max_bytes(self.fingerprint.geometry), dtype=torch.uint8,
                                          device=self.device)
                    move.nbytes = codec.encode(staging[i], scratch, first=move.first)
                    self.arena.slot(move.dram_slot, move.nbytes).copy_(scratch[: move.nbytes], non_blocking=True)
                self._note(result, i, move)
                self._own(move)
                self._count("hbm->dram", move.nbytes, result)
            self._sync()

    def _load(self, job: Job, result: JobResult) -> None:
        assert self.adapter is not None and self.kv_layers is not None, "mover has no KV tensors"
        self._await_slots([m.dram_slot for m in job.moves if m.dram_slot >= 0 and not m.from_nvme])
        sources = self._read_from_nvme(job, result)
        try:
            self._load_sources(job, result, sources)
        finally:
            self._give_staging(sources, job)

    def _load_sources(self, job: Job, result: JobResult, sources: dict) -> None:
        count = len(job.moves)
        if result.failed:  # load only the prefix before the first bad block; vLLM recomputes the rest
            count = min(result.failed)
            result.failed = list(range(count, len(job.moves)))
        moves = job.moves[:count]
        for move in moves:
            if not move.from_nvme:
                move.nbytes = self._own_nbytes(move)
        raw = [sources.get(i, self.arena.slot(m.dram_slot) if m.dram_slot >= 0 else None) for i, m in enumerate(moves)]
        plain = all(get_codec(m.codec).raw for m in moves)
        if self._stream is None and plain:  # CPU: scatter each block straight from its slot or read buffer
            for move, source in zip(moves, raw):
                self.adapter.scatter(self._as_block(source), self.kv_layers, [move.device_block])
                self._count("dram->hbm", move.nbytes, result)
            return
        if not moves:
            return
        staging = self._staging(count)  # decode (on the device with CUDA) into staging, one scatter
        with self._on_stream():
            for i, (move, source) in enumerate(zip(moves, raw)):
                self._decode_into(move, source[: move.nbytes], staging[i])
                self._count("dram->hbm", move.nbytes, result)
            self.adapter.scatter(staging, self.kv_layers, [m.device_block for m in moves])
            self._sync()

    def _decode_into(self, move: BlockMove, payload: "torch.Tensor", block: "torch.Tensor") -> None:
        """Decode one stored payload into a staging block (CUDA: H2D the payload, decode on the GPU)."""
        codec = get_codec(move.codec)
        if self._stream is None:
            codec.decode(payload, block)
            return
        if codec.raw:
            block.view(-1).view(payload.dtype).copy_(payload, non_blocking=True)
            return
        if codec.host_unpack:  # the lossless layer unpacks on the CPU
            payload, codec = codec.unpack(payload, codec.inner.max_bytes(self.fingerprint.geometry)), codec.inner
        codec.decode(payload.to(self.device, non_blocking=True), block)

    # ---- DRAM <-> NVMe ------------------------------------------------------------------------
    def _need_store(self) -> "NvmeStore":
        if self.store is None:
            raise KvtierError("no NVMe tier is configured")
        return self.store

    def _read_from_nvme(self, job: Job, result: JobResult) -> dict[int, "torch.Tensor"]:
        """Read the job's NVMe blocks (into their DRAM slot, or a buffer of their own)."""
        reads = [(i, m) for i, m in enumerate(job.moves) if m.from_nvme]
        if not reads:
            return {}
        store = self._need_store()
        targets = {i: self._landing(m) for i, m in reads}
        # one batch: adjacent records (a session demoted together) come back in large reads
        outcomes = store.read_batch([(m.namespace, m.key, targets[i]) for i, m in reads], self.fingerprint.digest)
        for (i, _m), outcome in zip(reads, outcomes):
            if isinstance(outcome, BaseException):
                result.failed.append(i)
                result.bad_reads.append(i)
                result.error = str(outcome)
                continue
            nbytes, codec = outcome
            move = job.moves[i]
            move.nbytes, move.codec = nbytes, codec
            self._count("nvme->dram", nbytes, result)
            if move.to_codec and move.dram_slot >= 0:  # re-encode to the warm codec to fit its slot
                move.nbytes = transcode(targets[i][:nbytes], codec, move.to_codec, self.fingerprint.geometry,
                                        self.arena.slot(move.dram_slot), first=move.first or None)
                move.codec = move.to_codec
                targets[i] = self.arena.slot(move.dram_slot)
            self._note(result, i, move)
            if move.dram_slot >= 0:
                self._own(move)
        result.failed.sort()
        return targets

    def _landing(self, move: BlockMove) -> "torch.Tensor":
        """Where a block read from NVMe or the shared store lands: its DRAM slot when it keeps its
        codec there, else a staging buffer (streamed to HBM, or re-encoded into the slot after)."""
        if move.dram_slot >= 0 and not move.to_codec:
            return self.arena.slot(move.dram_slot)
        return self._take_staging(max(self.arena.slot_bytes, move.nbytes))

    def _take_staging(self, nbytes: int) -> "torch.Tensor":
        """A page-aligned buffer for one NVMe read that has no DRAM slot to land in (pinned with
        CUDA, so its host-to-device copy is asynchronous); reused across jobs."""
        with self._lock:
            for i, buf in enumerate(self._staging_free):
                if buf.numel() >= nbytes:
                    return self._staging_free.pop(i)
        from kvtier.tiers.dram import aligned_empty

        return aligned_empty(nbytes, pin=self.arena.pinned)

    def _give_staging(self, sources: dict, job: Job) -> None:
        base = self.arena.buffer.data_ptr()
        end = base + self.arena.buffer.numel()
        with self._lock:
            for buf in sources.values():  # arena slots are not staging buffers
                if not base <= buf.data_ptr() < end and len(self._staging_free) < 8:
                    self._staging_free.append(buf)

    def _promote(self, job: Job, result: JobResult) -> None:
        self._give_staging(self._read_from_nvme(job, result), job)

    def _transcoded(self, move: BlockMove, payload: "torch.Tensor") -> "torch.Tensor":
        """``payload`` re-encoded from ``move.codec`` to ``move.to_codec`` (updates the move)."""
        import torch

        out = torch.empty(get_codec(move.to_codec).max_bytes(self.fingerprint.geometry), dtype=torch.uint8)
        n = transcode(payload, move.codec, move.to_codec, self.fingerprint.geometry, out, first=move.first or None)
        move.codec, move.nbytes = move.to_codec, n
        return out[:n]

    # ---- CUDA plumbing ------------------------------------------------------------------------
    def _on_stream(self):
        import contextlib

        import torch

        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _sync(self) -> None:
        """Wait for this job's copies on the mover's stream (a mover thread's wait, never the step's)."""
        if self._stream is not None:
            self._note_sync()
            self._stream.synchronize()
