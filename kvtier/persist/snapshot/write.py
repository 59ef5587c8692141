"""Writing a snapshot: staged, hashed while cache-hot, O_DIRECT where allowed, renamed into place."""
from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import secrets
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import xxhash

from kvtier.layout import ModelFingerprint
from kvtier.persist.snapshot.format import (
    _NO_SPACE,
    _PIECE,
    _PREAMBLE,
    _U64,
    _WIDEST_XXH3,
    FORMAT_VERSION,
    IO_CHUNK,
    IO_DEPTH,
    MAGIC,
    MAX_BLOCKS,
    MAX_HEADER_BYTES,
    PREAMBLE_BYTES,
    SnapshotInfo,
    _bytes_view,
    _direct_ok,
    _fail,
    _give_buffers,
    _take_buffer,
)
from kvtier.persist.snapshot.read import _info_from
from kvtier.tiers import fileio
from kvtier.tiers.dram import PAGE, round_up
from kvtier.tiers.records import checksum


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    written = fileio.pwrite(fd, view, offset)
    if written != len(view):
        raise OSError(errno.ENOSPC, f"short write ({written} of {len(view)} bytes)")


class SnapshotWriter:
    """Writes one snapshot; blocks go in order through :meth:`write_block`, then :meth:`commit`.

    As a context manager a clean exit commits and an exception aborts. An error raised by
    ``write_block`` or ``commit`` aborts too: the temp file is removed, the final path untouched.
    """

    def __init__(self, path: str | os.PathLike[str], fingerprint: ModelFingerprint, session_id: str,
                 namespace: bytes, codec: str, num_tokens: int, token_ids: Sequence[int] = (), *,
                 block_nbytes: Sequence[int], keys: Sequence[bytes], meta: dict | None = None,
                 sign_key: bytes | None = None, in_place: bool = False) -> None:
        self.path = Path(path)
        self._sign_key = sign_key
        # in_place: ``path`` is a file the caller made and handed over (``/proc/<pid>/fd/<n>``): written
        # as it is, no temp file and no rename (the caller renames it into place when the job is done)
        self._in_place = in_place
        self._nbytes, self._keys = [int(n) for n in block_nbytes], [bytes(k) for k in keys]
        if len(self._nbytes) != len(self._keys) or len(self._keys) > MAX_BLOCKS:
            raise _fail(path, f"{len(self._keys)} keys, {len(self._nbytes)} block sizes (max {MAX_BLOCKS})")
        token_ids = [int(t) for t in token_ids]
        if min([*self._nbytes, *token_ids, num_tokens, 0]) < 0 or max([*token_ids, num_tokens, 0]) >= _U64:
            raise _fail(path, "block sizes, num_tokens and token ids must be non-negative 64-bit integers")
        self._doc = {"fingerprint": fingerprint.to_dict(), "session_id": str(session_id),
                     "namespace": bytes(namespace).hex(), "codec": str(codec), "num_tokens": int(num_tokens),
                     "token_ids": token_ids, "created": time.time(), "meta": dict(meta or {})}
        self._payload_offset = PAGE
        while (need := round_up(PREAMBLE_BYTES + len(self._render([_WIDEST_XXH3] * len(self._keys))))) \
                > self._payload_offset:  # grow the header area until the widest header fits
            self._payload_offset = need
        self._header_len = self._payload_offset - PREAMBLE_BYTES
        if self._header_len > MAX_HEADER_BYTES:
            raise _fail(path, f"header would be {self._header_len} bytes (max {MAX_HEADER_BYTES})")
        self._digests: list[int] = []
        self._pending: list[Future] = []
        self._closed = False
        self._open()

    def _render(self, digests: Sequence[int]) -> bytes:
        offsets, pos = [], self._payload_offset
        for n in self._nbytes:
            offsets.append(pos)
            pos += round_up(n)
        self._file_len = pos
        blocks = [{"key": k.hex(), "offset": o, "nbytes": n, "xxh3": d}
                  for k, o, n, d in zip(self._keys, offsets, self._nbytes, digests)]
        try:
            text = json.dumps({**self._doc, "blocks": blocks}, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise _fail(self.path, f"header is not JSON-serialisable: {exc}",
                        "pass only JSON values (str, int, float, list, dict) in meta") from None
        return text.encode()

    def _open(self) -> None:
        directory = self.path.parent
        if self._in_place:
            self._tmp = self.path
            try:
                self._fd: int | None = fileio.open_file(self.path, os.O_WRONLY | os.O_NONBLOCK)
                if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                    fileio.close(self._fd)
                    raise _fail(self.path, "the file handed over is not a regular file")
                os.set_blocking(self._fd, True)
                fileio.ftruncate(self._fd, 0)
            except OSError as exc:
                raise _fail(self.path, f"cannot write the file handed over: {exc.strerror}") from None
            self._start_buffers()
            return
        if self.path.is_dir():
            raise _fail(self.path, "is a directory", "give a file name for the snapshot")
        self._tmp = directory / f".{self.path.name}.tmp-{secrets.token_hex(4)}"
        try:
            direct = os.O_DIRECT if _direct_ok(directory) else 0
            self._fd = fileio.open_file(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct, 0o600)
        except OSError as exc:
            raise _fail(self.path, f"cannot create a file in {directory}: {exc.strerror}",
                        "check that the directory exists and is writable") from None
        self._start_buffers()

    def _start_buffers(self) -> None:
        self._bufs = [_take_buffer(IO_CHUNK) for _ in range(IO_DEPTH + 1)]
        self._views = [memoryview(buf)[:IO_CHUNK] for buf in self._bufs]
        self._cur, self._fill, self._stage_start = 0, 0, 0
        self._pool = ThreadPoolExecutor(max_workers=IO_DEPTH, thread_name_prefix="kvtier-snapshot")
        self._put(None, self._payload_offset)  # header area: zeros until commit

    def __enter__(self) -> "SnapshotWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.commit()

    def _put(self, data: memoryview | None, nbytes: int, hasher: Any = None) -> None:
        """Append ``data`` (or ``nbytes`` zeros) to the staged stream, hashing the staged copy."""
        pos = 0
        while pos < nbytes:
            buf = self._views[self._cur]
            n = min(nbytes - pos, len(buf) - self._fill, _PIECE)
            piece = buf[self._fill : self._fill + n]
            piece[:] = bytes(n) if data is None else data[pos : pos + n]
            if hasher is not None:
                hasher.update(piece)
            self._fill += n
            pos += n
            if self._fill == len(buf):
                self._flush()

    def _flush(self) -> None:
        if self._fill:
            if len(self._pending) >= IO_DEPTH:  # the next buffer's earlier write must be done
                self._pending.pop(0).result()
            view = self._views[self._cur][: self._fill]
            self._pending.append(self._pool.submit(_pwrite_all, self._fd, view, self._stage_start))
            self._stage_start, self._fill = self._stage_start + self._fill, 0
            self._cur = (self._cur + 1) % len(self._views)

    def _wait(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def _guarded(self, action: Callable[[], Any]) -> Any:
        if self._closed:
            raise _fail(self.path, "the writer is already closed")
        try:
            return action()
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
                raise _fail(self.path, "no space left on the device",
                            "free disk space and take the snapshot again; nothing was written") from exc
            if isinstance(exc, OSError):
                raise _fail(self.path, f"write failed: {exc.strerror or exc}") from exc
            raise

    def write_block(self, index: int, payload: Any) -> None:
        """Append block ``index`` (bytes-like, numpy array or torch tensor); blocks go in order."""
        self._guarded(lambda: self._write_block(index, payload))

    def _write_block(self, index: int, payload: Any) -> None:
        if index != len(self._digests) or index >= len(self._keys):
            raise _fail(self.path, f"block {index} written out of order (expected {len(self._digests)})")
        data, nbytes = _bytes_view(payload), self._nbytes[index]
        if len(data) != nbytes:
            raise _fail(self.path, f"block {index} has {len(data)} bytes, declared {nbytes}")
        hasher = xxhash.xxh3_64()
        self._put(data, nbytes, hasher)
        self._put(None, round_up(nbytes) - nbytes)
        self._digests.append(hasher.intdigest())

    def commit(self) -> SnapshotInfo:
        """Write the header, make the file durable and move it to its final name."""
        return self._guarded(self._commit)

    def _commit(self) -> SnapshotInfo:
        if len(self._digests) != len(self._keys):
            raise _fail(self.path, f"only {len(self._digests)} of {len(self._keys)} blocks were written")
        self._flush()
        self._wait()
        header = self._render(self._digests).ljust(self._header_len, b" ")
        area = mmap.mmap(-1, self._payload_offset)
        area[: _PREAMBLE.size] = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, self._header_len, checksum(header),
                                                self._payload_offset, self._file_len)
        if self._sign_key:  # in the preamble's spare bytes: readers that do not know it ignore them
            from kvtier.persist.trust import SIGNATURE_BYTES, sign

            area[_PREAMBLE.size:_PREAMBLE.size + SIGNATURE_BYTES] = sign(self._sign_key, header)
        area[PREAMBLE_BYTES:] = header
        _pwrite_all(self._fd, memoryview(area), 0)
        fileio.fdatasync(self._fd)
        fileio.close(self._fd)
        self._fd = None
        self._release()
        if not self._in_place:
            fileio.replace(self._tmp, self.path)
            fileio.fsync_dir(self.path.parent)
            fileio.acknowledge("snapshot", self.path)
        return _info_from(os.fspath(self.path), json.loads(header), self._header_len, self._payload_offset,
                          self._file_len)

    def abort(self) -> None:
        """Drop the snapshot: remove the temp file; the final path is left untouched."""
        if self._closed:
            return
        with contextlib.suppress(BaseException):
            self._wait()
        if self._fd is not None:
            fileio.close(self._fd)
            self._fd = None
        if not self._in_place:  # a handed-over file is its owner's to remove
            fileio.unlink(self._tmp)
        self._release()

    def _release(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        self._views = []
        _give_buffers(self._bufs)


def write_snapshot(path: str | os.PathLike[str], fingerprint: ModelFingerprint, session_id: str,
                   namespace: bytes, codec: str, num_tokens: int, keys: Sequence[bytes],
                   payloads: Iterable[Any], token_ids: Sequence[int] = (), meta: dict | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   block_nbytes: Sequence[int] | None = None, sign_key: bytes | None = None,
                   in_place: bool = False) -> SnapshotInfo:
    """Write a snapshot of ``payloads`` (in key order); calls ``progress(done_bytes, total_bytes)``.

    Without ``block_nbytes`` the payloads are listed first to learn their sizes; pass it to stream.
    """
    if block_nbytes is None:
        payloads = list(payloads)
        block_nbytes = [len(_bytes_view(p)) for p in payloads]
    total, done, end = sum(block_nbytes), 0, object()
    with SnapshotWriter(path, fingerprint, session_id, namespace, codec, num_tokens, token_ids,
                        block_nbytes=block_nbytes, keys=keys, meta=meta, sign_key=sign_key,
                        in_place=in_place) as writer:
        source = iter(payloads)
        for index in range(len(keys)):
            payload = next(source, end)
            if payload is end:
                raise _fail(path, f"only {index} payloads for {len(keys)} keys")
            writer.write_block(index, payload)
            done += block_nbytes[index]
            if progress is not None:
                progress(done, total)
        if next(source, end) is not end:
            raise _fail(path, f"more payloads than the {len(keys)} keys")
        return writer.commit()


