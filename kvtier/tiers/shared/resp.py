"""The wire under the shared tier: redis-py, except where it would copy a block.

redis-py with hiredis packs every command into one buffer (a copy of each value) and turns every
reply into a ``bytes`` object (another). For multi-megabyte KV blocks both show: ``ZeroCopyPacker``
sends a value given as a tuple of buffers (header, a view of a DRAM slot) as one RESP bulk string,
large parts straight to the socket; ``get_into`` reads the replies of pipelined GETs itself, each
payload ``recv_into`` its destination. Everything else (connecting, auth, TLS, clusters, errors) is
redis-py's.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["ZeroCopyPacker", "copy_into", "get_into", "packed_connection", "pipeline_get"]


class ZeroCopyPacker:
    """redis-py's command packer (RESP), except that a value given as a tuple of buffers is sent as
    one bulk string made of them, and large buffers go to the socket as they are: a block's header
    and its payload (a view of a DRAM slot) are never joined or copied (redis-py with hiredis copies
    every value into one packed command)."""

    LARGE = 16 << 10

    @staticmethod
    def _encode(arg) -> bytes | memoryview:
        if isinstance(arg, (bytes, memoryview)):
            return arg
        if isinstance(arg, bytearray):
            return bytes(arg)
        if isinstance(arg, str):
            return arg.encode()
        if isinstance(arg, bool):
            raise TypeError("booleans are not redis values")
        if isinstance(arg, (int, float)):
            return repr(arg).encode()
        raise TypeError(f"cannot send {type(arg).__name__} to redis")

    def pack(self, *args) -> list:
        if isinstance(args[0], str):  # 'CONFIG GET' style names: separate words
            args = tuple(args[0].encode().split()) + args[1:]
        out: list = []
        small: list = [b"*%d\r\n" % len(args)]
        for arg in args:
            parts = [self._encode(p) for p in arg] if isinstance(arg, tuple) else [self._encode(arg)]
            small.append(b"$%d\r\n" % sum(len(p) for p in parts))
            for part in parts:
                if len(part) >= self.LARGE:
                    out.append(b"".join(small))
                    out.append(part if isinstance(part, memoryview) else memoryview(part))
                    small = []
                else:
                    small.append(part)
            small.append(b"\r\n")
        out.append(b"".join(small))
        return out


def packed_connection(url: str):
    """A redis-py connection class (TCP or TLS) that packs with ``ZeroCopyPacker`` (cluster clients
    take a class, not packer arguments)."""
    from redis.connection import Connection, SSLConnection

    base = SSLConnection if url.startswith("rediss://") else Connection

    class Packed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("command_packer", ZeroCopyPacker())
            super().__init__(*args, **kwargs)

    return Packed


def copy_into(values: Sequence[bytes | None], targets: Sequence[memoryview], prefix: int) -> list:
    """``get_into``'s answer from values already read (a cluster's pipeline)."""
    out: list = []
    for value, target in zip(values, targets):
        if value is None:
            out.append(None)
            continue
        n = min(max(len(value) - prefix, 0), len(target))
        target[:n] = memoryview(value)[prefix : prefix + n]
        out.append((value[:prefix], len(value)))
    return out


class _Replies:
    """Reads RESP2 replies of pipelined GETs from a socket, bulk values straight into buffers."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the shared store closed the connection")
        self.buf += chunk

    def line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[: end + 2]
                return line
            if len(self.buf) > 1 << 16:
                raise ConnectionError("the shared store sent a reply line over 64 KiB")
            self._fill()

    def into(self, view: memoryview) -> None:
        """Exactly ``len(view)`` bytes into ``view``: what is buffered first, then from the socket."""
        have = min(len(self.buf), len(view))
        if have:
            view[:have] = self.buf[:have]
            del self.buf[:have]
        while have < len(view):
            got = self.sock.recv_into(view[have:])
            if not got:
                raise ConnectionError("the shared store closed the connection")
            have += got

    def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            step = min(n, len(scratch))
            self.into(scratch[:step])
            n -= step


def get_into(client, names: Sequence[bytes], targets: Sequence[memoryview], prefix: int) -> list:
    """Pipelined GETs on one connection of a standalone store, each value's first ``prefix`` bytes
    (header and signature) into a small buffer and its payload straight from the socket into its
    target (no bytes object, no copy). Returns per name None (missing) or (first bytes, value
    length). Any fault leaves the connection closed, never half-read."""
    import redis

    pool = client.connection_pool
    conn = pool.get_connection()  # (redis-py: checks it is healthy and connects it)
    try:
        conn.send_packed_command(conn.pack_commands([("GET", name) for name in names]))
        replies = _Replies(conn._sock)
        out: list = []
        for target in targets:
            head = replies.line()
            if head.startswith(b"-"):  # e.g. WRONGTYPE: something else under our key: refused, not served
                out.append((b"", -1))
                continue
            if not head.startswith((b"$", b"_")):
                raise redis.ConnectionError(f"unexpected reply to GET: {head[:40]!r}")
            if head == b"_":  # RESP3's null, should the server speak it anyway
                out.append(None)
                continue
            total = int(head[1:])
            if total < 0:
                out.append(None)
                continue
            head_bytes = bytearray(min(total, prefix))
            replies.into(memoryview(head_bytes))
            body = total - len(head_bytes)
            room = min(body, len(target))
            replies.into(target[:room])
            replies.skip(body - room)
            replies.into(memoryview(bytearray(2)))  # CRLF
            out.append((bytes(head_bytes), total))
        if replies.buf:
            raise redis.ConnectionError("the shared store sent more than was asked")
        return out
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def pipeline_get(client, names: Sequence[bytes]) -> list:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    return pipe.execute()
