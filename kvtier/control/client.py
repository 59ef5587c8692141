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
        from kvtier.serve import admin_token

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
