"""Admin latency with the admin server inside a real vLLM engine (tiny demo model) under load."""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Callable

__all__ = ["run_vllm_load_latency"]


def run_vllm_load_latency(seconds: float, progress: Callable[[str], None]) -> dict:
    from benchmarks.latency import EchoServer, latency_figures, latency_in_subprocess
    from kvtier.bench.harness import Engine, cpu_environment
    from kvtier.models.demo import ensure_demo_model

    cpu_environment()
    model = str(ensure_demo_model("tiny", progress=progress))
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-admin-", dir=Path.cwd()) as tmp:
        sock = str(Path(tmp) / "admin.sock")
        engine = Engine(model, kvtier=True, nvme_dir=Path(tmp) / "nvme", max_len=4096,
                        extra={"admin_socket": sock, "snapshot_dir": str(Path(tmp) / "snapshots")})
        stop = threading.Event()
        served = [0]

        def load() -> None:  # back-to-back requests: 40 sessions of ~1k tokens, 8 output tokens each
            i = 0
            while not stop.is_set():
                prompt = [3 + ((i % 40) * 7919 + t * 131) % 1900 for t in range(900 + (i % 7) * 30)]
                engine.generate(prompt, 8)
                served[0] += 1
                i += 1

        worker = threading.Thread(target=load, daemon=True)
        echo = EchoServer(str(Path(tmp) / "echo.sock"))  # the reference, in the engine's process too
        try:
            engine.generate([5, 6, 7], 1)  # warm-up
            worker.start()
            progress(f"admin latency for {seconds:.0f} s inside a vLLM engine serving back-to-back requests")
            samples = latency_in_subprocess(sock, seconds, echo.path)
        finally:
            stop.set()
            worker.join(timeout=120)
            echo.close()
            engine.close()
    return {**latency_figures(samples), "_requests_served_meanwhile": served[0],
            "_load": "vLLM (tiny demo model) serving back-to-back requests"}
