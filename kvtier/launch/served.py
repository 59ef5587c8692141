"""A real ``kvtier serve`` process for the demo and the benchmarks: start, talk, stop or kill; a free
port and a wait until a server answers."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvtier.launch.serve import has_flag

__all__ = ["Served", "free_port", "wait_ready"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, log: Path | None = None, timeout: float = 300) -> None:
    """Wait until the OpenAI server at ``base`` answers /health (raises if ``proc`` exits first)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None else ""
            raise RuntimeError(f"server exited early ({proc.returncode}): {tail}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError("server not ready in time")


class Served:
    """One ``kvtier serve`` process (its own admin socket and logs under ``base``; the NVMe tier in
    ``base/nvme`` unless ``nvme_dir``), ready when constructed. Greedy 8-token completions."""

    def __init__(self, model: str, base: Path, name: str, max_len: int, write_behind: str = "10",
                 nvme_dir: Path | None = None, vllm_args: tuple[str, ...] = (), connector: bool = True,
                 serve_args: tuple[str, ...] = (), instance: str | None = None, served_name: str = "tiny",
                 max_seqs: int = 1, dram: str = "1GiB", nvme: str = "8GiB", env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / f"{name}.log"
        self.env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", TMPDIR=str(base), VLLM_CPU_KVCACHE_SPACE="1",
                        VLLM_CACHE_ROOT=str(base / "vllm-cache"), PYTHONUNBUFFERED="1",
                        XDG_RUNTIME_DIR=str(base / "run"), KVTIER_SNAPSHOT_DIR=str(base / "snapshots"),
                        **(env or {}))
        if has_flag(vllm_args, "--kv-cache-memory-bytes"):
            del self.env["VLLM_CPU_KVCACHE_SPACE"]  # it would beat the flag (vLLM's CPU platform)
        (base / "run").mkdir(exist_ok=True)
        from kvtier.control.instances import instance_socket

        self.instance = instance or str(self.port)
        self.socket = instance_socket(self.instance, self.env)
        self.served_name = served_name
        served = ["--max-model-len", str(max_len), "--enforce-eager", "--served-model-name", served_name,
                  "--max-num-seqs", str(max_seqs), *vllm_args]
        if connector:
            named = ("--instance", instance) if instance else ()
            cmd = [sys.executable, "-m", "kvtier.cli.main", "serve", model, "--port", str(self.port), *named,
                   "--dram", dram, "--nvme-dir", str(nvme_dir or base / "nvme"), "--nvme", nvme,
                   "--write-behind", write_behind, *serve_args, "--", *served]
        else:  # plain vLLM with kvtier serve's environment (the same cores, threads and KV space)
            from kvtier.launch.serve import is_cpu_only, vllm_cpu_env

            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--port", str(self.port), *served]
            self.env = vllm_cpu_env(self.env, served, connector=False) if is_cpu_only() else self.env
            self.socket = ""
        self.log = open(self.log_path, "w")
        started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_ready(self.url, self.proc, self.log_path)
        self.start_s = time.perf_counter() - started

    def admin(self):
        from kvtier.control.client import AdminClient

        return AdminClient(self.socket, timeout=60)

    def turn(self, session: str, prompt: list[int], max_tokens: int = 8) -> dict:
        body = json.dumps({"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", "X-Session-ID": session})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            doc = json.loads(response.read())
        kvtier = (doc.get("kv_transfer_params") or {}).get("kvtier") or {}
        return {"text": doc["choices"][0]["text"], "loaded": int(kvtier.get("loaded_tokens") or 0),
                "seconds": time.perf_counter() - started}

    def streamed(self, session: str, prompt: list[int], max_tokens: int = 8) -> dict:
        """A streamed completion: its text and its time to the first token (``ttft``)."""
        body = json.dumps({"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", "X-Session-ID": session})
        started, ttft, text = time.perf_counter(), None, []
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                piece = "".join(choice.get("text") or "" for choice in chunk.get("choices") or ())
                if piece and ttft is None:
                    ttft = time.perf_counter() - started
                text.append(piece)
        return {"text": "".join(text), "ttft": ttft if ttft is not None else time.perf_counter() - started}

    def stop(self, sig: int = signal.SIGINT) -> float:
        started = time.perf_counter()
        if sig == signal.SIGKILL:  # the whole server: kvtier serve and vLLM (in its own process group)
            import psutil

            family = psutil.Process(self.proc.pid).children(recursive=True)
            os.killpg(self.proc.pid, signal.SIGKILL)
            for proc in family:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(family, timeout=30)
        else:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        return time.perf_counter() - started
