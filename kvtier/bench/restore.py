"""``kvtier bench restore``: one long session restored from the NVMe tier into DRAM, at GB scale.

A 70B-shaped session (80 layers, 8 KV heads, head dim 128, bf16, 16-token blocks: 5 MiB a block,
``GEOMETRY_70B.block_bytes``) of ``--gib`` GiB sits in page-aligned DRAM, is written to the cold
tier (``write_batch`` group commits of 256 MiB, as demotions do), and is read back into the same DRAM
the way the mover loads it: ``read_batch`` calls of 256 MiB of blocks, two in flight (the mover's two
job threads), each drive reading its share on its own IO threads, every record verified (header and
xxh3 of the payload) on the IO thread that read it while the other reads are in flight.

Every restore the bench times is verified (``VerifiedRestores``): every round of the main restore,
of the one- and the two-directory restores and of the restore from RAM. Before each, its destination
slots are clobbered (``clobber``: bytes no block holds, so a block the restore does not bring back
cannot pass); after each, every block it restored is compared with what was written, byte for byte
(``compare_blocks``). Both happen outside the restore's timer and its CPU and RSS measurement; the
records' own verification is part of the restore and is measured. ``_blocks_checked`` and
``_blocks_mismatched`` count the blocks compared and those that differed over all of them. A block
that differs, or a restore not every block of which was compared, refuses the figures
(``kvtier.bench.checks.FigureRefused``): the run fails and records nothing. The raw reads are the
reference and are not compared; neither is the memcpy.

Figures (``RESTORE_KEYS``), each from rounds that alternate which side runs first (median):

* ``restore_vs_raw``: restore GB/s (payload bytes) over raw O_DIRECT reads of the same segment files
  (every byte the records take, as many threads per drive as the store's IO threads) in the same
  run. Each round reads them raw three times and the fastest counts: in 8 MiB requests and in the
  tier's own IO size for these records, both into small buffers of the threads' own, and record by
  record with each payload straight into its block's DRAM slot (the restore's destinations).
* ``core_s_per_gib``: process CPU time (user + sys, every thread) during the restore, per GiB
  restored; ``xxh3_core_s_per_gib``: the records' checksum (``kvtier.tiers.records.checksum``) alone,
  block by block over 1 GiB (less for a smaller session) of DRAM, on this box.
* ``extra_rss_mib``: the peak RSS during the restore (``/proc/self/statm`` every 2 ms) less the RSS
  just before it, the destination buffers already allocated and touched; the worst round.
* ``tmpfs_vs_memcpy``: the same restore from a RAM-backed directory (``/dev/shm``; tmpfs has no
  O_DIRECT, so the store reads buffered) of 2 GiB (1 GiB with ``--quick``) against a torch copy of
  the same bytes: the pipeline's ceiling when the disk is not the limit.
* ``two_dirs_vs_one``: the restore from a tier over two directories of the first drive (a
  ``DriveSet``, blocks placed by key hash) against a tier over one directory of it; one disk, so
  at best about 1.0.

The page cache plays no part: the tier and the raw reads both use O_DIRECT (and the files are
evicted before each read where the filesystem only reads buffered).
"""
from __future__ import annotations

import hashlib
import itertools
import math
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvtier.bench.checks import require
from kvtier.errors import StorageError, UsageError
from kvtier.layout import KVGeometry, ModelFingerprint
from kvtier.tiers.nvme.parts import IO_BYTES, MAX_RECORDS_PER_IO
from kvtier.tiers.records import HEADER_BYTES, checksum, file_bytes_for

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.tiers.dram import DramArena

__all__ = ["RESTORE_KEYS", "GEOMETRY_70B", "Session", "make_session", "write_session", "restore_session",
           "mismatched_blocks", "compare_blocks", "clobber", "VerifiedRestores", "run_restore_bench"]

RESTORE_KEYS = (
    "restore_vs_raw",
    "core_s_per_gib",
    "xxh3_core_s_per_gib",
    "extra_rss_mib",
    "tmpfs_vs_memcpy",
    "two_dirs_vs_one",
)
GEOMETRY_70B = KVGeometry(num_layers=80, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
BATCH_BYTES = 256 << 20  # payload bytes per read_batch / write_batch (one mover job's worth)
BATCHES_IN_FLIGHT = 2  # the mover runs jobs on two threads
IO_THREADS = 8  # the store's IO threads per drive (its default)
MOONSHOT_GIB_S = 15.0  # "15 GB in 1 s", taken as GiB: the stricter reading
GiB = 1 << 30
MiB = 1 << 20
GB = 1e9
NAMESPACE = b"bench-restore-ns"  # 16 bytes


# ---- the session ----------------------------------------------------------------------------------
@dataclass
class Session:
    """``len(keys)`` blocks of ``geometry`` in one page-aligned DRAM arena (the destinations)."""

    geometry: KVGeometry
    arena: "DramArena"
    keys: list[bytes]
    pattern: "torch.Tensor"  # the random bytes every block's content is cut from
    fingerprint: bytes
    namespace: bytes = NAMESPACE

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.block_bytes

    def dst(self, index: int) -> "torch.Tensor":
        return self.arena.slot(index, self.block_bytes)

    def fill(self, index: int) -> None:
        """Block ``index``'s content: a slice of the pattern that depends on the index, its first
        8 bytes the index itself (so no two blocks are the same)."""
        dst = self.dst(index)
        offset = _offset(index, dst.numel(), self.pattern.numel())
        dst.copy_(self.pattern[offset : offset + dst.numel()])
        head = min(8, dst.numel())
        dst[:head].copy_(_stamp(index)[:head])


def _offset(index: int, nbytes: int, pattern_bytes: int) -> int:
    return (index * 1_048_583) % (pattern_bytes - nbytes + 1)


def _stamp(index: int) -> "torch.Tensor":
    import torch

    return torch.tensor(list(index.to_bytes(8, "little")), dtype=torch.uint8)


def make_session(geometry: KVGeometry, total_bytes: int, seed: int = 20261203) -> Session:
    """A session of ``total_bytes // geometry.block_bytes`` blocks (at least one), written into fresh
    DRAM (every page touched)."""
    import torch

    from kvtier.tiers.dram import DramArena

    block = geometry.block_bytes
    blocks = max(1, total_bytes // block)
    generator = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, 256, (max(16 * MiB, 2 * block),), dtype=torch.uint8, generator=generator)
    arena = DramArena(blocks, block, pin=False)
    arena.buffer.zero_()  # every page of the destinations committed, padding included
    keys = [hashlib.sha256(b"restore-bench/%d" % i).digest() for i in range(blocks)]
    session = Session(geometry, arena, keys, pattern, ModelFingerprint("kvtier-bench-restore", geometry).digest)
    for i in range(blocks):
        session.fill(i)
    return session


def compare_blocks(session: Session, blocks: Sequence[int] | None = None) -> tuple[int, list[int]]:
    """Compare the blocks' DRAM bytes with what ``Session.fill`` wrote there, byte for byte: how many
    blocks were compared, and those that differ."""
    import torch

    compared, bad = 0, []
    for i in range(len(session.keys)) if blocks is None else blocks:
        dst = session.dst(i)
        n = dst.numel()
        offset = _offset(i, n, session.pattern.numel())
        head = min(8, n)
        if not (torch.equal(dst[:head], _stamp(i)[:head])
                and torch.equal(dst[head:], session.pattern[offset + head : offset + n])):
            bad.append(i)
        compared += 1
    return compared, bad


def mismatched_blocks(session: Session, blocks: Sequence[int] | None = None) -> list[int]:
    """The blocks whose DRAM bytes differ from what ``Session.fill`` wrote there."""
    return compare_blocks(session, blocks)[1]


def clobber(session: Session, blocks: Sequence[int] | None = None) -> None:
    """Overwrite the blocks' DRAM slots with bytes no block holds: 0xA5 throughout, then the first
    (up to 8) bytes the complement of the block's stamp, each of which differs from the block's own
    byte there: a restore that leaves a slot alone leaves a block that fails ``compare_blocks``."""
    import torch

    for i in range(len(session.keys)) if blocks is None else blocks:
        dst = session.dst(i)
        dst.fill_(0xA5)
        head = min(8, dst.numel())
        dst[:head].copy_(torch.bitwise_not(_stamp(i)[:head]))


class VerifiedRestores:
    """Every restore the bench times, checked: before it, its destinations are clobbered (``clobber``);
    after it, every block it restored is compared with what was written (``compare_blocks``). Neither
    is inside the restore's timer or its CPU and RSS measurement (``Measured``). The counts add up over
    every restore; a block that differs refuses the figures (``FigureRefused``) there and then."""

    def __init__(self, session: Session, rounds: int, batch_bytes: int, in_flight: int,
                 progress: Callable[[str], None]):
        self.session = session
        self.rounds = rounds
        self.batch_bytes = batch_bytes
        self.in_flight = in_flight
        self.progress = progress
        self.restores = 0  # restores verified
        self.restored = 0  # blocks those restores were asked for
        self.checked = 0  # blocks compared after them
        self.mismatched = 0
        self._rounds: dict[str, int] = {}

    def restore(self, store, blocks: range, source: str, evict: bool = False,
                measured: list["Measured"] | None = None) -> float:
        """Restore ``blocks`` from ``store`` (``restore_session``) and verify them; the seconds the
        restore took. ``evict``: drop buffered files from the page cache first; ``measured``: append
        the restore's ``Measured`` (CPU, RSS) there."""
        n = self._rounds[source] = self._rounds.get(source, 0) + 1
        what = f"the restore from {source}, round {n} of {self.rounds}"
        self.progress(f"restoring from {source}, round {n} of {self.rounds}")
        clobber(self.session, blocks)
        if evict:
            evict_buffered(store)
        if measured is None:
            seconds = restore_session(store, self.session, blocks, self.batch_bytes, self.in_flight)
        else:
            with Measured() as m:
                seconds = restore_session(store, self.session, blocks, self.batch_bytes, self.in_flight)
            measured.append(m)
        checked, bad = compare_blocks(self.session, blocks)
        self.restores += 1
        self.restored += len(blocks)
        self.checked += checked
        self.mismatched += len(bad)
        require(not bad, f"bench restore: {len(bad)} of the {len(blocks)} blocks {what} brought back differ from "
                         f"what was written (first: block {bad[0] if bad else None})",
                hint="the restore delivered bytes the session was not written with: no figure is recorded")
        return seconds

    def require_all(self, restores: int, blocks: int) -> None:
        """Refuse the figures unless ``restores`` restores of ``blocks`` blocks in all were verified,
        every block compared and none different."""
        require(self.restores == restores and self.restored == blocks and self.checked == blocks
                and self.mismatched == 0,
                f"bench restore: {self.restores} restores verified ({restores} timed), {self.checked} blocks "
                f"compared of {self.restored} restored ({blocks} expected), {self.mismatched} different",
                hint="a restore whose blocks were not all compared gives no figure")


# ---- the tier ---------------------------------------------------------------------------------------
def open_tier(dirs: Sequence[Path], capacity_bytes: int, io_threads: int = IO_THREADS, direct: str = "auto"):
    """The cold tier over ``dirs`` as serving opens it: an ``NvmeStore`` for one, a ``DriveSet`` for several."""
    from kvtier.tiers.nvme.drives import join_drives, open_nvme

    return open_nvme(join_drives(dirs), capacity_bytes, io_threads=io_threads, direct=direct)


def _drives(store) -> list:
    return list(getattr(store, "drives", None) or [store])


def _batches(blocks: range, block_bytes: int, batch_bytes: int) -> list[range]:
    per = max(1, batch_bytes // block_bytes)
    return [range(first, min(first + per, blocks.stop)) for first in range(blocks.start, blocks.stop, per)]


def _raise_first(outcomes: list, what: str) -> None:
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise StorageError(f"bench restore: {what} failed: {outcome}") from outcome


def write_session(store, session: Session, blocks: range | None = None, batch_bytes: int = BATCH_BYTES) -> None:
    """Write the blocks from their DRAM slots, one group commit per ``batch_bytes`` (as demotions do)."""
    blocks = range(len(session.keys)) if blocks is None else blocks
    for batch in _batches(blocks, session.block_bytes, batch_bytes):
        _raise_first(store.write_batch([(session.namespace, session.keys[i], session.dst(i), "none") for i in batch],
                                       session.fingerprint), "writing the session")


def evict_buffered(store) -> None:
    """Drop the files of the drives that read buffered (no O_DIRECT) from the page cache."""
    from kvtier.tiers.nvme.rawio import drop_page_cache

    drop_page_cache(*(drive.root for drive in _drives(store) if not drive.direct))


def restore_session(store, session: Session, blocks: range | None = None, batch_bytes: int = BATCH_BYTES,
                    in_flight: int = BATCHES_IN_FLIGHT, evict: bool = False) -> float:
    """Read the blocks back into their DRAM slots, ``read_batch`` calls of ``batch_bytes`` with
    ``in_flight`` of them at once (every record verified); the seconds it took. ``evict``: drop the
    tier's files from the page cache first where it reads buffered (not timed)."""
    blocks = range(len(session.keys)) if blocks is None else blocks
    if evict:
        evict_buffered(store)
    batches = _batches(blocks, session.block_bytes, batch_bytes)

    def one(batch: range) -> None:
        _raise_first(store.read_batch([(session.namespace, session.keys[i], session.dst(i)) for i in batch],
                                      session.fingerprint), "restoring the session")

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, in_flight), thread_name_prefix="kvtier-bench-restore") as pool:
        for _ in pool.map(one, batches):
            pass
    return time.perf_counter() - start


class RawFiles:
    """Raw reads of the segment files that hold ``blocks``, without the tier: per drive ``threads``
    threads take the pieces of that drive's files in order (O_DIRECT where the store uses it).
    ``chunk``: pieces of that size into buffers of the threads' own; ``into_dram``: one piece per
    record, its header into a scratch page and its payload straight into the block's DRAM slot (the
    same destinations the restore fills), not verified."""

    def __init__(self, store, session: Session, blocks: range, threads: int, chunk: int = IO_BYTES,
                 into_dram: bool = False):
        from kvtier.tiers.records import bytes_view

        drives = _drives(store)
        records: list[list[tuple[Path, int, int, int]]] = [[] for _ in drives]
        for i in blocks:
            key = session.keys[i]
            d = store.holder(session.namespace, key) if len(drives) > 1 else 0
            if d is None:
                raise StorageError(f"bench restore: block {i} is not in the tier")
            path, offset, length = drives[d].locate(session.namespace, key)
            records[d].append((path, offset, length, i))
        self.paths = sorted({r[0] for drive in records for r in drive})
        self.threads = max(1, threads)
        self.into_dram = into_dram
        self._fds: dict[Path, int] = {}
        self.plans: list[list[tuple[int, int, int, int]]] = []  # per drive: (fd, offset, length, block or -1)
        self.nbytes = 0
        try:
            for drive, found in zip(drives, records):
                flags = os.O_RDONLY | (os.O_DIRECT if drive.direct else 0)
                for path in {r[0] for r in found}:
                    self._fds[path] = os.open(path, flags)
                if into_dram:
                    plan = [(self._fds[path], offset, length, i) for path, offset, length, i in sorted(found)]
                else:
                    ends: dict[Path, int] = {}
                    for path, offset, length, _i in found:
                        ends[path] = max(ends.get(path, 0), offset + length)
                    plan = [(self._fds[path], off, min(chunk, end - off), -1)
                            for path, end in sorted(ends.items()) for off in range(0, end, chunk)]
                self.nbytes += sum(length for _fd, _off, length, _i in plan)
                if plan:
                    self.plans.append(plan)
        except BaseException:
            self.close()
            raise
        self._slots = [bytes_view(session.arena.slot(i)) for i in range(len(session.keys))] if into_dram else []
        size = HEADER_BYTES if into_dram else chunk
        self._buffers = [mmap.mmap(-1, size) for _ in range(self.threads * len(self.plans))]
        for buf in self._buffers:
            buf.write(b"\1" * size)  # touched before any round

    def read(self) -> float:
        from kvtier.tiers.nvme.rawio import drop_page_cache

        drop_page_cache(*self.paths)
        counters = [itertools.count() for _ in self.plans]
        slots = self._slots

        def worker(plan: list, counter, buf: mmap.mmap) -> None:
            view = memoryview(buf)
            while (k := next(counter)) < len(plan):
                fd, offset, length, block = plan[k]
                vectors = [view[:length]] if block < 0 else [view, slots[block][: length - HEADER_BYTES]]
                got = os.preadv(fd, vectors, offset)
                if got != length:
                    raise OSError(f"short raw read ({got} of {length} bytes)")

        jobs = [(plan, counter) for plan, counter in zip(self.plans, counters) for _ in range(self.threads)]
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="kvtier-bench-raw") as pool:
            futures = [pool.submit(worker, plan, counter, buf) for (plan, counter), buf in zip(jobs, self._buffers)]
            for future in futures:
                future.result()
        return time.perf_counter() - start

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


# ---- process CPU and memory ---------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


class Measured:
    """CPU time (every thread of the process, less this sampler's own) and peak RSS over a ``with``."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._sampler_cpu = 0.0
        self.base = self.peak = 0
        self.cpu_s = 0.0

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())
        self._sampler_cpu = time.thread_time()

    def __enter__(self) -> "Measured":
        self.base = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, name="kvtier-bench-rss", daemon=True)
        self._thread.start()
        self._cpu0 = time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        cpu = time.process_time() - self._cpu0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.cpu_s = max(0.0, cpu - self._sampler_cpu)

    @property
    def extra_bytes(self) -> int:
        return self.peak - self.base


def xxh3_core_s_per_gib(session: Session, nbytes: int = GiB, reps: int = 3) -> float:
    """CPU seconds per GiB of the records' checksum, block by block over DRAM (the best of ``reps``)."""
    blocks = max(1, min(len(session.keys), nbytes // session.block_bytes))
    from kvtier.tiers.records import bytes_view

    views = [bytes_view(session.dst(i)) for i in range(blocks)]
    best = math.inf
    for _ in range(reps):
        start = time.thread_time()
        for view in views:
            checksum(view)
        best = min(best, time.thread_time() - start)
    return best / (blocks * session.block_bytes / GiB)


def memcpy_s(session: Session, blocks: range) -> tuple[float, int]:
    """A torch copy of the blocks' bytes within their own DRAM (one half onto the other and back):
    the seconds and the bytes copied."""
    slot = session.arena.slot_bytes
    region = session.arena.buffer[blocks.start * slot : blocks.stop * slot]
    half = region.numel() // 2
    start = time.perf_counter()
    region[half : 2 * half].copy_(region[:half])
    region[:half].copy_(region[half : 2 * half])
    return time.perf_counter() - start, 2 * half


# ---- checks before anything is written ---------------------------------------------------------------
def _device(path: Path) -> int:
    return os.stat(path).st_dev


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def check_room(dirs: Sequence[Path], record_bytes: int, dram_bytes: int, ram_bytes: int) -> None:
    """Refuse before writing when a disk or the memory cannot hold what the run needs: the first
    drive's disk holds the one- and two-directory tiers at once (2x the records), every other disk its
    share of the main tier; the DRAM holds the destinations and the tmpfs copy."""
    need: dict[int, tuple[Path, int]] = {}
    for k, d in enumerate(dirs):
        share = 2 * record_bytes if k == 0 else math.ceil(1.25 * record_bytes / len(dirs))
        dev = _device(d)
        path, before = need.get(dev, (d, 0))
        need[dev] = (path, before + share)
    for path, nbytes in need.values():
        nbytes += 512 * MiB  # headroom: the journal, segment tails, the filesystem's own
        free = _free(path)
        if free < nbytes:
            raise StorageError(f"bench restore: {path} has {_gib(free)} free; this run needs {_gib(nbytes)} there",
                               hint="free disk space, pass --nvme-dir on a disk with more room, or a smaller --gib")
    available = mem_available()
    want = dram_bytes + ram_bytes + GiB
    if available is not None and available < want:
        raise UsageError(f"bench restore: {_gib(available)} of memory is available; this run needs {_gib(want)} "
                         "(the session's DRAM destinations, the tmpfs copy, 1 GiB spare)",
                         hint="pass a smaller --gib")


# ---- the run ----------------------------------------------------------------------------------------------
def _alternating(rounds: int, first: Callable[[], Any], second: Callable[[], Any]) -> list[tuple[Any, Any]]:
    out = []
    for rep in range(rounds):
        if rep % 2 == 0:
            a = first()
            b = second()
        else:
            b = second()
            a = first()
        out.append((a, b))
    return out


def moonshot(per_drive_gb_s: float, core_s_per_gib: float, target_gib_s: float = MOONSHOT_GIB_S) -> dict:
    """What restoring 15 GiB in one second takes at the measured rates."""
    target_gb_s = target_gib_s * GiB / GB
    drives = math.ceil(target_gb_s / per_drive_gb_s) if per_drive_gb_s > 0 else None
    cores = target_gib_s * core_s_per_gib
    line = (f"15 GiB ({target_gb_s:.1f} GB) in 1 s: at {per_drive_gb_s:.2f} GB/s per drive, {drives} drives; "
            f"at {core_s_per_gib:.3f} core-s/GiB, {cores:.2f} cores busy")
    return {"_moonshot": line, "_moonshot_drives": drives, "_moonshot_cores": cores}


def run_restore_bench(gib: float = 8.0, quick: bool = False, dirs: Sequence[str | os.PathLike] | None = None,
                      progress: Callable[[str], None] = print, *, total_bytes: int | None = None,
                      geometry: KVGeometry = GEOMETRY_70B, tmpfs_bytes: int | None = None,
                      ram_dir: str | os.PathLike = "/dev/shm", rounds: int = 5, batch_bytes: int = BATCH_BYTES,
                      io_threads: int = IO_THREADS, in_flight: int = BATCHES_IN_FLIGHT) -> dict:
    """The whole benchmark; see the module docstring. ``dirs``: the drives (default: the current
    directory); each gets a temporary directory of its own, removed at the end. ``progress`` is told
    each step, every restore included, before it starts. A restored block that differs from what was
    written raises ``FigureRefused`` (nothing is returned)."""
    wall = time.perf_counter()
    total = int(total_bytes if total_bytes is not None else gib * GiB)
    block = geometry.block_bytes
    if total < block:
        raise UsageError(f"bench restore: {_gib(total)} is less than one {block / MiB:.2f} MiB block",
                         hint="pass a larger --gib")
    blocks = total // block
    record_bytes = blocks * file_bytes_for(block)
    tmpfs_total = min(tmpfs_bytes if tmpfs_bytes is not None else (GiB if quick else 2 * GiB), blocks * block)
    tmpfs_blocks = max(1, tmpfs_total // block)
    given = [Path(d).expanduser() for d in (dirs or [Path.cwd()])]
    for d in given:
        if not d.is_dir():
            raise UsageError(f"--nvme-dir {d} is not a directory",
                             hint="pass an existing directory on the disk to test")
    real = [os.path.realpath(d) for d in given]
    if len(set(real)) != len(real):
        raise UsageError("an --nvme-dir is named twice", hint="give each drive's directory once")
    ram = Path(ram_dir)
    ram_ok = ram.is_dir() and os.access(ram, os.W_OK) and _free(ram) >= tmpfs_blocks * file_bytes_for(block) + 64 * MiB
    check_room(given, record_bytes, blocks * block, tmpfs_blocks * file_bytes_for(block) if ram_ok else 0)

    run = _Run(given, 2 * record_bytes + 256 * MiB, rounds, batch_bytes, io_threads, in_flight, progress)
    results: dict = {}
    try:
        progress(f"session: {blocks} blocks of {block / MiB:.2f} MiB ({_gib(blocks * block)}) in DRAM")
        run.session = make_session(geometry, total)
        run.verified = VerifiedRestores(run.session, rounds, batch_bytes, in_flight, progress)
        results.update(run.restore_vs_raw(blocks, geometry))
        results.update(run.two_dirs_vs_one(blocks))
        results.update(run.tmpfs_vs_memcpy(ram, tmpfs_blocks) if ram_ok else
                       {"tmpfs_vs_memcpy": None, "_tmpfs_note": f"{ram} is missing, not writable or too small: "
                                                                 "not measured"})
        verified = run.verified
        arms = 3 + int(ram_ok)  # main, one directory, two directories; RAM
        verified.require_all(restores=rounds * arms, blocks=rounds * (3 * blocks + int(ram_ok) * tmpfs_blocks))
        results.update({"_blocks_checked": verified.checked, "_blocks_mismatched": verified.mismatched})

        progress("xxh3 alone over DRAM")
        results["xxh3_core_s_per_gib"] = xxh3_core_s_per_gib(run.session)
        results.update(moonshot(results["_restore_gb_s"] / results["_disks"], results["core_s_per_gib"]))
    finally:
        run.close()
    results["_quick"] = quick
    results["_wall_s"] = time.perf_counter() - wall
    return results


class _Run:
    """One run's drives, temporary directories and open tiers (all closed and removed by ``close``),
    and its arms, each timing verified restores (``VerifiedRestores``)."""

    session: Session
    verified: VerifiedRestores

    def __init__(self, given: list[Path], capacity: int, rounds: int, batch_bytes: int, io_threads: int,
                 in_flight: int, progress: Callable[[str], None]):
        self.given = given
        self.capacity = capacity
        self.rounds = rounds
        self.batch_bytes = batch_bytes
        self.io_threads = io_threads
        self.in_flight = in_flight
        self.progress = progress
        self.stores: list = []
        self.tmps: list[Path] = []
        self.tmps += [Path(tempfile.mkdtemp(prefix="kvtier-bench-restore-", dir=d)) for d in given]
        self.main = None

    def open(self, dirs: Sequence[Path], direct: str = "auto"):
        store = open_tier(dirs, self.capacity, self.io_threads, direct=direct)
        self.stores.append(store)
        return store

    def shut(self, store) -> None:
        store.close()
        self.stores.remove(store)

    def close(self) -> None:
        for store in self.stores:
            store.close()
        for t in self.tmps:
            shutil.rmtree(t, ignore_errors=True)

    def restore_vs_raw(self, blocks: int, geometry: KVGeometry) -> dict:
        """The main tier over every drive, written; its restore against raw reads of its files."""
        session, block, rounds = self.session, geometry.block_bytes, self.rounds
        main_dirs = [t / "main" for t in self.tmps]
        main = self.main = self.open(main_dirs)
        self.progress(f"writing it to the NVMe tier in {', '.join(map(str, main_dirs))}")
        started = time.perf_counter()
        write_session(main, session, batch_bytes=self.batch_bytes)
        write_s = time.perf_counter() - started
        # three raw references, the fastest of them counts in each round: 8 MiB pieces (the tier's
        # largest IO) and pieces of the tier's own IO for these records (as many whole records as fit
        # in 8 MiB), both into small buffers, and each record into its block's DRAM slot
        record = file_bytes_for(block)
        own_io = record * max(1, min(IO_BYTES // record, MAX_RECORDS_PER_IO))
        threads = self.io_threads
        raws = {"8mib_io": RawFiles(main, session, range(blocks), threads, IO_BYTES),
                "record_io": RawFiles(main, session, range(blocks), threads, own_io),
                "into_dram": RawFiles(main, session, range(blocks), threads, into_dram=True)}
        raw_gb_s: dict[str, list[float]] = {name: [] for name in raws}

        def raw_read() -> float:
            names = list(raws)[:: 1 if len(raw_gb_s["8mib_io"]) % 2 == 0 else -1]
            for name in names:
                raw_gb_s[name].append(raws[name].nbytes / GB / raws[name].read())
            return max(speeds[-1] for speeds in raw_gb_s.values())

        self.progress(f"restore vs raw direct reads of the same files: {rounds} rounds")
        measured: list[Measured] = []
        try:  # each restore into clobbered DRAM (the raw reads write the right bytes there), then compared
            pairs = _alternating(rounds, lambda: self.verified.restore(main, range(blocks), "the NVMe tier",
                                                                       evict=True, measured=measured), raw_read)
        finally:
            for raw in raws.values():
                raw.close()
        restore_gb_s = [blocks * block / GB / r for r, _ in pairs]
        best_raw = [w for _, w in pairs]
        return {
            "restore_vs_raw": statistics.median(g / w for g, w in zip(restore_gb_s, best_raw)),
            "_restore_vs_raw_rounds": ", ".join(f"{g / w:.2f}" for g, w in zip(restore_gb_s, best_raw)),
            "_restore_vs_raw_into_dram": statistics.median(g / w for g, w in zip(restore_gb_s,
                                                                                 raw_gb_s["into_dram"])),
            "core_s_per_gib": statistics.median(m.cpu_s / (blocks * block / GiB) for m in measured),
            "extra_rss_mib": max(m.extra_bytes for m in measured) / MiB,
            "_session_gib": blocks * block / GiB,
            "_blocks": blocks,
            "_block_mib": block / MiB,
            "_geometry": (f"{geometry.num_layers} layers x {geometry.num_kv_heads} kv heads x {geometry.head_dim} "
                          f"x {geometry.dtype}, {geometry.block_tokens}-token blocks"),
            "_drives": len(self.given),
            "_disks": len({_device(d) for d in self.given}),
            "_direct_io": bool(main.direct),
            "_batch_mib": self.batch_bytes / MiB,
            "_batches_in_flight": self.in_flight,
            "_io_threads_per_drive": threads,
            "_rounds": rounds,
            "_write_gb_s": blocks * block / GB / write_s,
            "_restore_gb_s": statistics.median(restore_gb_s),
            "_raw_best_gb_s": statistics.median(best_raw),
            "_raw_8mib_io_gb_s": statistics.median(raw_gb_s["8mib_io"]),
            "_raw_record_io_mib": own_io / MiB,
            "_raw_record_io_gb_s": statistics.median(raw_gb_s["record_io"]),
            "_raw_into_dram_gb_s": statistics.median(raw_gb_s["into_dram"]),
            "_restore_cores_busy": statistics.median(m.cpu_s / r for m, (r, _) in zip(measured, pairs)),
            "_rss_before_mib": measured[0].base / MiB,
            "_blocks_checked": self.verified.checked,  # so far; the run's total once every arm is done
            "_blocks_mismatched": self.verified.mismatched,
        }

    def two_dirs_vs_one(self, blocks: int) -> dict:
        """Two directories of the first drive vs one (the main tier, when it has one drive)."""
        session, first, block = self.session, self.given[0], self.session.block_bytes
        if len(self.given) == 1:
            one = self.main
        else:
            self.shut(self.main)
            for t in self.tmps:
                shutil.rmtree(t / "main", ignore_errors=True)
            one = self.open([self.tmps[0] / "one"])
            self.progress(f"writing the session to one directory of {first}")
            write_session(one, session, batch_bytes=self.batch_bytes)
        two = self.open([self.tmps[0] / "two-a", self.tmps[0] / "two-b"])
        self.progress(f"writing the session to two directories of {first}")
        write_session(two, session, batch_bytes=self.batch_bytes)
        self.progress(f"restore from two directories vs one: {self.rounds} rounds")
        every = range(blocks)
        pairs = _alternating(self.rounds, lambda: self.verified.restore(one, every, "one directory", evict=True),
                             lambda: self.verified.restore(two, every, "two directories", evict=True))
        for store in (one, two):
            self.shut(store)
        for t in self.tmps:
            for child in t.iterdir():
                shutil.rmtree(child, ignore_errors=True)
        return {
            "two_dirs_vs_one": statistics.median(a / b for a, b in pairs),
            "_two_dirs_vs_one_rounds": ", ".join(f"{a / b:.2f}" for a, b in pairs),
            "_one_dir_gb_s": statistics.median(blocks * block / GB / a for a, _ in pairs),
            "_two_dirs_gb_s": statistics.median(blocks * block / GB / b for _, b in pairs),
        }

    def tmpfs_vs_memcpy(self, ram: Path, tmpfs_blocks: int) -> dict:
        """The pipeline's ceiling: the first ``tmpfs_blocks`` restored from RAM vs a torch copy."""
        session, block = self.session, self.session.block_bytes
        ram_tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-restore-", dir=ram))
        self.tmps.append(ram_tmp)
        in_ram = range(tmpfs_blocks)
        shm = self.open([ram_tmp], direct="auto")
        self.progress(f"{_gib(tmpfs_blocks * block)} of it from {ram} (RAM) vs memcpy: {self.rounds} rounds")
        write_session(shm, session, in_ram, batch_bytes=self.batch_bytes)
        copies: list[tuple[float, int]] = []

        def copy() -> float:
            copies.append(memcpy_s(session, in_ram))
            return copies[-1][0]

        pairs = _alternating(self.rounds, lambda: self.verified.restore(shm, in_ram, f"RAM ({ram})"), copy)
        self.shut(shm)
        ram_gb_s = [tmpfs_blocks * block / GB / r for r, _ in pairs]
        copy_gb_s = [n / GB / s for s, n in copies]
        return {
            "tmpfs_vs_memcpy": statistics.median(g / c for g, c in zip(ram_gb_s, copy_gb_s)),
            "_tmpfs_vs_memcpy_rounds": ", ".join(f"{g / c:.2f}" for g, c in zip(ram_gb_s, copy_gb_s)),
            "_tmpfs_gib": tmpfs_blocks * block / GiB,
            "_tmpfs_direct_io": bool(shm.direct),
            "_tmpfs_restore_gb_s": statistics.median(ram_gb_s),
            "_memcpy_gb_s": statistics.median(copy_gb_s),
        }
