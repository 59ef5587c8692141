"""Several ``kvtier serve`` instances on one box, and models named by a Hugging Face id.

The registry is real files with real ``flock``s (a server killed with SIGKILL in a child process
leaves a stale record), the servers real admin servers on real Unix sockets, the hub cache a real
Hugging Face cache layout read by ``huggingface_hub`` with ``HF_HUB_OFFLINE=1``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.engine import make_engine
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.control.instances import Instance, Registration, find_instance, list_instances, registry_dir, valid_name
from kvtier.control.local import LocalAdmin
from kvtier.errors import NoServerError, UsageError

runner = CliRunner()
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def run_env(tmp_path, monkeypatch):
    """A private runtime dir (registry, sockets) and settings for this test only."""
    for key in list(os.environ):
        if key.startswith(("KVTIER_", "HF_")):
            monkeypatch.delenv(key)
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "KVTIER_DRAM": "256MiB", "KVTIER_NVME": "256MiB",
           "KVTIER_NVME_DIR": str(tmp_path / "nvme")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "run").mkdir()
    return env


def record(name: str, port: int, sock: str, **extra) -> Instance:
    return Instance(name=name, pid=os.getpid(), port=port, host="127.0.0.1", api_url=f"http://127.0.0.1:{port}/v1",
                    admin_socket=sock, model="tiny", **extra)


# ---- the registry ---------------------------------------------------------------------------------
def test_a_name_is_held_while_its_server_lives_and_freed_when_it_is_killed(run_env, tmp_path):
    sock = tmp_path / "run" / "gpu0.sock"
    child = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, time\n"
        "from kvtier.control.instances import Instance, Registration\n"
        f"s = socket.socket(socket.AF_UNIX); s.bind({str(sock)!r}); s.listen()\n"
        f"Registration(Instance('gpu0', 0, 8001, '127.0.0.1', 'u', {str(sock)!r}, 'tiny')).claim()\n"
        # a live server that holds its name until the test kills it (the sleep is its life, not a wait)
        "print('up', flush=True); time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert [i.name for i in list_instances()] == ["gpu0"]
        with pytest.raises(UsageError, match="'gpu0' is already running"):
            Registration(record("gpu0", 8002, str(tmp_path / "x.sock"))).claim()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert (registry_dir() / "gpu0.json").exists() and sock.exists()  # what a killed server leaves
        assert list_instances() == []  # stale: its lock died with it
        assert not (registry_dir() / "gpu0.json").exists() and not sock.exists()  # both cleaned up
        with Registration(record("gpu0", 8002, str(tmp_path / "x.sock"))):  # the name is free again
            assert [i.port for i in list_instances()] == [8002]
        assert list_instances() == []  # a clean stop unregisters
    finally:
        child.kill()
        child.wait()


def test_a_stale_record_never_removes_a_socket_a_live_server_answers_on(run_env, tmp_path):
    import socket

    live = tmp_path / "run" / "live.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(live))
    server.listen()
    try:
        registry_dir().mkdir(parents=True)
        (registry_dir() / "old.json").write_text(json.dumps(record("old", 9, str(live)).to_dict()))
        assert list_instances() == []
        assert not (registry_dir() / "old.json").exists() and live.exists()
    finally:
        server.close()


def test_names_are_checked(run_env):
    for bad in ("", "a/b", "../x", ".hidden", "x" * 65, "sp ace"):
        with pytest.raises(UsageError, match="invalid instance name"):
            valid_name(bad)
    assert valid_name("gpu0") == "gpu0" and valid_name("8000") == "8000"
    result = runner.invoke(app, ["serve", "--instance", "../x", "--dry-run"])
    assert result.exit_code == 2 and "invalid instance name" in result.stderr


def test_find_instance_by_name_port_or_alone(run_env, tmp_path):
    assert find_instance(None) is None
    with Registration(record("gpu0", 8001, "a.sock")):
        assert find_instance(None).name == "gpu0"
        with Registration(record("gpu1", 8002, "b.sock")):
            with pytest.raises(UsageError) as many:
                find_instance(None)
            assert "gpu0 (port 8001" in str(many.value) and "gpu1 (port 8002" in str(many.value)
            assert "--instance" in many.value.hint
            assert find_instance("gpu1").admin_socket == "b.sock"
            assert find_instance("8001").name == "gpu0"  # a port works too
            with pytest.raises(NoServerError, match="no kvtier instance named 'gpu7'"):
                find_instance("gpu7")


# ---- the CLI against two real admin servers ---------------------------------------------------------
@pytest.fixture
def two_servers(fingerprint, hbm, tmp_path, run_env):
    from kvtier.plan.index import chain_block_hashes, namespace_of

    made = []
    for i, name in enumerate(("gpu0", "gpu1")):
        engine = make_engine(fingerprint, hbm, tmp_path / name, dram_blocks=8, nvme_blocks=16)
        keys = chain_block_hashes(list(range(i * 1000, i * 1000 + 32)), 16)
        engine.store(f"agent-{name}", namespace_of(fingerprint.digest), keys, [0, 1], num_tokens=32)
        sock = str(registry_dir() / f"{name}.sock")
        admin = LocalAdmin(engine, sock, snapshot_dir=tmp_path / "snapshots").start()
        reg = Registration(record(name, 8001 + i, sock)).claim()
        made.append((engine, admin, reg))
    yield made
    for engine, admin, reg in made:
        reg.release()
        admin.stop()
        engine.close(write_back=False)


def test_the_cli_reaches_each_instance_and_asks_which_when_several_run(two_servers):
    listed = runner.invoke(app, ["instances", "--json"])
    assert listed.exit_code == 0, listed.output
    doc = json.loads(listed.output)
    assert [(i["name"], i["port"], i["reachable"], i["sessions"]) for i in doc["instances"]] == \
        [("gpu0", 8001, True, 1), ("gpu1", 8002, True, 1)]
    table = runner.invoke(app, ["instances"])
    assert "gpu0" in table.output and "gpu1" in table.output and "8002" in table.output

    ambiguous = runner.invoke(app, ["sessions"])
    assert ambiguous.exit_code == 2
    assert "2 kvtier instances are running" in ambiguous.stderr and "--instance" in ambiguous.stderr
    for selector, session in (("gpu0", "agent-gpu0"), ("8002", "agent-gpu1")):
        result = runner.invoke(app, ["sessions", "--json", "--instance", selector])
        assert result.exit_code == 0, result.output
        assert [s["session_id"] for s in json.loads(result.output)["sessions"]] == [session]
    result = runner.invoke(app, ["inspect", "agent-gpu1", "--json", "--instance", "gpu1"])
    assert result.exit_code == 0 and json.loads(result.output)["blocks"] == 2
    missing = runner.invoke(app, ["status", "--instance", "gpu9"])
    assert missing.exit_code == 3 and "gpu0 (port 8001" in missing.stderr
    # the variable works like the flag, and an explicit socket beats both
    result = runner.invoke(app, ["sessions", "--json"], env={"KVTIER_INSTANCE": "gpu1"})
    assert json.loads(result.output)["sessions"][0]["session_id"] == "agent-gpu1"
    result = runner.invoke(app, ["sessions", "--json", "--socket", two_servers[0][1].server.socket_path.as_posix()],
                           env={"KVTIER_INSTANCE": "gpu1"})
    assert json.loads(result.output)["sessions"][0]["session_id"] == "agent-gpu0"


def test_a_taken_name_or_port_is_refused_before_vllm_starts(two_servers, tiny_model):
    started = time.monotonic()
    taken = runner.invoke(app, ["serve", str(tiny_model), "--instance", "gpu1", "--port", "18999"])
    assert time.monotonic() - started < 3
    assert taken.exit_code == 2 and "instance 'gpu1' is already running" in taken.stderr
    assert "--instance NAME" in taken.stderr and taken.stderr.count("\n") == 2  # one error line, one hint
    port = runner.invoke(app, ["serve", str(tiny_model), "--instance", "gpu2", "--port", "8002", "--dry-run"])
    assert port.exit_code == 2 and "port 8002 is taken by kvtier instance 'gpu1'" in port.stderr


def test_named_instances_share_one_nvme_dir_each_in_its_own_place(run_env, tiny_model, tmp_path):
    result = runner.invoke(app, ["serve", str(tiny_model), "--instance", "gpu1", "--dry-run", "--port", "18998"])
    assert result.exit_code == 0, result.output
    extra = json.loads(result.stdout.split("kv-transfer-config:\n", 1)[1].rsplit("\nAPI", 1)[0])
    extra = extra["kv_connector_extra_config"]
    assert extra["nvme_dir"] == str(tmp_path / "nvme" / "instances" / "gpu1")
    assert extra["instance"] == "gpu1" and extra["admin_socket"] == str(registry_dir() / "gpu1.sock")
    unnamed = runner.invoke(app, ["serve", str(tiny_model), "--dry-run", "--port", "18997"])
    extra = json.loads(unnamed.stdout.split("kv-transfer-config:\n", 1)[1].rsplit("\nAPI", 1)[0])
    assert extra["kv_connector_extra_config"]["nvme_dir"] == str(tmp_path / "nvme")  # as before instances


def test_one_disk_is_not_promised_twice(run_env, tiny_model, tmp_path):
    """Budgets of live instances on the same filesystem count against a new one's room."""
    free = shutil.disk_usage(tmp_path).free
    half = free * 3 // 5
    with Registration(record("big", 8101, "x.sock", nvme_dir=str(tmp_path / "nvme" / "instances" / "big"),
                             nvme_bytes=half)):
        alone = runner.invoke(app, ["serve", str(tiny_model), "--dry-run", "--port", "18996", "--nvme", str(half)])
        assert alone.exit_code == 2, alone.output
        assert "other kvtier instances may still fill" in alone.stderr
    fine = runner.invoke(app, ["serve", str(tiny_model), "--dry-run", "--port", "18996", "--nvme", str(half)])
    assert fine.exit_code == 0, fine.output


# ---- hub ids ------------------------------------------------------------------------------------
def lay_out_hub_cache(cache: Path, repo: str, source: Path, commit: str = COMMIT) -> Path:
    """``source`` as the Hugging Face cache holds ``repo`` at ``commit`` (refs/main points at it)."""
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file():
            os.symlink(path, snapshot / path.name)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_id_in_the_local_cache_is_served_by_its_id(run_env, tiny_model, tmp_path, monkeypatch):
    lay_out_hub_cache(tmp_path / "hf", "kvtier-test/tiny-llama", tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for args in ([], ["--revision", COMMIT], ["--revision", "main"]):
        result = runner.invoke(app, ["serve", "kvtier-test/tiny-llama", *args, "--dry-run", "--port", "18995"])
        assert result.exit_code == 0, result.output
        cmd = result.stdout.split("vLLM command:\n", 1)[1].splitlines()[0]
        assert "--model kvtier-test/tiny-llama" in cmd and "--served-model-name kvtier-test/tiny-llama" in cmd
        assert ("--revision" in cmd) == bool(args) and (not args or f"--revision {args[1]}" in cmd)
    from kvtier.persist.weights import weights_identity

    # the weights identity names the resolved snapshot: same files, another commit, another identity
    same = weights_identity("kvtier-test/tiny-llama")
    assert same == weights_identity("kvtier-test/tiny-llama", COMMIT) and same != weights_identity(tiny_model)
    lay_out_hub_cache(tmp_path / "hf2", "kvtier-test/tiny-llama", tiny_model, commit="f" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf2"))
    assert weights_identity("kvtier-test/tiny-llama") not in (same, "")


@pytest.mark.parametrize("how", ["offline", "hub unreachable"])
def test_a_hub_id_that_cannot_be_resolved_exits_2_with_one_line_fast(run_env, tmp_path, monkeypatch, how):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    if how == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:  # a closed port: the hub cannot be asked (as on a box with no network)
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "serve", "org/missing", "--port", "18994"],
                            capture_output=True, text=True, env=dict(os.environ), timeout=60)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and "org/missing" in lines[0]
    assert lines[1].startswith("hint: ")
    assert ("HF_HUB_OFFLINE" in lines[0]) == (how == "offline")
    assert took < 3, f"{took:.1f} s"


def test_revision_is_for_hub_ids(run_env, tiny_model):
    result = runner.invoke(app, ["serve", str(tiny_model), "--revision", "main", "--dry-run"])
    assert result.exit_code == 2 and "--revision is for hub ids" in result.stderr
    owned = runner.invoke(app, ["serve", str(tiny_model), "--dry-run", "--", "--revision", "x"])
    assert owned.exit_code == 2 and "--revision is set by kvtier serve" in owned.stderr


# ---- the box-wide kvtier top -----------------------------------------------------------------------
def test_top_shows_the_box_switches_and_lists_all_sessions(two_servers):
    once = runner.invoke(app, ["top", "--once", "--json"])
    assert once.exit_code == 0, once.output
    doc = json.loads(once.output)
    assert doc["instance"] == "gpu0" and [i["name"] for i in doc["instances"]] == ["gpu0", "gpu1"]
    assert all(i["connected"] and i["sessions"] == 1 and i["dram_used"] > 0 for i in doc["instances"])
    assert [s["session_id"] for s in doc["sessions"]] == ["agent-gpu0"]
    picked = json.loads(runner.invoke(app, ["top", "--once", "--json", "--instance", "8002"]).output)
    assert picked["instance"] == "gpu1" and [s["session_id"] for s in picked["sessions"]] == ["agent-gpu1"]
    every = json.loads(runner.invoke(app, ["top", "--once", "--json", "--all"]).output)
    assert sorted((s["instance"], s["session_id"]) for s in every["sessions"]) == \
        [("gpu0", "agent-gpu0"), ("gpu1", "agent-gpu1")]
    text = runner.invoke(app, ["top", "--once"])
    assert "instances on this box" in text.output and "▶ gpu0" in text.output and "gpu1" in text.output


def test_top_switches_instance_and_acts_on_the_right_one(two_servers):
    """In the dashboard (Textual's Pilot, real servers): i shows the next instance, a lists every
    instance's sessions, and an action on a row goes to that row's instance."""
    import asyncio

    from kvtier.tui.app import TopApp
    from kvtier.tui.collector import BoxCollector

    box = BoxCollector()
    box.select(None)
    top = TopApp(box.poll, interval=0.2, client=box.client(None), box=box)

    async def drive() -> None:
        async with top.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: top.snapshot is not None and top.snapshot.instance == "gpu0")
            assert top.query_one("#box").display  # two instances: the box panel is shown
            await pilot.press("i")
            await wait_for(pilot, lambda: top.snapshot.instance == "gpu1")
            assert top.selected_session() == "agent-gpu1"
            await pilot.press("a")
            await wait_for(pilot, lambda: top.snapshot.all_sessions and len(top.snapshot.sessions) == 2)
            top.filter = "gpu0"  # the row of the other instance
            top._sessions(top.snapshot)
            assert top.selected_session() == "agent-gpu0"
            await pilot.press("p", "d")  # pin to DRAM: must reach gpu0's server, not the shown gpu1
            await wait_for(pilot, lambda: any(r.pinned for r in top.snapshot.sessions))

    asyncio.run(drive())
    result = runner.invoke(app, ["sessions", "--json", "--instance", "gpu0"])
    assert json.loads(result.output)["sessions"][0]["pinned"] == "dram"
    result = runner.invoke(app, ["sessions", "--json", "--instance", "gpu1"])
    assert json.loads(result.output)["sessions"][0]["pinned"] is None


async def wait_for(pilot, condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.1)


class FakeNvml:
    """NVML's API for a box with four GPUs (this machine has none): the thing under test is how
    kvtier maps CUDA_VISIBLE_DEVICES to NVML's GPUs and sums them, not NVML."""

    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

    class Memory:
        def __init__(self, used, total):
            self.used, self.total = used, total

    def nvmlDeviceGetUUID(self, handle):  # noqa: N802 - NVML's names
        return f"GPU-{handle:08d}-aaaa"

    def nvmlDeviceGetName(self, handle):  # noqa: N802
        return b"H200"

    def nvmlDeviceGetPcieThroughput(self, handle, which):  # noqa: N802
        return (handle + 1) * (10 if which == self.NVML_PCIE_UTIL_RX_BYTES else 1)  # KB/s

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        return self.Memory((handle + 1) << 30, 141 << 30)

    def __getattr__(self, name):
        raise AttributeError(name)


def test_gpus_of_an_instance_from_cuda_visible_devices():
    from kvtier.control.gpu import select_gpus
    from kvtier.tui.collector import Nvml

    nvml, handles = FakeNvml(), [0, 1, 2, 3]
    assert select_gpus(nvml, handles, None) == [0, 1, 2, 3]
    assert select_gpus(nvml, handles, ["2", "3"]) == [2, 3]
    assert select_gpus(nvml, handles, ["GPU-00000001"]) == [1]  # a UUID prefix, as CUDA accepts
    assert select_gpus(nvml, handles, ["7", "MIG-xyz"]) == []
    pair = Nvml(["1", "3"], (nvml, handles, None))
    sample = pair.sample()
    assert sample["hbm_used"] == (2 + 4) << 30 and sample["pcie_to_gpu"] == (20 + 40) * 1024
    assert pair.name.startswith("2× H200")
    assert [row["hbm_used"] for row in pair.per_gpu()] == [float(i << 30) for i in (1, 2, 3, 4)]
    nothing = Nvml(["7"], (nvml, handles, None))
    assert nothing.sample() is None and "names no GPU" in nothing.reason


def test_box_collector_says_which_instances_use_each_gpu(run_env):
    from kvtier.tui.collector import BoxCollector

    fake = [record("gpu0", 8001, "/nonexistent/a.sock", gpus=["0"]),
            record("tp", 8002, "/nonexistent/b.sock", gpus=["2", "3"])]
    box = BoxCollector(nvml_opened=(FakeNvml(), [0, 1, 2, 3], None), list_instances=lambda: fake)
    snap = box.poll()
    assert [g.instances for g in snap.gpus] == [("gpu0",), (), ("tp",), ("tp",)]
    assert [(i.name, i.gpus, i.connected) for i in snap.instances] == [("gpu0", ("0",), False), ("tp", ("2", "3"),
                                                                                                 False)]


# ---- two real servers on one box ------------------------------------------------------------------
def test_two_real_instances_tiny_by_hub_id_and_mid(run_env, tiny_model, mid_model, tmp_path, monkeypatch):
    """A tiny model served by its hub id from an offline Hugging Face cache (a named instance) and the
    mid demo model (named by its port) on one box, sharing one --nvme-dir: both reachable, a taken
    name refused before vLLM starts, kvtier top shows both, their blocks never mix."""
    from support.harness import Served

    lay_out_hub_cache(tmp_path / "hf", "kvtier-test/tiny-llama", tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nvme = tmp_path / "shared-nvme"
    tiny = Served("kvtier-test/tiny-llama", tmp_path, "tiny", 1024, nvme_dir=nvme, instance="tiny",
                  serve_args=("--revision", "main"), served_name="kvtier-test/tiny-llama")
    mid = None
    try:
        mid = Served(str(mid_model), tmp_path, "mid", 1024, nvme_dir=nvme, served_name="mid")
        listed = json.loads(runner.invoke(app, ["instances", "--json"]).output)["instances"]
        assert sorted(i["name"] for i in listed) == sorted(["tiny", str(mid.port)])
        assert all(i["reachable"] for i in listed)

        status = json.loads(runner.invoke(app, ["status", "--json", "--instance", "tiny"]).output)
        assert status["instance"] == "tiny" and status["model"].startswith("kvtier-test/tiny-llama")
        assert status["revision"] == "main" and status["commit"] == COMMIT
        human = runner.invoke(app, ["status", "--instance", "tiny"]).output
        assert f"revision main ({COMMIT[:12]})" in human
        other = json.loads(runner.invoke(app, ["status", "--json", "--instance", str(mid.port)]).output)
        assert other["instance"] == str(mid.port) and other["model"].startswith("mid")
        assert other["fingerprint"]["geometry"]["num_layers"] != status["fingerprint"]["geometry"]["num_layers"]

        started = time.monotonic()
        third = runner.invoke(app, ["serve", str(tiny_model), "--instance", "tiny", "--nvme-dir", str(nvme)])
        assert third.exit_code == 2 and "instance 'tiny' is already running" in third.stderr
        assert time.monotonic() - started < 3

        prompt = list(range(100, 100 + 200))
        assert tiny.turn("agent-t", prompt)["text"] is not None
        assert mid.turn("agent-m", prompt)["text"] is not None
        for server in (tiny, mid):
            server.admin().wait(server.admin().post("/v1/flush", {}))
        box = json.loads(runner.invoke(app, ["top", "--once", "--json", "--all"]).output)
        assert sorted(i["name"] for i in box["instances"]) == sorted(["tiny", str(mid.port)])
        assert sorted((s["instance"], s["session_id"]) for s in box["sessions"]) == \
            sorted([("tiny", "agent-t"), (str(mid.port), "agent-m")])
        # one directory each inside the shared one: the named instance's, and the root for the unnamed
        named = sorted(p.name for p in (nvme / "instances" / "tiny" / "segments").iterdir())
        unnamed = sorted(p.name for p in (nvme / "segments").iterdir())
        assert named and unnamed
        assert sorted(p.name for p in (nvme / "instances").iterdir()) == ["tiny"]
    finally:
        if mid is not None:
            mid.stop()
        tiny.stop()
    assert list_instances() == []


def test_doctor_reports_every_gpu_of_the_instance(monkeypatch):
    """kvtier doctor names the GPUs an instance uses (not always GPU 0) and warns per GPU."""
    from kvtier.control import gpu
    from kvtier.diagnose import doctor

    class Links(FakeNvml):
        def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):  # noqa: N802
            return 3 if handle == 3 else 5

        def nvmlDeviceGetCurrPcieLinkWidth(self, handle):  # noqa: N802
            return 4 if handle == 3 else 16

        def nvmlDeviceGetMaxPcieLinkGeneration(self, handle):  # noqa: N802
            return 5

        def nvmlDeviceGetMaxPcieLinkWidth(self, handle):  # noqa: N802
            return 16

    monkeypatch.setattr(gpu, "open_gpus", lambda: (Links(), [0, 1, 2, 3], None))
    links = gpu.gpu_links(["2", "3"])
    assert [(g["index"], g["gen"], g["width"]) for g in links] == [(2, 5, 16), (3, 3, 4)]
    warnings = [w for link in links for w in doctor._link_warnings(link, 12.0, True)]
    assert len(warnings) == 2 and all(w.startswith("GPU 3: ") for w in warnings)
    assert gpu.gpu_links(["9"])[0]["present"] is False


def test_a_hung_resolver_does_not_hold_serve_up(run_env, tmp_path, monkeypatch):
    """The hub's HTTP timeout does not cover DNS: a resolver that hangs is cut off by kvtier itself."""
    import socket as socket_mod

    import huggingface_hub.constants

    from kvtier.launch.serve import resolve_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    # huggingface_hub reads HF_HUB_OFFLINE once, at its import: another test of this run may have set it
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    # the hang under test: a resolver that does not answer for 30 s (kvtier must give up within ~3 s)
    monkeypatch.setattr(socket_mod, "getaddrinfo", lambda *a, **k: time.sleep(30))
    started = time.monotonic()
    with pytest.raises(UsageError, match="cannot reach the Hugging Face hub") as err:
        resolve_model("org/slow-dns")
    assert time.monotonic() - started < 3.5
    assert "TimeoutError" in err.value.message
