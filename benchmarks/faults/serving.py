"""Faults while serving: ``kvtier serve`` on the tiny demo model under concurrent multi-turn load,
with operator actions and disk faults, against the same conversations on plain vLLM.

1. Reference: vLLM's OpenAI server without kvtier serves the conversations (same concurrency).
2. kvtier: ``kvtier serve`` with a small DRAM tier (constant demotion) and its NVMe directory on a
   256 MiB tmpfs in a private mount namespace (``unshare -rm``: no root needed), serves the same
   conversations while a chaos thread evicts, drops, snapshots, restores, pins and unpins sessions
   through the admin socket, and the disk is, in turn: filled (ENOSPC), freed, remounted
   read-only, made writable, and wiped (``rm -rf``) under the server. For each disk fault the
   warning must show in ``/v1/status``, ``/metrics`` and ``kvtier top --once --json``, and clear
   once the disk works again.

``failed_requests_under_load``: requests that got no completion (HTTP error, exception).
``outputs_mismatched``: completions whose text differs from the reference's for the same
conversation and turn. Greedy decoding; vLLM's own prefix cache is on in both servers.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from kvtier.launch.served import free_port, wait_ready

__all__ = ["run_serving_faults"]

TMPFS_MB = 256
WORDS = ("alpha beta gamma delta kernel cache block tier session token layer head vector matrix "
         "page disk link queue shard model prompt").split()


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(words))


def _script(clients: int, sessions_per_client: int, turns: int) -> list[list[tuple[str, list[str]]]]:
    """Per client, its sessions in order (churn: a client moves on to a new session), each a list of
    user messages (the first one a long context)."""
    out = []
    for c in range(clients):
        sessions = []
        for s in range(sessions_per_client):
            sid = f"c{c}-s{s}"
            seed = c * 1000 + s * 10
            sessions.append((sid, [_text(seed, 500 + 100 * (c % 3))] + [_text(seed + t, 60) for t in range(1, turns)]))
        out.append(sessions)
    return out


def _complete(base: str, prompt: str, session: str | None, details: dict | None = None) -> str:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "seed": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if session:
        headers["X-Session-ID"] = session
    request = urllib.request.Request(base + "/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=300) as response:
        doc = json.loads(response.read())
    if details is not None:  # where the prompt's KV came from: vLLM's cache, kvtier's tiers
        usage = doc.get("usage") or {}
        details.update(prompt_tokens=usage.get("prompt_tokens"),
                       cached=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                       kvtier=(doc.get("kv_transfer_params") or {}).get("kvtier"))
    return doc["choices"][0]["text"]


def _drive(base: str, script, kvtier: bool, done: list[int]) -> tuple[dict, list[str], dict]:
    outputs: dict[tuple[str, int], str] = {}
    details: dict[tuple[str, int], dict] = {}
    failures: list[str] = []
    lock = threading.Lock()

    def client(sessions) -> None:
        for sid, messages in sessions:
            history = ""
            for turn, message in enumerate(messages):
                history += ("\n" if history else "") + message
                try:
                    info: dict = {}
                    reply = _complete(base, history, sid if kvtier else None, info)
                except Exception as exc:  # noqa: BLE001 - every failure is counted, none hidden
                    with lock:
                        failures.append(f"{sid} turn {turn}: {type(exc).__name__}: {exc}")
                    break
                with lock:
                    outputs[(sid, turn)] = reply
                    details[(sid, turn)] = info
                    done[0] += 1
                history += reply

    with ThreadPoolExecutor(len(script)) as pool:
        list(pool.map(client, script))
    return outputs, failures, details


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class _Disk:
    """The server's NVMe directory on a tmpfs only the server's mount namespace sees; reached from
    here through ``/proc/<pid>/root`` and ``nsenter``."""

    def __init__(self, pid: int, mount: Path):
        self.pid, self.mount = pid, mount
        self.view = Path(f"/proc/{pid}/root") / str(mount).lstrip("/")

    def _ns(self, *cmd: str) -> None:
        subprocess.run(["nsenter", "-t", str(self.pid), "-U", "-m", "--preserve-credentials", *cmd], check=True,
                       capture_output=True)

    def fill(self) -> None:
        """Another process filling the disk, and keeping it full: it takes whatever space frees up
        (kvtier's own drops included) until ``free``."""
        self._filling = threading.Event()
        self._filling.set()
        self._fill_once()  # full before this returns
        self._filler = threading.Thread(target=self._keep_full, daemon=True)
        self._filler.start()

    def _fill_once(self) -> None:
        chunk = b"\1" * (64 << 10)
        with contextlib.suppress(OSError), open(self.view / "filler", "ab") as f:
            while True:
                f.write(chunk)
                f.flush()

    def _keep_full(self) -> None:
        while self._filling.is_set():
            self._fill_once()
            time.sleep(0.02)

    def free(self) -> None:
        self._filling.clear()
        self._filler.join(10)
        (self.view / "filler").unlink(missing_ok=True)

    def read_only(self, on: bool) -> None:
        """Remount read-only (or back). A remount is refused (EBUSY) while a file on the disk is
        open for writing, which kvtier does for the moment of each write: retry, as an operator would."""
        deadline = time.monotonic() + 10
        while True:
            try:
                return self._ns("mount", "-o", f"remount,{'ro' if on else 'rw'}", str(self.mount))
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wipe(self) -> None:
        shutil.rmtree(self.view / "nvme", ignore_errors=True)


def _warnings(admin, sock: str, env: dict) -> dict[str, bool]:
    status = admin.get("/v1/status").get("warnings", {})
    metrics = admin.request("GET", "/metrics", raw=True)
    top = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "top", "--once", "--json", "--socket", sock],
                         capture_output=True, text=True, env=env, timeout=60)
    banners = json.loads(top.stdout).get("banners", []) if top.returncode == 0 else []
    return {"status": any(k.startswith("nvme") for k in status),
            "metrics": 'kvtier_warning{tier="nvme"} 1.0' in metrics,
            "top": any(b.startswith("nvme") for b in banners)}


def _until(predicate: Callable[[], bool], timeout: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.25)
    return None


def run_serving_faults(quick: bool = False, progress: Callable[[str], None] = print, model: str | None = None,
                       chaos_on: bool = True, disk_on: bool = True) -> dict:
    from kvtier.control.client import AdminClient
    from kvtier.launch.serve import admin_socket_path
    from kvtier.models.demo import ensure_demo_model

    model = model or str(ensure_demo_model("tiny", progress=progress))
    script = _script(*((3, 2, 3) if quick else (4, 3, 4)))
    requests = sum(len(messages) for sessions in script for _sid, messages in sessions)
    results: dict = {"_requests": requests, "_clients": len(script)}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-faults-") as tmp:
        tmp = Path(tmp)
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1",
                   VLLM_CACHE_ROOT=str(tmp / "vllm-cache"), XDG_RUNTIME_DIR=str(tmp / "run"),
                   KVTIER_SNAPSHOT_DIR=str(tmp / "snapshots"), TMPDIR=str(tmp), KVTIER_NO_NUMBA="1",
                   KVTIER_ALLOW_RAM_NVME="1")  # the disk under test is a tmpfs (mountable without root)
        (tmp / "run").mkdir()
        # vLLM's CPU kernels are not batch-invariant: the same prompt alone and batched with three
        # others gives different greedy text on plain vLLM (measured). Both servers therefore run
        # one sequence at a time; clients, chaos and disk faults stay concurrent.
        vllm_args = ["--max-model-len", "4096", "--enforce-eager", "--served-model-name", "tiny", "--max-num-seqs", "1"]

        # 1. the reference: plain vLLM, same conversations, same concurrency
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = tmp / "plain.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               *vllm_args]
        progress("reference: plain vLLM serving the conversations")
        plain = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(base, plain, log)
            reference, ref_failures, ref_details = _drive(base, script, kvtier=False, done=[0])
        finally:
            _stop(plain)
        if ref_failures:
            raise RuntimeError(f"the reference server failed requests: {ref_failures[:3]}")

        # 2. kvtier serve, its NVMe tier on a private tmpfs
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        mount = tmp / "disk"
        mount.mkdir()
        log = tmp / "kvtier.log"
        serve = [sys.executable, "-m", "kvtier.cli.main", "serve", model, "--port", str(port), "--dram", "8MiB",
                 "--nvme-dir", str(mount / "nvme"), "--nvme", "192MiB", "--", *vllm_args]
        wrapper = f'mount -t tmpfs -o size={TMPFS_MB}m tmpfs "$0" && exec "$@"'
        progress("kvtier serve (NVMe tier on a private tmpfs) under load, chaos and disk faults")
        server = subprocess.Popen(["unshare", "-rm", "sh", "-c", wrapper, str(mount), *serve], env=env,
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        sock = admin_socket_path(env, str(port))  # the instance is named by its port
        chaos_counts = {"actions": 0, "refused": 0, "admin_errors": 0}
        faults: dict[str, dict] = {}
        stop = threading.Event()
        try:
            wait_ready(base, server, log)
            admin = AdminClient(sock, timeout=60)
            disk = _Disk(server.pid, mount)
            done = [0]

            def chaos() -> None:
                from kvtier.errors import KvtierError

                rng = random.Random(7)
                snaps: list[str] = []
                while chaos_on and not stop.wait(rng.uniform(0.2, 0.8)):
                    try:
                        sessions = [s["session_id"] for s in admin.get("/v1/sessions")["sessions"]]
                    except Exception:  # noqa: BLE001
                        chaos_counts["admin_errors"] += 1
                        continue
                    if not sessions:
                        continue
                    sid = rng.choice(sessions)
                    action = rng.choice(["evict-nvme", "evict-drop", "snapshot", "restore", "pin", "unpin"])
                    try:
                        if action == "evict-nvme":
                            admin.post(f"/v1/sessions/{sid}/evict", {"to": "nvme"})
                        elif action == "evict-drop":
                            admin.post(f"/v1/sessions/{sid}/evict", {"to": "drop"})
                        elif action == "snapshot":
                            name = f"{sid}-{len(snaps)}.kvsnap"
                            admin.post(f"/v1/sessions/{sid}/snapshot", {"path": name})
                            snaps.append(name)
                        elif action == "restore" and snaps:
                            admin.post("/v1/restore", {"path": rng.choice(snaps)})
                        elif action == "pin":
                            admin.post(f"/v1/sessions/{sid}/pin", {"tier": "dram"})
                        else:
                            admin.post(f"/v1/sessions/{sid}/unpin")
                        chaos_counts["actions"] += 1
                    except KvtierError as exc:  # refused with a reason (busy, pinned, gone...): fine
                        chaos_counts["refused"] += 1
                        if getattr(exc, "status", 400) >= 500:
                            chaos_counts["admin_errors"] += 1
                    except Exception:  # noqa: BLE001 - the admin plane must not break under load
                        chaos_counts["admin_errors"] += 1

            def disk_faults() -> None:
                plan = [("enospc", disk.fill, disk.free), ("read_only", lambda: disk.read_only(True),
                                                           lambda: disk.read_only(False)),
                        ("removed", disk.wipe, None)]  # lost blocks: a lasting warning, nothing to heal
                for name, inject, heal in plan:
                    if stop.wait(4.0):
                        return
                    record = faults[name] = {}
                    inject()
                    shown = _until(lambda: _warnings(admin, sock, env)["status"], 60)
                    record["warning_after_s"] = shown
                    if shown is not None:
                        record["shown_in"] = [k for k, v in _warnings(admin, sock, env).items() if v]
                    if heal is None:
                        continue
                    heal()
                    record["cleared_after_s"] = _until(lambda: "nvme" not in admin.get("/v1/status")["warnings"], 90) \
                        if shown is not None else None
                    if record["cleared_after_s"] is None:  # what the server saw, to tell why
                        status = admin.get("/v1/status")
                        record["warnings"] = status["warnings"]
                        record["counters"] = {k: v for k, v in status["counters"].items()
                                              if "nvme" in k or "demote" in k or "written" in k or "behind" in k}
                        record["dirty"] = status.get("dirty")

            faults_done = threading.Event()
            extra = {"requests": 0, "failed": 0}

            def background_traffic() -> None:  # keeps demotions going until every disk fault has run
                i = 0
                while not faults_done.is_set():
                    try:
                        _complete(base, _text(50_000 + i, 300), f"bg-{i % 5}")
                        extra["requests"] += 1
                    except Exception:  # noqa: BLE001 - counted with the other failures
                        extra["failed"] += 1
                    i += 1

            def run_disk_faults() -> None:
                try:
                    if disk_on:
                        disk_faults()
                finally:
                    faults_done.set()

            threads = [threading.Thread(target=chaos, daemon=True), threading.Thread(target=run_disk_faults,
                                                                                     daemon=True),
                       threading.Thread(target=background_traffic, daemon=True)]
            for thread in threads:
                thread.start()
            outputs, failures, details = _drive(base, script, kvtier=True, done=done)
            faults_done.wait(timeout=900)
            stop.set()
            for thread in threads:
                thread.join(timeout=300)
            counters = admin.get("/v1/status").get("counters", {})
        finally:
            stop.set()
            _stop(server)
        mismatched = [key for key, text in reference.items() if key in outputs and outputs[key] != text]
        results.update(
            # failed, or never sent because an earlier turn of its conversation failed; and the
            # background requests that kept the disk busy until every disk fault had run
            failed_requests_under_load=sum(1 for key in reference if key not in outputs) + extra["failed"],
            _background_requests=extra["requests"],
            outputs_mismatched=len(mismatched),
            _failures=failures[:5],
            _mismatched=[{"turn": f"{s} turn {t}", "reference": reference[(s, t)], "kvtier": outputs[(s, t)],
                          "reference_kv": ref_details.get((s, t)), "kvtier_kv": details.get((s, t))}
                         for s, t in mismatched[:5]],
            _chaos=chaos_counts, _disk_faults=faults,
            _counters={k: v for k, v in counters.items() if k.startswith(("hit_", "demote", "dram_dropped",
                                                                          "nvme_", "restored", "jobs_"))},
        )
    return results
