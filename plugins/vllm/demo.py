"""``kvtier demo``: the seed's overnight scenario on real vLLM with the demo model.

An agent session with a long context is served (its prefill is paid once), snapshotted to a file,
and the engine is shut down with its cold tier wiped. A fresh engine ("the next morning") restores
the snapshot and serves the session's next turn: its time to first token is compared with the
recompute the session paid the evening before.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

__all__ = ["run_demo"]


def run_demo(tokens: int = 8192, size: str = "tiny", workdir: str | None = None,
             say: Callable[[str], None] = print) -> dict:
    from kvtier.demo_model import ensure_demo_model
    from kvtier.plugins.vllm.harness import Engine, cpu_environment
    from kvtier.snapshot import open_snapshot, verify_snapshot

    cpu_environment()
    model = str(ensure_demo_model(size, progress=say))
    base = Path(workdir or tempfile.mkdtemp(prefix="kvtier-demo-"))
    nvme, snapshot = base / "nvme", base / "agent-42.kvsnap"
    context = [3 + (i * 131) % 1900 for i in range(tokens)]
    say(f"DEMO model ({size}, random weights): an agent session with a {tokens:,}-token context")

    evening = Engine(model, kvtier=True, nvme_dir=nvme, max_len=tokens + 512)
    evening.timed([5, 6, 7], 1)  # warm-up: the first forward of a process is slow
    recompute, _ = evening.timed(context, 1)
    say(f"evening: first turn, prefill paid in full: TTFT {recompute:.2f} s")
    session = max(evening.manager.sessions.values(), key=lambda s: len(s.keys)).session_id
    started = time.perf_counter()
    evening.run_job(evening.manager.prepare_snapshot(session, str(snapshot)))
    info = verify_snapshot(snapshot)
    say(f"snapshot of {session}: {len(info.blocks)} blocks, {info.payload_bytes / 2**20:.1f} MiB "
        f"in {time.perf_counter() - started:.2f} s -> {snapshot}")
    evening.close()
    shutil.rmtree(nvme, ignore_errors=True)
    say("server stopped overnight; its DRAM and NVMe tiers are gone, only the snapshot file is left")

    morning = Engine(model, kvtier=True, nvme_dir=nvme, max_len=tokens + 512)
    morning.timed([5, 6, 7], 1)
    started = time.perf_counter()
    morning.run_job(morning.manager.prepare_restore(open_snapshot(snapshot)))
    restore_s = time.perf_counter() - started
    next_turn = context + [3 + (i * 17) % 1900 for i in range(64)]
    restored, out = morning.timed(next_turn, 1)
    loaded = morning.manager.counters.get("loaded_tokens", 0)
    morning.close()
    say(f"next morning: restore {restore_s:.2f} s, next turn TTFT {restored:.2f} s "
        f"({loaded:,} of {len(next_turn):,} prompt tokens loaded from kvtier)")
    say(f"recompute {recompute:.2f} s vs restored {restored:.2f} s: {recompute / restored:.1f}x faster")
    return {"recompute_ttft_s": recompute, "restore_s": restore_s, "restored_ttft_s": restored,
            "loaded_tokens": loaded, "snapshot": str(snapshot)}
