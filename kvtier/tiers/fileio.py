"""The one door kvtier's durable file IO goes through.

Every operation whose outcome kvtier promises to keep across a crash is issued here: the cold
tier's segments and journal, the shard lock and the drives manifest, the snapshot writer, the keys
file and the session catalog's own files (SQLite does its IO itself: the catalog reports its commit
points instead, ``commit_point``). Nothing else in ``kvtier.tiers``, ``kvtier.persist`` writes.

Two observers can be attached, both for tests and benchmarks, never set when serving:

* a **recorder** (``benchmarks.power.trace.Recorder``) that sees each operation with its file
  and range, and the points where kvtier acknowledges something as durable, so that crash states
  of a power cut can be built from the trace;
* a **slowdown** (``set_slowdown``): each data IO (read, write, sync) then takes ``factor`` times
  its own time, as on a failing drive, a noisy neighbour or a RAID rebuild.

When neither is set, each function is the ``os`` call it wraps plus one global read and test:
the write path's CPU time per GiB is the same (``python -m benchmarks faults --power`` measures it).

What "acknowledged" means, per thing kvtier keeps:
* a block on NVMe: when its ``write_batch`` returned its size, i.e. after its record's segment
  and then the journal entry naming it were ``fdatasync``-ed (group commit);
* a dropped block: no longer owed from the moment ``delete_many`` is called (marked then); a power
  cut may bring back one whose drop entry was not yet synced, and it is still exactly its key's
  bytes (keys name content);
* a snapshot: when ``SnapshotWriter.commit`` returned (file synced, renamed, directory synced);
* a session in the catalog: when its commit returned (SQLite in WAL mode with
  ``synchronous=FULL``: the log is synced at each commit); a dropped one from the moment the commit
  that drops it starts.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["open_file", "close", "pwritev", "pwrite", "append", "preadv", "fdatasync", "fsync", "fsync_dir",
           "allocate", "punch_hole", "ftruncate", "truncate", "replace", "unlink", "mkdir", "rmdir",
           "write_small_file", "commit_point", "acknowledge", "set_recorder", "set_slowdown", "recorder"]

_recorder: Any = None  # a benchmarks.power.trace.Recorder while one records (tests, benchmarks)
_slowdown: float = 1.0  # > 1: each data IO takes this many times its own time (injected slow disk)


def set_recorder(recorder: Any) -> Any:
    """Attach (or, with None, detach) the recorder; returns the previous one."""
    global _recorder
    previous, _recorder = _recorder, recorder
    return previous


def recorder() -> Any:
    return _recorder


def set_slowdown(factor: float) -> None:
    """Make every data IO (``preadv``, ``pwritev``, ``pwrite``, syncs) take ``factor`` times its
    time: 1 is a healthy disk. An injection, for the slow-disk benchmark."""
    global _slowdown
    _slowdown = max(1.0, float(factor))


def _io(call: Any, *args: Any) -> Any:
    """A data IO system call, slowed by the injected factor when one is set."""
    if _slowdown <= 1.0:
        return call(*args)
    started = time.perf_counter()
    result = call(*args)
    time.sleep((_slowdown - 1.0) * (time.perf_counter() - started))
    return result


# ---- opening and closing ------------------------------------------------------------------------
def open_file(path: str | os.PathLike, flags: int, mode: int = 0o600) -> int:
    rec = _recorder
    if rec is None:
        return os.open(path, flags, mode)
    created = bool(flags & os.O_CREAT) and not os.path.lexists(path)
    fd = os.open(path, flags, mode)
    rec.opened(fd, path, created, bool(flags & os.O_TRUNC))
    return fd


def close(fd: int) -> None:
    rec = _recorder
    if rec is not None:  # before the number is free: another thread's open may get it at once
        rec.closed(fd)
    os.close(fd)


# ---- data ---------------------------------------------------------------------------------------
def pwritev(fd: int, buffers: Sequence[Any], offset: int) -> int:
    written = _io(os.pwritev, fd, buffers, offset)
    rec = _recorder
    if rec is not None:
        rec.wrote(fd, offset, b"".join(bytes(b) for b in buffers)[:written])
    return written


def pwrite(fd: int, data: Any, offset: int) -> int:
    written = _io(os.pwrite, fd, data, offset)
    rec = _recorder
    if rec is not None:
        rec.wrote(fd, offset, bytes(data)[:written])
    return written


def append(fd: int, data: bytes) -> None:
    """All of ``data`` at the end of a file opened with ``O_APPEND``."""
    rec = _recorder
    offset = os.fstat(fd).st_size if rec is not None else 0
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    if rec is not None:
        rec.wrote(fd, offset, bytes(data))


def preadv(fd: int, buffers: Sequence[Any], offset: int) -> int:
    return _io(os.preadv, fd, buffers, offset)


def fdatasync(fd: int) -> None:
    rec = _recorder
    began = rec.sync_begins() if rec is not None else 0  # a sync covers what was written before it began
    _io(os.fdatasync, fd)
    if rec is not None:
        rec.synced(fd, began)


def fsync(fd: int) -> None:
    rec = _recorder
    began = rec.sync_begins() if rec is not None else 0
    os.fsync(fd)
    if rec is not None:
        rec.synced(fd, began)


def ftruncate(fd: int, size: int) -> None:
    os.ftruncate(fd, size)
    rec = _recorder
    if rec is not None:
        rec.truncated(fd, None, size)


def truncate(path: str | os.PathLike, size: int) -> None:
    os.truncate(path, size)
    rec = _recorder
    if rec is not None:
        rec.truncated(None, path, size)


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = None


def _fallocate():
    """libc's ``fallocate(2)`` (Python's ``os.posix_fallocate`` cannot punch, and emulates with
    writes where the filesystem lacks it)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return _libc.fallocate


def allocate(fd: int, offset: int, length: int) -> bool:
    """Reserve ``length`` bytes at ``offset`` (the file grows to cover them; they read as zeros), so
    the direct writes that follow land inside the file and run in parallel. False when the
    filesystem cannot (writes then extend the file themselves); raises ENOSPC and other errors."""
    if length <= 0:
        return True
    if _fallocate()(fd, 0, offset, length) == 0:
        rec = _recorder
        if rec is not None:
            rec.allocated(fd, offset, length)
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, os.strerror(err))


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free ``length`` bytes at ``offset`` of an open file (they read back as zeros; the file keeps
    its size). False when the filesystem cannot (the caller compacts instead); raises other errors."""
    if length <= 0:
        return True
    if _fallocate()(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        rec = _recorder
        if rec is not None:
            rec.punched(fd, offset, length)
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


# ---- names --------------------------------------------------------------------------------------
def replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    os.replace(src, dst)
    rec = _recorder
    if rec is not None:
        rec.renamed(src, dst)


def unlink(path: str | os.PathLike, missing_ok: bool = True) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise
        return
    rec = _recorder
    if rec is not None:
        rec.unlinked(path)


def mkdir(path: str | os.PathLike, mode: int = 0o777) -> None:
    """``path`` and its missing parents (an existing directory is fine), each made durable in its
    parent where the parent can be opened to sync it. ``mode``: the last directory's (parents get
    the default, as ``Path.mkdir(parents=True)`` gives them)."""
    path = Path(path)
    if path.is_dir():
        return
    if not path.parent.is_dir():
        mkdir(path.parent)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if not path.is_dir():
            raise
        return
    rec = _recorder
    if rec is not None:
        rec.made_dir(path)
    try:
        fsync_dir(path.parent)  # the new entry survives a power cut (what is made inside it hangs on it)
    except PermissionError:  # a parent we may enter but not read (0711): its entries are its owner's
        pass


def rmdir(path: str | os.PathLike) -> None:
    os.rmdir(path)
    rec = _recorder
    if rec is not None:
        rec.unlinked(path)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a directory's entries (a file created, renamed or removed in it) durable. Filesystems
    that cannot fsync a directory (EINVAL, ENOTSUP) make its entries durable on their own."""
    rec = _recorder
    began = rec.sync_begins() if rec is not None else 0
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
    if rec is not None:
        rec.synced_dir(directory, began)


def write_small_file(path: str | os.PathLike, data: bytes, exclusive: bool = False, durable: bool = True,
                     mode: int = 0o600) -> None:
    """A small file written whole (a lock's pid, a manifest, a key): with ``durable``, synced and
    its directory entry too. ``exclusive``: FileExistsError when it exists."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = open_file(path, flags, mode)
    try:
        pwrite(fd, data, 0)
        if durable:
            fsync(fd)
    finally:
        close(fd)
    if durable:
        fsync_dir(Path(path).parent)


# ---- what kvtier promises ------------------------------------------------------------------------
def acknowledge(what: str, *items: Any) -> None:
    """kvtier has told its caller that ``items`` (of kind ``what``) are durable: a recorder marks
    the point in its trace (a crash state after it must keep them)."""
    rec = _recorder
    if rec is not None:
        rec.acknowledged(what, items)


def commit_point(*paths: str | os.PathLike) -> None:
    """A library that does its own IO (SQLite) has just committed: a recorder keeps the files it
    left behind at this point."""
    rec = _recorder
    if rec is not None:
        rec.commit_point([Path(p) for p in paths])
