"""Regenerate tests/tui/data/top.jsonl: a short recording of `kvtier top` watching a real admin server
(an in-process tier engine) with sessions in every state and a few finished jobs. The snapshot
tests and the README screenshot replay it, so they do not depend on timing.

    python tests/tui/data/make_top_replay.py
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from benchmarks.top import demo_admin
from kvtier.control.client import AdminClient
from kvtier.tui.collector import Collector

OUT = Path(__file__).with_name("top.jsonl")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvtier-top-replay-") as tmp:
        admin, engine = demo_admin(Path(tmp), 40, churn=False)
        client = AdminClient(str(Path(tmp) / "admin.sock"))
        with admin.lock:  # a few sessions in the HBM of a running request
            for n in (3, 17):
                engine.manager.table.sessions[f"session-{n:04d}"].hot = True
            # and what vLLM's KV cache events would say its prefix cache holds
            engine.manager.views.follow_hbm(lambda: {"session-0003": 4, "session-0017": 9, "session-0008": 2})
        client.post(client.session_path("session-0005", "pin"), {"tier": "dram"})
        client.post(client.session_path("session-0011", "pin"), {"tier": "nvme"})
        for n in (21, 22, 23):
            client.post(client.session_path(f"session-{n:04d}", "evict"), {"to": "nvme"})
        client.post(client.session_path("session-0030", "snapshot"), {})
        admin.drain()
        client.post(client.session_path("session-0031", "evict"), {"to": "drop"})
        admin.drain()
        collector = Collector(client)
        lines = []
        for n in range(3):  # some traffic between samples, so the links have rates
            lines.append(collector.poll().to_json())
            client.post(client.session_path(f"session-{24 + n:04d}", "evict"), {"to": "nvme"})
            admin.drain()
            time.sleep(0.5)
        admin.stop()
        engine.close(write_back=False)
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT} ({len(lines)} snapshots)", file=sys.stderr)


if __name__ == "__main__":
    main()
