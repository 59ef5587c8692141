"""End to end through HTTP: `kvtier serve` on the tiny demo model, the `openai` client, SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from support.realpath import need

from kvtier.bench.checks import reset_served_prefix_cache
from kvtier.launch.served import free_port

pytestmark = pytest.mark.slow
openai = need("openai")


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    from kvtier.launch.served import wait_ready as ready

    ready(url, proc, timeout=timeout)


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie no one reaped yet counts as gone
        return stat.read().split()[2] == "Z"


def test_chat_through_kvtier_serve_reloads_session_after_prefix_reset(tiny_model, tmp_path):
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", TMPDIR=str(tmp_path), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), PYTHONUNBUFFERED="1",
               XDG_RUNTIME_DIR=str(tmp_path / "run"))  # the CLI finds this server alone
    log = open(tmp_path / "server.log", "w")
    cmd = [sys.executable, "-m", "kvtier.cli.main", "serve", str(tiny_model), "--port", str(port),
           "--dram", "256MiB", "--nvme-dir", str(tmp_path / "nvme"), "--nvme", "1GiB",
           "--", "--max-model-len", "4096", "--enforce-eager", "--served-model-name", "tiny"]
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, server)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        long_context = " ".join(f"def function_{i}(x): return x * {i}" for i in range(120))
        messages = [{"role": "user", "content": long_context}]

        def turn():
            return client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0, seed=0,
                extra_headers={"X-Session-ID": "agent-a"})

        first = turn()
        assert first.kv_transfer_params["kvtier"]["session_id"] == "agent-a"
        messages.append({"role": "assistant", "content": first.choices[0].message.content})
        messages.append({"role": "user", "content": "and the next step?"})
        second = turn()
        _readme_request_and_hbm_as_vllm_holds_it(client, env)
        # vLLM forgets everything it cached; kvtier still holds the session
        reset_served_prefix_cache(base, "tiny")  # accepted, not just answered (blocks held refuse it)
        again = turn()
        assert again.choices[0].message.content == second.choices[0].message.content
        assert again.kv_transfer_params["kvtier"]["loaded_tokens"] >= 0.9 * again.usage.prompt_tokens - 128
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=90)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
        log.close()
    assert code == 0, (tmp_path / "server.log").read_text()[-3000:]
    # no process of the server's group is left behind
    leftovers = subprocess.run(["pgrep", "-g", str(server.pid)], capture_output=True, text=True).stdout.split()
    assert all(process_gone(int(pid)) for pid in leftovers)


def _readme_request_and_hbm_as_vllm_holds_it(client, env: dict) -> None:
    """Issue 32: the README's first request (shorter than one block) is listed and explained; and
    after turns that leave their blocks in vLLM's prefix cache, `kvtier top` shows HBM occupied and
    the session hot (vLLM's KV cache events, which kvtier serve turns on)."""
    import json
    import time

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "def fib(n):"}],
                                   max_tokens=16, extra_headers={"X-Session-ID": "agent-42"})
    rows = {s["session_id"]: s for s in json.loads(cli("sessions", "--json"))["sessions"]}
    assert "shorter than one block" in rows["agent-42"]["stored_note"], rows["agent-42"]
    assert "nothing stored" in cli("inspect", "agent-42")
    deadline = time.monotonic() + 60  # the events reach the connector's thread just after the step
    while True:
        sample = json.loads(cli("top", "--once", "--json"))
        hbm = next(t for t in sample["tiers"] if t["name"] == "hbm")
        session = next(s for s in sample["sessions"] if s["session_id"] == "agent-a")
        if (hbm["used_bytes"] and session["state"] == "hot" and session["bytes_hbm"]) or time.monotonic() > deadline:
            break
    assert hbm["used_bytes"] > 0 and hbm["capacity_bytes"], hbm
    assert session["state"] == "hot" and session["bytes_hbm"] > 0, session


def _serve(tiny_model, tmp_path, port: int, env: dict, log_name: str, *vllm_args: str) -> subprocess.Popen:
    log = open(tmp_path / log_name, "w")
    cmd = [sys.executable, "-m", "kvtier.cli.main", "serve", str(tiny_model), "--port", str(port),
           "--dram", "256MiB", "--nvme-dir", str(tmp_path / "nvme"), "--nvme", "1GiB",
           "--", "--max-model-len", "4096", "--enforce-eager", "--served-model-name", "tiny", *vllm_args]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(server: subprocess.Popen) -> int:
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=90)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def test_snapshot_restart_restore_through_the_cli(tiny_model, tmp_path):
    """Chat in session A, snapshot A with the CLI, restart the server (tiers wiped), restore A,
    and A's next turn loads from kvtier with the same output as before the restart. The second
    server hashes blocks with another algorithm (as after a vLLM upgrade): the restore recomputes
    every key from the file's token ids with the engine's own hash, so it still loads."""
    import json
    import shutil

    port = free_port()
    run_dir = tmp_path / "run"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", TMPDIR=str(tmp_path), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), PYTHONUNBUFFERED="1", XDG_RUNTIME_DIR=str(run_dir),
               KVTIER_SNAPSHOT_DIR=str(tmp_path / "snapshots"))
    base = f"http://127.0.0.1:{port}"
    long_context = " ".join(f"class Widget{i}: size = {i}" for i in range(150))
    messages = [{"role": "user", "content": long_context}]

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def turn(client):
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                              seed=0, extra_headers={"X-Session-ID": "agent-a"})

    server = _serve(tiny_model, tmp_path, port, env, "first.log")
    try:
        wait_ready(base, server)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        first = turn(client)
        sessions = json.loads(cli("sessions", "--json"))["sessions"]
        assert [s["session_id"] for s in sessions if s["session_id"] == "agent-a"] == ["agent-a"]
        job = json.loads(cli("snapshot", "agent-a", "--json"))
        assert job["state"] == "done" and job["path"].endswith("agent-a.kvsnap")
    finally:
        assert _stop(server) == 0, (tmp_path / "first.log").read_text()[-3000:]
    snapshot = job["path"]
    shutil.rmtree(tmp_path / "nvme")  # the next morning: nothing but the snapshot file
    assert "agent-a" in cli("snapshot", "inspect", snapshot)  # offline, no server

    server = _serve(tiny_model, tmp_path, port, env, "second.log", "--prefix-caching-hash-algo", "sha256_cbor")
    try:
        wait_ready(base, server)
        restored = json.loads(cli("restore", snapshot, "--json"))
        assert restored["state"] == "done", restored
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        again = turn(client)
        assert again.choices[0].message.content == first.choices[0].message.content
        loaded = again.kv_transfer_params["kvtier"]["loaded_tokens"]
        assert loaded >= 0.9 * again.usage.prompt_tokens - 128
        status = json.loads(cli("status", "--json"))
        assert status["counters"]["restored_blocks"] >= loaded // 128
        # hit-rate counters and vLLM's KV capacity, as `kvtier top` shows them
        assert status["counters"]["prompt_tokens"] >= again.usage.prompt_tokens
        assert status["counters"]["hit_dram_blocks"] * 128 >= loaded
        hbm = status["tiers"]["hbm"]
        assert hbm["capacity_bytes"] > 0 and hbm["used_bytes"] is not None
    finally:
        assert _stop(server) == 0, (tmp_path / "second.log").read_text()[-3000:]


def test_a_sigkilled_server_loses_nothing_older_than_the_write_behind_window(tiny_model, tmp_path):
    """SIGKILL of kvtier serve and vLLM together (no flush, no shutdown hook): a session older than
    the write-behind window is listed by the next server and its next turn loads, same text."""
    import signal as sig

    from kvtier.launch.served import Served

    prompt = [3 + (i * 131) % 1900 for i in range(1100)]
    server = Served(str(tiny_model), tmp_path, "first", 2048, write_behind="1")
    try:
        first = server.turn("agent-k", prompt)
        admin = server.admin()
        # the worker writes it behind on its own, the engine idle: wait on that result, not a timer
        status = admin.get("/v1/status?until=clean&wait_s=45")
        admin.close()
        assert status["dirty"]["dirty_blocks"] == 0, status["dirty"]
        assert status["counters"]["written_behind_blocks"] >= 1100 // 128
    finally:
        server.stop(sig.SIGKILL)
    server = Served(str(tiny_model), tmp_path, "second", 2048, write_behind="1")
    try:
        admin = server.admin()
        listed = {s["session_id"]: s for s in admin.get("/v1/sessions")["sessions"]}
        admin.close()
        assert listed["agent-k"]["state"] == "cold" and listed["agent-k"]["blocks_missing"] == 0
        again = server.turn("agent-k", prompt)
        assert again["loaded"] == (1100 - 1) // 128 * 128 and again["text"] == first["text"]
    finally:
        server.stop(sig.SIGINT)
