"""``python -m benchmarks faults --power``: power cuts, not only SIGKILL.

Each workload (``workloads.WORKLOADS``) runs once under the recorder; crash states are cut from its
trace (``states.sample_states``), each is written onto a fresh directory, started and checked
(``check``). The recorder's own cost is measured too: the write path's CPU time per GiB with the
door (``kvtier.tiers.fileio``) as shipped, recorder off, against the same path with the door's
functions replaced by the bare ``os`` calls ("not compiled in"), interleaved runs, medians.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from benchmarks.power.check import acked_before, check_engine, check_store, in_flight_sessions
from benchmarks.power.states import build, materialize, sample_states
from benchmarks.power.workloads import WORKLOADS, record

__all__ = ["run_power", "POWER_KEYS", "measure_door_cost"]

POWER_KEYS = ("power_states", "power_acked_lost", "power_wrong_bytes", "power_start_crashes", "power_catalog_wrong",
              "power_window_losses", "power_over_budget", "recorder_off_cpu_ratio", "recorder_off_cpu_bound")


def _check_state(recorded, state, work: Path, causes: list) -> Counter:
    image = build(recorded.trace, state)
    target = work / "state"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    materialize(image, target)
    acked = acked_before(recorded.trace.ops[: state.upto])
    label = f"{recorded.name} ({state.label()})"
    if recorded.world == "store":
        return check_store(target, acked, recorded.capacity, label, causes)
    return check_engine(target, acked, recorded.tokens, recorded.dram_blocks, recorded.nvme_blocks, label, causes,
                        in_flight_sessions(recorded.trace.ops[state.upto :]))


def run_power(states_per_workload: int = 250, seed: int = 0, directory: Path | None = None,
              workloads: list[str] | None = None, progress: Callable[[str], None] = print,
              door_cost_mib: int = 256) -> dict:
    started = time.perf_counter()
    totals: Counter = Counter()
    per: dict[str, dict] = {}
    causes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-power-", dir=directory) as tmp:
        work = Path(tmp)
        for number, name in enumerate(workloads or list(WORKLOADS)):
            t0 = time.perf_counter()
            recorded = record(name, work / f"run-{name}", seed * 100 + number)
            states = sample_states(recorded.trace, states_per_workload, seed * 100 + number)
            counts: Counter = Counter()
            for k, state in enumerate(states):
                counts += _check_state(recorded, state, work, causes)
                if (k + 1) % 50 == 0:
                    progress(f"power: {name} {k + 1}/{len(states)} states")
            per[name] = {"states": counts["states"], "ops": len(recorded.trace.ops),
                         "syncs": sum(op.kind in ("fsync", "dsync") for op in recorded.trace.ops),
                         "acks": sum(op.kind == "ack" for op in recorded.trace.ops),
                         "seconds": round(time.perf_counter() - t0, 1), **{k: v for k, v in counts.items()
                                                                          if k != "states"}}
            totals += counts
            progress(f"power: {name}: {counts['states']} states, {counts['acked_lost']} acknowledged lost, "
                     f"{counts['wrong_bytes']} wrong, {counts['start_crashes']} start-up crashes")
            shutil.rmtree(work / f"run-{name}", ignore_errors=True)
        door = measure_door_cost(work, door_cost_mib) if door_cost_mib else \
            {"recorder_off_cpu_ratio": None, "recorder_off_cpu_bound": None}
    return {
        "power_states": totals["states"],
        "power_acked_lost": totals["acked_lost"],
        "power_wrong_bytes": totals["wrong_bytes"],
        "power_start_crashes": totals["start_crashes"],
        "power_catalog_wrong": totals["catalog_wrong"],
        "power_window_losses": totals["window_losses"] + totals["catalog_window_losses"],
        "power_over_budget": totals["over_budget"],
        "_power_blocks_read": totals["blocks_read"],
        "_power_detected_bad_records": totals["detected_bad_records"],
        "_power_snapshots_checked": totals["snapshots_checked"],
        "_power_write_behind_window_losses": totals["window_losses"],
        "_power_catalog_window_losses": totals["catalog_window_losses"],
        "_power_per_workload": per,
        "_power_failures": causes[:50],
        "_power_seconds": round(time.perf_counter() - started, 1),
        **door,
    }


# ---- what the door costs ------------------------------------------------------------------------
def _bare_door() -> dict:
    """The door's functions as the bare ``os`` calls (what kvtier would call without it)."""
    from kvtier.tiers import fileio

    return {"open_file": os.open, "close": os.close, "pwritev": os.pwritev, "pwrite": os.pwrite,
            "preadv": os.preadv, "fdatasync": os.fdatasync, "fsync": os.fsync,
            "allocate": lambda fd, off, n: fileio._fallocate()(fd, 0, off, n) == 0 or True}


def _write_cpu(directory: Path, nbytes: int, block: int = 2 << 20) -> float:
    """CPU seconds (every thread of the process) to write ``nbytes`` through the NVMe tier."""
    import numpy as np

    from kvtier.tiers.nvme.store import NvmeStore

    shutil.rmtree(directory, ignore_errors=True)
    store = NvmeStore(directory, nbytes * 2, io_threads=2)
    payload = np.random.default_rng(0).integers(0, 255, block, dtype=np.uint8)
    try:
        started = time.process_time()
        for batch in range(nbytes // (block * 16)):
            store.write_batch([(b"\x01" * 16, f"{batch}-{i}".encode(), payload, "none") for i in range(16)],
                              b"\x02" * 16)
        return time.process_time() - started
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)


def measure_door_cost(work: Path, mib: int = 256, rounds: int = 5) -> dict:
    """CPU time per GiB of the write path, door as shipped (recorder off) over bare ``os`` calls."""
    from kvtier.tiers import fileio

    shipped = {name: getattr(fileio, name) for name in _bare_door()}
    with_door, bare = [], []
    nbytes = mib << 20
    _write_cpu(work / "door-warm", nbytes // 4)
    for turn in range(2 * rounds):  # interleaved, each going first in turn
        if (turn + turn // 2) % 2 == 0:
            with_door.append(_write_cpu(work / "door", nbytes))
            continue
        for name, fn in _bare_door().items():
            setattr(fileio, name, fn)
        try:
            bare.append(_write_cpu(work / "door", nbytes))
        finally:
            for name, fn in shipped.items():
                setattr(fileio, name, fn)
    gib = nbytes / (1 << 30)
    door_s, bare_s = statistics.median(with_door) / gib, statistics.median(bare) / gib
    calls = _door_calls(work / "door", nbytes) / gib
    extra_ns = _door_extra_ns()
    return {"recorder_off_cpu_ratio": round(door_s / bare_s, 4),
            "recorder_off_cpu_bound": round(calls * extra_ns * 1e-9 / bare_s, 5),
            "_door_calls_per_gib": round(calls), "_door_extra_ns_per_call": round(extra_ns, 1),
            "_recorder_off_cpu_s_per_gib": round(door_s, 3), "_bare_os_cpu_s_per_gib": round(bare_s, 3),
            "_recorder_cost_rounds": rounds, "_recorder_cost_mib": mib,
            "_recorder_off_cpu_s": [round(x, 3) for x in with_door], "_bare_os_cpu_s": [round(x, 3) for x in bare]}


def _door_calls(directory: Path, nbytes: int) -> int:
    """How many times the write path goes through the door for ``nbytes``."""
    from kvtier.tiers import fileio

    shipped = {name: getattr(fileio, name) for name in _bare_door()}
    calls = Counter()

    def counted(name: str, fn: Callable) -> Callable:
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    for name, fn in shipped.items():
        setattr(fileio, name, counted(name, fn))
    try:
        _write_cpu(directory, nbytes)
    finally:
        for name, fn in shipped.items():
            setattr(fileio, name, fn)
    return sum(calls.values())


def _door_extra_ns(calls: int = 200_000) -> float:
    """What one call through the door adds to the bare ``os`` call (a 1-byte write to /dev/null)."""
    from kvtier.tiers import fileio

    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        best_door = best_bare = float("inf")
        for _ in range(5):
            started = time.process_time()
            for _ in range(calls):
                fileio.pwrite(fd, b"x", 0)
            best_door = min(best_door, time.process_time() - started)
            started = time.process_time()
            for _ in range(calls):
                os.pwrite(fd, b"x", 0)
            best_bare = min(best_bare, time.process_time() - started)
    finally:
        os.close(fd)
    return max(0.0, (best_door - best_bare) / calls * 1e9)
