"""What the admin server reads off the wire: HTTP/1.1 request heads and Content-Length bodies.

``parse_head`` is a pure function (the head's bytes in, a ``Head`` out, or a ``RequestError`` carrying the
status to answer); ``check_auth`` and ``body_length`` decide, from the head alone, whether the rest of the
request is read at all. ``RequestReader`` owns one connection's receive buffer and the files handed over
with a request (SCM_RIGHTS on the Unix socket), and frames heads and bodies out of it.

The parser is as strict as h11: no obsolete line folding, tokens for methods and header names, no control
characters in values, ASCII digits only in Content-Length, one Content-Length / Authorization / Host /
Transfer-Encoding at most (two disagreeing copies are the classic request-smuggling vector).
"""
from __future__ import annotations

import contextlib
import hmac
import os
import re
import socket
import time
from dataclasses import dataclass

from kvtier.control.ops import ApiError

__all__ = ["MAX_BODY", "MAX_HEAD", "HEAD_TIMEOUT_S", "MAX_FDS", "Head", "RequestError", "RequestReader",
           "body_length", "check_auth", "close_fds", "parse_head", "split_head"]

MAX_BODY = 64 << 10
MAX_HEAD = 16 << 10
HEAD_TIMEOUT_S = 10.0  # a request head must arrive whole within this
MAX_FDS = 4  # files one request may hand over
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token: methods and header names
_DIGITS = re.compile(r"[0-9]{1,19}")  # Content-Length: ASCII digits only ("²".isdigit() is True)
_TARGET = re.compile(r"/[\x21-\x7e]*")  # origin-form, visible ASCII only
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")  # no control characters in values
_SINGLE = ("content-length", "authorization", "host", "transfer-encoding")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class RequestError(ApiError):
    """A request refused before it is routed; ``status`` is the answer (400, 401, 408, 411, 413, 431,
    505), after which the connection is closed."""


@dataclass(frozen=True)
class Head:
    method: str
    target: str
    version: str
    headers: dict[str, str]  # lower-case names; values stripped of surrounding blanks
    keep_alive: bool

    @property
    def expects_continue(self) -> bool:
        return self.headers.get("expect", "").lower() == "100-continue"


def split_head(buffer: bytes) -> tuple[bytes, bytes] | None:
    """(head, rest) once ``buffer`` holds a whole head (the blank line is dropped); None while more is
    needed."""
    end = buffer.find(b"\r\n\r\n")
    if end >= 0:
        return buffer[:end], buffer[end + 4:]
    if len(buffer) > MAX_HEAD:
        raise RequestError(431, "request head is too large")
    return None


def parse_head(data: bytes) -> Head:
    """The request line and header fields of ``data`` (a head without its blank line)."""
    if len(data) > MAX_HEAD:
        raise RequestError(431, "request head is too large")
    lines = data.decode("iso-8859-1").split("\r\n")
    while lines and not lines[0]:  # tolerate blank lines between requests (RFC 9112 2.2)
        lines.pop(0)
    parts = lines[0].split(" ") if lines else []
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise RequestError(400, f"malformed request line: {lines[0][:80] if lines else ''!r}")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise RequestError(505, f"unsupported protocol {version[:20]!r}", hint="speak HTTP/1.1")
    headers = _fields(lines[1:])
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    return Head(method, target, version, headers, keep_alive)


def _fields(lines: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        # no obsolete line folding (a line starting with a space continues the previous one
        # in old HTTP: a classic request-smuggling vector), names are tokens, values printable
        if not sep or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise RequestError(400, f"malformed header line: {line[:80]!r}")
        key = name.lower()
        if key in headers and key in _SINGLE:
            raise RequestError(400, f"duplicate {name} header")
        headers[key] = value.strip(" \t")
    return headers


def check_auth(head: Head, expected: bytes | None) -> None:
    """The bearer token (TCP only: ``expected`` is ``b"Bearer <token>"``), checked before anything else of
    a stranger's request is read, in constant time."""
    if expected is None:
        return
    given = head.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode("iso-8859-1"), expected):
        raise RequestError(401, "missing or wrong bearer token", hint="send 'Authorization: Bearer <admin token>'")


def body_length(head: Head) -> int | None:
    """The body's size from Content-Length (None: no body); chunked bodies and sizes over ``MAX_BODY``
    are refused before a byte of the body is read."""
    if "transfer-encoding" in head.headers:
        raise RequestError(411, "chunked bodies are not accepted", hint="send Content-Length")
    length = head.headers.get("content-length")
    if length is None:
        return None
    if not _DIGITS.fullmatch(length):
        raise RequestError(400, f"bad Content-Length: {length[:20]!r}")
    size = int(length)
    if size > MAX_BODY:
        raise RequestError(413, f"body of {size} bytes is over the {MAX_BODY}-byte limit")
    return size


def close_fds(fds: list[int]) -> None:
    """Close every descriptor in ``fds`` still open (marking it -1: a handler may have kept some)."""
    for i, fd in enumerate(fds):
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            fds[i] = -1


class RequestReader:
    """One connection's receive side: one ``recv`` per request where it fits (each blocking call is a
    GIL hand-off, which under engine load costs up to a switch interval)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""
        self.unix = sock.family == socket.AF_UNIX
        self.fds: list[int] = []  # files handed over (SCM_RIGHTS) with the request being read

    def take_fds(self) -> list[int]:
        """The files handed over with the request just read; the caller closes the ones it does not keep."""
        fds, self.fds = self.fds, []
        return fds

    def close(self) -> None:
        close_fds(self.fds)

    def read_request(self, expected_auth: bytes | None) -> tuple[Head, bytes] | None:
        """The next request (head, body), or None when the client hung up between requests."""
        data = self.read_head()
        if data is None:
            return None
        head = parse_head(data)
        check_auth(head, expected_auth)  # the token first: nothing else of a stranger's request is read
        size = body_length(head)
        return head, (b"" if size is None else self.read_body(head, size))

    def recv(self) -> bytes:
        if self.unix:  # a client may hand over an open file with its request (kvtier snapshot --out)
            chunk, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, MAX_FDS)
            self.fds.extend(fds)
            if len(self.fds) > MAX_FDS:
                close_fds(self.fds)
                raise RequestError(400, "too many files handed over")
        else:
            chunk = self.sock.recv(65536)
        self.buffer += chunk
        return chunk

    def read_head(self) -> bytes | None:
        """The next head's bytes, or None when the client hung up between requests. A head that trickles
        in (slowloris) holds a connection slot: it must be whole within ``HEAD_TIMEOUT_S``."""
        started = None
        while True:
            split = split_head(self.buffer)
            if split is not None:
                head, self.buffer = split
                return head
            if self.buffer:
                started = started or time.monotonic()
                if time.monotonic() - started > HEAD_TIMEOUT_S:
                    raise RequestError(408, f"request head not complete within {HEAD_TIMEOUT_S:g} s")
            if not self.recv():
                if self.buffer.strip():
                    raise RequestError(400, "incomplete request")
                return None

    def read_body(self, head: Head, size: int) -> bytes:
        if size and head.expects_continue:
            self.sock.sendall(_CONTINUE)
        while len(self.buffer) < size:
            if not self.recv():
                raise RequestError(400, f"body shorter than its Content-Length ({len(self.buffer)} < {size})")
        body, self.buffer = self.buffer[:size], self.buffer[size:]
        return body
