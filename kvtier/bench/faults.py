"""``kvtier bench faults``: crashes, corruption, pressure and hostile input against kvtier's own data
path (tier manager, mover, NVMe files with direct IO, snapshot files, admin socket), with figures.

kvtier's promise, checked here: it never serves a block that is not exactly what was stored for
that model, tenant and prefix; it loses nothing it acknowledged; under a fault it drops the bad
block and lets vLLM recompute it rather than failing a request.

Every block's content is a function of its key (``reference_block``), so any load, anywhere, can
be checked bit for bit without remembering what was stored.

* ``crash``: a child process runs a ``TierEngine`` doing random stores, demotions, evictions,
  snapshots, restores, loads and drops on a persistent NVMe directory, and reports on a pipe what
  became durable (a demoted block, a snapshot) and what it is about to delete. The parent kills it
  with SIGKILL at a random moment, opens a fresh engine on the same directories (a restart), and
  loads every visible block and every visible snapshot, comparing each with its reference.
  Children are forked from a zygote process that has imported torch but never run it (fast, and
  safe with OpenMP).
* ``corruption``: flipped bits, truncation, zeroed pages and files swapped between blocks, in NVMe
  block files and in snapshot files, each followed by a load or a restore through a fresh engine:
  the fault must be detected (the block dropped and counted, the load reported failed so vLLM
  recomputes) or be provably harmless (the loaded bytes are the reference's).
* ``pressure``: 1,000 sessions churn through a small DRAM budget (slot use sampled after every
  operation; process RSS against budget + index overhead).
* ``hostile``: the admin API fuzzer (``kvtier.bench.admin.fuzz``), crafted snapshot files (valid
  checksums, hostile sizes, offsets, counts and fingerprints), odd session ids, and blocks written
  under another model or another tenant's cache salt.

The load, ENOSPC-while-serving and recompute-equals-baseline parts run against real vLLM:
``kvtier.bench.vllm.faults``.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["reference_block", "run_crash_trials", "run_corruption_trials", "run_pressure", "run_hostile",
           "run_faults_bench", "FAULT_KEYS"]

FAULT_KEYS = ("crash_trials", "corrupt_loads", "corruption_trials", "corruption_detected_ratio",
              "failed_requests_under_load", "outputs_mismatched", "dram_budget_exceeded", "hostile_inputs",
              "hostile_crashes", "poisoning_attempts", "poisoned_loads", "accepted_forged", "slot_leaks",
              "path_escapes_tried", "path_escapes", "blocked_requests")

SHAPE = (2, 2, 32, 16)  # layers, KV heads, head dim, block tokens: 8 KiB blocks in bf16
HBM_BLOCKS = 48


# ---- a small world: an engine whose blocks are functions of their keys ---------------------------------
def _fingerprint(name: str = "faults-model"):
    from kvtier.layout import KVGeometry, ModelFingerprint

    return ModelFingerprint(name, KVGeometry(*SHAPE))


def reference_block(key: bytes, geometry):
    """The canonical block kvtier must hand back for ``key``: random bits seeded by the key."""
    import torch

    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))
    bits = torch.randint(-32768, 32767, (1, *geometry.block_shape), dtype=torch.int16, generator=generator)
    return bits.view(torch.bfloat16)


class World:
    """A ``TierEngine`` on CPU-layout 'HBM', with helpers to put reference blocks in and check them."""

    def __init__(self, root: Path, dram_blocks: int = 24, nvme_blocks: int = 400, name: str = "faults-model",
                 cold_codec: str = "none"):
        import torch

        from kvtier.engine import TierEngine
        from kvtier.index import namespace_of
        from kvtier.layout import CpuLayout, adapter_for
        from kvtier.tiers.nvme import file_bytes_for

        self.fingerprint = _fingerprint(name)
        self.geometry = g = self.fingerprint.geometry
        self.hbm = [torch.zeros(CpuLayout(g).layer_shape(HBM_BLOCKS),
                                dtype=torch.bfloat16) for _ in range(g.num_layers)]
        self.adapter = adapter_for("cpu", g)
        self.root = Path(root)
        self.snapshots = self.root / "snapshots"
        self.snapshots.mkdir(parents=True, exist_ok=True)
        self.engine = TierEngine(self.fingerprint, dram_blocks * g.block_bytes, self.root / "nvme",
                                 nvme_blocks * file_bytes_for(g.block_bytes), kv_layers=self.hbm, io_threads=2,
                                 cold_codec=cold_codec)
        self.ns = namespace_of(self.fingerprint.digest)

    def put(self, keys, device_blocks) -> None:
        """Fill HBM blocks with the reference content of ``keys`` (what vLLM's forward would compute)."""
        import torch

        if keys:
            blocks = torch.cat([reference_block(k, self.geometry) for k in keys])
            self.adapter.scatter(blocks, self.hbm, list(device_blocks))

    def wrong(self, keys, device_blocks) -> list[bytes]:
        """Keys whose HBM block differs (bit for bit) from its reference."""
        import torch

        out = torch.empty((len(keys), *self.geometry.block_shape), dtype=torch.bfloat16)
        self.adapter.gather(self.hbm, list(device_blocks), out)
        return [k for i, k in enumerate(keys)
                if not torch.equal(out[i].view(torch.int16), reference_block(k, self.geometry)[0].view(torch.int16))]

    def scrub(self, device_blocks) -> None:
        """Poison HBM blocks so a load that writes nothing cannot pass for a correct one."""
        import torch

        poison = torch.full((len(device_blocks), *self.geometry.block_shape), float("nan"), dtype=torch.bfloat16)
        self.adapter.scatter(poison, self.hbm, list(device_blocks))

    def load_and_check(self, keys: list[bytes]) -> tuple[int, list[bytes]]:
        """Load the stored prefix of ``keys`` (in HBM-sized batches): (blocks loaded, wrong ones)."""
        loaded, wrong = 0, []
        for start in range(0, len(keys), HBM_BLOCKS):
            batch = keys[start : start + HBM_BLOCKS]
            device = list(range(len(batch)))
            self.scrub(device)
            n = self.engine.load(self.ns, batch, device)
            loaded += n
            wrong += self.wrong(batch[:n], device[:n])
            if n < len(batch):
                break
        return loaded, wrong

    def visible_nvme_keys(self) -> set[bytes]:
        from kvtier.index import IN_NVME, PENDING

        index = self.engine.manager.index
        flags = index.col["flags"]
        return {index.key_of(r)[1] for r in range(len(index._keys))
                if index._keys[r] is not None and flags[r] & IN_NVME and not flags[r] & PENDING}

    def close(self) -> None:
        self.engine.close(write_back=False)


def _tokens(tag: int, blocks: int, prefix: list[int] | None = None) -> list[int]:
    base = list(prefix or [])
    return base + [(tag * 7919 + i * 131) % 50_000 for i in range(blocks * SHAPE[3] - len(base))]


# ---- crash consistency ----------------------------------------------------------------------------------------
def _crash_child(root: str, seed: int, fd: int) -> None:
    """Random tiering work until killed; every durable effect is announced on ``fd`` only once it is
    durable, and every NVMe deletion before it may happen."""
    import torch

    from kvtier.index import Tier, chain_block_hashes
    from kvtier.jobs import JobKind

    torch.set_num_threads(1)
    rng = random.Random(seed)

    def say(*lines: str) -> None:
        if lines:
            os.write(fd, ("\n".join(lines) + "\n").encode())

    world = World(Path(root))
    engine = world.engine
    run_job = engine.execute

    def execute(job):
        if job is not None:
            say(*(f"gone {d.key.hex()}" for d in job.drops))
            if job.kind in (JobKind.LOAD, JobKind.PROMOTE):  # a bad read deletes the block: announce first
                say(*(f"maybe {m.key.hex()}" for m in job.moves if m.from_nvme))
        result = run_job(job)
        if job is not None and job.kind in (JobKind.DEMOTE, JobKind.RESTORE):
            failed = set(result.failed) if not result.ok else set()
            if not result.ok and not result.failed:
                failed = set(range(len(job.moves)))
            say(*(f"nvme {m.key.hex()}" for i, m in enumerate(job.moves)
                  if i not in failed and (job.kind == JobKind.DEMOTE or m.to_nvme)))
        return result

    engine.execute = execute
    sessions: dict[str, list[int]] = {}
    say("ready")
    for step in range(1_000_000):
        op = rng.choice(["store", "store", "extend", "maintain", "evict", "snapshot", "restore", "load", "drop"])
        say(f"op {op}")
        if op in ("store", "extend") or not sessions:
            if op == "extend" and sessions:
                sid = rng.choice(list(sessions))
                tokens = _tokens(seed * 1000 + step, len(sessions[sid]) // SHAPE[3] + rng.randint(1, 4), sessions[sid])
            else:
                sid = f"c{seed}-{step}"
                tokens = _tokens(seed * 1000 + step, rng.randint(2, 12))
            keys = chain_block_hashes(tokens, SHAPE[3])[: HBM_BLOCKS]
            world.put(keys, range(len(keys)))
            engine.store(sid, world.ns, keys, list(range(len(keys))), num_tokens=len(keys) * SHAPE[3],
                         token_ids=tokens[: len(keys) * SHAPE[3]])
            sessions[sid] = tokens[: len(keys) * SHAPE[3]]
        elif op == "maintain":
            engine.maintain(force=True)
        elif op == "evict":
            sid = rng.choice(list(sessions))
            with contextlib.suppress(Exception):  # pinned, shared or already gone: not this test's subject
                engine.execute(engine.manager.evict(sid, Tier.NVME))
        elif op == "snapshot":
            sid = rng.choice(list(sessions))
            path = world.snapshots / f"s{seed}-{step}.kvsnap"
            with contextlib.suppress(Exception):
                result = engine.snapshot(sid, path)
                if result is not None and result.ok:
                    say(f"snap {path.name}")
        elif op == "restore":
            files = sorted(world.snapshots.glob("*.kvsnap"))
            if files:
                with contextlib.suppress(Exception):
                    engine.restore(rng.choice(files), rng.choice([Tier.DRAM, Tier.NVME]))
        elif op == "load":
            sid = rng.choice(list(sessions))
            keys = chain_block_hashes(sessions[sid], SHAPE[3])
            _n, wrong = world.load_and_check(keys)
            say(*(f"wrong {k.hex()}" for k in wrong))
        elif op == "drop":
            sid = rng.choice(list(sessions))
            with contextlib.suppress(Exception):
                engine.execute(engine.manager.evict(sid, None))
            sessions.pop(sid, None)


def _verify_after_restart(root: Path, acked_nvme: set[bytes], acked_snaps: set[str], check_snaps: list[Path],
                          out: dict) -> None:
    from kvtier.snapshot import open_snapshot, remove_stale_temp_files, verify_snapshot

    world = World(root)  # a restart: replays the NVMe index (or rebuilds it), punches torn tails
    try:
        store = world.engine.nvme
        out["unnamed_bytes_after_restart"] += store.unnamed_tail_bytes()
        out["index_rebuilds"] += store.rebuilt_index
        visible = world.visible_nvme_keys()
        lost = acked_nvme - visible
        out["lost_acknowledged_blocks"] += len(lost)
        keys = sorted(visible)
        loaded, wrong = 0, []
        for start in range(0, len(keys), HBM_BLOCKS):  # every visible block, one by one in batches
            batch = keys[start : start + HBM_BLOCKS]
            device = list(range(len(batch)))
            world.scrub(device)
            job = world.engine.manager.prepare_load(
                [world.engine.manager.index.row_of(world.ns, k) for k in batch], device)
            result = world.engine.execute(job)
            good = [i for i in range(len(batch)) if i not in set(result.failed or ())] if result.ok or result.failed \
                else []
            out["unreadable_blocks"] += len(batch) - len(good)
            wrong += world.wrong([batch[i] for i in good], [device[i] for i in good])
            loaded += len(good)
        out["blocks_checked"] += loaded
        out["corrupt_loads"] += len(wrong)
        out["snapshot_temp_files_cleaned"] += remove_stale_temp_files(world.snapshots, older_than_s=0)
        present = {p.name for p in world.snapshots.glob("*.kvsnap")}
        out["lost_acknowledged_snapshots"] += len(acked_snaps - present)
        for path in check_snaps:
            if not path.exists():
                continue
            try:
                info = verify_snapshot(open_snapshot(path), world.fingerprint)
            except Exception:  # noqa: BLE001 - a visible snapshot must be complete and intact
                out["bad_snapshots"] += 1
                continue
            out["snapshots_checked"] += 1
            keys = [b.key for b in info.blocks]
            world.engine.restore(path)
            _n, wrong = world.load_and_check(keys)
            out["corrupt_loads"] += len(wrong)
    finally:
        world.close()


def _unnamed_tail(nvme_dir: Path) -> int:
    from kvtier.tiers.nvme import NvmeStore

    if not nvme_dir.is_dir():
        return 0
    store = NvmeStore(nvme_dir, 1 << 40, io_threads=1, readonly=True)
    try:
        return store.unnamed_tail_bytes()
    finally:
        store.close()


_ZYGOTE = """
import os, signal, sys
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
import torch  # imported, never run here: forked children may use OpenMP safely
import kvtier.bench.faults as faults
for line in sys.stdin:
    root, seed, fifo = line.split()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd = os.open(fifo, os.O_WRONLY)
        try:
            faults._crash_child(root, int(seed), fd)
        finally:
            os._exit(0)
    print(pid, flush=True)
"""


def run_crash_trials(trials: int = 200, seed: int = 0, directory: Path | None = None,
                     progress: Callable[[str], None] = print) -> dict:
    """SIGKILL a tiering engine ``trials`` times at random moments; verify everything after each.

    Children are forked by a zygote process that has imported torch and kvtier (so a trial starts
    in milliseconds, like a restarted server that is already installed)."""
    import subprocess
    import sys

    rng = random.Random(seed)
    out = {k: 0 for k in ("crash_trials", "corrupt_loads", "lost_acknowledged_blocks", "lost_acknowledged_snapshots",
                          "bad_snapshots", "unreadable_blocks", "blocks_checked", "snapshots_checked",
                          "torn_tail_trials", "unnamed_bytes_after_restart", "index_rebuilds", "live_wrong_loads",
                          "snapshot_temp_files_cleaned")}
    killed_during: dict[str, int] = {}
    acked_nvme: set[bytes] = set()
    acked_snaps: set[str] = set()
    env = dict(os.environ, OMP_NUM_THREADS="1", KVTIER_NO_NUMBA=os.environ.get("KVTIER_NO_NUMBA", "1"))
    zygote = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-faults-crash-", dir=directory) as tmp:
            root = Path(tmp) / "engine"
            fifo = Path(tmp) / "acks"
            started = time.perf_counter()
            for trial in range(trials):
                os.mkfifo(fifo)
                zygote.stdin.write(f"{root} {seed * 100_000 + trial} {fifo}\n")
                zygote.stdin.flush()
                pid = int(zygote.stdout.readline())
                read_fd = os.open(fifo, os.O_RDONLY)  # blocks until the child opens its end
                buffer = b""
                while b"ready\n" not in buffer:  # the restart itself is not the subject
                    chunk = os.read(read_fd, 65536)
                    if not chunk:
                        break
                    buffer += chunk
                time.sleep(rng.uniform(0.0, 0.4))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                while True:
                    chunk = os.read(read_fd, 65536)
                    if not chunk:  # EOF: the child is dead
                        break
                    buffer += chunk
                os.close(read_fd)
                fifo.unlink()
                last_op = "start"
                for line in buffer.decode().split("\n")[:-1]:  # complete lines only
                    word, _, arg = line.partition(" ")
                    if word == "op":
                        last_op = arg
                    elif word == "nvme":
                        acked_nvme.add(bytes.fromhex(arg))
                    elif word in ("gone", "maybe"):
                        acked_nvme.discard(bytes.fromhex(arg))
                    elif word == "snap":
                        acked_snaps.add(arg)
                    elif word == "wrong":
                        out["live_wrong_loads"] += 1
                killed_during[last_op] = killed_during.get(last_op, 0) + 1
                out["torn_tail_trials"] += _unnamed_tail(root / "nvme") > 0  # a batch the kill cut short
                if trial % 4 == 3:  # every fourth restart also finds its index gone: rebuilt from the segments
                    from kvtier.tiers.journal import JOURNAL_NAME

                    (root / "nvme" / JOURNAL_NAME).unlink(missing_ok=True)
                snaps = sorted((root / "snapshots").glob("*.kvsnap"), key=lambda p: p.stat().st_mtime)
                check = snaps[-3:] + rng.sample(snaps[:-3], min(2, len(snaps[:-3])))  # newest, and a few older
                _verify_after_restart(root, acked_nvme, acked_snaps, check, out)
                out["crash_trials"] += 1
                if (trial + 1) % 25 == 0:
                    progress(f"crash trials: {trial + 1}/{trials}, {out['blocks_checked']} block loads checked, "
                             f"{out['corrupt_loads']} wrong, {out['lost_acknowledged_blocks']} lost")
            out["_seconds"] = round(time.perf_counter() - started, 1)
            out["_acknowledged_blocks_at_end"] = len(acked_nvme)
            out["_snapshots_at_end"] = len(list((root / "snapshots").glob("*.kvsnap")))
    finally:
        zygote.stdin.close()
        zygote.wait(30)
    out["corrupt_loads"] += out["live_wrong_loads"]
    out["_killed_during"] = killed_during
    return out


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
    from kvtier.tiers.nvme import NvmeStore

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
    from kvtier.tiers.journal import ENTRY_BYTES, JOURNAL_NAME

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
    from kvtier.snapshot import _PREAMBLE, PREAMBLE_BYTES, open_snapshot

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
        from kvtier.snapshot import open_snapshot

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
    from kvtier.index import Tier, chain_block_hashes

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
                    counters = world.engine.manager.counters
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


# ---- pressure ----------------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_pressure(sessions: int = 1000, dram_blocks: int = 64, seed: int = 0, directory: Path | None = None,
                 progress: Callable[[str], None] = print) -> dict:
    """``sessions`` sessions churn through a ``dram_blocks`` DRAM tier (with NVMe behind it)."""
    import gc

    from kvtier.index import chain_block_hashes

    rng = random.Random(seed)
    out = {"pressure_sessions": sessions, "dram_budget_exceeded": 0, "wrong_loads": 0}
    with tempfile.TemporaryDirectory(prefix="kvtier-faults-pressure-", dir=directory) as tmp:
        warm = World(Path(tmp) / "warm", dram_blocks=4, nvme_blocks=8)  # libraries and kernels paged in once
        keys = chain_block_hashes(_tokens(-1, 2), SHAPE[3])
        warm.put(keys, [0, 1])
        warm.engine.store("warm", warm.ns, keys, [0, 1])
        warm.load_and_check(keys)
        warm.close()
        del warm
        gc.collect()
        rss_before = _rss_bytes()
        world = World(Path(tmp) / "engine", dram_blocks=dram_blocks, nvme_blocks=2000)
        world.load_and_check([])  # first use of the IO paths: buffers allocated once
        gc.collect()
        rss_ready = _rss_bytes()
        engine = world.engine
        slots = engine.manager.slots
        budget = dram_blocks * world.geometry.block_bytes
        arena_bytes = engine.arena.buffer.numel()  # the DRAM tier's memory, allocated once
        peak_slots = 0
        history: dict[str, list[int]] = {}
        for i in range(sessions):
            sid = f"u{i}"
            tokens = _tokens(i, rng.randint(2, 12))
            keys = chain_block_hashes(tokens, SHAPE[3])
            world.put(keys, range(len(keys)))
            engine.store(sid, world.ns, keys, list(range(len(keys))), num_tokens=len(tokens), token_ids=tokens)
            history[sid] = tokens
            peak_slots = max(peak_slots, slots.used_slots)
            out["dram_budget_exceeded"] += slots.used_slots * slots.slot_bytes > budget
            if rng.random() < 0.3:  # an older session comes back
                back = rng.choice(list(history))
                _n, wrong = world.load_and_check(chain_block_hashes(history[back], SHAPE[3]))
                out["wrong_loads"] += len(wrong)
                peak_slots = max(peak_slots, slots.used_slots)
                out["dram_budget_exceeded"] += slots.used_slots * slots.slot_bytes > budget
            if (i + 1) % 250 == 0:
                progress(f"pressure: {i + 1}/{sessions} sessions, DRAM peak {peak_slots}/{slots.num_slots} slots")
        gc.collect()
        rss_after = _rss_bytes()
        index_bytes = engine.manager.index.memory_bytes()
        out.update(_dram_budget_bytes=budget, _dram_peak_bytes=peak_slots * slots.slot_bytes,
                   _dram_arena_bytes=int(arena_bytes), _rss_engine_start_bytes=rss_ready - rss_before,
                   _rss_churn_growth_bytes=rss_after - rss_ready,
                   _index_bytes=index_bytes, _blocks_indexed=len(engine.manager.index),
                   _nvme_blocks=engine.manager.stats()["nvme"]["blocks"])
        world.close()
    return out


# ---- hostile input -------------------------------------------------------------------------------------------
def _crafted_snapshots(directory: Path, fingerprint, other_fingerprint) -> list[tuple[str, Path]]:
    """Snapshot files with valid checksums and hostile contents."""
    import xxhash

    from kvtier.snapshot import _PREAMBLE, FORMAT_VERSION, MAGIC, PREAMBLE_BYTES, write_snapshot
    from kvtier.tiers.dram import PAGE, round_up

    base = directory / "base.kvsnap"
    payloads = [bytes([i]) * 3000 for i in range(3)]
    keys = [bytes([i]) * 32 for i in range(3)]
    write_snapshot(base, fingerprint, "victim", bytes(16), "none", 48, keys, payloads, token_ids=list(range(48)))
    raw = base.read_bytes()
    _m, _v, _f, header_len, _x, payload_offset, file_len = _PREAMBLE.unpack_from(raw)
    header = json.loads(raw[PREAMBLE_BYTES : PREAMBLE_BYTES + header_len])
    cases: list[tuple[str, Path]] = []

    def craft(name: str, doc: dict, tail: bytes | None = None, file_len_override: int | None = None,
              header_len_override: int | None = None) -> None:
        text = json.dumps(doc).encode()
        hlen = len(text)
        offset = round_up(PREAMBLE_BYTES + hlen)
        body = raw[payload_offset:] if tail is None else tail
        total = offset + len(body) if file_len_override is None else file_len_override
        pre = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, header_len_override or hlen, xxhash.xxh3_64_intdigest(text),
                             offset, total)
        data = pre.ljust(PREAMBLE_BYTES, b"\0") + text
        data = data.ljust(offset, b"\0") + body
        path = directory / f"{name}.kvsnap"
        path.write_bytes(data)
        cases.append((name, path))

    def blocks(**change) -> dict:
        doc = json.loads(json.dumps(header))
        for i, block in enumerate(doc["blocks"]):
            block.update({k: v[i] if isinstance(v, list) else v for k, v in change.items()})
        return doc

    craft("offset_past_end", blocks(offset=[payload_offset, payload_offset + PAGE, 1 << 62]))
    craft("offset_negative", blocks(offset=[-PAGE, payload_offset, payload_offset + PAGE]))
    craft("nbytes_overflow", blocks(nbytes=[2**64 - 1, 3000, 3000]))
    craft("nbytes_huge", blocks(nbytes=[1 << 40, 3000, 3000]))
    craft("overlapping_blocks", blocks(offset=[payload_offset] * 3))
    craft("unaligned_offset", blocks(offset=[payload_offset + 1, payload_offset + PAGE, payload_offset + 2 * PAGE]))
    many = json.loads(json.dumps(header))
    many["blocks"] = many["blocks"] * 4000
    craft("block_count_lies", many)
    tokens = json.loads(json.dumps(header))
    tokens["num_tokens"] = 2**70
    craft("num_tokens_overflow", tokens)
    keyed = blocks(key=["zz", "00", "11"])
    craft("key_not_hex", keyed)
    other = json.loads(json.dumps(header))
    other["fingerprint"] = other_fingerprint.to_dict()
    craft("other_model", other)
    forged = json.loads(json.dumps(header))
    forged["fingerprint"]["model_id"] = "someone-else"  # digest kept: must not be trusted alone
    craft("fingerprint_forged", forged)
    craft("file_len_lies", header, file_len_override=file_len * 1000)
    craft("header_len_lies", header, header_len_override=1 << 40)
    session = json.loads(json.dumps(header))
    session["session_id"] = "../../etc/passwd"
    craft("session_id_traversal", session)
    return cases


def run_hostile(examples: int = 600, directory: Path | None = None, progress: Callable[[str], None] = print) -> dict:
    """Hostile input at every door: the admin API, snapshot files, session ids, other models' blocks."""
    from kvtier.bench.admin import run_fuzz
    from kvtier.errors import KvtierError
    from kvtier.index import Tier, chain_block_hashes, namespace_of, validate_session_id
    from kvtier.snapshot import open_snapshot

    out = {"hostile_inputs": 0, "hostile_crashes": 0, "hostile_accepted": 0, "served_across_models": 0,
           "served_across_tenants": 0}
    cases: dict[str, str] = {}
    fuzz = run_fuzz(examples, progress)
    out["hostile_inputs"] += fuzz["fuzz_requests"]
    out["hostile_crashes"] += fuzz["fuzz_crashes"]
    out["hostile_accepted"] += fuzz["fuzz_accepted_invalid"]
    with tempfile.TemporaryDirectory(prefix="kvtier-faults-hostile-", dir=directory) as tmp:
        root = Path(tmp)
        world = World(root / "a")
        try:
            crafted = root / "crafted"
            crafted.mkdir()
            for name, path in _crafted_snapshots(crafted, world.fingerprint, _fingerprint("another-model")):
                out["hostile_inputs"] += 1
                try:
                    world.engine.restore(path)
                    cases[name] = "ACCEPTED"
                    out["hostile_accepted"] += 1
                except KvtierError as exc:
                    cases[name] = str(exc).split("\n")[0][:120]
                except Exception as exc:  # noqa: BLE001 - anything but a clear kvtier error is a crash
                    cases[name] = f"CRASH {type(exc).__name__}: {exc}"
                    out["hostile_crashes"] += 1
            for odd in ("", "..", "../x", "a/b", "a\0b", "x" * 1000, "ünï\u202e", "-rf", "a b", "\n"):
                out["hostile_inputs"] += 1
                try:
                    validate_session_id(odd)
                    out["hostile_accepted"] += 1
                    cases[f"session_id {odd!r}"] = "ACCEPTED"
                except KvtierError:
                    pass
                except Exception:  # noqa: BLE001
                    out["hostile_crashes"] += 1
            # blocks written under another model, and under another tenant's cache salt
            keys = chain_block_hashes(_tokens(77, 4), SHAPE[3])
            world.put(keys, range(4))
            world.engine.store("tenant-a", world.ns, keys, [0, 1, 2, 3])
            world.engine.evict("tenant-a", Tier.NVME)
            salted = namespace_of(world.fingerprint.digest, "tenant-b-salt")
            out["hostile_inputs"] += 1
            out["served_across_tenants"] += world.engine.load(salted, keys, [8, 9, 10, 11])
            world.close()
            other_root = root / "b"
            shutil.copytree(root / "a", other_root)
            other = World(other_root, name="another-model")  # the same files, another model's engine
            out["hostile_inputs"] += 1
            other_ns = namespace_of(other.fingerprint.digest)
            out["served_across_models"] += other.engine.load(other_ns, keys, [0, 1, 2, 3])
            out["served_across_models"] += other.engine.load(world.ns, keys, [0, 1, 2, 3])  # even asked by name
            other.close()
            world = World(root / "a")
            info = None
            with contextlib.suppress(KvtierError):
                info = open_snapshot(crafted / "session_id_traversal.kvsnap")
            if info is not None and "/" in info.session_id:
                cases["session_id_traversal"] += " (opened; its id is refused on restore)"
        finally:
            world.close()
    out["hostile_crashes"] += out["served_across_models"] + out["served_across_tenants"]
    out["_cases"] = cases
    return out


# ---- snapshot poisoning (issue 19) ---------------------------------------------------------------------
_PRE = struct.Struct("<8sHHQQQQ")


def _forge(data: bytes, rng, kind: str, other_payload: bytes, other_keys: list[bytes]) -> bytes:
    """A forged copy of the genuine snapshot ``data``: header fields or payloads changed the way the
    format allows, every checksum recomputed (only the signature cannot be, without the key)."""
    import xxhash

    from kvtier.index import chain_block_hashes, namespace_of
    from kvtier.snapshot import PREAMBLE_BYTES

    magic, version, flags, header_len, _sum, payload_offset, file_len = _PRE.unpack_from(data)
    doc = json.loads(data[PREAMBLE_BYTES:PREAMBLE_BYTES + header_len])
    body = bytearray(data[payload_offset:file_len])
    blocks, bt = doc["blocks"], SHAPE[3]
    j = rng.randrange(len(blocks))
    if kind == "payload":  # the victim's tokens and keys, someone else's KV
        start = blocks[j]["offset"] - payload_offset
        body[start:start + blocks[j]["nbytes"]] = other_payload[:blocks[j]["nbytes"]]
        blocks[j]["xxh3"] = xxhash.xxh3_64_intdigest(bytes(body[start:start + blocks[j]["nbytes"]]))
    elif kind == "key":
        blocks[j]["key"] = (other_keys[j] if rng.random() < 0.5 else rng.randbytes(32)).hex()
    elif kind == "token_ids":
        tokens = doc["token_ids"]
        tokens[rng.randrange(len(tokens))] = rng.randrange(50_000)
        if rng.random() < 0.5:  # consistent: the keys recomputed for the forged tokens (the hash is public)
            for block, key in zip(blocks, chain_block_hashes(tokens, bt)):
                block["key"] = key.hex()
    elif kind == "namespace":
        doc["namespace"] = (rng.randbytes(16) if rng.random() < 0.5 else
                            namespace_of(bytes.fromhex(doc["fingerprint"]["digest"]), "another-tenant")).hex()
    elif kind == "fingerprint":
        field = rng.choice(["model_id", "weights", "num_layers", "block_tokens", "dtype"])
        if field in ("model_id", "weights"):
            doc["fingerprint"][field] = f"forged-{rng.randrange(1000)}"
        else:
            geometry = doc["fingerprint"]["geometry"]
            geometry[field] = "float32" if field == "dtype" else geometry[field] + 1
    elif kind == "scheme":  # claims another hash so its keys are not compared, and moves them
        doc.setdefault("meta", {})["key_scheme"] = "vllm:xxhash:forged"
        blocks[j]["key"] = other_keys[j].hex()
    elif kind == "session":
        doc["session_id"] = rng.choice(["../../etc/passwd", "a/b", "", "x" * 300, "agent\n"])
    else:  # "tamper": nothing that matters changed, but the signed bytes did
        doc["created"] = rng.random() * 1e9
    text = json.dumps(doc).encode()
    if len(text) > header_len:
        text = json.dumps(doc, separators=(",", ":")).encode()
    header = text.ljust(header_len, b" ")[:header_len]
    pre = _PRE.pack(magic, version, flags, header_len, xxhash.xxh3_64_intdigest(header), payload_offset,
                    file_len).ljust(PREAMBLE_BYTES, b"\0")  # and no signature: the forger has no key
    return pre + header + data[PREAMBLE_BYTES + header_len:payload_offset] + bytes(body)


POISON_KINDS = ("payload", "key", "token_ids", "namespace", "fingerprint", "scheme", "session", "tamper")


def run_poisoning(attempts: int = 240, refused_restores: int = 1000, seed: int = 0, directory: Path | None = None,
                  progress: Callable[[str], None] = print) -> dict:
    """Forged snapshots (valid checksums) restored through a real admin server: none may be accepted,
    none may make a later load of the victim's prefix return other KV, and refusing them 1,000 times
    must leak no DRAM slot, index row, NVMe byte or session."""
    import torch

    from kvtier.control.client import AdminClient
    from kvtier.control.local import LocalAdmin
    from kvtier.errors import KvtierError
    from kvtier.index import chain_block_hashes

    rng = random.Random(seed)
    out = {"poisoning_attempts": 0, "accepted_forged": 0, "poisoned_loads": 0, "slot_leaks": 0,
           "_accepted_with_trust_unsigned": {}, "_poisoned_with_trust_unsigned": {}, "_refusals": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-faults-poison-", dir=directory) as tmp:
        root = Path(tmp)
        world = World(root)
        admin = LocalAdmin(world.engine, root / "run" / "admin.sock", snapshot_dir=world.snapshots).start()
        client = AdminClient(str(root / "run" / "admin.sock"), timeout=60)
        try:
            tokens = _tokens(1, 4)
            keys = chain_block_hashes(tokens, SHAPE[3])
            world.put(keys, range(4))
            world.engine.manager.record_session("victim", world.ns, keys, len(tokens), token_ids=tokens)
            world.engine.store("victim", world.ns, keys, [0, 1, 2, 3], len(tokens))
            genuine = Path(client.wait(client.post("/v1/sessions/victim/snapshot", {}))["path"])
            data = genuine.read_bytes()
            other_keys = chain_block_hashes(_tokens(2, 4), SHAPE[3])
            other_payload = bytes(reference_block(other_keys[0], world.geometry).reshape(-1).view(torch.uint8)
                                  .numpy()) * 2
            forged_dir = root / "forged"
            forged_dir.mkdir()

            def victim_clean() -> None:
                client.wait(client.post("/v1/sessions/victim/evict", {"to": "drop"}))

            def victim_poisoned() -> bool:
                loaded = world.engine.load(world.ns, keys, [40, 41, 42, 43])
                return bool(loaded and world.wrong(keys[:loaded], range(40, 40 + loaded)))

            victim_clean()
            paths = []
            for attempt in range(attempts):
                kind = POISON_KINDS[attempt % len(POISON_KINDS)]
                path = forged_dir / f"{attempt:04d}-{kind}.kvsnap"
                path.write_bytes(_forge(data, rng, kind, other_payload, other_keys))
                paths.append(path)
                out["poisoning_attempts"] += 1
                try:  # handed over as `kvtier restore FILE` does
                    client.wait(client.restore_file(path))
                    out["accepted_forged"] += 1
                except KvtierError as exc:
                    reason = exc.message.split(".kvsnap", 1)[-1].lstrip(" :")[:70]
                    out["_refusals"][reason] = out["_refusals"].get(reason, 0) + 1
                if victim_poisoned():
                    out["poisoned_loads"] += 1
                with contextlib.suppress(KvtierError):
                    victim_clean()
                # the operator vouching for the file (--trust-unsigned): recomputed keys still decide
                try:
                    client.wait(client.restore_file(path, {"trust_unsigned": True}))
                    out["_accepted_with_trust_unsigned"][kind] = out["_accepted_with_trust_unsigned"].get(kind, 0) + 1
                except KvtierError:
                    pass
                if victim_poisoned():  # what vouching for a forged file costs: only its own tokens' KV
                    out["_poisoned_with_trust_unsigned"][kind] = out["_poisoned_with_trust_unsigned"].get(kind, 0) + 1
                with contextlib.suppress(KvtierError):
                    victim_clean()
            progress(f"poisoning: {out['poisoning_attempts']} forged snapshots, {out['accepted_forged']} accepted")
            manager = world.engine.manager

            def usage() -> tuple:
                return manager.slots.free_slots, len(manager.index), manager._nvme_used, len(manager.sessions)

            before = usage()
            for i in range(refused_restores):
                with contextlib.suppress(KvtierError):
                    client.restore_file(paths[i % len(paths)])
            after = usage()
            out["slot_leaks"] = max(0, before[0] - after[0]) + max(0, after[1] - before[1])
            out["_usage_before_after"] = [before, after]
        finally:
            client.close()
            admin.stop()
            world.close()
    return out


# ---- paths a client names (issue 19) -------------------------------------------------------------------
def _escapes(snaps: Path, outside: Path) -> list[tuple[str, str, dict]]:
    """(label, route, body) of requests naming paths the server must not touch: outside its snapshot
    directory, through symlinks at every component, special files, over-long names."""
    snaps.mkdir(parents=True, exist_ok=True)
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "loot.kvsnap").write_bytes(b"not yours")
    (snaps / "up").symlink_to(outside)  # a directory symlink leading out
    (snaps / "link.kvsnap").symlink_to(outside / "loot.kvsnap")  # a final-component symlink
    (snaps / "dangling.kvsnap").symlink_to(outside / "new.kvsnap")
    (snaps / "sub").mkdir()
    (snaps / "sub" / "deeper").symlink_to("/etc")
    os.mkfifo(snaps / "fifo.kvsnap")
    (snaps / "dir.kvsnap").mkdir()
    names = [str(outside / "loot.kvsnap"), str(outside / "new.kvsnap"), "/etc/passwd.kvsnap", "/dev/null.kvsnap",
             "../loot.kvsnap", "../../etc/x.kvsnap", "sub/../../loot.kvsnap", "up/loot.kvsnap", "up/new.kvsnap",
             str(snaps / "up" / "loot.kvsnap"), "link.kvsnap", "dangling.kvsnap", "sub/deeper/x.kvsnap",
             str(snaps / "sub" / "deeper" / "shadow.kvsnap"), "fifo.kvsnap", "dir.kvsnap",
             "x" * 300 + ".kvsnap", "a/" * 2100 + "x.kvsnap", "nul\0.kvsnap", "/proc/self/environ.kvsnap",
             str(snaps) + "/../" + outside.name + "/loot.kvsnap", "./up/./loot.kvsnap", "//etc//x.kvsnap",
             "/dev/zero", "/dev/stdin.kvsnap", "sub/deeper/../../../loot.kvsnap", "up/../up/loot.kvsnap",
             str(outside) + "/../" + snaps.name + "/../" + outside.name + "/new.kvsnap", "\u202e.kvsnap/..",
             "~/x.kvsnap"]
    cases = []
    for name in names:
        cases.append((f"snapshot {name[:40]}", "/v1/sessions/victim/snapshot", {"path": name}))
        cases.append((f"restore {name[:40]}", "/v1/restore", {"path": name}))
        cases.append((f"restore unsigned {name[:40]}", "/v1/restore", {"path": name, "trust_unsigned": True}))
    for n in range(10):  # a symlink at each depth of a path inside the snapshot directory
        deep = snaps.joinpath(*[f"d{i}" for i in range(n)])
        deep.mkdir(parents=True, exist_ok=True)
        (deep / f"s{n}").symlink_to(outside)
        rel = "/".join([*(f"d{i}" for i in range(n)), f"s{n}", "loot.kvsnap"])
        cases.append((f"symlink at depth {n}", "/v1/restore", {"path": rel}))
        cases.append((f"symlink at depth {n} (write)", "/v1/sessions/victim/snapshot", {"path": rel}))
    return cases


def run_path_escapes(directory: Path | None = None, progress: Callable[[str], None] = print) -> dict:
    """Every way of naming a file outside the snapshot directory, or a special file in it, sent to a
    real admin server: none may be opened, created or written, and none may block a request."""
    from kvtier.control.client import AdminClient
    from kvtier.control.local import LocalAdmin
    from kvtier.errors import KvtierError
    from kvtier.index import chain_block_hashes

    out = {"path_escapes_tried": 0, "path_escapes": 0, "blocked_requests": 0, "_escaped": [], "_slowest_s": 0.0}
    with tempfile.TemporaryDirectory(prefix="kvtier-faults-paths-", dir=directory) as tmp:
        root = Path(tmp)
        world = World(root / "world")
        snaps = root / "snaps"
        admin = LocalAdmin(world.engine, root / "run" / "admin.sock", snapshot_dir=snaps).start()
        client = AdminClient(str(root / "run" / "admin.sock"), timeout=10)
        try:
            tokens = _tokens(3, 2)
            keys = chain_block_hashes(tokens, SHAPE[3])
            world.put(keys, range(2))
            world.engine.store("victim", world.ns, keys, [0, 1], len(tokens), token_ids=tokens)
            outside = root / "outside"
            cases = _escapes(snaps, outside)
            before = sorted(p.name for p in outside.iterdir())
            loot = (outside / "loot.kvsnap").read_bytes()
            for label, route, body in cases:
                out["path_escapes_tried"] += 1
                started = time.monotonic()
                try:
                    job = client.post(route, body)
                    if job.get("state") in ("queued", "running", "done"):
                        client.wait(job, timeout=10)
                        out["path_escapes"] += 1
                        out["_escaped"].append(label)
                except KvtierError:
                    pass
                took = time.monotonic() - started
                out["_slowest_s"] = max(out["_slowest_s"], took)
                if took > 2.0:
                    out["blocked_requests"] += 1
            # nothing outside was created or changed, whatever the server answered
            if sorted(p.name for p in outside.iterdir()) != before or (outside / "loot.kvsnap").read_bytes() != loot:
                out["path_escapes"] += 1
                out["_escaped"].append("a file outside the snapshot directory changed")
            progress(f"paths: {out['path_escapes_tried']} escapes tried, {out['path_escapes']} got through")
        finally:
            client.close()
            admin.stop()
            world.close()
    return out


def run_faults_bench(quick: bool = False, progress: Callable[[str], None] = print, vllm: bool = True) -> dict:
    results: dict = {}
    progress("crash consistency: SIGKILL during stores, demotions, snapshots and restores")
    crash = run_crash_trials(20 if quick else 200, progress=progress)
    progress("corruption: bit flips, truncation, zeroed pages, swapped files")
    corruption = run_corruption_trials(100 if quick else 1000, progress=progress)
    progress("pressure: sessions churning through a small DRAM budget")
    pressure = run_pressure(200 if quick else 1000, progress=progress)
    progress("hostile input")
    hostile = run_hostile(150 if quick else 600, progress=progress)
    progress("snapshot poisoning: forged snapshots through the admin API")
    poison = run_poisoning(80 if quick else 240, 300 if quick else 1000, progress=progress)
    progress("paths: escapes from the snapshot directory, special files")
    paths = run_path_escapes(progress=progress)
    results.update(
        crash_trials=crash["crash_trials"],
        corrupt_loads=crash["corrupt_loads"] + corruption["corrupt_loads"] + pressure["wrong_loads"],
        corruption_trials=corruption["corruption_trials"],
        corruption_detected_ratio=corruption["corruption_detected_ratio"],
        dram_budget_exceeded=pressure["dram_budget_exceeded"],
        hostile_inputs=hostile["hostile_inputs"],
        hostile_crashes=hostile["hostile_crashes"],
        poisoning_attempts=poison["poisoning_attempts"],
        poisoned_loads=poison["poisoned_loads"],
        accepted_forged=poison["accepted_forged"],
        slot_leaks=poison["slot_leaks"],
        path_escapes_tried=paths["path_escapes_tried"],
        path_escapes=paths["path_escapes"],
        blocked_requests=paths["blocked_requests"],
    )
    results["_paths"] = paths
    results["_poisoning"] = poison
    results["_crash"] = crash
    results["_corruption"] = corruption
    results["_pressure"] = pressure
    results["_hostile"] = hostile
    if vllm:
        from kvtier.bench.vllm.faults import run_serving_faults

        serving = run_serving_faults(quick=quick, progress=progress)
        results.update(failed_requests_under_load=serving["failed_requests_under_load"],
                       outputs_mismatched=serving["outputs_mismatched"])
        results["_serving"] = serving
    else:
        results.update(failed_requests_under_load=None, outputs_mismatched=None)
    return results
