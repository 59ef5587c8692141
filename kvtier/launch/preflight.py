"""``kvtier serve``'s checks before vLLM starts: the model (a local directory, or a hub id resolved
without downloading), the instance name and port, the budgets (automatic ones sized to the box first,
``kvtier.launch.budgets``), the NVMe directory (its filesystem, free space, other servers' claims),
DRAM, codecs, the admin socket and the shared store. Each refusal is one ``UsageError`` /
``ConfigError`` with a hint; what is worth knowing but not fatal comes back as warnings."""
from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import Settings
from kvtier.errors import ConfigError, UsageError
from kvtier.launch.budgets import INSTANCES_SUBDIR, check_dram, committed_elsewhere, size_budgets, stored_bytes
from kvtier.tiers.nvme.drives import nearest_existing
from kvtier.units import human_bytes

RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "9p", "afs"})
NO_MODEL_HINT = "pass a local model directory (one with config.json) or a Hugging Face id (org/name)"

__all__ = ["INSTANCES_SUBDIR", "Checked", "ModelSource", "check_admin_socket", "check_serve", "check_shared",
           "filesystem_type", "instance_store_dir", "preflight", "resolve_model"]


@dataclass(frozen=True)
class Checked:
    """What :func:`check_serve` found: the settings to launch with (budgets in bytes, automatic
    ones sized), the line saying how each budget was chosen, and warnings (nothing fatal)."""

    settings: Settings
    budgets: str
    warnings: list[str]


def check_serve(
    settings: Settings,
    model: str | None,
    *,
    sources: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    port: int | None = 8000,
    create_dirs: bool = True,
    extra_args: Sequence[str] = (),
    kv_cache_dtype: str | None = None,
    admin_socket: str | None = None,
    revision: str | None = None,
    instance: str | None = None,
) -> Checked:
    """Size the automatic budgets, then refuse (UsageError / ConfigError, each with a hint) what
    would make vLLM fail later.

    ``sources``: ``load_settings``'s field -> source map; the budgets it marks automatic are sized
    here (without it every budget is taken as given).  ``create_dirs=False`` (dry runs) checks that
    the NVMe dir *could* be created without creating it.  ``port=None`` skips the port check.
    ``instance``: this server's name, refused when a live instance has it.
    """
    from kvtier.control.instances import list_instances

    warnings: list[str] = []
    running = list_instances()
    if instance is not None:
        _check_instance(instance, port, running)
    _check_codecs(settings, kv_cache_dtype)
    if model is not None:
        resolve_model(model, revision, extra_args)
    sized = size_budgets(settings, sources, running)
    warnings += _check_nvme_dir(sized.settings, create_dirs, running)
    warnings += check_dram(sized.settings, running)
    if port is not None:
        _check_port(host, port)
    if admin_socket is not None:
        check_admin_socket(admin_socket)
    warnings += check_shared(sized.settings)
    return Checked(sized.settings, sized.line, warnings)


def preflight(settings: Settings, model: str | None, **checks) -> list[str]:
    """:func:`check_serve` for settings whose budgets are given (sizes, not ``auto``): its warnings."""
    return check_serve(settings, model, **checks).warnings


def check_shared(settings: Settings) -> list[str]:
    """The shared tier's settings (credentials readable, a policy that has what it needs), and one
    round trip to the store: a store that is down or refuses the credentials is a warning, not a
    refusal -- the server serves without it and picks it up when it answers."""
    if not settings.shared:
        return []
    from kvtier.tiers.shared.store import SharedConfig, SharedStore, SharedUnavailable, parse_shared_url

    if settings.shared_policy == "demote" and not settings.nvme_bytes:
        raise ConfigError("--shared-policy demote publishes blocks when they get their NVMe copy, and this server "
                          "has no NVMe tier", hint="use --shared-policy write-through, or give it --nvme-dir")
    store = SharedStore(SharedConfig(parse_shared_url(settings.shared), settings.shared_policy,
                                     int(settings.shared_ttl), 2.0, settings.shared_codec,
                                     settings.shared_auth_file or None, settings.shared_ca_file or None))
    try:
        store.client.ping()
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
    from kvtier.persist.weights import hub_cache_dir, hub_snapshot

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


def _unescape_mount(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash in mount points as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_type(path: str | os.PathLike[str], mounts_file: str = "/proc/mounts") -> str | None:
    """The fstype of the mount holding ``path`` (longest matching mount point; later mounts win)."""
    real = os.path.realpath(nearest_existing(Path(path).expanduser().absolute()))
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


def instance_store_dir(nvme_dir: str, name: str | None) -> str:
    """Where an instance keeps its cold tier: a named instance (``--instance NAME``) in
    ``NVME_DIR/instances/NAME`` -- so instances share one NVMe directory, each with its own blocks,
    journal, catalog, lock and budget -- and an unnamed one in ``NVME_DIR`` itself, as before."""
    return str(Path(nvme_dir) / INSTANCES_SUBDIR / name) if name else str(nvme_dir)


def _check_nvme_dir(settings: Settings, create: bool, running: Sequence = ()) -> list[str]:
    """Every drive of the cold tier (``--nvme-dir`` once per drive): the list against the one its
    blocks were written with, then each drive with its share of the budget."""
    from kvtier.tiers.nvme.drives import check_drive_list, drive_dirs, split_budget

    dirs = drive_dirs(settings.nvme_dir)
    if not dirs:
        raise ConfigError("no NVMe dir given", hint="pass --nvme-dir a directory on a local SSD")
    warnings = check_drive_list(dirs, write=False)
    for raw, budget in zip(dirs, split_budget(dirs, settings.nvme_bytes)):
        warnings += _check_drive(raw, budget, create, running, len(dirs) > 1)
    if create:
        check_drive_list(dirs, write=True)  # every drive checked: record the list (several drives only)
    return warnings


def _check_drive(raw: str, budget: int, create: bool, running: Sequence, several: bool) -> list[str]:
    warnings: list[str] = []
    nvme_dir = Path(raw).expanduser()
    where = nearest_existing(nvme_dir.absolute())
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

    from kvtier.persist.catalog import held_locks

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
    stored = stored_bytes(nvme_dir) if nvme_dir.is_dir() else 0
    others = committed_elsewhere(nvme_dir, running)
    room = max(0, usage.free - others) + stored
    if budget > room:
        promised = f", less {human_bytes(others)} other kvtier instances may still fill" if others else ""
        share = " (its share of the budget: the budget is split across the drives by their size)" if several else ""
        raise ConfigError(
            f"nvme budget {human_bytes(budget)}{share} is larger than the disk space kvtier can use "
            f"in {raw}: {human_bytes(usage.free)} free + {human_bytes(stored)} already stored by kvtier{promised}",
            hint=f"lower --nvme (at most {human_bytes(room)} fits there) or leave it out (sized to the disk), "
                 "free disk space, or pass --nvme-dir on a bigger disk")
    return warnings


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
