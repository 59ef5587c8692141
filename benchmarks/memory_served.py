"""``python -m benchmarks memory``: the RAM of ``kvtier serve`` with its DRAM tier full, against plain vLLM.

For each DRAM budget N (1, 4 and 8 GiB; ``--quick``: 1 GiB), one ``kvtier serve`` of the fat-KV
model (``benchmarks.memory``: 128 KiB of KV per token) with ``--dram N``, an NVMe tier of
N + 1 GiB (every block gets its NVMe copy: the write-behind can finish) and watermarks 1.0 / 0.95
(``KVTIER_HIGH_WATERMARK`` / ``KVTIER_LOW_WATERMARK``: at the default 0.90 the tier would be
demoted before it is full). Distinct prompts of random token ids (1,025 tokens: 8 full blocks
each, one output token, ``concurrency`` at a time) are sent until kvtier's admin API
(``/v1/status``, what ``kvtier status --json`` shows) reports the DRAM tier full; then the
server waits for its write-behind (``/v1/status?until=clean``, no job in flight), and the RSS,
PSS and USS of every process of the server (``kvtier serve``, vLLM's API server, engine core,
workers) are summed, three readings 2 s apart, the last kept.

The reference is one plain vLLM server of the same model with the same engine flags (the same
``--max-model-len``, ``--max-num-seqs``, vLLM KV cache space, environment; no KV connector),
measured the same way after the same warm-up and after exactly the prompts each kvtier run was
sent: the prompts are one seeded sequence, so plain vLLM measured after the first P of them has
seen what the kvtier run that sent P saw. Runs one server at a time.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from benchmarks.memory import (
    ALLOWANCE_MIB,
    FATKV,
    FILLED_AT_LEAST,
    QUICK_SIZES_GIB,
    SIZES_GIB,
    SLACK,
    GiB,
    MiB,
    cpu_model,
    ensure_fatkv_model,
    expected_prompts,
    kv_bytes_per_token,
    label,
    random_prompts,
    settled_memory,
    size_figures,
    summarize,
)

__all__ = ["run_memory_bench"]

PROMPT_TOKENS = 1025  # 8 full 128-token blocks (vLLM's CPU block size) and one token more
WAIT_S = 300  # the longest wait for the write-behind (the admin API's own maximum)
WATERMARKS = {"KVTIER_HIGH_WATERMARK": "1.0", "KVTIER_LOW_WATERMARK": "0.95"}
HEADROOM = 1 * GiB  # RAM that must stay free beyond the tier's budget before a run fills it


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (the servers it starts inherit it) for a while."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _send(server, prompts: Sequence[list[int]], first: int, concurrency: int) -> None:
    """Prompts ``first``.. of the sequence, ``concurrency`` in flight, one output token each."""
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda item: server.turn(f"fill-{item[0]}", item[1], max_tokens=1),
                      enumerate(prompts, start=first)))


def _tree_figures(mem: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    return {f"{prefix}rss_mib": round(mem["rss"] / MiB, 1), f"{prefix}pss_mib": round(mem["pss"] / MiB, 1),
            f"{prefix}uss_mib": round(mem["uss"] / MiB, 1)}


def _wait_stores(admin, goal: int, timeout: float = 120.0) -> int:
    """DRAM used bytes once it reaches ``goal`` or stops growing (stores finish behind the step)."""
    deadline, last, still = time.monotonic() + timeout, -1, 0
    while True:
        used = int(admin.get("/v1/status")["tiers"]["dram"]["used_bytes"])
        still = still + 1 if used == last else 0
        if used >= goal or still >= 6 or time.monotonic() > deadline:
            return used
        last = used
        time.sleep(0.5)


def _wait_idle(admin) -> dict:
    """The status once no DRAM block lacks its NVMe copy and no job is in flight."""
    status = admin.get("/v1/status", until="clean", wait_s=WAIT_S)
    deadline = time.monotonic() + 60
    while status.get("jobs_in_flight") and time.monotonic() < deadline:
        time.sleep(0.5)
        status = admin.get("/v1/status")
    return status


def kvtier_run(model: str, base: Path, gib: float, concurrency: int, prompt_tokens: int,
               progress: Callable[[str], None]) -> dict[str, Any]:
    """One ``kvtier serve --dram N`` filled with distinct prompts, its tree's memory once idle."""
    import psutil

    from kvtier.control.client import AdminClient
    from kvtier.launch.served import Served
    from kvtier.layout import KVGeometry
    from kvtier.tiers.dram import slot_size

    name = label(gib)
    budget = int(round(gib * 1024)) * MiB  # what --dram is given, in whole MiB
    nvme_dir = base / f"nvme-{name}"
    with _environment(WATERMARKS):
        server = Served(model, base, f"kvtier-{name}gib", prompt_tokens + 64, served_name="fatkv",
                        max_seqs=concurrency, dram=f"{budget >> 20}MiB", nvme=f"{(budget >> 20) + 1024}MiB",
                        nvme_dir=nvme_dir)
    entry: dict[str, Any] = {"dram_gib": gib, "server_start_s": round(server.start_s, 1)}
    admin = AdminClient(server.socket, timeout=WAIT_S + 60)
    try:
        status = admin.get("/v1/status")
        geometry = KVGeometry.from_dict(status["fingerprint"]["geometry"])
        slot = slot_size(geometry.block_bytes)
        capacity = int(status["tiers"]["dram"]["capacity_bytes"])
        server.turn("warm", [5] * 64, max_tokens=2)  # under one block: nothing stored
        idle = settled_memory(server.proc.pid, seconds=1.0, samples=2)
        entry.update(_tree_figures(idle, "idle_"))
        available = psutil.virtual_memory().available
        if available < budget * SLACK + HEADROOM:
            entry["skipped"] = (f"{available / GiB:.1f} GiB of RAM available with the server up: filling "
                                f"{gib:g} GiB needs {(budget * SLACK + HEADROOM) / GiB:.1f} GiB")
            progress(f"--dram {name}GiB: skipped: {entry['skipped']}")
            return entry
        need = expected_prompts(capacity, slot, geometry.block_tokens, prompt_tokens)
        goal = min(capacity, (need * (prompt_tokens // geometry.block_tokens)) * slot)
        progress(f"--dram {name}GiB: {capacity // slot} slots of {slot / MiB:g} MiB; sending {need} prompts "
                 f"of {prompt_tokens} tokens, {concurrency} at a time")
        started, sent = time.monotonic(), 0
        prompts = list(random_prompts(need, prompt_tokens))
        for at in range(0, need, concurrency * 4):
            batch = prompts[at:at + concurrency * 4]
            _send(server, batch, at, concurrency)
            sent += len(batch)
            used = int(admin.get("/v1/status")["tiers"]["dram"]["used_bytes"])
            progress(f"--dram {name}GiB: {sent}/{need} prompts sent, DRAM tier {used / GiB:.2f} GiB "
                     f"({time.monotonic() - started:.0f} s)")
        used = _wait_stores(admin, goal)
        while used < min(goal, FILLED_AT_LEAST * budget) and sent < 2 * need:  # a store was skipped: top up
            extra = list(random_prompts(concurrency, prompt_tokens, first=sent))
            _send(server, extra, sent, concurrency)
            sent += len(extra)
            used = _wait_stores(admin, goal)
        fill_s = time.monotonic() - started
        progress(f"--dram {name}GiB: filled {used / GiB:.2f} GiB in {fill_s:.0f} s; waiting for the write-behind")
        _wait_idle(admin)
        mem = settled_memory(server.proc.pid)
        status = admin.get("/v1/status")
        dram = status["tiers"]["dram"]
        entry.update(_tree_figures(mem))
        entry.update(rss_bytes=mem["rss"], prompts=sent, tokens_sent=sent * prompt_tokens, fill_s=round(fill_s, 1),
                     dram_used_bytes=int(dram["used_bytes"]), dram_capacity_bytes=int(dram["capacity_bytes"]),
                     dram_filled=round(int(dram["used_bytes"]) / budget, 4), dram_blocks=int(dram["blocks"]),
                     nvme_used_bytes=int(status["tiers"]["nvme"]["used_bytes"]),
                     dirty_blocks=int((status.get("dirty") or {}).get("dirty_blocks") or 0),
                     rss_spread_mib=mem["rss_spread_mib"], processes=mem["processes"],
                     memory_complete=mem["complete"], slot_bytes=slot, block_tokens=geometry.block_tokens)
        progress(f"--dram {name}GiB: server RSS {mem['rss'] / GiB:.2f} GiB over {len(mem['processes'])} processes "
                 f"(PSS {mem['pss'] / GiB:.2f}, USS {mem['uss'] / GiB:.2f}); DRAM tier "
                 f"{100 * entry['dram_filled']:.1f}% of {name} GiB")
        return entry
    finally:
        admin.close()
        server.stop()
        shutil.rmtree(nvme_dir, ignore_errors=True)


def plain_run(model: str, base: Path, checkpoints: dict[str, int], concurrency: int, prompt_tokens: int,
              progress: Callable[[str], None]) -> dict[str, Any]:
    """Plain vLLM (same flags, no connector): its tree's memory after the warm-up and after the
    first P prompts for every checkpoint P (a kvtier run's prompt count)."""
    from kvtier.launch.served import Served

    server = Served(model, base, "plain", prompt_tokens + 64, served_name="fatkv", max_seqs=concurrency,
                    connector=False)
    out: dict[str, Any] = {"server_start_s": round(server.start_s, 1)}
    try:
        server.turn("warm", [5] * 64, max_tokens=2)
        out["idle"] = settled_memory(server.proc.pid, seconds=1.0, samples=2)
        sent = 0
        for name, count in sorted(checkpoints.items(), key=lambda item: item[1]):
            if count > sent:
                progress(f"plain vLLM: prompts {sent}..{count - 1} ({count - sent} of {prompt_tokens} tokens)")
                _send(server, list(random_prompts(count - sent, prompt_tokens, first=sent)), sent, concurrency)
                sent = count
            out[name] = settled_memory(server.proc.pid)
            progress(f"plain vLLM after {count} prompts (as --dram {name}GiB): RSS {out[name]['rss'] / GiB:.2f} GiB")
        return out
    finally:
        server.stop()


def run_memory_bench(sizes: Sequence[float] | None = None, quick: bool = False,
                     progress: Callable[[str], None] = print, directory: str | None = None,
                     concurrency: int = 4, prompt_tokens: int = PROMPT_TOKENS,
                     model: str | None = None) -> dict[str, Any]:
    """Every budget of ``sizes`` (GiB; default 1, 4, 8; ``quick``: 1) against plain vLLM."""
    import datetime

    import psutil

    from kvtier.launch.serve import is_cpu_only

    sizes = tuple(sizes or (QUICK_SIZES_GIB if quick else SIZES_GIB))
    progress("building / loading the fat-KV model")
    model = model or str(ensure_fatkv_model(progress=progress))
    started = time.monotonic()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-mem-", dir=directory or Path.cwd()) as tmp:
        base = Path(tmp)
        for gib in sizes:
            progress(f"kvtier serve --dram {label(gib)}GiB")
            try:
                runs[label(gib)] = kvtier_run(model, base, gib, concurrency, prompt_tokens, progress)
            except Exception as exc:  # noqa: BLE001 - one budget that fails (a server killed for memory)
                progress(f"--dram {label(gib)}GiB failed: {exc}")  # must not lose the budgets measured
                runs[label(gib)] = {"dram_gib": gib, "skipped": f"failed: {str(exc)[-500:]}"}
        checkpoints = {name: run["prompts"] for name, run in runs.items() if "prompts" in run}
        progress("plain vLLM, the same engine flags, no connector")
        plain = plain_run(model, base, checkpoints, concurrency, prompt_tokens, progress)
    per_size: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        entry = {key: value for key, value in run.items() if key != "processes"}
        if name in plain:
            reading = plain[name]
            entry.update(_tree_figures(reading, "plain_"), plain_rss_bytes=reading["rss"])
            entry.update(size_figures(run["dram_gib"], run["rss_bytes"], reading["rss"]))
            entry.update(idle_rss_over_plain_mib=round(entry["idle_rss_mib"] - plain["idle"]["rss"] / MiB, 1),
                         pss_over_plain_mib=round(entry["pss_mib"] - entry["plain_pss_mib"], 1),
                         uss_over_plain_mib=round(entry["uss_mib"] - entry["plain_uss_mib"], 1),
                         plain_rss_spread_mib=reading["rss_spread_mib"],
                         processes={"kvtier": run["processes"], "plain": reading["processes"]})
        per_size[name] = entry
    # no CUDA, no pinned memory: the arena is an anonymous mmap whose pages count once touched. With
    # CUDA the server does not say whether its cudaHostRegister succeeded: unknown (None) there
    pinned = False if is_cpu_only() else None
    idle = plain["idle"]
    return {**summarize(per_size), "pinned": pinned, "sizes": per_size,
            "details": {"date": datetime.date.today().isoformat(), "cpu": cpu_model(),
                        "ram_gib": round(psutil.virtual_memory().total / GiB, 1),
                        "model": {**FATKV, "kv_bytes_per_token": kv_bytes_per_token(), "path": model},
                        "prompt_tokens": prompt_tokens, "concurrency": concurrency,
                        "engine_flags": ["--max-model-len", str(prompt_tokens + 64), "--enforce-eager",
                                         "--max-num-seqs", str(concurrency)],
                        "vllm_kv_cache_space_gib": 1, "kvtier_env": WATERMARKS, "nvme": "N + 1 GiB",
                        "target": f"RSS - plain RSS <= {SLACK} x N + {ALLOWANCE_MIB} MiB",
                        "pinned_note": "no CUDA: the DRAM arena is pageable memory (an anonymous mmap)"
                        if pinned is False else "not reported by the server (cudaHostRegister may have failed)",
                        "plain_idle": _tree_figures(idle), "plain_start_s": plain["server_start_s"],
                        "wall_s": round(time.monotonic() - started, 1)}}
