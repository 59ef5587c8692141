"""Budgets that fit the box: ``kvtier serve`` with no ``--dram`` / ``--nvme`` sizes both to this
machine's free disk and available RAM, less what the other live instances promised, and records the
bytes so the next instance counts them. And the module vLLM's OpenAI server is started as.

The instances are real registry records with real ``flock``s on this box's real disk; the last test
starts two real ``kvtier serve`` processes (the tiny demo model) with default budgets.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from support.realpath import need
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.control.instances import Instance, Registration, list_instances

runner = CliRunner()
GiB = 2**30


@pytest.fixture
def box(tmp_path, monkeypatch):
    """A private registry and cache, and no budget set anywhere (no KVTIER_*, no kvtier.toml)."""
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith("KVTIER_"):
            monkeypatch.delenv(key)
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "KVTIER_NVME_DIR": str(tmp_path / "nvme")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "run").mkdir()
    return env


def other(name: str, port: int, **budgets) -> Instance:
    """The registry record of another live instance (held while the test holds its Registration)."""
    return Instance(name=name, pid=os.getpid(), port=port, host="127.0.0.1", api_url=f"http://127.0.0.1:{port}/v1",
                    admin_socket=f"/nonexistent/{name}.sock", model="tiny", **budgets)


def dry_run(model, *args):
    return runner.invoke(app, ["serve", str(model), "--dry-run", "--port", "18991", *map(str, args)])


def vllm_argv(result) -> list[str]:
    lines = result.stdout.splitlines()
    words = shlex.split(lines[lines.index("vLLM command:") + 1])
    return words[next(i for i, word in enumerate(words) if "=" not in word):]


def assert_one_line_refusal(result, *needles):
    assert result.exit_code == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), result.stderr
    assert "vLLM command:" not in result.stdout
    for needle in needles:
        assert needle in result.stderr, result.stderr


# ---- the vLLM module ---------------------------------------------------------------------------------
def test_the_vllm_command_names_a_server_module_the_installed_vllm_has(box, tiny_model, monkeypatch):
    result = dry_run(tiny_model)
    assert result.exit_code == 0, result.stdout + result.stderr
    argv = vllm_argv(result)
    assert argv[1] == "-m"
    module = argv[2]
    assert module != "vllm.entrypoints.openai.api_server"  # deprecated in vLLM 0.32: a warning at every start
    assert importlib.util.find_spec(module) is not None, module
    # a vLLM without the launcher package gets the path it has
    import kvtier.launch.serve as srv

    monkeypatch.setattr(srv, "SERVER_MODULE", "vllm.entrypoints.launchers.no_such_module")
    assert vllm_argv(dry_run(tiny_model))[2] == "vllm.entrypoints.openai.api_server"


# ---- budgets beside other instances (dry runs) ----------------------------------------------------------
def test_default_budgets_are_sized_and_printed(box, tiny_model, tmp_path):
    result = dry_run(tiny_model)
    assert result.exit_code == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("kvtier: budgets: "))
    assert "DRAM " in line and "(auto: ¼ of " in line and "available" in line
    assert "(auto: ½ of " in line and f"free on {box['KVTIER_NVME_DIR']}" in line
    extra = json.loads(vllm_argv(result)[vllm_argv(result).index("--kv-transfer-config") + 1])
    extra = extra["kv_connector_extra_config"]
    assert 0 < extra["nvme_bytes"] <= min(64 * GiB, shutil.disk_usage(tmp_path).free)
    assert 0 < extra["dram_bytes"] <= 4 * GiB


def test_a_disk_other_instances_promised_leaves_no_automatic_budget(box, tiny_model, tmp_path):
    """Another instance on the same filesystem promised more than is free: the automatic budget is
    refused in one line that says why; an explicit one keeps its own refusal; once the other is gone,
    the default fits again."""
    promise = shutil.disk_usage(tmp_path).free + 10 * GiB
    with Registration(other("big", 8101, nvme_dir=str(tmp_path / "nvme" / "instances" / "big"), nvme_bytes=promise)):
        auto = dry_run(tiny_model)
        assert_one_line_refusal(auto, f"free on {tmp_path / 'nvme'}", "promised to 1 other instance",
                                "less than kvtier needs", "--nvme-dir on another drive")
        assert_one_line_refusal(dry_run(tiny_model, "--nvme", "auto"), "less than kvtier needs")
        assert_one_line_refusal(dry_run(tiny_model, "--nvme", "1GiB"), "other kvtier instances may still fill")
    assert dry_run(tiny_model).exit_code == 0


def test_dram_other_instances_promised_counts_for_explicit_and_automatic_budgets(box, tiny_model, tmp_path):
    total = psutil.virtual_memory().total
    with Registration(other("ram", 8102, dram_bytes=total)):
        explicit = dry_run(tiny_model, "--dram", "1GiB", "--nvme", "1GiB")
        assert_one_line_refusal(explicit, "plus the DRAM budgets of 1 other instance", "is more than its RAM")
        assert_one_line_refusal(dry_run(tiny_model, "--nvme", "1GiB"), "available RAM is",
                                "promised to 1 other instance", "less than kvtier needs")
    assert dry_run(tiny_model, "--dram", "1GiB", "--nvme", "1GiB").exit_code == 0


# ---- two real servers with default budgets ----------------------------------------------------------------
def start_default(model: Path, base: Path, name: str, env: dict) -> tuple[subprocess.Popen, Path, int]:
    """``kvtier serve MODEL --instance NAME --port P`` with no budget flags (nothing else sets them
    either; the NVMe dir is the box's KVTIER_NVME_DIR, shared as named instances share it), ready."""
    from support.harness import free_port, wait_ready

    port = free_port()
    log = base / f"{name}.log"
    cmd = [sys.executable, "-m", "kvtier.cli.main", "serve", str(model), "--instance", name, "--port", str(port), "--",
           "--max-model-len", "1024", "--enforce-eager", "--served-model-name", "tiny", "--max-num-seqs", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(f"http://127.0.0.1:{port}", proc, log)
    return proc, log, port


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: kvtier serve flushes, stops vLLM, unregisters
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def budgets_line(log: Path) -> str:
    return next(line for line in log.read_text().splitlines() if line.startswith("kvtier: budgets: "))


def test_two_servers_with_default_budgets_both_start_and_fit_the_box(box, tiny_model, tmp_path):
    need("vllm")
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", TMPDIR=str(tmp_path), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), PYTHONUNBUFFERED="1",
               KVTIER_SNAPSHOT_DIR=str(tmp_path / "snapshots"))
    disk = tmp_path
    free, available = [shutil.disk_usage(disk).free], psutil.virtual_memory().available
    servers = []
    try:
        servers.append(start_default(tiny_model, tmp_path, "first", env))
        free.append(shutil.disk_usage(disk).free)
        servers.append(start_default(tiny_model, tmp_path, "second", env))
        listed = {i.name: i for i in list_instances()}
        first, second = listed["first"], listed["second"]
        for inst in (first, second):  # the registry holds bytes, which the next instance counts
            assert isinstance(inst.nvme_bytes, int) and isinstance(inst.dram_bytes, int)
            assert inst.nvme_bytes >= GiB and inst.dram_bytes >= 256 * 2**20
        # both fit the disk they share, the second beside the first's promise
        assert first.nvme_bytes + second.nvme_bytes <= max(free)
        assert second.nvme_bytes <= free[1] - first.nvme_bytes
        assert first.dram_bytes + second.dram_bytes <= available
        assert "promised to 1 other instance" in budgets_line(servers[1][1])
        assert "promised" not in budgets_line(servers[0][1])
        # the connector got what was recorded
        from kvtier.control.client import AdminClient

        for inst in (first, second):
            tiers = AdminClient(inst.admin_socket, timeout=30).get("/v1/status")["tiers"]
            assert 0.9 * inst.nvme_bytes <= tiers["nvme"]["capacity_bytes"] <= inst.nvme_bytes
            assert 0 < tiers["dram"]["capacity_bytes"] <= inst.dram_bytes
        # vLLM runs as the launcher's module, which says nothing of a deprecated entry point
        for proc, log, _port in servers:
            children = psutil.Process(proc.pid).children(recursive=True)
            assert any("vllm.entrypoints.launchers.api_server.entry" in c.cmdline() for c in children)
            deprecated = [line for line in log.read_text().splitlines() if "deprecated" in line.lower()]
            assert not [line for line in deprecated if "api_server" in line or "vllm serve" in line
                        or "entrypoint" in line.lower()], deprecated
    finally:
        for proc, _log, _port in reversed(servers):
            stop(proc)
    assert list_instances() == []
