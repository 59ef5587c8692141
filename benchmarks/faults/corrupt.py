"""On-disk corruption: damaged records and snapshots must be detected, never served (part of
``python -m benchmarks faults``)."""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.faults.world import (
    SHAPE,
    World,
    _tokens,
)

# ---- corruption ----------------------------------------------------------------------------------------------
FAULTS = ("bitflip", "truncate", "zero_page", "swap")
# a block record in a segment: the snapshot faults, plus a torn last write (the disk lost the end of
# the newest record: its tail zeroed or the segment cut inside it) and a flipped bit in the index
# entry naming the block
BLOCK_FAULTS = (*FAULTS, "torn_tail", "index_bitflip")


@dataclass(frozen=True)
class _Record:
    """One block record in a copy of the tier: where it is, to damage it."""

    key: bytes
    path: Path
    offset: int
    nbytes: int

    def moved_to(self, old_root: Path, new_root: Path) -> "_Record":
        return _Record(self.key, new_root / self.path.relative_to(old_root), self.offset, self.nbytes)


def _records(nvme_dir: Path) -> list[_Record]:
    from kvtier.tiers.nvme.store import NvmeStore

    store = NvmeStore(nvme_dir, 1 << 40, io_threads=1, readonly=True)
    try:
        found = [_Record(r.key, *store.locate(r.namespace, r.key)[:2], r.nbytes) for r in store.scan()]
    finally:
        store.close()
    return sorted(found, key=lambda r: (r.path, r.offset))


def _damage_record(record: _Record, fault: str, rng: random.Random, others: list[_Record]) -> str:
    """Apply ``fault`` to one record (or to its index entry) so it changes meaningful bytes."""
    from kvtier.tiers.dram import PAGE
    from kvtier.tiers.records import _HEADER, HEADER_BYTES

    start, end = record.offset, record.offset + HEADER_BYTES + record.nbytes
    ranges = [(start, start + _HEADER.size + 8), (start + HEADER_BYTES, end)]
    path = record.path
    with open(path, "r+b") as f:
        fd = f.fileno()
        if fault == "bitflip":
            lo, hi = rng.choice(ranges)
            at = rng.randrange(lo, hi)
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ (1 << rng.randrange(8))]), at)
            return f"bit flipped at {at}"
        if fault == "truncate":
            at = rng.randrange(start, end)
            os.truncate(path, at)
            return f"segment cut at {at}"
        if fault == "zero_page":
            lo, hi = rng.choice(ranges)
            page = rng.randrange(lo // PAGE, (hi - 1) // PAGE + 1)
            os.pwrite(fd, bytes(PAGE), page * PAGE)
            return f"page {page} zeroed"
        if fault == "swap":  # another block's record under this one's index entry
            other = rng.choice([o for o in others if o.key != record.key and o.nbytes == record.nbytes])
            with open(other.path, "rb") as g:
                os.pwrite(fd, os.pread(g.fileno(), end - start, other.offset), start)
            return f"replaced by the record at {other.offset}"
        if fault == "torn_tail":
            at = rng.randrange(start, end)
            if rng.random() < 0.5:
                os.truncate(path, at)
                return f"last record cut at {at}"
            os.pwrite(fd, bytes(end - at), at)
            return f"last record zeroed from {at}"
    from kvtier.tiers.nvme.journal import ENTRY_BYTES, JOURNAL_NAME

    journal = path.parent.parent / JOURNAL_NAME  # index_bitflip: the entry naming this block
    data = bytearray(journal.read_bytes())
    at = data.index(record.key)
    entry = 64 + (at - 64) // ENTRY_BYTES * ENTRY_BYTES
    flip = rng.randrange(entry, entry + ENTRY_BYTES)
    data[flip] ^= 1 << rng.randrange(8)
    journal.write_bytes(bytes(data))
    return f"index entry bit flipped at {flip}"


def _meaningful_ranges(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of a snapshot that carry data (not alignment padding): a fault there must be caught."""
    from kvtier.persist.snapshot import _PREAMBLE, PREAMBLE_BYTES, open_snapshot

    info = open_snapshot(path)
    header_len = _PREAMBLE.unpack_from(path.read_bytes()[: _PREAMBLE.size])[3]
    ranges = [(0, _PREAMBLE.size), (PREAMBLE_BYTES, PREAMBLE_BYTES + header_len)]
    ranges += [(b.offset, b.offset + b.nbytes) for b in info.blocks if b.nbytes]
    return ranges


def _damage(path: Path, fault: str, rng: random.Random) -> str:
    """Apply ``fault`` to a snapshot file so that it changes meaningful bytes; returns a description."""
    from kvtier.tiers.dram import PAGE

    data = bytearray(path.read_bytes())
    ranges = _meaningful_ranges(path)
    if fault == "bitflip":
        lo, hi = rng.choice(ranges)
        offset = rng.randrange(lo, hi)
        data[offset] ^= 1 << rng.randrange(8)
        what = f"bit flipped at {offset}"
    elif fault == "truncate":
        end = max(hi for _lo, hi in ranges)
        size = rng.randrange(0, end)  # cuts into meaningful bytes
        del data[size:]
        what = f"truncated to {size}"
    elif fault == "zero_page":
        lo, hi = rng.choice(ranges)
        while True:
            page = rng.randrange(lo // PAGE, (hi - 1) // PAGE + 1)
            if any(data[page * PAGE : (page + 1) * PAGE]):
                break
        data[page * PAGE : (page + 1) * PAGE] = bytes(len(data[page * PAGE : (page + 1) * PAGE]))
        what = f"page {page} zeroed"
    else:  # swap two blocks' payloads inside the snapshot (a whole snapshot under another name is
        # just that session's valid snapshot: content-addressed blocks restore correctly)
        from kvtier.persist.snapshot import open_snapshot

        blocks = [b for b in open_snapshot(path).blocks if b.nbytes]
        a, b = rng.sample(blocks, 2)
        n = min(a.nbytes, b.nbytes)
        data[a.offset : a.offset + n], data[b.offset : b.offset + n] = data[b.offset : b.offset + n], \
            data[a.offset : a.offset + n]
        what = f"payloads at {a.offset} and {b.offset} swapped"
    path.write_bytes(bytes(data))
    return what


def run_corruption_trials(trials: int = 1000, seed: int = 0, directory: Path | None = None,
                          progress: Callable[[str], None] = print) -> dict:
    """Damage one NVMe block file or one snapshot file per trial, then load it through a fresh engine."""
    from kvtier.errors import KvtierError
    from kvtier.plan.index import Tier, chain_block_hashes

    rng = random.Random(seed)
    out = {"corruption_trials": 0, "detected": 0, "corrupt_loads": 0, "harmless": 0}
    by_fault: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-faults-corrupt-", dir=directory) as tmp:
        pristine = Path(tmp) / "pristine"
        world = World(pristine)
        sessions = []
        for s in range(6):  # six sessions of 4-7 blocks, all on NVMe, each also a snapshot
            tokens = _tokens(900 + s, 4 + s % 4)
            keys = chain_block_hashes(tokens, SHAPE[3])
            world.put(keys, range(len(keys)))
            world.engine.store(f"p{s}", world.ns, keys, list(range(len(keys))), num_tokens=len(keys) * SHAPE[3],
                               token_ids=tokens)
            world.engine.evict(f"p{s}", Tier.NVME)
            world.engine.snapshot(f"p{s}", world.snapshots / f"p{s}.kvsnap")
            sessions.append(keys)
        world.close()
        block_records = _records(pristine / "nvme")
        snap_files = sorted(world.snapshots.glob("*.kvsnap"))
        work = Path(tmp) / "work"
        started = time.perf_counter()
        for trial in range(trials):
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(pristine, work)
            kind = "block" if trial % 2 == 0 else "snapshot"
            if kind == "block":
                fault = BLOCK_FAULTS[(trial // 2) % len(BLOCK_FAULTS)]
                records = [r.moved_to(pristine, work) for r in block_records]
                record = records[-1] if fault == "torn_tail" else rng.choice(records)  # a tail is the newest
                what = _damage_record(record, fault, rng, records)
            else:
                fault = FAULTS[(trial // 2) % len(FAULTS)]
                target = rng.choice([work / p.relative_to(pristine) for p in snap_files])
                what = _damage(target, fault, rng)
            if kind == "snapshot":  # the restore must read the snapshot: the tiers start empty
                shutil.rmtree(work / "nvme")
            world = World(work)
            detail = ""
            try:
                if kind == "block":
                    keys = next(k for k in sessions if record.key in k)
                    counters = world.engine.manager.telemetry.counters
                    loaded, wrong = world.load_and_check(keys)
                    # a damaged file is dropped at start (wrong size) or at its first read (checksums)
                    dropped = counters["nvme_failed_reads"] + counters["nvme_removed_at_start"]
                    # caught: the damaged block (or the one it was swapped with) is dropped, counted, and
                    # the load stops before it (vLLM recomputes from there); nothing wrong is served
                    caught = dropped > 0 and loaded < len(keys)
                    harmless = loaded == len(keys) and not wrong
                else:
                    wrong, caught, harmless = [], False, False
                    try:
                        info_keys = sessions[int(target.stem[1:])]
                        result = world.engine.restore(target)
                        if result is not None and not result.ok:
                            caught = True
                        else:
                            detail = f"restored ok: {result}"
                            _n, wrong = world.load_and_check(info_keys)
                            harmless = not wrong
                    except KvtierError:
                        caught = True
            finally:
                world.close()
            if os.environ.get("KVTIER_FAULTS_DEBUG") and not caught:
                print(kind, fault, what, "harmless" if harmless else "NOT CAUGHT", detail)
            out["corruption_trials"] += 1
            out["corrupt_loads"] += len(wrong)
            out["detected"] += caught
            out["harmless"] += harmless and not caught
            stats = by_fault.setdefault(f"{kind}:{fault}", [0, 0])
            stats[0] += 1
            stats[1] += caught
            if (trial + 1) % 200 == 0:
                progress(f"corruption trials: {trial + 1}/{trials}, {out['detected']} detected, "
                         f"{out['corrupt_loads']} wrong loads")
        out["_seconds"] = round(time.perf_counter() - started, 1)
    faulty = out["corruption_trials"] - out["harmless"]
    out["corruption_detected_ratio"] = round(out["detected"] / faulty, 6) if faulty else 1.0
    out["_by_fault"] = {k: {"trials": v[0], "detected": v[1]} for k, v in sorted(by_fault.items())}
    return out
