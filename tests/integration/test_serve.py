"""`kvtier serve`: preflight refusals and the vLLM command (via --dry-run), and run_server's
signal handling with a fake server. Never starts real vLLM."""
from __future__ import annotations

import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from support.realpath import need
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.launch.served import free_port

runner = CliRunner()
GiB = 2**30


@pytest.fixture
def env(tmp_path, monkeypatch):
    """No stray kvtier.toml or KVTIER_* variables; small budgets so any disk and box will do."""
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith("KVTIER_"):
            monkeypatch.delenv(key)
    return {"XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "XDG_RUNTIME_DIR": str(tmp_path / "run"), "KVTIER_DRAM": "1GiB", "KVTIER_NVME": "1GiB",
            "KVTIER_NVME_DIR": str(tmp_path / "nvme")}


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path


def serve(env, *args):
    return runner.invoke(app, ["serve", *map(str, args)], env=env)


def dry_run(env, *args):
    """Run `kvtier serve --dry-run ...`; return (argv of the vLLM command, its env prefix, result)."""
    result = serve(env, "--port", free_port(), "--dry-run", *args)
    assert result.exit_code == 0, result.stderr + result.stdout
    lines = result.stdout.splitlines()
    words = shlex.split(lines[lines.index("vLLM command:") + 1])
    start = next(i for i, word in enumerate(words) if "=" not in word)
    return words[start:], dict(word.split("=", 1) for word in words[:start]), result


def connector_config(cmd):
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


def assert_refused(result, *needles):
    assert result.exit_code == 2, result.stderr + result.stdout
    assert result.stderr.startswith("error: "), result.stderr
    assert "\nhint: " in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "vLLM command:" not in result.stdout
    for needle in needles:
        assert needle in result.stderr, result.stderr


# ---- the command -------------------------------------------------------------------------------
def cmd_url(cmd) -> str:
    return f"http://{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}/v1"


def test_dry_run_command_and_connector_config(env, model_dir, tmp_path):
    env = {**env, "KVTIER_NVME": "3GiB", "KVTIER_POLICY": "arc"}
    cmd, _prefix, result = dry_run(env, model_dir, "--dram", "2GiB", "--nvme-dir", tmp_path / "cold")
    assert cmd[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]  # not the deprecated openai path
    assert cmd[cmd.index("--model") + 1] == str(model_dir)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    config = connector_config(cmd)
    assert config["kv_connector"] == "KVTierConnector"
    assert config["kv_connector_module_path"] == "kvtier.plugins.vllm.connector"
    assert config["kv_role"] == "kv_both"
    assert config["kv_load_failure_policy"] == "recompute"
    extra = config["kv_connector_extra_config"]
    assert extra["dram_bytes"] == 2 * GiB  # flag beats env KVTIER_DRAM=1GiB
    assert extra["nvme_bytes"] == 3 * GiB  # from env
    assert extra["policy"] == "arc"
    assert extra["nvme_dir"] == str(tmp_path / "cold")
    assert extra["model_id"] == "tiny-llama"
    assert set(extra) == {"dram_bytes", "nvme_dir", "nvme_bytes", "policy", "high_watermark", "low_watermark",
                          "io_threads", "direct_io", "warm_codec", "cold_codec", "link_gbps", "model_id",
                          "admin_socket", "snapshot_dir", "api_url", "write_behind", "instance"}
    assert extra["instance"] == cmd[cmd.index("--port") + 1]  # unnamed: the port names it
    assert extra["write_behind"] == "10"
    assert extra["api_url"] == cmd_url(cmd)
    assert extra["admin_socket"] == str(tmp_path / "run" / "kvtier" / "instances" / f"{extra['instance']}.sock")
    assert json.loads(result.stdout.split("kv-transfer-config:\n", 1)[1].rsplit("\nAPI", 1)[0]) == config
    assert "--kv-cache-dtype" not in cmd
    assert not (tmp_path / "cold").exists()  # a dry run creates nothing


def test_toml_is_below_env_and_flags(env, model_dir, tmp_path):
    (tmp_path / "kvtier.toml").write_text('dram = "5GiB"\nnvme = "6GiB"\npolicy = "arc"\n')
    env = {k: v for k, v in env.items() if k != "KVTIER_DRAM"}
    cmd, _prefix, _result = dry_run(env, model_dir, "--policy", "lru")
    extra = connector_config(cmd)["kv_connector_extra_config"]
    assert (extra["dram_bytes"], extra["nvme_bytes"], extra["policy"]) == (5 * GiB, GiB, "lru")


def test_extra_args_and_kv_cache_dtype_pass_through(env, model_dir):
    cmd, _prefix, _result = dry_run(env, model_dir, "--kv-cache-dtype", "fp8", "--",
                                    "--max-model-len", "4096", "--enforce-eager")
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8"
    assert cmd[-3:] == ["--max-model-len", "4096", "--enforce-eager"]


def test_served_model_name_is_the_model_id(env, model_dir):
    cmd, _prefix, _result = dry_run(env, model_dir, "--", "--served-model-name", "llama-8b")
    assert connector_config(cmd)["kv_connector_extra_config"]["model_id"] == "llama-8b"


def test_flags_kvtier_owns_are_refused_after_dashdash(env, model_dir):
    result = serve(env, model_dir, "--dry-run", "--", "--kv-transfer-config", "{}")
    assert_refused(result, "--kv-transfer-config")


def test_cpu_env_respects_the_users_values(env, model_dir):
    from kvtier.config import load_settings
    from kvtier.launch.serve import vllm_command

    settings, _ = load_settings(env={}, toml_path=None)
    _cmd, child_env = vllm_command(str(model_dir), settings, "127.0.0.1", 8000, None, [],
                                   base_env={"VLLM_CPU_KVCACHE_SPACE": "1", "PATH": "/bin",
                                             "VLLM_CPU_NUM_OF_RESERVED_CPU": "3"}, cpu=True)
    assert child_env == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "PATH": "/bin",
                         "VLLM_CPU_NUM_OF_RESERVED_CPU": "3"}
    _cmd, child_env = vllm_command(str(model_dir), settings, "127.0.0.1", 8000, None, [],
                                   base_env={"PATH": "/bin"}, cpu=True)  # the same cores as plain vLLM
    assert child_env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    _cmd, child_env = vllm_command(str(model_dir), settings, "127.0.0.1", 8000, None, [],
                                   base_env={"PATH": "/bin"}, cpu=False)  # GPU: nothing added
    assert child_env == {"PATH": "/bin"}


def test_no_model_means_the_demo_model(env):
    cmd, _prefix, result = dry_run(env, "--demo-size", "mid", "--", "--max-model-len", "512")
    assert "DEMO model" in result.stderr and "gibberish" in result.stderr
    from kvtier.models.demo import demo_model_dir

    where = demo_model_dir("mid", Path(env["XDG_CACHE_HOME"]) / "kvtier" / "models")
    assert cmd[cmd.index("--model") + 1] == str(where)
    assert not where.exists()  # a dry run builds nothing
    assert cmd[-2:] == ["--max-model-len", "512"]
    assert_refused(serve(env, "--demo-size", "huge", "--dry-run"), "--demo-size")


def test_serve_runs_the_server_and_returns_its_status(env, model_dir, tmp_path, monkeypatch):
    import types

    import kvtier.launch.serve
    from kvtier.control.instances import list_instances

    calls, registered = [], []

    def run_server(cmd, env, url, sock, say, before_stop, stop_timeout_s):
        registered.extend(list_instances({"XDG_RUNTIME_DIR": str(tmp_path / "run")}))
        calls.append((cmd, env, url, sock, before_stop, stop_timeout_s))
        return 3

    monkeypatch.setattr(kvtier.launch.serve, "run_server", run_server)
    demo = types.ModuleType("kvtier.models.demo")
    demo.ensure_demo_model = lambda size="tiny", cache_dir=None, progress=None: model_dir
    demo.demo_model_dir = lambda size="tiny", cache_dir=None: model_dir
    monkeypatch.setitem(sys.modules, "kvtier.models.demo", demo)
    port = free_port()
    result = serve({**env, "XDG_RUNTIME_DIR": str(tmp_path / "run")}, "--port", port, "--", "--enforce-eager")
    assert result.exit_code == 3, result.stderr + result.stdout
    assert "DEMO model" in result.stderr
    (cmd, _child_env, url, sock, before_stop, stop_timeout_s), = calls
    assert callable(before_stop) and stop_timeout_s == 60.0  # the flush on stop, bounded
    assert cmd[cmd.index("--model") + 1] == str(model_dir) and cmd[-1] == "--enforce-eager"
    assert url == f"http://127.0.0.1:{port}/v1"
    assert sock == str(tmp_path / "run" / "kvtier" / "instances" / f"{port}.sock")
    assert (tmp_path / "nvme").is_dir()  # a real run creates the cold tier's directory
    # registered while it ran (named by its port), unregistered once it stopped
    assert [(i.name, i.port, i.admin_socket, i.model) for i in registered] == [(str(port), port, sock, "tiny-llama")]
    assert list_instances({"XDG_RUNTIME_DIR": str(tmp_path / "run")}) == []


# ---- preflight refusals --------------------------------------------------------------------------
def test_missing_model_path_is_refused(env, tmp_path):
    assert_refused(serve(env, tmp_path / "no-such-model", "--dry-run"), "does not exist", "Hugging Face id")
    (tmp_path / "empty").mkdir()
    assert_refused(serve(env, tmp_path / "empty", "--dry-run"), "config.json")


@pytest.fixture
def tmpfs_dir(tmp_path):
    mount_point = tmp_path / "ram"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                             check=False, capture_output=True).returncode == 0
    if not mounted:
        from kvtier.launch.serve import filesystem_type

        if filesystem_type("/dev/shm") != "tmpfs":
            pytest.skip("cannot mount a tmpfs and /dev/shm is not one")
        mount_point = Path("/dev/shm") / f"kvtier-test-{uuid.uuid4().hex}"
        mount_point.mkdir()
    try:
        yield mount_point
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)
        else:
            import shutil

            shutil.rmtree(mount_point, ignore_errors=True)


@pytest.mark.parametrize("dry", [True, False])
def test_nvme_dir_on_tmpfs_is_refused(env, model_dir, tmpfs_dir, dry):
    args = [model_dir, "--nvme-dir", tmpfs_dir / "kv", "--port", free_port()]
    if dry:
        args.append("--dry-run")
    result = serve(env, *args)  # not a dry run: refused before anything starts
    assert_refused(result, "tmpfs", "the cold tier must be on a real disk; pass --nvme-dir on an SSD")
    assert not (tmpfs_dir / "kv").exists()


def test_unwritable_nvme_dir_is_refused(env, model_dir, tmp_path):
    regular = tmp_path / "a-file"
    regular.write_text("x")
    for dry in (["--dry-run"], []):
        result = serve(env, model_dir, "--nvme-dir", regular / "nvme", "--port", free_port(), *dry)
        assert_refused(result, "NVMe dir", "--nvme-dir")
    assert_refused(serve(env, model_dir, "--nvme-dir", regular, "--dry-run"), "not a directory")


def test_dram_above_available_ram_is_refused(env, model_dir):
    assert_refused(serve(env, model_dir, "--dram", "100000GiB", "--dry-run"), "dram", "--dram")


def test_nvme_above_free_disk_is_refused(env, model_dir):
    assert_refused(serve(env, model_dir, "--nvme", "1000000TiB", "--dry-run"), "nvme", "--nvme")


def test_nvme_budget_counts_what_kvtier_already_stores(tmp_path):
    import shutil

    from kvtier.config import Settings
    from kvtier.launch.serve import preflight

    nvme = tmp_path / "nvme"
    block = nvme / "blocks" / ("00" * 16) / "ab" / "abcd.4096.kvb"
    block.parent.mkdir(parents=True)
    block.write_bytes(b"\1" * 3 * 2**20)
    free = shutil.disk_usage(nvme).free
    fits = Settings(dram_bytes=GiB, nvme_dir=str(nvme), nvme_bytes=free + 2**20)
    assert preflight(fits, None, port=None) == []
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError):
        preflight(Settings(dram_bytes=GiB, nvme_dir=str(nvme), nvme_bytes=free + 2**30), None, port=None)


def test_port_in_use_is_refused(env, model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["serve", str(model_dir), "--port", str(port), "--dry-run"], env=env)
    assert_refused(result, f"port {port}", "--port")


# ---- run_server with a fake vLLM -----------------------------------------------------------------
FAKE_SERVER = textwrap.dedent("""
    import http.server, os, signal, subprocess, sys, time
    port, pid_file, ignore_term = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    alive = os.open(sys.argv[4], os.O_WRONLY)  # the test reads EOF once this process and its worker are gone
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],  # an 'engine core'
                              pass_fds=(alive,))
    with open(pid_file, "w") as fh:
        fh.write(f"{os.getpid()} {worker.pid}")
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass

    time.sleep(0.5)  # not ready at once: kvtier must poll
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    server.timeout = 0.2
    while True:
        server.handle_request()
""")

KVTIER = textwrap.dedent("""
    import os, sys, time
    from kvtier.launch.serve import run_server
    fake, port, pid_file, ignore_term, alive = sys.argv[1:6]
    cmd = [sys.executable, fake, port, pid_file, ignore_term, alive]
    say = lambda msg: print(msg, flush=True)

    def flush():  # stands in for kvtier's flush through the admin API: vLLM must still be up
        server_pid = int(open(pid_file).read().split()[0])
        os.kill(server_pid, 0)
        say(f"flushing while vLLM runs (pid {server_pid})")
        time.sleep(float(os.environ["FAKE_FLUSH_S"]))
        say("flushed")

    before_stop = flush if os.environ.get("FAKE_FLUSH_S") else None
    sys.exit(run_server(cmd, None, f"http://127.0.0.1:{port}/v1", "/tmp/kvtier-test/kvtier.sock",
                        say=say, grace_s=1.5, poll_s=0.1, before_stop=before_stop,
                        stop_timeout_s=float(os.environ.get("FAKE_STOP_TIMEOUT", "60"))))
""")


def run_fake(tmp_path, ignore_term: bool, env: dict | None = None):
    (tmp_path / "fake.py").write_text(FAKE_SERVER)
    (tmp_path / "kvtier_serve.py").write_text(KVTIER)
    pid_file = tmp_path / "pids"
    alive = tmp_path / "alive"  # a FIFO the fake server and its worker hold open for writing
    os.mkfifo(alive)
    reader = os.open(alive, os.O_RDONLY | os.O_NONBLOCK)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "kvtier_serve.py"), str(tmp_path / "fake.py"), str(port),
         str(pid_file), "1" if ignore_term else "0", str(alive)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("ready"):
                break
        assert lines[-1] == f"ready: http://127.0.0.1:{port}/v1", lines
        assert f"API: http://127.0.0.1:{port}/v1" in lines
        assert "admin socket: /tmp/kvtier-test/kvtier.sock (kvtier status / sessions / top find it without flags)" \
            in lines
        server_pid, worker_pid = map(int, pid_file.read_text().split())
        assert os.getpgid(server_pid) == server_pid != os.getpgid(proc.pid)  # its own process group
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=20)
        lines += rest.splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:
        # EOF once no process holds the FIFO's write end: the server and its worker have both exited
        readable, _, _ = select.select([reader], [], [], 5)
        assert readable and os.read(reader, 1) == b"", (server_pid, worker_pid, lines)
    finally:
        os.close(reader)
    return proc.returncode, lines


def test_run_server_forwards_sigterm_and_leaves_nothing(tmp_path):
    code, lines = run_fake(tmp_path, ignore_term=False)
    assert code == 0, lines
    assert lines[-1] == "stopped"


def test_run_server_flushes_before_it_stops_vllm(tmp_path):
    code, lines = run_fake(tmp_path, ignore_term=False, env={"FAKE_FLUSH_S": "0.5"})
    assert code == 0, lines
    flushing = next(i for i, line in enumerate(lines) if line.startswith("flushing while vLLM runs"))
    assert lines[flushing + 1:] == ["flushed", "stopped"], lines


def test_run_server_stops_vllm_when_the_flush_takes_too_long(tmp_path):
    code, lines = run_fake(tmp_path, ignore_term=False, env={"FAKE_FLUSH_S": "30", "FAKE_STOP_TIMEOUT": "1"})
    assert code == 0, lines
    assert "flush did not finish within 1 s; stopping anyway" in lines and lines[-1] == "stopped"
    assert "flushed" not in lines


def test_run_server_kills_a_server_that_ignores_sigterm(tmp_path):
    code, lines = run_fake(tmp_path, ignore_term=True)
    assert code == 128 + signal.SIGKILL, lines
    assert any("killing it" in line for line in lines)


def test_kvtier_help_stays_light():
    code = ("import sys; from typer.testing import CliRunner; from kvtier.cli.main import app; "
            "r = CliRunner().invoke(app, ['serve', '--help']); assert r.exit_code == 0, r.output; "
            "bad = [m for m in ('torch', 'vllm') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_run_server_returns_the_status_of_a_server_that_dies():
    from kvtier.launch.serve import run_server

    said = []
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    code = run_server([sys.executable, "-c", "import sys; sys.exit(5)"], None,
                      f"http://127.0.0.1:{free_port()}/v1", "/tmp/x.sock", say=said.append, poll_s=0.05)
    assert code == 5
    assert said[-1] == "vLLM exited with status 5 (its output is above)"
    assert not any(line.startswith("ready") for line in said)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_bad_write_behind_and_stop_timeout_are_refused(env, model_dir):
    assert_refused(serve(env, model_dir, "--write-behind", "soon", "--dry-run"), "write_behind", "off")
    assert_refused(serve(env, model_dir, "--stop-timeout", "-5", "--dry-run"), "stop_timeout", "stop_timeout = 60")


def test_the_admin_socket_follows_the_flag_or_kvtier_admin_socket(env, model_dir, tmp_path):
    from kvtier.launch.serve import admin_socket_path

    assert admin_socket_path({"KVTIER_ADMIN_SOCKET": "/run/a/kvtier.sock", "XDG_RUNTIME_DIR": "/r"}) == \
        "/run/a/kvtier.sock"
    assert admin_socket_path({"XDG_RUNTIME_DIR": "/r"}) == "/r/kvtier/instances/8000.sock"
    assert admin_socket_path({"XDG_RUNTIME_DIR": "/r"}, "gpu1") == "/r/kvtier/instances/gpu1.sock"
    mine = tmp_path / "one.sock"
    cmd, _prefix, result = dry_run(env, model_dir, "--admin-socket", mine)
    config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["admin_socket"] == str(mine) and str(mine) in result.stdout
    cmd, _prefix, _result = dry_run({**env, "KVTIER_ADMIN_SOCKET": str(tmp_path / "env.sock")}, model_dir)
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["admin_socket"] == \
        str(tmp_path / "env.sock")


def test_an_admin_socket_a_live_server_answers_on_is_refused_before_vllm_starts(env, model_dir, tmp_path):
    path = tmp_path / "live.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    try:
        started = time.perf_counter()
        assert_refused(serve(env, model_dir, "--port", free_port(), "--dry-run", "--admin-socket", path),
                       "listening on the admin socket", "--admin-socket")
        assert time.perf_counter() - started < 3
    finally:
        live.close()
    dry_run(env, model_dir, "--admin-socket", path)  # stale now (its server is gone): accepted
    (tmp_path / "plain").write_text("x")
    assert_refused(serve(env, model_dir, "--port", free_port(), "--dry-run", "--admin-socket", tmp_path / "plain"),
                   "not a socket")


def test_the_admin_token_never_reaches_the_command_line(env, model_dir, tmp_path):
    """`ps -ef` shows vLLM's argv to every local user: the TCP admin token travels in its environment."""
    secret = "s3cret-" + uuid.uuid4().hex
    cmd, prefix, result = dry_run({**env, "KVTIER_ADMIN_TOKEN": secret}, model_dir, "--admin-tcp", "127.0.0.1:8100")
    assert secret not in result.stdout + result.stderr and secret not in " ".join(cmd)
    assert connector_config(cmd)["kv_connector_extra_config"]["admin_tcp"] == "127.0.0.1:8100"
    assert "admin_token" not in connector_config(cmd)["kv_connector_extra_config"]
    from kvtier.config import load_settings
    from kvtier.launch.serve import vllm_command

    settings, _ = load_settings(env={k: v for k, v in env.items() if k.startswith("KVTIER_")})
    _cmd, child_env = vllm_command(str(model_dir), settings, "127.0.0.1", 8000, None, [], base_env={},
                                   admin_tcp="127.0.0.1:8100", token=secret)
    assert child_env["KVTIER_ADMIN_TOKEN"] == secret and secret not in " ".join(_cmd)


def test_the_admin_token_file_must_be_private(env, model_dir, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("0123456789abcdef0123456789abcdef\n")
    token_file.chmod(0o644)
    args = ["--port", free_port(), "--dry-run", "--admin-tcp", "127.0.0.1:8100", "--admin-token-file", token_file]
    assert_refused(serve(env, model_dir, *args), "other users", "chmod 600")
    token_file.chmod(0o600)
    assert serve(env, model_dir, *args).exit_code == 0
    assert_refused(serve(env, model_dir, "--port", free_port(), "--dry-run", "--admin-tcp", "127.0.0.1:8100"),
                   "bearer token")  # no token anywhere
    assert_refused(serve({**env, "KVTIER_ADMIN_TOKEN": "x" * 32}, model_dir, "--port", free_port(), "--dry-run",
                         "--admin-tcp", "0.0.0.0:8100"), "loopback")


def test_the_engine_takes_the_admin_token_from_its_environment():
    need("vllm")
    from kvtier.connector_config import ConnectorConfig
    from kvtier.plugins.vllm.scheduler import admin_token_of

    parse = ConnectorConfig.from_extra
    assert admin_token_of(parse({"admin_tcp": "127.0.0.1:1"}), {"KVTIER_ADMIN_TOKEN": "from-env"}) == "from-env"
    assert admin_token_of(parse({"admin_token": "legacy"}), {}) == "legacy"
    assert admin_token_of(parse({}), {}) is None


# ---- several drives ------------------------------------------------------------------------------
def test_nvme_dir_once_per_drive_reaches_the_connector(env, model_dir, tmp_path):
    a, b = tmp_path / "d0", tmp_path / "d1"
    cmd, _env, result = dry_run(env, model_dir, "--nvme-dir", a, "--nvme-dir", b)
    assert connector_config(cmd)["kv_connector_extra_config"]["nvme_dir"] == f"{a}{os.pathsep}{b}"
    assert "one filesystem" in result.stderr  # both on this test's disk: a warning, not a refusal


def test_bad_drive_lists_are_refused_with_a_hint(env, model_dir, tmp_path):
    a, b, c = tmp_path / "d0", tmp_path / "d1", tmp_path / "d2"
    assert_refused(serve(env, model_dir, "--nvme-dir", a, "--nvme-dir", a, "--dry-run"), "named twice")
    regular = tmp_path / "a-file"
    regular.write_text("x")
    assert_refused(serve(env, model_dir, "--nvme-dir", a, "--nvme-dir", regular, "--dry-run"), str(regular))
    from kvtier.tiers.nvme.drives import check_drive_list

    check_drive_list([str(a), str(b)], write=True)  # as a server with these two drives records them
    assert_refused(serve(env, model_dir, "--nvme-dir", a, "--nvme-dir", c, "--dry-run"), "was written with the drives",
                   "--nvme-dir once for each of")
    assert_refused(serve(env, model_dir, "--nvme-dir", a, "--nvme", "1000000TiB", "--nvme-dir", b, "--dry-run"),
                   "its share of the budget")
