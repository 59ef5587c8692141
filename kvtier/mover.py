"""The worker half: runs the manager's jobs and moves bytes. It decides nothing.

Links: HBM (vLLM's per-layer KV tensors, through a layout adapter) <-> the DRAM arena <-> the NVMe
store, plus snapshot files. Jobs run on a small thread pool (CPU copies, NVMe syscalls and
checksums release the GIL); NVMe reads and writes within a job fan out over the store's own IO
threads. With CUDA, device<->host copies go through pinned DRAM slots on a dedicated stream that
first waits for the compute stream, so stores never read KV the forward pass is still writing.

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
from kvtier.codecs.base import Identity, Zstd
from kvtier.errors import KvtierError
from kvtier.jobs import BlockMove, Job, JobKind, JobResult

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.layout import LayoutAdapter, ModelFingerprint
    from kvtier.tiers.dram import DramArena
    from kvtier.tiers.nvme import NvmeStore

__all__ = ["Mover"]

log = logging.getLogger(__name__)


class Mover:
    def __init__(
        self,
        fingerprint: "ModelFingerprint",
        arena: "DramArena",
        store: "NvmeStore | None" = None,
        adapter: "LayoutAdapter | None" = None,
        kv_layers: "Sequence[torch.Tensor] | None" = None,
        threads: int = 2,
    ):
        import torch

        self.fingerprint = fingerprint
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
        }

    # ---- running jobs -------------------------------------------------------------------------
    def submit(self, job: Job) -> Future:
        """Run ``job`` in the background; its result arrives through ``poll``."""
        ready = self._record_compute_event()
        return self._pool.submit(self._run_and_queue, job, ready)

    def run(self, job: Job) -> JobResult:
        """Run ``job`` now, in this thread; never raises for a failed job."""
        return self._run(job, self._record_compute_event())

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

    def _run_and_queue(self, job: Job, ready) -> JobResult:
        result = self._run(job, ready)
        self._results.put(result)
        return result

    def _run(self, job: Job, ready) -> JobResult:
        result = JobResult(job_id=job.job_id, kind=job.kind, ok=True)
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
        self._pool.shutdown(wait=True)

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

    def _write_behind_buffer(self) -> "torch.Tensor":
        buffer = getattr(self, "_wb_buffer", None)
        if buffer is None:
            from kvtier.tiers.dram import aligned_empty

            buffer = self._wb_buffer = aligned_empty(self.arena.slot_bytes)
        return buffer

    def dirty_due(self, max_age_s: float) -> int:
        """How many dirty slots are at least ``max_age_s`` old (pinned sessions' blocks: at once)."""
        cutoff = time.monotonic() - max_age_s
        with self._slots_lock:
            return sum(1 for since in self.dirty.values() if since <= cutoff)

    def write_behind(self, max_age_s: float, max_blocks: int = 64, cold_codec: str = "none",
                     room: Callable[[int], bool] | None = None) -> tuple[list[tuple[bytes, bytes, int, str]], str | None]:
        """Write up to ``max_blocks`` DRAM blocks that have had no NVMe copy for ``max_age_s`` seconds
        (oldest first) to the NVMe tier, keeping them in DRAM. Returns (namespace, key, nbytes, codec)
        of each block written, for the manager (``TierManager.note_written_behind``), and the error
        that stopped it (a full, read-only or missing disk), if any.

        Each slot is copied out under the slot lock, after checking it still holds the same block:
        a slot the manager freed and a new store reuses is never written under the old key.
        ``room(nbytes)`` says whether the tier may take another file (the caller's watermark).
        """
        if self.store is None:
            return [], None
        from kvtier.errors import CapacityError

        cutoff = time.monotonic() - max_age_s
        with self._slots_lock:
            due = sorted((since, slot) for slot, since in self.dirty.items() if since <= cutoff)[:max_blocks]
        written: list[tuple[bytes, bytes, int, str]] = []
        error = None
        bounce = self._write_behind_buffer()
        for _, slot in due:
            with self._slots_lock:
                owner = self.slot_owner.get(slot)
                if owner is None or slot not in self.dirty:
                    continue
                namespace, key, nbytes, codec, first = owner
                payload = bounce[:nbytes]  # page-aligned: the store writes it with O_DIRECT, no second copy
                payload.copy_(self.arena.slot(slot, nbytes))
            move = BlockMove(row=-1, namespace=namespace, key=key, dram_slot=slot, nbytes=nbytes, codec=codec,
                             first=first, to_codec="" if codec == cold_codec else cold_codec)
            try:
                if move.to_codec:
                    payload = self._transcoded(move, payload)
                if room is not None and not room(len(payload)):
                    break
                self.store.write(namespace, key, payload, self.fingerprint.digest, move.codec, sync_dir=False)
            except CapacityError as exc:  # kvtier's own NVMe budget: demotion makes room, not an error
                log.info("kvtier: write-behind paused: %s", exc)
                break
            except (KvtierError, OSError) as exc:  # the disk is full, read-only, gone...: tell the manager
                log.warning("kvtier: write-behind of block %s failed: %s", key.hex()[:16], exc)
                error = str(exc)
                break
            with self._slots_lock:
                if self.slot_owner.get(slot) == owner:
                    self.dirty.pop(slot, None)
            with self._lock:
                self.link_bytes["dram->nvme"] += move.nbytes
            written.append((namespace, key, move.nbytes, move.codec))
        if written:
            self.store.sync_dirs()  # durable before anyone is told
        if error:
            self.disk_failing, self.disk_failed_at = True, time.monotonic()
        elif written:
            self.disk_failing = False
        return written, error

    def write_back(self, cold_codec: str = "none") -> int:
        """Clean shutdown: write every DRAM block that has no NVMe copy to the NVMe tier, so a
        restart finds it (write-behind with no age limit). Stops quietly when the tier is full or the
        disk fails. Returns the blocks written."""
        written, error = self.write_behind(0.0, len(self.dirty), cold_codec)
        if error:
            log.warning("kvtier: write-back stopped after %d blocks: %s", len(written), error)
        if written:
            log.info("kvtier: wrote %d DRAM-only blocks to the NVMe tier before shutting down", len(written))
        return len(written)

    @staticmethod
    def _note(result: JobResult, index: int, move: BlockMove) -> None:
        """Report what was written for one move (the manager may run in another process)."""
        result.extra.setdefault("encoded", {})[index] = (move.nbytes, move.codec)

    def _store(self, job: Job, result: JobResult) -> None:
        assert self.adapter is not None and self.kv_layers is not None, "mover has no KV tensors"
        plain = all(isinstance(get_codec(m.codec), Identity) for m in job.moves)
        if self._stream is None and plain:  # CPU: gather each block straight into its DRAM slot
            for move in job.moves:
                self.adapter.gather(self.kv_layers, [move.device_block], self._as_block(self.arena.slot(move.dram_slot)))
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
                elif self._stream is None or isinstance(codec, Zstd):
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
        sources = self._read_from_nvme(job, result)
        count = len(job.moves)
        if result.failed:  # load only the prefix before the first bad block; vLLM recomputes the rest
            count = min(result.failed)
            result.failed = list(range(count, len(job.moves)))
        moves = job.moves[:count]
        raw = [sources.get(i, self.arena.slot(m.dram_slot) if m.dram_slot >= 0 else None) for i, m in enumerate(moves)]
        plain = all(isinstance(get_codec(m.codec), Identity) for m in moves)
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
        if isinstance(codec, Identity):
            block.view(-1).view(payload.dtype).copy_(payload, non_blocking=True)
            return
        if isinstance(codec, Zstd):  # the lossless layer unpacks on the CPU
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
        from kvtier.tiers.dram import aligned_empty

        targets = {i: self.arena.slot(m.dram_slot) if m.dram_slot >= 0 and not m.to_codec
                   else aligned_empty(max(self.arena.slot_bytes, m.nbytes)) for i, m in reads}
        futures = {i: store.submit_read(m.namespace, m.key, targets[i], self.fingerprint.digest) for i, m in reads}
        sizes = result.extra.setdefault("nbytes", {})
        for i, future in futures.items():
            try:
                nbytes, codec = future.result()
            except (KvtierError, OSError) as exc:
                result.failed.append(i)
                result.extra.setdefault("bad_reads", []).append(i)
                result.error = str(exc)
                continue
            move = job.moves[i]
            move.nbytes, move.codec = nbytes, codec
            self._count("nvme->dram", nbytes, result)
            if move.to_codec and move.dram_slot >= 0:  # re-encode to the warm codec to fit its slot
                move.nbytes = transcode(targets[i][:nbytes], codec, move.to_codec, self.fingerprint.geometry,
                                        self.arena.slot(move.dram_slot), first=move.first or None)
                move.codec = move.to_codec
                targets[i] = self.arena.slot(move.dram_slot)
            sizes[i] = move.nbytes
            self._note(result, i, move)
            if move.dram_slot >= 0:
                self._own(move)
        result.failed.sort()
        return targets

    def _promote(self, job: Job, result: JobResult) -> None:
        self._read_from_nvme(job, result)

    def _demote(self, job: Job, result: JobResult) -> None:
        self._drop(job, result)
        store = self._need_store()
        futures = []
        for i, move in enumerate(job.moves):
            payload = self.arena.slot(move.dram_slot, move.nbytes)
            if move.to_codec:  # the cold tier's codec differs from the warm one
                payload = self._transcoded(move, payload)
                self._note(result, i, move)
            futures.append(store.submit_write(move.namespace, move.key, payload, self.fingerprint.digest, move.codec))
        self._collect_writes(futures, job.moves, result, "dram->nvme")
        store.sync_dirs()
        failed = set(result.failed)
        with self._slots_lock:
            for i, move in enumerate(job.moves):
                if i not in failed:
                    self.dirty.pop(move.dram_slot, None)
        if self.take_recreated():
            result.extra["nvme_recreated"] = True  # the directory had vanished: what it held is gone
        result.extra["disk_free"] = store.free_bytes()

    def take_recreated(self) -> bool:
        """Whether the NVMe directory vanished and was made again since the last call."""
        if self.store is None or self.store.recreated <= self._recreated_seen:
            return False
        self._recreated_seen = self.store.recreated
        return True

    def _transcoded(self, move: BlockMove, payload: "torch.Tensor") -> "torch.Tensor":
        """``payload`` re-encoded from ``move.codec`` to ``move.to_codec`` (updates the move)."""
        import torch

        out = torch.empty(get_codec(move.to_codec).max_bytes(self.fingerprint.geometry), dtype=torch.uint8)
        n = transcode(payload, move.codec, move.to_codec, self.fingerprint.geometry, out, first=move.first or None)
        move.codec, move.nbytes = move.to_codec, n
        return out[:n]

    def _collect_writes(self, futures, moves: Sequence[BlockMove], result: JobResult, link: str) -> None:
        for i, future in enumerate(futures):
            try:
                future.result()
            except (KvtierError, OSError) as exc:
                result.failed.append(i)
                result.error = str(exc)
                self.disk_failing, self.disk_failed_at = True, time.monotonic()
                continue
            self.disk_failing = False
            self._count(link, moves[i].nbytes, result)

    def _drop(self, job: Job, result: JobResult) -> None:
        if job.drops:
            store = self._need_store()
            for move in job.drops:
                store.delete(move.namespace, move.key)

    # ---- snapshots ----------------------------------------------------------------------------
    def _snapshot(self, job: Job, result: JobResult) -> None:
        from kvtier.snapshot import write_snapshot

        import torch

        header = job.header or {}
        bounce = torch.empty(max([self.arena.slot_bytes] + [m.nbytes for m in job.moves]), dtype=torch.uint8)
        sizes = header.get("sizes") or [m.nbytes for m in job.moves]  # as written, after re-encoding

        def payloads():
            for i, move in enumerate(job.moves):
                if move.from_nvme:
                    nbytes, move.codec = self._need_store().read_into(move.namespace, move.key, bounce,
                                                                       self.fingerprint.digest)
                    payload = bounce[:nbytes]
                else:
                    payload = self.arena.slot(move.dram_slot, move.nbytes)
                if move.to_codec and move.codec != move.to_codec:
                    payload = self._transcoded(move, payload)
                if len(payload) != sizes[i]:
                    raise KvtierError(f"snapshot: block {i} holds {len(payload)} bytes, planned {sizes[i]}")
                yield payload
                self._count("tier->snapshot", len(payload), result)

        info = write_snapshot(
            job.path, self.fingerprint, header["session_id"], header["namespace"],
            codec=header.get("codec", job.moves[0].codec),
            num_tokens=header["num_tokens"], keys=[m.key for m in job.moves], payloads=payloads(),
            block_nbytes=sizes, token_ids=header.get("token_ids") or (),
        )
        result.extra["path"] = str(info.path)

    def _restore(self, job: Job, result: JobResult) -> None:
        import numpy as np

        from kvtier.snapshot import read_blocks

        wanted = {m.device_block: i for i, m in enumerate(job.moves)}  # snapshot position -> move
        writes = []
        for position, payload in read_blocks(job.path, expected_fingerprint=self.fingerprint):
            i = wanted.get(position)
            if i is None:
                continue
            move = job.moves[i]
            if move.to_nvme:  # the reader reuses its buffer: hand the writer its own copy
                writes.append((i, self._need_store().submit_write(
                    move.namespace, move.key, bytearray(payload), self.fingerprint.digest, move.codec)))
            elif move.to_codec and move.to_codec != move.codec:  # too big for a warm slot: re-encode
                import torch

                move.nbytes = transcode(torch.frombuffer(payload, dtype=torch.uint8), move.codec, move.to_codec,
                                        self.fingerprint.geometry, self.arena.slot(move.dram_slot), first=move.first)
                move.codec = move.to_codec
                self._note(result, i, move)
                self._own(move)
                self._count("snapshot->dram", len(payload), result)
            else:
                self.arena.slot(move.dram_slot, len(payload)).numpy()[:] = np.frombuffer(payload, np.uint8)
                self._own(move)
                self._count("snapshot->dram", len(payload), result)
        self._collect_writes([f for _, f in writes], [job.moves[i] for i, _ in writes], result, "snapshot->nvme")
        result.failed = [writes[k][0] for k in result.failed]
        if writes:
            self._need_store().sync_dirs()

    # ---- CUDA plumbing ------------------------------------------------------------------------
    def _on_stream(self):
        import contextlib

        import torch

        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
