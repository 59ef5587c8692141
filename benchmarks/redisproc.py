"""A real ``redis-server`` (or ``valkey-server``) for the shared tier's tests and benchmarks.

Started on a free loopback port (or a Unix socket) in a directory of the caller's, with no
persistence; optionally with a password, TLS, a memory cap and eviction policy, or as the nodes of
a cluster. ``stop`` / ``pause`` (SIGSTOP) / ``resume`` / ``restart`` are the faults the benchmarks
and tests inflict.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from kvtier.errors import KvtierError

__all__ = ["RedisServer", "start_cluster", "server_binary", "free_port"]


def server_binary() -> str:
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path:
            return path
    raise KvtierError("no redis-server or valkey-server on PATH",
                      hint="install one: `apt-get install redis-server` (Debian/Ubuntu), `dnf install valkey`, "
                           "or `brew install valkey`")


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node one at most 55535 whose bus port (+10000) is free too."""
    if not cluster:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    import random

    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            with socket.socket() as one, socket.socket() as bus:
                one.bind(("127.0.0.1", port))
                bus.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise KvtierError("no free port pair for a cluster node")


class RedisServer:
    def __init__(self, workdir: str | os.PathLike, port: int | None = None, password: str | None = None,
                 unix: bool = False, maxmemory: str | None = None, policy: str = "noeviction",
                 cluster: bool = False, tls: tuple[str, str, str] | None = None):
        """``tls``: (certificate, key, CA) files; the server then listens with TLS only."""
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(cluster)
        self.password, self.unix, self.cluster, self.tls = password, unix, cluster, tls
        self.socket_path = str(self.dir / "redis.sock") if unix else None
        lines = [f"port {0 if tls else self.port}", "bind 127.0.0.1", f"dir {self.dir}", "save \"\"",
                 "appendonly no", f"logfile {self.dir / 'server.log'}", f"maxmemory-policy {policy}",
                 "protected-mode no"]
        if unix:
            lines += [f"unixsocket {self.socket_path}", "unixsocketperm 700"]
        if password:
            lines.append(f"requirepass {password}")
        if maxmemory:
            lines.append(f"maxmemory {maxmemory}")
        if cluster:
            lines += ["cluster-enabled yes", f"cluster-config-file {self.dir / 'nodes.conf'}",
                      "cluster-node-timeout 2000"]
        if tls:
            cert, key, ca = tls
            lines += [f"tls-port {self.port}", f"tls-cert-file {cert}", f"tls-key-file {key}",
                      f"tls-ca-cert-file {ca}", "tls-auth-clients no"]
        self.config = self.dir / "redis.conf"
        self.config.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.unix:
            return f"unix://{self.socket_path}"
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.proc = subprocess.Popen([server_binary(), str(self.config)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "server.log")
                raise KvtierError(f"redis-server exited at start: {log.read_text()[-500:] if log.exists() else ''}")
            if self._answers():
                return self
            time.sleep(0.05)
        raise KvtierError(f"redis-server did not answer on port {self.port} within {timeout:g} s")

    def _answers(self) -> bool:
        try:
            if self.unix:
                sock = socket.socket(socket.AF_UNIX)
                sock.settimeout(0.5)
                sock.connect(self.socket_path)
            else:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        except OSError:
            return False
        with sock:
            if self.tls:
                return True
            try:
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
            except OSError:
                return False
            return reply.startswith((b"+PONG", b"-NOAUTH"))

    def client(self):
        """A plain redis-py client of this server (for the raw reference runs and the fault tests)."""
        import redis

        return redis.Redis.from_url(self.url, password=self.password, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_cluster(workdir: str | os.PathLike, nodes: int = 3) -> list[RedisServer]:
    """``nodes`` primaries (no replicas) forming one cluster, every slot assigned."""
    servers: list[RedisServer] = []
    try:
        for i in range(nodes):
            servers.append(RedisServer(Path(workdir) / f"node{i}", cluster=True).start())
    except BaseException:
        for server in servers:
            server.stop()
        raise
    cli = shutil.which("valkey-cli") or shutil.which("redis-cli")
    if cli is None:
        for server in servers:
            server.stop()
        raise KvtierError("no redis-cli to create the cluster with", hint="it comes with redis-server")
    created = subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in servers],
                              "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
    if created.returncode != 0:
        for server in servers:
            server.stop()
        raise KvtierError(f"redis-cli --cluster create failed: {created.stdout[-400:]}{created.stderr[-400:]}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # every node must know every slot, not only the first one
        states = [subprocess.run([cli, "-p", str(s.port), "cluster", "info"], capture_output=True, text=True).stdout
                  for s in servers]
        if all("cluster_state:ok" in state and "cluster_slots_ok:16384" in state for state in states):
            return servers
        time.sleep(0.1)
    for server in servers:
        server.stop()
    raise KvtierError("the redis cluster did not reach cluster_state:ok on every node within 30 s")
