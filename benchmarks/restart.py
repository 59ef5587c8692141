"""``python -m benchmarks restart``: do sessions survive a stop, a SIGKILL, and what does it cost?

Real ``kvtier serve`` processes on the demo model, one NVMe directory throughout:

1. **Stop.** Three sessions; ``s-pinned`` is pinned to NVMe, ``s-warm`` stays in DRAM, ``s-cold`` is
   evicted to NVMe. Ctrl-C (SIGINT: kvtier flushes, then stops vLLM), start again: are the sessions
   listed (``sessions_listed_after_stop``), is the pin kept (``pins_kept_after_stop``), does each next
   turn load >= 90% of its full blocks (``loaded_after_stop``) with the same greedy text
   (``outputs_identical``, over every turn after a restart)?
2. **SIGKILL.** A fourth session, older than the write-behind window, then SIGKILL of the whole
   process group (no flush, no shutdown hook): is it listed and loaded after a start
   (``loaded_after_sigkill``)?
3. **Catalog start-up** with 100,000 sessions: a new process opens the catalog and builds the tier
   manager, page cache dropped first; the median of three (``catalog_start_ms_100k_sessions``).
4. **Serving overhead**: prefill throughput of one in-process engine with the catalog and
   write-behind switched on and off between distinct prompts, ABBA order
   (``serving_overhead`` = 1 - on/off; <= 0 is no cost).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from kvtier.launch.served import Served

__all__ = ["RESTART_KEYS", "run_restart_bench", "catalog_start_ms"]

RESTART_KEYS = ("sessions_listed_after_stop", "pins_kept_after_stop", "loaded_after_stop", "outputs_identical",
                "loaded_after_sigkill", "catalog_start_ms_100k_sessions", "serving_overhead")
BLOCK = 128  # the CPU backend's block size (tokens)


def _prompt(seed: int, tokens: int) -> list[int]:
    return [3 + (i * 131 + seed * 7919) % 1900 for i in range(tokens)]


def _full_tokens(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK  # kvtier never claims the last prompt token


def _restart_phases(model: str, base: Path, tokens: int, window: float, say: Callable[[str], None]) -> dict:
    prompts = {name: _prompt(seed, tokens) for seed, name in enumerate(("s-pinned", "s-warm", "s-cold", "s-crash"))}
    first, out = {}, {}
    server = Served(model, base, "serve-1", tokens + 512, str(window))
    try:
        say(f"server 1 up in {server.start_s:.0f} s; three sessions of {tokens:,} tokens")
        for name in ("s-pinned", "s-warm", "s-cold"):
            first[name] = server.turn(name, prompts[name])
        admin = server.admin()
        from kvtier.control.client import AdminClient

        admin.wait(admin.post(AdminClient.session_path("s-pinned", "pin"), {"tier": "nvme"}), timeout=120)
        admin.wait(admin.post(AdminClient.session_path("s-cold", "evict"), {"to": "nvme"}), timeout=120)
        admin.close()
    finally:
        out["_stop_s"] = server.stop(signal.SIGINT)
    log = server.log_path.read_text()
    out["_flush_on_stop"] = next((line.split("kvtier: ", 1)[1] for line in log.splitlines()
                                  if "kvtier: flushed" in line or "already has an NVMe copy" in line), "none")
    say(f"stopped with Ctrl-C in {out['_stop_s']:.1f} s ({out['_flush_on_stop']})")

    server = Served(model, base, "serve-2", tokens + 512, str(window))
    identical, loaded_ok = [], []
    try:
        admin = server.admin()
        listed = {s["session_id"]: s for s in admin.get("/v1/sessions")["sessions"]}
        status = admin.get("/v1/status")
        out["_catalog_start_ms_3_sessions"] = (status.get("catalog") or {}).get("start_ms")
        names = ("s-pinned", "s-warm", "s-cold")
        out["sessions_listed_after_stop"] = sum(
            1 for n in names if n in listed and listed[n]["blocks_nvme"] * BLOCK >= 0.9 * _full_tokens(prompts[n])
        ) / len(names)
        out["pins_kept_after_stop"] = 1.0 if (listed.get("s-pinned") or {}).get("pinned") == "nvme" else 0.0
        say(f"server 2 up in {server.start_s:.0f} s: listed "
            + ", ".join(f"{n} ({listed[n]['state']})" for n in names if n in listed))
        for name in names:
            again = server.turn(name, prompts[name])
            identical.append(again["text"] == first[name]["text"])
            loaded_ok.append(again["loaded"] >= 0.9 * _full_tokens(prompts[name]))
            out[f"_ttft_{name}_first_s"] = first[name]["seconds"]
            out[f"_ttft_{name}_after_stop_s"] = again["seconds"]
        out["loaded_after_stop"] = sum(loaded_ok) / len(loaded_ok)
        say(f"next turns after the stop: {sum(loaded_ok)}/3 loaded, {sum(identical)}/3 identical")
        first["s-crash"] = server.turn("s-crash", prompts["s-crash"])
        time.sleep(window + 3)  # older than the write-behind window
        admin.close()
    finally:
        out["_sigkill_s"] = server.stop(signal.SIGKILL)
    say(f"a fourth session, {window + 3:.0f} s old, then SIGKILL of the whole server")

    server = Served(model, base, "serve-3", tokens + 512, str(window))
    try:
        admin = server.admin()
        listed = {s["session_id"] for s in admin.get("/v1/sessions")["sessions"]}
        admin.close()
        again = server.turn("s-crash", prompts["s-crash"])
        identical.append(again["text"] == first["s-crash"]["text"])
        crash_ok = "s-crash" in listed and again["loaded"] >= 0.9 * _full_tokens(prompts["s-crash"])
        out["loaded_after_sigkill"] = 1.0 if crash_ok else 0.0
        out["_ttft_s-crash_after_sigkill_s"] = again["seconds"]
        out["_loaded_tokens_after_sigkill"] = again["loaded"]
    finally:
        server.stop(signal.SIGINT)
    out["outputs_identical"] = sum(identical) / len(identical)
    say(f"after SIGKILL: s-crash {'listed' if 's-crash' in listed else 'NOT listed'}, "
        f"{again['loaded']:,} tokens loaded; outputs identical {sum(identical)}/{len(identical)}")
    return out


def catalog_start_ms(sessions: int, directory: Path, blocks: int = 16, say: Callable[[str], None] = print) -> dict:
    """Start-up read of a catalog of ``sessions`` sessions (``blocks`` keys and 16 tokens a block each),
    its file's page cache dropped first: the manager's constructor, as a restart runs it."""
    from kvtier.bench.tiers import drop_page_cache
    from kvtier.layout import KVGeometry, ModelFingerprint
    from kvtier.persist.catalog import Catalog, SessionRecord, encode_tokens
    from kvtier.plan.index import namespace_of

    fingerprint = ModelFingerprint("bench-catalog", KVGeometry(32, 8, 128, 16, "bfloat16"), "w")
    ns = namespace_of(fingerprint.digest)
    catalog = Catalog(directory, fingerprint)
    tokens = encode_tokens(range(blocks * 16))
    now = time.time()
    for start in range(0, sessions, 10_000):
        catalog.write([SessionRecord(f"agent-{i}", ns, os.urandom(32 * blocks), 32, blocks * 16, None, now, now + i,
                                     tokens) for i in range(start, min(sessions, start + 10_000))])
    catalog.close()
    size = sum(p.stat().st_size for p in (directory / "catalog").glob("*.sqlite*"))
    # a restart is a new process: time it in one (this one's heap is full of the records just written)
    code = f"""
import json, time
from kvtier.persist.catalog import Catalog
from kvtier.layout import ModelFingerprint
from kvtier.plan.manager import TierManager
fingerprint = ModelFingerprint.from_dict({fingerprint.to_dict()!r})
started = time.perf_counter()
catalog = Catalog({str(directory)!r}, fingerprint)
manager = TierManager(fingerprint, 64 << 20, catalog=catalog)
elapsed = (time.perf_counter() - started) * 1000
started = time.perf_counter()
manager.views.session_state_counts()  # the first `kvtier status`: splits every session's keys
print(json.dumps([elapsed, (time.perf_counter() - started) * 1000, len(manager.table.sessions)]))
"""
    runs = []
    for _ in range(3):  # three cold starts, page cache dropped before each: this box is shared and noisy
        drop_page_cache(directory / "catalog")
        answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        runs.append(json.loads(answer.stdout.strip().splitlines()[-1]))
    runs.sort()
    elapsed, first_status, listed = runs[1]  # the median start-up
    say(f"catalog of {listed:,} sessions ({size / 2**20:.0f} MiB) read at start in {elapsed:.0f} ms "
        f"(first status after it: {first_status:.0f} ms)")
    return {"catalog_start_ms_100k_sessions": elapsed if sessions == 100_000 else None,
            "_catalog_start_ms_runs": ", ".join(f"{run[0]:.0f}" for run in runs),
            "_catalog_sessions": listed, "_catalog_mib": size / 2**20, "_catalog_first_status_ms": first_status}


def _background_writes(scheduler, worker, on: bool) -> None:
    """Switch the engine's background writes off (or back on) from the outside, with no switch in
    the product: while off, the catalog thread's sync writes nothing (what changed stays queued, and
    is written once it is on again) and the worker's write-behind sees no block due."""
    catalog, ledger = scheduler.manager.catalog_log, worker.mover.ledger
    if on:
        vars(catalog).pop("sync_catalog", None)  # the class's own methods again
        vars(ledger).pop("due_count", None)
    else:
        catalog.sync_catalog = lambda lock=None: True
        ledger.due_count = lambda max_age_s: 0


def serving_overhead(model: str, base: Path, pairs: int, tokens: int, window: str = "1",
                     say: Callable[[str], None] = print) -> dict:
    """Prefill tokens/s of one in-process engine with the session catalog and write-behind (``window``
    seconds) switched on and off between prompts: ``pairs`` pairs of distinct prompts in ABBA order, so drift
    and warm-up cancel (the same process, the same core binding, the same caches). Off means the
    catalog thread writes nothing and the worker's write-behind thread writes nothing; a backlog is
    then written while it is on, which counts against "on"."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvtier.bench.harness import Engine, cpu_environment
    from kvtier.launch.serve import is_cpu_only

    if is_cpu_only():  # as `kvtier serve` runs it: vLLM computes on all cores but one, kvtier's threads use that one
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    cpu_environment(str(base / "vllm"))
    engine = Engine(model, kvtier=True, nvme_dir=base / "nvme", max_len=tokens + 256,
                    extra={"synchronous": False, "write_behind": window})
    seconds = {"on": 0.0, "off": 0.0}
    try:
        scheduler, worker = engine.connector._scheduler, get_kv_transfer_group()._worker
        engine.generate(_prompt(99, tokens), 1)  # warm-up
        for pair in range(pairs):
            for i, mode in enumerate(("on", "off") if pair % 2 == 0 else ("off", "on")):
                _background_writes(scheduler, worker, on=mode == "on")
                started = time.perf_counter()
                engine.generate(_prompt(100 + 2 * pair + i, tokens), 1)
                seconds[mode] += time.perf_counter() - started
            say(f"pair {pair + 1}/{pairs}: on {(pair + 1) * tokens / max(seconds['on'], 1e-9):,.0f}, "
                f"off {(pair + 1) * tokens / max(seconds['off'], 1e-9):,.0f} prefill tokens/s so far")
        counters = dict(engine.manager.telemetry.counters)
    finally:
        engine.close()
    on, off = pairs * tokens / seconds["on"], pairs * tokens / seconds["off"]
    return {"serving_overhead": 1 - on / off, "_prefill_tokens_s_on": on, "_prefill_tokens_s_off": off,
            "_overhead_write_behind_s": window, "_overhead_blocks_stored": counters.get("stored_blocks", 0),
            "_overhead_written_behind_blocks": counters.get("written_behind_blocks", 0),
            "_overhead_catalog_writes": counters.get("catalog_writes", 0)}


def run_restart_bench(quick: bool = False, progress: Callable[[str], None] = print, model: str | None = None) -> dict:
    from kvtier.models.demo import ensure_demo_model

    model = str(model or ensure_demo_model("tiny", progress=progress))
    tokens, window = (2048, 3.0) if quick else (8192, 10.0)
    out: dict = {"_tokens_per_session": tokens, "_write_behind_s": window}
    with tempfile.TemporaryDirectory(prefix="kvtier-restart-") as tmp:
        base = Path(tmp)
        for sub in ("serve", "catalog", "overhead"):
            (base / sub).mkdir()
        out.update(_restart_phases(model, base / "serve", tokens, window, progress))
        out.update(catalog_start_ms(100_000, base / "catalog", blocks=8 if quick else 16, say=progress))
        # full: the default 10 s window under a minute of back-to-back prefills (a busy engine writes
        # blocks past twice the window, so most are written during the run); quick: a 1 s window
        out.update(serving_overhead(model, base / "overhead", pairs=3 if quick else 24, tokens=8192,
                                    window="1" if quick else "10", say=progress))
    return out
