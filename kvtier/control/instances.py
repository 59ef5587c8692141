"""Named ``kvtier serve`` instances on one box, and how a client finds the one it means.

Each running ``kvtier serve`` registers itself as ``<runtime>/instances/<name>.json`` (``<runtime>``
is ``$XDG_RUNTIME_DIR/kvtier``, else ``/tmp/kvtier-$UID``) and holds an exclusive ``flock`` on that
file for as long as it runs.  The lock, not the pid, says an instance is alive: the kernel drops it
when the process dies however it dies, and a pid can be reused.  A record nobody holds is stale (a
killed server): whoever lists the instances removes it, with its socket if nothing answers there.

The default name is the API port (``8000``), the default admin socket ``<runtime>/instances/<name>.sock``.
A client uses, in order: ``--socket`` / ``$KVTIER_ADMIN_SOCKET``; ``--instance`` / ``$KVTIER_INSTANCE``
(a name or a port); the only live instance; the pre-instance default socket (``<runtime>.../kvtier.sock``).

Stdlib only: the CLI imports this for every session command.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import stat
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.errors import NoServerError, UsageError

__all__ = ["Instance", "Registration", "client_socket", "find_instance", "instance_socket", "legacy_socket_path",
           "list_instances",
           "registry_dir", "runtime_dir", "socket_answers", "valid_name"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_HINT = "a name is 1 to 64 letters, digits, '.', '_' or '-' (default: the API port)"


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where kvtier keeps per-user runtime files (sockets, the instance registry)."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "kvtier" if xdg else Path(f"/tmp/kvtier-{os.getuid()}")


def registry_dir(env: Mapping[str, str] | None = None) -> Path:
    return runtime_dir(env) / "instances"


def legacy_socket_path(env: Mapping[str, str] | None = None) -> str:
    """The admin socket of a server from before instances (``$XDG_RUNTIME_DIR/kvtier.sock``)."""
    env = os.environ if env is None else env
    base = env.get("XDG_RUNTIME_DIR") or f"/tmp/kvtier-{os.getuid()}"
    return os.path.join(base, "kvtier.sock")


def instance_socket(name: str, env: Mapping[str, str] | None = None) -> str:
    """The default admin socket of instance ``name``."""
    return str(registry_dir(env) / f"{name}.sock")


def valid_name(name: str) -> str:
    if not _NAME.fullmatch(name or ""):
        raise UsageError(f"invalid instance name {name!r}", hint=NAME_HINT)
    return name


@dataclass(slots=True)
class Instance:
    """What a running instance says about itself (its registry record)."""

    name: str
    pid: int
    port: int
    host: str
    api_url: str
    admin_socket: str
    model: str
    revision: str | None = None
    admin_tcp: str | None = None
    nvme_dir: str | None = None
    # its budgets in bytes (automatic ones as sized at start, never "auto"): what the next
    # `kvtier serve` on the box counts as promised (kvtier.launch.budgets)
    nvme_bytes: int = 0
    dram_bytes: int = 0
    gpus: list[str] | None = None  # CUDA_VISIBLE_DEVICES as given (indexes or UUIDs); None: not set
    started: float = field(default_factory=time.time)

    @classmethod
    def from_json(cls, text: str) -> Instance:
        doc = json.loads(text)
        known = {name: doc[name] for name in cls.__dataclass_fields__ if name in doc}
        return cls(**known)

    def to_dict(self) -> dict:
        return asdict(self)


def socket_answers(path: str, timeout: float = 1.0) -> bool:
    """Whether a server accepts connections on the Unix socket ``path`` (False: gone, stale, not there)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _held(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _remove_stale(record: Path, fd: int) -> None:
    """Remove a record nobody holds, while holding it ourselves (so a server claiming it right now
    either got it first, and we see it held, or finds the path gone and claims a fresh file)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # claimed meanwhile: live
    try:
        text = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace")
        sock = Instance.from_json(text).admin_socket if text.strip() else None
    except (ValueError, TypeError, KeyError):
        sock = None
    try:
        if os.fstat(fd).st_ino == os.stat(record).st_ino:
            os.unlink(record)
    except FileNotFoundError:
        pass
    if sock and not socket_answers(sock):
        try:
            if stat.S_ISSOCK(os.lstat(sock).st_mode):
                os.unlink(sock)
        except OSError:
            pass


def list_instances(env: Mapping[str, str] | None = None, clean: bool = True) -> list[Instance]:
    """Live instances, by name; stale records (and their dead sockets) are removed on the way."""
    directory = registry_dir(env)
    live: list[Instance] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return live
    for entry in names:
        if not entry.endswith(".json"):
            continue
        path = directory / entry
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if not _held(fd):
                if clean:
                    _remove_stale(path, fd)
                continue
            text = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace")
            try:
                live.append(Instance.from_json(text))
            except (ValueError, TypeError):
                continue  # being written right now: it will read back next time
        finally:
            os.close(fd)
    return live


def _describe(instances: list[Instance]) -> str:
    return "; ".join(f"{i.name} (port {i.port}, {i.model})" for i in instances)


def find_instance(selector: str | None, env: Mapping[str, str] | None = None) -> Instance | None:
    """The instance ``selector`` (a name, or a port) means; with none, the only one running.

    Returns None when nothing is registered and no selector was given (the caller may then try the
    pre-instance socket).  Several instances and no selector is a usage error that lists them.
    """
    instances = list_instances(env)
    if selector:
        for inst in instances:
            if inst.name == selector:
                return inst
        for inst in instances:
            if selector.isdigit() and inst.port == int(selector):
                return inst
        listed = _describe(instances) or "none is running"
        raise NoServerError(f"no kvtier instance named {selector!r} is running",
                            hint=f"running: {listed} (kvtier instances)")
    if len(instances) == 1:
        return instances[0]
    if not instances:
        return None
    raise UsageError(f"{len(instances)} kvtier instances are running: {_describe(instances)}",
                     hint="pick one with --instance NAME|PORT (or set KVTIER_INSTANCE); `kvtier instances` lists them")


def client_socket(socket_path: str | None = None, instance: str | None = None,
                  env: Mapping[str, str] | None = None) -> str:
    """The admin socket a client command talks to (the order is in this module's docstring)."""
    env = os.environ if env is None else env
    if socket_path:
        return socket_path
    if env.get("KVTIER_ADMIN_SOCKET"):
        return str(env["KVTIER_ADMIN_SOCKET"])
    found = find_instance(instance or env.get("KVTIER_INSTANCE") or None, env)
    if found is not None:
        return found.admin_socket
    legacy = legacy_socket_path(env)
    return legacy if os.path.exists(legacy) else instance_socket("8000", env)


class Registration:
    """This server's registry record, held (``flock``) from :meth:`claim` until :meth:`release`
    or the process's death."""

    def __init__(self, instance: Instance, env: Mapping[str, str] | None = None):
        self.instance = instance
        self.path = registry_dir(env) / f"{instance.name}.json"
        self._fd: int | None = None

    def claim(self) -> Registration:
        """Take the name, or refuse it (UsageError) when a live instance has it."""
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for _attempt in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise self._taken() from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # a client removed it as stale between our open and our lock: again
                os.close(fd)
                continue
            payload = json.dumps(self.instance.to_dict(), indent=1).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, payload, 0)
            self._fd = fd
            return self
        raise UsageError(f"could not register instance {self.instance.name}", hint=f"check {directory}")

    def _taken(self) -> UsageError:
        try:
            other = Instance.from_json(self.path.read_text())
            who = f" (pid {other.pid}, port {other.port}, {other.model})"
        except (OSError, ValueError, TypeError):
            who = ""
        return UsageError(f"instance {self.instance.name!r} is already running{who}",
                          hint="stop it, or name this one with --instance NAME (and give it its own --port)")

    def update(self, **changes) -> None:
        for key, value in changes.items():
            setattr(self.instance, key, value)
        if self._fd is not None:
            payload = json.dumps(self.instance.to_dict(), indent=1).encode()
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, payload, 0)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> Registration:
        return self.claim()

    def __exit__(self, *exc) -> None:
        self.release()
