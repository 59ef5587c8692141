"""Crash consistency: SIGKILL at random moments, then a restart checked against what was
acknowledged (part of ``python -m benchmarks faults``)."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.faults.world import (
    HBM_BLOCKS,
    SHAPE,
    World,
    _tokens,
)


# ---- crash consistency ----------------------------------------------------------------------------------------
def _crash_child(root: str, seed: int, fd: int) -> None:
    """Random tiering work until killed; every durable effect is announced on ``fd`` only once it is
    durable, and every NVMe deletion before it may happen."""
    import torch

    from kvtier.jobs import JobKind
    from kvtier.plan.index import Tier, chain_block_hashes

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
                engine.execute(engine.manager.planner.evict(sid, Tier.NVME))
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
                engine.execute(engine.manager.planner.evict(sid, None))
            sessions.pop(sid, None)


def _verify_after_restart(root: Path, acked_nvme: set[bytes], acked_snaps: set[str], check_snaps: list[Path],
                          out: dict) -> None:
    from kvtier.persist.snapshot import open_snapshot, remove_stale_temp_files, verify_snapshot

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
                [world.engine.manager.table.index.row_of(world.ns, k) for k in batch], device)
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
    from kvtier.tiers.nvme.store import NvmeStore

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
import benchmarks.faults.suite as faults
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
                    from kvtier.tiers.nvme.journal import JOURNAL_NAME

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
