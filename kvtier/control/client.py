"""Client of the admin API (the CLI and ``kvtier top``): stdlib only, no torch, no vLLM."""
from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from typing import Any, Callable
from urllib.parse import quote, urlencode

import orjson

from kvtier.errors import KvtierError, NoServerError, NotFoundError, UsageError

__all__ = ["AdminClient", "connect", "default_socket_path"]

NO_SERVER_HINT = "start one with `kvtier serve` (or pass --instance NAME, --socket PATH / set KVTIER_ADMIN_SOCKET)"


def default_socket_path() -> str:
    from kvtier.control.instances import client_socket

    return client_socket()


def connect(socket_path: str | None = None, instance: str | None = None, timeout: float = 10.0) -> "AdminClient":
    """A client of the server the user means: ``--socket``, ``--instance``, ``$KVTIER_ADMIN_SOCKET``,
    ``$KVTIER_INSTANCE``, the only running instance -- or, with ``$KVTIER_ADMIN_URL`` set and none
    of the first four, the loopback TCP listener with the token of ``$KVTIER_ADMIN_TOKEN`` or
    ``$KVTIER_ADMIN_TOKEN_FILE``."""
    from kvtier.control.instances import client_socket

    env = os.environ
    if not (socket_path or instance or env.get("KVTIER_ADMIN_SOCKET") or env.get("KVTIER_INSTANCE")) \
            and env.get("KVTIER_ADMIN_URL"):
        from kvtier.persist.secrets import admin_token

        token = admin_token(env.get("KVTIER_ADMIN_TOKEN_FILE") or None)
        return AdminClient(timeout=timeout, url=env["KVTIER_ADMIN_URL"], token=token)
    return AdminClient(client_socket(socket_path, instance), timeout=timeout)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class AdminClient:
    """``get`` / ``post`` JSON against the admin socket; errors become kvtier errors with hints."""

    def __init__(self, socket_path: str | None = None, timeout: float = 10.0, url: str | None = None,
                 token: str | None = None):
        self.socket_path = socket_path or default_socket_path()
        self.timeout = timeout
        self.url = url  # http://127.0.0.1:PORT for the token-protected TCP listener
        self.token = token
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # one connection: `kvtier top` polls and acts from two threads

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.url:
                from urllib.parse import urlparse

                parsed = urlparse(self.url)
                self._conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=self.timeout)
            else:
                self._conn = _UnixConnection(self.socket_path, self.timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(self, method: str, path: str, body: dict | None = None, raw: bool = False) -> Any:
        with self._lock:
            return self._request(method, path, body, raw)

    def _request(self, method: str, path: str, body: dict | None, raw: bool) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in (0, 1):  # one retry on a connection the server closed meanwhile
            conn = self._connection()
            try:
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                payload = response.read()
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self.close()
                raise NoServerError(f"no kvtier server is listening on {self.url or self.socket_path}",
                                    hint=NO_SERVER_HINT) from None
            except (http.client.RemoteDisconnected, http.client.IncompleteRead, BrokenPipeError,
                    ConnectionResetError):
                self.close()
                if attempt:
                    raise NoServerError("the kvtier server closed the connection", hint=NO_SERVER_HINT) from None
            except socket.timeout:
                self.close()
                raise KvtierError(f"the kvtier server did not answer within {self.timeout:.0f} s",
                                  hint="it may be busy; retry, or check its log") from None
            except PermissionError:
                self.close()
                raise NoServerError(f"no permission to use {self.socket_path}",
                                    hint="the socket belongs to another user; run as that user") from None
        if raw:
            if response.status >= 400:
                _raise(response.status, payload)
            return payload.decode("utf-8", "replace")
        if response.status >= 400:
            _raise(response.status, payload)
        return orjson.loads(payload)

    def post_with_file(self, path: str, body: dict, fd: int, name: str | os.PathLike | None = None) -> Any:
        """POST ``body`` with the open file ``fd`` handed over the Unix socket (``SCM_RIGHTS``): the
        server reads or writes that file, and only that, whatever its path (it names none). Its
        errors name the file as ``name`` (the server only knows it as ``/proc/<pid>/fd/<n>``)."""
        try:
            return self._post_with_file(path, body, fd)
        except KvtierError as exc:
            if name is not None:
                import re

                exc.message = re.sub(r"/proc/\d+/fd/\d+", os.fspath(name).replace("\\", "\\\\"), exc.message)
                exc.args = (exc.message,)
            raise

    def _post_with_file(self, path: str, body: dict, fd: int) -> Any:
        if self.url:
            raise UsageError("a file can only be handed over the admin Unix socket, not TCP",
                             hint="over TCP, name a file in the server's snapshot directory")
        data = json.dumps({**body, "fd": 0}).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.socket_path)
                socket.send_fds(sock, [head + data], [fd])
                response = http.client.HTTPResponse(sock)
                response.begin()
                payload = response.read()
            except (FileNotFoundError, ConnectionRefusedError):
                raise NoServerError(f"no kvtier server is listening on {self.socket_path}",
                                    hint=NO_SERVER_HINT) from None
            except socket.timeout:
                raise KvtierError(f"the kvtier server did not answer within {self.timeout:.0f} s",
                                  hint="it may be busy; retry, or check its log") from None
        if response.status >= 400:
            _raise(response.status, payload)
        return orjson.loads(payload)

    def snapshot_to_file(self, session_id: str, target: str | os.PathLike,
                         on_poll: Callable[[dict], None] | None = None) -> dict:
        """Snapshot a session into ``target`` wherever the caller may write: a temp file is made beside
        it, handed over, written by the server, and renamed into place once the job is done (the
        target only ever holds a complete snapshot). Returns the finished job, its path the target's."""
        from pathlib import Path

        from kvtier.persist.snapshot import overwrite_refusal
        from kvtier.tiers.fileio import fsync_dir

        target = Path(target).expanduser().absolute()
        refusal = overwrite_refusal(target)
        if refusal:
            raise UsageError(refusal, hint="kvtier only overwrites its own snapshot files; choose another path")
        if not target.parent.is_dir():
            raise UsageError(f"directory {target.parent} does not exist", hint="create it first")
        import secrets

        temp = target.parent / f".{target.name}.tmp-{secrets.token_hex(4)}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UsageError(f"cannot create {temp}: {exc.strerror}", hint="check the directory's permissions") \
                from None
        done = False
        try:
            try:
                job = self.post_with_file(self.session_path(session_id, "snapshot"), {}, fd, name=target)
            finally:
                os.close(fd)
            job = self.wait(job, on_poll=on_poll)
            if job["state"] == "done":
                os.replace(temp, target)
                fsync_dir(target.parent)
                job["path"], done = str(target), True
            return job
        finally:
            if not done:
                temp.unlink(missing_ok=True)

    def restore_file(self, source: str | os.PathLike, body: dict | None = None) -> dict:
        """Restore the snapshot ``source`` (opened here, without blocking on a special file, and
        handed over); returns the job as the server answered it."""
        import stat

        try:
            fd = os.open(os.fspath(source), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFoundError(f"snapshot file {source} does not exist", hint="kvtier snapshot SESSION writes one") \
                from None
        except OSError as exc:
            raise UsageError(f"cannot open {source}: {exc.strerror}", hint="check its permissions") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UsageError(f"{source} is not a regular file", hint="give the path of a .kvsnap file")
            return self.post_with_file("/v1/restore", dict(body or {}), fd, name=source)
        finally:
            os.close(fd)

    def get(self, path: str, **query) -> Any:
        query = {k: v for k, v in query.items() if v is not None}
        return self.request("GET", path + (f"?{urlencode(query)}" if query else ""))

    def post(self, path: str, body: dict | None = None) -> Any:
        return self.request("POST", path, body or {})

    @staticmethod
    def session_path(session_id: str, action: str = "") -> str:
        return f"/v1/sessions/{quote(session_id, safe='')}" + (f"/{action}" if action else "")

    def wait(self, job: dict, timeout: float = 600.0, on_poll: Callable[[dict], None] | None = None) -> dict:
        """Poll a job until it is done or failed."""
        deadline = time.monotonic() + timeout
        delay = 0.02
        while job["state"] not in ("done", "failed"):
            if time.monotonic() > deadline:
                raise KvtierError(f"job {job['id']} is still {job['state']} after {timeout:.0f} s",
                                  hint=f"follow it with `kvtier jobs {job['id']}`")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
            job = self.get(f"/v1/jobs/{job['id']}")
            if on_poll is not None:
                on_poll(job)
        return job


def _raise(status: int, payload: bytes) -> None:
    try:
        doc = json.loads(payload)
        message, hint = doc.get("error", ""), doc.get("hint")
    except (ValueError, AttributeError):
        message, hint = payload.decode("utf-8", "replace")[:200], None
    if status == 404:
        exc: KvtierError = NotFoundError(message, hint=hint)
    elif status in (400, 405, 411, 413):
        exc = UsageError(message, hint=hint)
    elif status == 401:
        exc = KvtierError(message, hint=hint or "pass the admin token")
    else:
        exc = KvtierError(message, hint=hint)
    exc.status = status  # the HTTP status, for callers that tell refusals (4xx) from faults (5xx)
    raise exc
