"""``python -m benchmarks faults``: crashes, corruption, pressure and hostile input against kvtier's own data
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
* ``hostile``: the admin API fuzzer (``benchmarks.admin.fuzz``), crafted snapshot files (valid
  checksums, hostile sizes, offsets, counts and fingerprints), odd session ids, and blocks written
  under another model or another tenant's cache salt.

The load, ENOSPC-while-serving and recompute-equals-baseline parts run against real vLLM:
``benchmarks.faults.serving``.
"""
from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["reference_block", "run_crash_trials", "run_corruption_trials", "run_pressure", "run_hostile",
           "run_faults_bench", "FAULT_KEYS", "SLOW_DISK_KEYS", "fault_part_keys", "run_fault_parts"]

# the parts, re-exported: tests and the crash zygote (``faults._crash_child``) use them from here
from benchmarks.faults.corrupt import (  # noqa: F401
    BLOCK_FAULTS,
    FAULTS,
    _damage,
    _damage_record,
    _meaningful_ranges,
    _Record,
    _records,
    run_corruption_trials,
)
from benchmarks.faults.crash import (  # noqa: F401
    _ZYGOTE,
    _crash_child,
    _unnamed_tail,
    _verify_after_restart,
    run_crash_trials,
)
from benchmarks.faults.trust import (  # noqa: F401
    _PRE,
    POISON_KINDS,
    _crafted_snapshots,
    _escapes,
    _forge,
    run_hostile,
    run_path_escapes,
    run_poisoning,
)
from benchmarks.faults.world import (  # noqa: F401
    HBM_BLOCKS,
    SHAPE,
    World,
    _fingerprint,
    _tokens,
    reference_block,
)

FAULT_KEYS = ("crash_trials", "corrupt_loads", "corruption_trials", "corruption_detected_ratio",
              "failed_requests_under_load", "outputs_mismatched", "dram_budget_exceeded", "hostile_inputs",
              "hostile_crashes", "poisoning_attempts", "poisoned_loads", "accepted_forged", "slot_leaks",
              "path_escapes_tried", "path_escapes", "blocked_requests")



# ---- pressure ----------------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_pressure(sessions: int = 1000, dram_blocks: int = 64, seed: int = 0, directory: Path | None = None,
                 progress: Callable[[str], None] = print) -> dict:
    """``sessions`` sessions churn through a ``dram_blocks`` DRAM tier (with NVMe behind it)."""
    import gc

    from kvtier.plan.index import chain_block_hashes

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
        slots = engine.manager.table.slots
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
        index_bytes = engine.manager.table.index.memory_bytes()
        out.update(_dram_budget_bytes=budget, _dram_peak_bytes=peak_slots * slots.slot_bytes,
                   _dram_arena_bytes=int(arena_bytes), _rss_engine_start_bytes=rss_ready - rss_before,
                   _rss_churn_growth_bytes=rss_after - rss_ready,
                   _index_bytes=index_bytes, _blocks_indexed=len(engine.manager.table.index),
                   _nvme_blocks=engine.manager.views.stats()["nvme"]["blocks"])
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
        from benchmarks.faults.serving import run_serving_faults

        serving = run_serving_faults(quick=quick, progress=progress)
        results.update(failed_requests_under_load=serving["failed_requests_under_load"],
                       outputs_mismatched=serving["outputs_mismatched"])
        results["_serving"] = serving
    else:
        results.update(failed_requests_under_load=None, outputs_mismatched=None)
    return results


# ---- power cuts and a slow disk: run on their own (``--power``, ``--slow-disk``) ----------------------
SLOW_DISK_KEYS = ("slow_disk_ttft_vs_recompute_max", "slow_disk_failed_requests", "slow_disk_noticed_after_loads",
                  "slow_disk_resume_s")


def fault_part_keys(power: bool, slow_disk: bool) -> tuple[str, ...]:
    from benchmarks.power.run import POWER_KEYS

    return (POWER_KEYS if power else ()) + (SLOW_DISK_KEYS if slow_disk else ())


def run_fault_parts(power: bool, slow_disk: bool, quick: bool, states: int,
                    progress: Callable[[str], None] = print) -> dict:
    """Power cuts (``benchmarks.power``: ``states`` crash states per workload) and/or a disk that
    turns slow while ``kvtier serve`` runs sessions (``benchmarks.faults.slowdisk``)."""
    results: dict = {}
    if power:
        from benchmarks.power.run import run_power

        progress(f"power cuts: {states} crash states per workload, built from recorded IO")
        results.update(run_power(states, progress=progress, door_cost_mib=64 if quick else 1024))
    if slow_disk:
        from benchmarks.faults.slowdisk import run_slow_disk_bench

        progress("slow disk: NVMe IO slowed 10x while kvtier serve runs sessions")
        results.update(run_slow_disk_bench(quick=quick, progress=progress))
        results["_slow_disk_method"] = results.pop("slow_disk_method", None)
    return results
