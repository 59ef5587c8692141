"""The admin API server: HTTP/1.1 + JSON over a Unix socket (mode 0600), optional loopback TCP with a
bearer token. Runs on its own threads inside the engine process, beside the scheduler half.

Every read takes the manager's lock for the time of a copy; every write plans a job under the lock
and hands it to the engine (``Ops.enqueue``), which ships it to the worker with the next step;
``Ops.wake`` makes sure there is a next step when the engine is idle. Writes answer at once with a
job id (``202``); ``GET /v1/jobs/{id}`` follows it. Two writes on one session never interleave: a
second one while the first is in flight is refused with ``409`` and the id of the running job.

Routes (``GET /v1/openapi.json`` describes them)::

    GET  /v1/status                      model, tiers, sessions by state, jobs, warnings
    GET  /v1/tiers                       per tier: bytes, capacity, blocks, codec, tokens per GiB
    GET  /v1/sessions[?state=&sort=&limit=]
    GET  /v1/sessions/{id}
    GET  /v1/jobs  |  GET /v1/jobs/{id}
    POST /v1/sessions/{id}/pin           {"tier": "dram" | "nvme"}
    POST /v1/sessions/{id}/unpin         {}
    POST /v1/sessions/{id}/evict         {"to": "dram" | "nvme" | "drop"}
    POST /v1/sessions/{id}/snapshot      {"path": optional file path; default: the snapshot dir}
    POST /v1/restore                     {"path": snapshot file, "tier": "dram" | "nvme"}
    POST /v1/flush                       {"session": optional id}: DRAM-only blocks to NVMe now
    GET  /metrics                        Prometheus text
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import socket
import socketserver
import stat
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import orjson

from kvtier.control.ops import API_VERSION, ApiError, Ops
from kvtier.control.wire import HEAD_TIMEOUT_S, MAX_BODY, MAX_HEAD, Head, RequestReader, close_fds
from kvtier.errors import KvtierError, NotFoundError, UsageError

__all__ = ["AdminServer", "Ops", "MAX_BODY", "MAX_HEAD", "HEAD_TIMEOUT_S", "API_VERSION", "Connection", "Endpoint"]

log = logging.getLogger("kvtier.admin")

SWITCH_INTERVAL_S = 0.001
_SESSION = r"(?P<session>[^/]+)"


MAX_CONNECTIONS = 32  # per listener; more are answered 503 at once, without a thread
_BUSY_BODY = b'{"error":"too many admin connections","hint":"close idle ones, then retry"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nServer: kvtier-admin\r\nContent-Type: application/json\r\n"
         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class _Quiet:
    """Shared by both listeners: quiet about clients that hang up, and a cap on connections (each
    one is a thread; 10,000 idle ones must not become 10,000 threads)."""

    max_connections = MAX_CONNECTIONS
    request_queue_size = 128  # listen backlog: a burst of clients waits for accept instead of failing

    def __init__(self, *args, **kwargs):
        self._slots = threading.Condition()  # guards _active; notified whenever it changes
        self._active = 0
        super().__init__(*args, **kwargs)

    def handle_error(self, request, client_address) -> None:  # a client that hung up is not news
        log.debug("kvtier admin: connection error", exc_info=True)

    def process_request(self, request, client_address) -> None:
        with self._slots:
            refused = self._active >= self.max_connections
            if not refused:
                self._active += 1
                self._slots.notify_all()
        if refused:
            try:
                request.setblocking(False)
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._slots:
            self._active = max(0, self._active - 1)
            self._slots.notify_all()

    def wait_connections(self, count: int, timeout: float) -> bool:
        """Wait until exactly ``count`` connections are being served; False if that took over ``timeout``."""
        with self._slots:
            return self._slots.wait_for(lambda: self._active == count, timeout)


class _UnixServer(_Quiet, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True


class _TcpServer(_Quiet, socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class AdminServer:
    """Serves ``ops`` on a Unix socket (and optionally loopback TCP with a token) until ``stop``."""

    def __init__(self, ops: Ops, socket_path: str | os.PathLike, tcp: tuple[str, int] | None = None,
                 token: str | None = None):
        self.ops = ops
        self.socket_path = Path(socket_path)
        self.token = token
        if tcp is not None:
            if tcp[0] not in ("127.0.0.1", "::1", "localhost"):
                raise UsageError(f"admin TCP must listen on loopback, not {tcp[0]}",
                                 hint="use 127.0.0.1 (and the Unix socket for local use)")
            if not token:
                raise UsageError("admin TCP needs a bearer token", hint="set admin_token (a long random string)")
        self.tcp = tcp
        self._servers: list[_UnixServer | _TcpServer] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> "AdminServer":
        # The engine thread holds the GIL between short torch ops; a waiting admin thread gets it
        # at the next switch interval (5 ms by default). 1 ms bounds admin latency; it costs only
        # while an admin request actually waits (an idle server thread sleeps in select()).
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._prepare_socket_dir()
        handler = _make_handler(self.ops, None)
        old = os.umask(0o177)  # the socket is born 0600: no window in which others may connect
        try:
            unix = _UnixServer(str(self.socket_path), handler)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        self._servers.append(unix)
        if self.tcp is not None:
            self._servers.append(_TcpServer(self.tcp, _make_handler(self.ops, self.token)))
        for server in self._servers:
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                      name="kvtier-admin", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("kvtier admin API on %s%s", self.socket_path,
                 f" and http://{self.tcp[0]}:{self.tcp[1]}" if self.tcp else "")
        return self

    def wait_connections(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until the Unix listener serves exactly ``count`` connections (a connection counts from
        its accept to its handler's end); False if that took over ``timeout`` seconds."""
        return self._servers[0].wait_connections(count, timeout)

    @property
    def tcp_port(self) -> int | None:
        return self._servers[1].server_address[1] if len(self._servers) > 1 else None

    def _prepare_socket_dir(self) -> None:
        directory = self.socket_path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
        if info.st_uid != os.getuid():
            raise UsageError(f"admin socket directory {directory} belongs to another user",
                             hint="set XDG_RUNTIME_DIR to a directory you own")
        if self.socket_path.exists() or self.socket_path.is_symlink():
            if not stat.S_ISSOCK(self.socket_path.lstat().st_mode):
                raise UsageError(f"{self.socket_path} exists and is not a socket", hint="move it away")
            from kvtier.control.instances import socket_answers

            if socket_answers(str(self.socket_path)):
                raise UsageError(f"another kvtier server is already listening on {self.socket_path}",
                                 hint="stop it first, or set XDG_RUNTIME_DIR for this one")
            self.socket_path.unlink()  # stale: its server is gone

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass


# ---- request handling --------------------------------------------------------------------------
_ROUTES: list[tuple[str, re.Pattern, str]] = [
    (method, re.compile(f"^{pattern}$"), name) for method, pattern, name in [
        ("GET", "/v1/status", "status"),
        ("GET", "/v1/tiers", "tiers"),
        ("GET", "/v1/sessions", "sessions"),
        ("GET", f"/v1/sessions/{_SESSION}", "session"),
        ("GET", "/v1/jobs", "jobs"),
        ("GET", r"/v1/jobs/(?P<job>[^/]+)", "job"),
        ("GET", "/v1/openapi.json", "openapi"),
        ("GET", "/v1/costmodel", "costmodel"),
        ("GET", "/metrics", "metrics"),
        ("POST", f"/v1/sessions/{_SESSION}/pin", "pin"),
        ("POST", f"/v1/sessions/{_SESSION}/unpin", "unpin"),
        ("POST", f"/v1/sessions/{_SESSION}/evict", "evict"),
        ("POST", f"/v1/sessions/{_SESSION}/snapshot", "snapshot"),
        ("POST", "/v1/restore", "restore"),
        ("POST", "/v1/flush", "flush"),
        ("GET", "/v1/shared", "shared"),
        ("GET", "/v1/shared/sessions", "shared_sessions"),
        ("POST", "/v1/shared/restore", "shared_restore"),
    ]
]
_BODY_FIELDS = {"pin": {"tier", "for_s"}, "unpin": set(), "evict": {"to"}, "snapshot": {"path", "fd"},
                "restore": {"path", "fd", "tier", "cache_salt", "trust_unsigned"}, "flush": {"session"},
                "shared_restore": {"session", "tier", "cache_salt"}}


_REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 503: "Service Unavailable", 409: "Conflict",
            411: "Length Required", 413: "Payload Too Large",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 505: "HTTP Version Not Supported"}
IDLE_TIMEOUT_S = 30.0  # a keep-alive connection with no request for this long is closed
_JSON = b"application/json"
_TEXT = b"text/plain; version=0.0.4; charset=utf-8"
Answer = tuple[int, bytes, bytes, bool]  # status, body, content type, close after answering


@dataclass(frozen=True)
class Endpoint:
    """What one listener serves: the ops, the API's route handler (``api.handle``), the metrics page,
    and the credential its requests must carry (``b"Bearer <token>"`` on TCP; None on the Unix socket)."""

    ops: Ops
    handle: Callable[..., tuple[int, Any]]
    metrics: Callable[[Ops], bytes]
    expected_auth: bytes | None = None

    def respond(self, head: Head, body: bytes, fds: list[int]) -> Answer:
        method = head.method
        try:
            path, _, query = head.target.partition("?")
            name, params = _route(method, path)
            doc = _body(name, body) if method == "POST" else {}
            if name == "metrics":
                return 200, self.metrics(self.ops), _TEXT, False
            status, payload = self.handle(self.ops, name, params, _query(query), doc, fds)
            return status, orjson.dumps(payload), _JSON, False
        except ApiError as exc:
            return exc.status, _error_body(exc.message, exc.hint), _JSON, True
        except KvtierError as exc:
            status = 404 if isinstance(exc, NotFoundError) else 400
            return status, _error_body(getattr(exc, "message", str(exc)), getattr(exc, "hint", None)), _JSON, True
        except Exception as exc:  # never kill the server thread, never leak a traceback
            log.exception("kvtier admin: %s %s failed", method, head.target[:200])
            return 500, _error_body(f"internal error: {type(exc).__name__}", "see the server log"), _JSON, True


class Connection(socketserver.BaseRequestHandler):
    """A lean HTTP/1.1 connection loop (keep-alive, Content-Length bodies only): one ``recv`` per
    request and one ``sendall`` per answer. ``http.server`` parsed headers with ``email`` and wrote
    in pieces; each blocking call is a GIL hand-off, which under engine load costs up to a switch
    interval, so fewer calls is lower tail latency."""

    def __init__(self, request, client_address, server, *, endpoint: Endpoint):
        self.endpoint = endpoint
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        # A kernel receive timeout, not ``settimeout``: Python's timeout mode polls before every
        # recv and send, two GIL hand-offs instead of one.
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(IDLE_TIMEOUT_S), 0))
        self.reader = RequestReader(self.request)

    def finish(self) -> None:
        self.reader.close()

    def handle(self) -> None:
        while True:
            try:
                read = self.reader.read_request(self.endpoint.expected_auth)
            except ApiError as exc:  # unreadable request: answer and hang up
                self._answer(exc.status, _error_body(exc.message, exc.hint), _JSON, close=True)
                return
            except (OSError, socket.timeout):
                return  # the client went away or idled out
            if read is None:
                return
            head, body = read
            fds = self.reader.take_fds()
            try:
                status, data, content_type, close = self.endpoint.respond(head, body, fds)
            finally:
                close_fds(fds)  # the ones no handler kept
            close = close or not head.keep_alive
            if not self._answer(status, data, content_type, close=close) or close:
                return

    def _answer(self, status: int, data: bytes, content_type: bytes, close: bool) -> bool:
        head = (b"HTTP/1.1 %d %s\r\nServer: kvtier-admin\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n"
                % (status, _REASONS.get(status, "").encode(), content_type, len(data),
                   b"Connection: close\r\n" if close else b""))
        try:
            self.request.sendall(head + data)
        except OSError:
            return False
        return True


def _make_handler(ops: Ops, token: str | None) -> Callable[..., Connection]:
    """The handler a listener builds per connection: ``Connection`` bound to what it serves."""
    from kvtier.control import api
    from kvtier.control.metrics import metrics

    expected = f"Bearer {token}".encode() if token is not None else None
    return functools.partial(Connection, endpoint=Endpoint(ops, api.handle, metrics, expected))


def _error_body(message: str, hint: str | None) -> bytes:
    return orjson.dumps({"error": message, **({"hint": hint} if hint else {})})


def _route(method: str, path: str) -> tuple[str, dict]:
    allowed = []
    for route_method, pattern, name in _ROUTES:
        match = pattern.match(path)
        if match:
            if route_method == method:
                return name, match.groupdict()
            allowed.append(route_method)
    if allowed:
        raise ApiError(405, f"{method[:20]} is not allowed on {path[:200]}", hint=f"use {', '.join(allowed)}")
    raise ApiError(404, f"no such route: {path[:200]}", hint="GET /v1/openapi.json lists the routes")


def _body(name: str, raw: bytes) -> dict:
    try:
        body = json.loads(raw.decode("utf-8")) if raw else {}  # stdlib: its error messages say where
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", hint='send a JSON object, e.g. {"tier": "dram"}') from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = set(body) - _BODY_FIELDS[name]
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(sorted(map(str, unknown)))[:200]}",
                       hint=f"{name} accepts: {', '.join(sorted(_BODY_FIELDS[name])) or 'no fields'}")
    return body


def _query(query: str) -> dict[str, str]:
    from urllib.parse import parse_qsl

    try:
        return dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=20))
    except ValueError as exc:
        raise ApiError(400, f"bad query string: {exc}") from None
