"""Several drives behind one cold tier: ``--nvme-dir`` given once per drive.

A box built for long contexts has several NVMe drives (a DGX H100 has eight); a 15 GB session back in
a second needs them all at once. Each drive is a whole ``NvmeStore`` of its own: its segments, its
journal, its lock, its IO threads and queue depth. ``DriveSet`` is the one ``DiskStore`` over them.

Placement is by key hash, weighted by each drive's share of the budget (rendezvous hashing: a block
goes to the drive with the highest ``weight / -ln(hash(key, drive))``), not by free space:
* a session's blocks are written together; placed by free space they would land on one drive, and
  its restore would read from one drive. By hash they spread over every drive in proportion to its
  size, so a restore reads from all of them at once;
* a block's drive follows from its key, with no table to keep or lose;
* a drive that fails or fills takes only its share: its writes go to the next drive in the block's
  own order, and a read looks in that order too (no IO: each drive's index is in memory).

The budget is split across the drives by their filesystems' sizes (equal on one filesystem). The
directory list is recorded in ``drives.json`` in drive 0, the first ``--nvme-dir``, which also holds
the session catalog. A single directory has no manifest and stays as it is: given more directories
later, it becomes drive 0 with nothing rewritten. A list that differs from the one on record is
refused at start (blocks would be lost or not found), with the list to pass.

The directory list travels as one string, the directories joined by ``os.pathsep`` (``:``), like
``PATH``: the settings, the connector configuration and ``KVTIER_NVME_DIR`` carry it unchanged.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvtier.errors import ConfigError, StorageError
from kvtier.tiers import fileio
from kvtier.tiers.nvme.parts import SEGMENT_BYTES, BlockRecord, Name
from kvtier.tiers.nvme.store import NvmeStore, scan_shards, shard_dir

__all__ = ["DriveSet", "drive_dirs", "join_drives", "primary_dir", "open_nvme", "scan_drives", "split_budget",
           "check_drive_list", "MANIFEST"]

MANIFEST = "drives.json"


def drive_dirs(spec: str | os.PathLike | Sequence[str] | None) -> list[str]:
    """The drives of a ``--nvme-dir`` setting: ``"/a:/b"`` (or a list) -> ``["/a", "/b"]``."""
    if spec is None:
        return []
    if isinstance(spec, (list, tuple)):
        parts = [str(p) for p in spec]
    else:
        parts = str(spec).split(os.pathsep)
    return [p.strip() for p in parts if p and p.strip()]


def join_drives(dirs: Iterable[str | os.PathLike]) -> str:
    return os.pathsep.join(str(d) for d in dirs)


def primary_dir(spec: str | os.PathLike | None) -> str | None:
    """Drive 0: where the session catalog and the drive manifest live."""
    dirs = drive_dirs(spec)
    return dirs[0] if dirs else None


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (a drive's directory may not be made yet)."""
    probe = path
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    return probe


def _fs_bytes(path: Path) -> int:
    try:
        st = os.statvfs(nearest_existing(path))
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize


def split_budget(dirs: Sequence[str | os.PathLike], total: int) -> list[int]:
    """The NVMe budget of each drive: ``total`` split by the drives' filesystem sizes (evenly when
    they share a filesystem, or when a size is unknown)."""
    if not dirs:
        return []
    sizes = [_fs_bytes(Path(d)) for d in dirs]
    devices = [_device(Path(d)) for d in dirs]
    if len(set(devices)) == 1 or not all(sizes):
        sizes = [1] * len(dirs)
    whole = sum(sizes)
    shares = [total * s // whole for s in sizes]
    shares[0] += total - sum(shares)
    return shares


def _device(path: Path) -> int:
    try:
        return os.stat(nearest_existing(path)).st_dev
    except OSError:
        return -1


def check_drive_list(dirs: Sequence[str], write: bool = False) -> list[str]:
    """Refuse a drive named twice, or a list that differs from the one drive 0 recorded; warn of two
    drives on one filesystem (they share a disk's bandwidth). With ``write``, record the list (only
    when there are several drives: a single directory keeps no manifest). Returns the warnings."""
    resolved = [os.path.realpath(os.path.expanduser(d)) for d in dirs]
    seen: dict[str, str] = {}
    for given, real in zip(dirs, resolved):
        if real in seen:
            raise ConfigError(f"--nvme-dir {given} is named twice (as {seen[real]} too)",
                              hint="give each drive's directory once")
        seen[real] = given
    warnings = []
    by_device: dict[int, list[str]] = {}
    for given in dirs:
        by_device.setdefault(_device(Path(given).expanduser()), []).append(given)
    for same in by_device.values():
        if len(same) > 1:
            warnings.append(f"--nvme-dir {' and '.join(same)} are on one filesystem: they share a disk, "
                            "so they add no bandwidth (give one directory per drive)")
    manifest = Path(resolved[0]) / MANIFEST if resolved else None
    if manifest is not None and manifest.is_file():
        try:
            recorded = list(json.loads(manifest.read_text())["drives"])
        except (OSError, ValueError, KeyError, TypeError):
            recorded = None
        if recorded is not None and recorded != resolved:
            raise ConfigError(f"the NVMe tier in {dirs[0]} was written with the drives {join_drives(recorded)}; "
                              f"now given {join_drives(resolved)}",
                              hint="pass --nvme-dir once for each of: " + " ".join(recorded) +
                                   " (or another drive 0 to start a new tier)")
    elif len(resolved) > 1:
        for other in resolved[1:]:  # a drive that leads a list of its own elsewhere would be shared
            if (Path(other) / MANIFEST).is_file():
                raise ConfigError(f"--nvme-dir {other} is drive 0 of another NVMe tier",
                                  hint="give each tier its own directories")
    if write and manifest is not None and len(resolved) > 1 and not manifest.is_file():
        fileio.mkdir(resolved[0])
        tmp = manifest.with_suffix(".tmp")
        fileio.write_small_file(tmp, json.dumps({"drives": resolved}).encode(), mode=0o644)
        fileio.replace(tmp, manifest)
        fileio.fsync_dir(manifest.parent)
    return warnings


def _named(outcome: Any, root: Path) -> Any:
    """A drive's failure says which drive (status and top show the message)."""
    if not isinstance(outcome, BaseException) or str(root) in str(outcome):
        return outcome
    named = StorageError(f"{outcome} (drive {root})")
    named.__cause__ = outcome
    return named


def _rank_key(key: bytes, drive: int) -> float:
    digest = hashlib.blake2b(key, digest_size=8, salt=drive.to_bytes(8, "little")).digest()
    return (int.from_bytes(digest, "little") + 1) / (2**64 + 1)  # in (0, 1)


class DriveSet:
    """One ``DiskStore`` over several ``NvmeStore`` drives; see the module docstring.

    ``roots`` are this rank's directories on each drive (``shard_dir`` of each ``--nvme-dir``)."""

    name = "nvme"

    def __init__(self, roots: Sequence[str | os.PathLike], capacity_bytes: int, io_threads: int = 8,
                 direct: str = "auto", rank: int = 0, readonly: bool = False, segment_bytes: int = SEGMENT_BYTES,
                 budgets: Sequence[int] | None = None):
        self.roots = [Path(r) for r in roots]
        if len(self.roots) < 1:
            raise StorageError("NVMe tier: no directory", hint="pass --nvme-dir")
        budgets = list(budgets) if budgets is not None else split_budget(self.roots, capacity_bytes)
        self.drives: list[NvmeStore] = []
        try:
            for root, budget in zip(self.roots, budgets):
                self.drives.append(NvmeStore(root, budget, io_threads, direct, rank=rank, readonly=readonly,
                                             segment_bytes=segment_bytes))
        except BaseException:
            for drive in self.drives:
                drive.close()
            raise
        self.rank = rank
        total = sum(budgets) or 1
        self._weights = [max(b, 1) / total for b in budgets]
        # two per drive: the mover's next batch starts on a drive while its last one finishes
        self._pool = ThreadPoolExecutor(max_workers=2 * len(self.drives), thread_name_prefix="kvtier-drives")

    # ---- placement ------------------------------------------------------------------------------
    def order(self, key: bytes) -> list[int]:
        """The drives in this block's order of preference (weighted rendezvous hashing)."""
        scores = [w / -math.log(_rank_key(key, i)) for i, w in enumerate(self._weights)]
        return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)

    def holder(self, namespace: bytes, key: bytes) -> int | None:
        """The drive that holds the block (no IO), None when none does."""
        for i in self.order(key):
            if self.drives[i].contains(namespace, key):
                return i
        return None

    def _each(self, groups: dict[int, list[int]], call) -> dict[int, Any]:
        """``call(drive, positions)`` for every drive with work, all drives at once."""
        if len(groups) == 1:
            ((i, positions),) = groups.items()
            return {i: call(self.drives[i], positions)}
        futures = {i: self._pool.submit(call, self.drives[i], positions) for i, positions in groups.items()}
        return {i: f.result() for i, f in futures.items()}

    # ---- blocks in and out ----------------------------------------------------------------------
    def write_batch(self, blocks: Sequence[tuple[bytes, bytes, Any, str]], fingerprint: bytes) -> list:
        """One group commit per drive, all drives at once; a block whose drive failed (full, read-only,
        gone) goes to its next drive. Per block what ``NvmeStore.write_batch`` says."""
        out: list = [None] * len(blocks)
        written_on: list[int | None] = [None] * len(blocks)
        orders = [self.order(b[1]) for b in blocks]
        pending = list(range(len(blocks)))
        for attempt in range(len(self.drives)):
            groups: dict[int, list[int]] = {}
            for pos in pending:
                groups.setdefault(orders[pos][attempt], []).append(pos)
            done = self._each(groups, lambda drive, ps: drive.write_batch([blocks[p] for p in ps], fingerprint))
            pending = []
            for i, positions in groups.items():
                for pos, outcome in zip(positions, done[i]):
                    out[pos] = outcome
                    if isinstance(outcome, BaseException):
                        pending.append(pos)
                    else:
                        written_on[pos] = i
            if not pending:
                break
        self._drop_other_copies(blocks, written_on)
        return out

    def _drop_other_copies(self, blocks: Sequence[tuple[bytes, bytes, Any, str]],
                           written_on: Sequence[int | None]) -> None:
        """A block just written to one drive while another copy lies on another drive (it went there
        when its own drive failed, or it goes elsewhere now because its own drive refuses writes):
        every copy but the one just written goes, so reads find the copy that was acknowledged and
        a later drop cannot leave an older one behind to be read."""
        stale: dict[int, list[Name]] = {}
        for (ns, key, _payload, _codec), kept in zip(blocks, written_on):
            if kept is None:
                continue
            for i, drive in enumerate(self.drives):
                if i != kept and drive.contains(ns, key):
                    stale.setdefault(i, []).append((ns, key))
        for i, names in stale.items():
            self.drives[i].delete_many(names)

    def read_batch(self, reads: Sequence[tuple[bytes, bytes, Any]], fingerprint: bytes) -> list:
        """Every drive reads its share at once (each its merged reads and its own queue depth)."""
        groups: dict[int, list[int]] = {}
        for pos, (ns, key, _dst) in enumerate(reads):
            where = self.holder(ns, key)
            groups.setdefault(self.order(key)[0] if where is None else where, []).append(pos)
        out: list = [None] * len(reads)
        done = self._each(groups, lambda drive, ps: drive.read_batch([reads[p] for p in ps], fingerprint))
        for i, positions in groups.items():
            for pos, outcome in zip(positions, done[i]):
                out[pos] = _named(outcome, self.drives[i].root)
        return out

    def read_into(self, namespace: bytes, key: bytes, dst: Any, fingerprint: bytes) -> tuple[int, str]:
        return self._drive_of(namespace, key).read_into(namespace, key, dst, fingerprint)

    def write(self, namespace: bytes, key: bytes, payload: Any, fingerprint: bytes, codec: str = "none") -> int:
        outcome = self.write_batch([(namespace, key, payload, codec)], fingerprint)[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def submit_read(self, namespace: bytes, key: bytes, *args: Any, **kwargs: Any):
        return self._drive_of(namespace, key).submit_read(namespace, key, *args, **kwargs)

    def _drive_of(self, namespace: bytes, key: bytes) -> NvmeStore:
        where = self.holder(namespace, key)
        return self.drives[self.order(key)[0] if where is None else where]

    def delete(self, namespace: bytes, key: bytes) -> int:
        return self.delete_many([(namespace, key)])

    def delete_many(self, names: Iterable[Name]) -> int:
        """Forget blocks on every drive that holds them."""
        groups: dict[int, list[Name]] = {}
        for ns, key in names:
            for i, drive in enumerate(self.drives):
                if drive.contains(ns, key):
                    groups.setdefault(i, []).append((ns, key))
        return sum(self.drives[i].delete_many(group) for i, group in groups.items())

    def compact(self, max_bytes: int = 64 << 20, sparse: float = 0.5) -> int:
        return sum(drive.compact(max_bytes, sparse) for drive in self.drives)

    # ---- what the drives say --------------------------------------------------------------------
    def contains(self, namespace: bytes, key: bytes) -> bool:
        return any(drive.contains(namespace, key) for drive in self.drives)

    has = contains

    def size_of(self, namespace: bytes, key: bytes) -> int | None:
        where = self.holder(namespace, key)
        return self.drives[where].size_of(namespace, key) if where is not None else None

    def locate(self, namespace: bytes, key: bytes) -> tuple[Path, int, int]:
        return self._drive_of(namespace, key).locate(namespace, key)

    def scan(self) -> list[BlockRecord]:
        return [record for drive in self.drives for record in drive.scan()]

    @property
    def capacity_bytes(self) -> int:
        return sum(d.capacity_bytes for d in self.drives)

    @property
    def used_bytes(self) -> int:
        return sum(d.used_bytes for d in self.drives)

    @property
    def num_blocks(self) -> int:
        return sum(d.num_blocks for d in self.drives)

    @property
    def segment_bytes(self) -> int:
        return self.drives[0].segment_bytes

    @property
    def direct(self) -> bool:
        return all(d.direct for d in self.drives)

    @property
    def recreated(self) -> int:
        return sum(d.recreated for d in self.drives)

    @property
    def removed_at_scan(self) -> int:
        return sum(d.removed_at_scan for d in self.drives)

    @property
    def rebuilt_index(self) -> int:
        return sum(int(d.rebuilt_index) for d in self.drives)

    @property
    def can_punch(self) -> bool:
        return all(d.can_punch for d in self.drives)

    @property
    def io_counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for drive in self.drives:
            total.update(drive.io_counts)
        return total

    def files(self) -> int:
        return sum(d.files() for d in self.drives)

    def disk_bytes(self) -> int:
        return sum(d.disk_bytes() for d in self.drives)

    def unnamed_tail_bytes(self) -> int:
        return sum(d.unnamed_tail_bytes() for d in self.drives)

    def free_bytes(self) -> int | None:
        """Free bytes on the drives' filesystems (each counted once)."""
        seen: dict[int, int] = {}
        for drive in self.drives:
            free = drive.free_bytes()
            if free is not None:
                seen[_device(drive.root)] = free
        return sum(seen.values()) if seen else None

    def stats(self) -> list[dict]:
        """Per drive: its directory, blocks, bytes used and budget."""
        return [{"dir": str(d.root), "blocks": d.num_blocks, "used_bytes": d.used_bytes,
                 "capacity_bytes": d.capacity_bytes} for d in self.drives]

    # ---- health ---------------------------------------------------------------------------------
    def check_present(self) -> bool:
        return any([drive.check_present() for drive in self.drives])  # every drive, not the first true

    def probe(self) -> str | None:
        for drive in self.drives:
            problem = drive.probe()
            if problem:
                return problem
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for drive in self.drives:
            drive.close()


def open_nvme(spec: str | os.PathLike, capacity_bytes: int, io_threads: int = 8, direct: str = "auto",
              rank: int = 0, shards: int = 1, readonly: bool = False) -> NvmeStore | DriveSet:
    """This rank's cold tier over the drives of ``spec``: an ``NvmeStore`` for one directory (as it
    always was), a ``DriveSet`` for several."""
    dirs = drive_dirs(spec)
    if dirs and (len(dirs) > 1 or (Path(dirs[0]) / MANIFEST).is_file()):
        check_drive_list(dirs, write=not readonly)  # a hand-written vLLM command line has no preflight
    if len(dirs) <= 1:
        return NvmeStore(shard_dir(dirs[0] if dirs else spec, rank, shards), capacity_bytes, io_threads, direct,
                         rank=rank, readonly=readonly)
    return DriveSet([shard_dir(d, rank, shards) for d in dirs], capacity_bytes, io_threads, direct, rank=rank,
                    readonly=readonly, budgets=split_budget(dirs, capacity_bytes))


def scan_drives(spec: str | os.PathLike, capacity_bytes: int, shards: int, direct: str = "auto") -> tuple[list, int]:
    """``scan_shards`` over every drive: the blocks they hold and the damaged records dropped."""
    dirs = drive_dirs(spec) or [str(spec)]
    if len(dirs) == 1:  # one drive: nothing to merge (no second map of every block at start-up)
        found = scan_shards(dirs[0], capacity_bytes, shards, direct)
        _trim_heap()
        return found
    records: dict = {}
    removed = 0
    for d, budget in zip(dirs, split_budget(dirs, capacity_bytes)):
        found, bad = scan_shards(d, budget, shards, direct)
        for record in found:  # a block on two drives (a crash before its older copy went) counts once
            records.setdefault((record.namespace, record.key), record)
        removed += bad
    _trim_heap()
    return list(records.values()), removed


def _trim_heap() -> None:
    """Give the heap the scan's read-only stores freed back to the system (glibc keeps it otherwise:
    a few hundred bytes a block of a server's resident memory, for as long as it runs)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
