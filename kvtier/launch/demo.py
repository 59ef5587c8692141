"""``kvtier demo``: the seed's overnight scenario, on real ``kvtier serve`` processes.

An agent session with a long context is served in the evening (its prefill is paid once) and
snapshotted to a portable file. The server is stopped (Ctrl-C: kvtier flushes what DRAM held to
NVMe, then stops vLLM). The next morning a new server process starts on the same NVMe directory:
the session is listed at once (``cold``), and its next turn loads its KV instead of recomputing it.
Its time to first token is compared with the evening's full prefill. Nothing is done by hand
between the turns. The snapshot file is the other way back (another box, a wiped disk):
``kvtier restore agent-42.kvsnap``.
"""
from __future__ import annotations

import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Callable

__all__ = ["run_demo"]


def run_demo(tokens: int = 8192, size: str = "tiny", workdir: str | None = None,
             say: Callable[[str], None] = print) -> dict:
    from kvtier.launch.served import Served
    from kvtier.models.demo import ensure_demo_model
    from kvtier.persist.snapshot import verify_snapshot

    model = str(ensure_demo_model(size, progress=say))
    base = Path(workdir or tempfile.mkdtemp(prefix="kvtier-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    snapshot = base / "agent-42.kvsnap"
    context = [3 + (i * 131) % 1900 for i in range(tokens)]
    next_turn = context + [3 + (i * 17) % 1900 for i in range(64)]
    say(f"DEMO model ({size}, random weights): an agent session with a {tokens:,}-token context, "
        f"served by `kvtier serve` (logs in {base})")

    say("evening: starting kvtier serve…")
    evening = Served(model, base, "evening", len(next_turn) + 512)
    try:
        evening.turn("warm-up", [5, 6, 7])  # the first forward of a process is slow
        first = evening.turn("agent-42", context)
        say(f"evening: agent-42's first turn, prefill paid in full: TTFT {first['seconds']:.2f} s")
        admin = evening.admin()
        job = admin.snapshot_to_file("agent-42", snapshot)  # made here, handed to the server
        admin.close()
        info = verify_snapshot(snapshot)
        if info.session_id != "agent-42":  # the file is named for the session it must hold
            from kvtier.errors import KvtierError

            raise KvtierError(f"the snapshot {snapshot.name} holds session {info.session_id!r}, not 'agent-42'",
                              hint=f"the server did not see the X-Session-ID header; see {evening.log_path}")
        say(f"snapshot of {info.session_id}: {len(info.blocks)} blocks, {info.payload_bytes / 2**20:.1f} MiB, "
            f"checksums verified -> {snapshot} (job {job['id']})")
    finally:
        stop_s = evening.stop(signal.SIGINT)
    flush = next((line.split("kvtier: ", 1)[1] for line in evening.log_path.read_text().splitlines()
                  if "kvtier: flushed" in line or "already has an NVMe copy" in line), "no flush reported")
    say(f"server stopped overnight with Ctrl-C in {stop_s:.1f} s ({flush})")

    say("next morning: a new kvtier serve process on the same NVMe directory…")
    morning = Served(model, base, "morning", len(next_turn) + 512)
    try:
        admin = morning.admin()
        listed = {s["session_id"]: s for s in admin.get("/v1/sessions")["sessions"]}
        admin.close()
        state = (listed.get("agent-42") or {}).get("state", "not listed")
        say(f"agent-42 is listed at start: {state}, {(listed.get('agent-42') or {}).get('tokens', 0):,} tokens")
        morning.turn("warm-up", [5, 6, 7])
        started = time.perf_counter()
        again = morning.turn("agent-42", next_turn)
        restored_s = time.perf_counter() - started
    finally:
        morning.stop(signal.SIGINT)
    say(f"next morning: agent-42's next turn TTFT {restored_s:.2f} s "
        f"({again['loaded']:,} of {len(next_turn):,} prompt tokens loaded from kvtier)")
    say(f"recompute {first['seconds']:.2f} s vs loaded {restored_s:.2f} s: "
        f"{first['seconds'] / max(restored_s, 1e-9):.1f}x faster")
    if workdir is None:
        for leftover in ("nvme", "vllm-cache", "run"):
            shutil.rmtree(base / leftover, ignore_errors=True)
    return {"recompute_ttft_s": first["seconds"], "restored_ttft_s": restored_s, "loaded_tokens": again["loaded"],
            "state_after_restart": state, "snapshot": str(snapshot), "stop_s": stop_s}
