"""Two NVMe drives behind one real ``kvtier serve``: blocks on both, and one drive lost while serving
costs only its blocks (they recompute, the other drive's load; no request fails)."""
from __future__ import annotations

import json
import shutil

from support.realpath import need

need("vllm")


def test_one_of_two_drives_lost_while_serving_fails_no_request(tiny_model, tmp_path):
    from kvtier.bench.checks import reset_served_prefix_cache
    from kvtier.launch.served import Served

    a, b = tmp_path / "drive-a", tmp_path / "drive-b"
    served = Served(str(tiny_model), tmp_path, "x", 2048, nvme_dir=f"{a}:{b}", write_behind="off")
    try:
        admin = served.admin()
        bt = int(admin.get("/v1/status")["block_tokens"])
        prompts = {f"agent-{n}": [100 + 37 * n + i for i in range(6 * bt)] for n in range(6)}
        first = {s: served.turn(s, p)["text"] for s, p in prompts.items()}
        admin.post("/v1/flush", {})
        assert admin.get("/v1/status?until=clean&wait_s=30")["tiers"]
        on_disk = {d.name: sum(f.stat().st_size for f in (d / "segments").glob("*.kvseg")) for d in (a, b)}
        assert all(on_disk.values()), on_disk  # placed by key hash: both drives hold blocks
        for session in prompts:  # out of DRAM and out of vLLM's own cache: the next turns read the drives
            admin.post(f"/v1/sessions/{session}/evict", {"to": "nvme"})
        reset_served_prefix_cache(served.url, served.served_name)  # accepted, not just answered
        shutil.rmtree(b)  # drive 1 is gone

        again = {s: served.turn(s, p) for s, p in prompts.items()}  # urlopen raises on any failed request
        assert {s: t["text"] for s, t in again.items()} == first  # recomputed where its blocks were lost
        assert sum(t["loaded"] for t in again.values()) > 0  # drive 0's blocks still load
        status = admin.get("/v1/status")
        assert status["counters"].get("nvme_failed_reads", 0) > 0
        assert str(b) in json.dumps(status["warnings"]), status["warnings"]  # the lost drive is named
        assert status["nvme_drives"] == [str(a), str(b)]
        from typer.testing import CliRunner

        from kvtier.cli.main import app

        shown = CliRunner().invoke(app, ["status", "--socket", served.socket])
        assert shown.exit_code == 0 and "NVMe drives: " in shown.output, shown.output
    finally:
        served.stop()
