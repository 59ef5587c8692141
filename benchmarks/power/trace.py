"""The recorder: kvtier's own file operations under one directory, in the order they completed.

Attached to ``kvtier.tiers.fileio`` (the one door of kvtier's durable IO), it keeps each operation
with its file and range, and the data of each write, as an ``Op`` in a list: the trace a crash
state is built from (``benchmarks.power.states``). Files are followed by identity (an inode
number of the recorder's own), not by name: a write lands on the file an ``fd`` was opened on,
whatever renames happen later, as in the kernel.

Besides the operations, the trace holds:
* ``ack`` marks: the points where kvtier told its caller something was durable
  (``fileio.acknowledge``: blocks written or dropped, a snapshot, sessions committed);
* ``commit`` marks: SQLite does its IO itself, so at each of the catalog's commits the files it
  left behind (database and write-ahead log) are copied into the trace.

Paths outside ``root`` are ignored. An operation is recorded after its system call returned, from
whichever thread issued it: a write is always recorded before a sync that waited for it.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.tiers import fileio

__all__ = ["Op", "Recorder", "DATA_OPS", "NAME_OPS"]

DATA_OPS = frozenset({"write", "trunc", "alloc", "punch"})  # change a file's bytes (durable on its fsync)
NAME_OPS = frozenset({"create", "rename", "unlink", "mkdir"})  # change a directory (durable on its fsync)


@dataclass(slots=True)
class Op:
    kind: str  # DATA_OPS | NAME_OPS | fsync (a file) | dsync (a directory) | ack | commit
    ino: int = 0  # the file of a data op, a create or an fsync
    path: str = ""  # relative to the root: a name op's (source) name, a dsync's directory
    dst: str = ""  # a rename's target
    offset: int = 0  # a write's; for fsync and dsync, where the sync began: it covers the ops before it
    length: int = 0  # alloc, punch: the range; trunc: the new size
    data: bytes = b""  # a write's bytes
    what: str = ""  # ack: the kind of thing acknowledged
    items: tuple = ()  # ack: the things
    files: dict[str, bytes] = field(default_factory=dict)  # commit: the library's files at this point

    @property
    def parent(self) -> str:
        """The directory a name op changes (a rename: its target's; kvtier renames within one)."""
        return os.path.dirname(self.dst or self.path)


class Recorder:
    """Records kvtier's file operations under ``root`` while attached (``with Recorder(root):``).

    ``initial``: what the directory held when recording began, taken as durable: file name ->
    bytes, and its directories."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.ops: list[Op] = []
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}
        self._names: dict[str, int] = {}
        self._next_ino = 1
        self.initial: dict[str, bytes] = {}
        self.initial_inos: dict[str, int] = {}
        self.initial_dirs: set[str] = {""}
        self._previous: Any = None

    # ---- attaching -------------------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        for path in sorted(self.root.rglob("*")) if self.root.is_dir() else ():
            rel = str(path.relative_to(self.root))
            if path.is_dir():
                self.initial_dirs.add(rel)
            elif path.is_file():
                self.initial[rel] = path.read_bytes()
                self.initial_inos[rel] = self._names[rel] = self._new_ino()
        self._previous = fileio.set_recorder(self)
        return self

    def __exit__(self, *exc: object) -> None:
        fileio.set_recorder(self._previous)

    def _new_ino(self) -> int:
        ino, self._next_ino = self._next_ino, self._next_ino + 1
        return ino

    def _rel(self, path: str | os.PathLike) -> str | None:
        absolute = Path(os.path.abspath(path))
        try:
            rel = absolute.relative_to(self.root)
        except ValueError:
            try:
                rel = absolute.resolve().relative_to(self.root)
            except ValueError:
                return None
        text = str(rel)
        return "" if text == "." else text

    def _add(self, op: Op) -> None:
        self.ops.append(op)

    # ---- what fileio reports -----------------------------------------------------------------
    def opened(self, fd: int, path: str | os.PathLike, created: bool, truncated: bool) -> None:
        rel = self._rel(path)
        if rel is None:
            return
        with self._lock:
            if created or rel not in self._names:
                ino = self._names[rel] = self._new_ino()
                self._add(Op("create", ino=ino, path=rel))
            ino = self._names[rel]
            self._fds[fd] = ino
            if truncated and not created:
                self._add(Op("trunc", ino=ino, length=0))

    def closed(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)

    def _file_op(self, fd: int, op: Op) -> None:
        with self._lock:
            ino = self._fds.get(fd)
            if ino is not None:
                op.ino = ino
                self._add(op)

    def wrote(self, fd: int, offset: int, data: bytes) -> None:
        self._file_op(fd, Op("write", offset=offset, data=data))

    def sync_begins(self) -> int:
        """Where a sync starts in the trace: it covers only what was recorded before this point
        (a write another thread finishes while the sync runs may or may not be covered)."""
        with self._lock:
            return len(self.ops)

    def synced(self, fd: int, began: int) -> None:
        self._file_op(fd, Op("fsync", offset=began))

    def allocated(self, fd: int, offset: int, length: int) -> None:
        self._file_op(fd, Op("alloc", offset=offset, length=length))

    def punched(self, fd: int, offset: int, length: int) -> None:
        self._file_op(fd, Op("punch", offset=offset, length=length))

    def truncated(self, fd: int | None, path: str | os.PathLike | None, size: int) -> None:
        if fd is not None:
            self._file_op(fd, Op("trunc", length=size))
            return
        rel = self._rel(path)
        with self._lock:
            if rel is not None and rel in self._names:
                self._add(Op("trunc", ino=self._names[rel], length=size))

    def renamed(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        rel_src, rel_dst = self._rel(src), self._rel(dst)
        if rel_src is None or rel_dst is None:
            return
        with self._lock:
            if rel_src in self._names:
                self._names[rel_dst] = self._names.pop(rel_src)
            self._add(Op("rename", path=rel_src, dst=rel_dst))

    def unlinked(self, path: str | os.PathLike) -> None:
        rel = self._rel(path)
        if rel is None:
            return
        with self._lock:
            self._names.pop(rel, None)
            self._add(Op("unlink", path=rel))

    def made_dir(self, path: str | os.PathLike) -> None:
        rel = self._rel(path)
        if rel is not None:
            with self._lock:
                self._add(Op("mkdir", path=rel))

    def synced_dir(self, path: str | os.PathLike, began: int) -> None:
        rel = self._rel(path)
        if rel is not None:
            with self._lock:
                self._add(Op("dsync", path=rel, offset=began))

    def acknowledged(self, what: str, items: tuple) -> None:
        with self._lock:
            self._add(Op("ack", what=what, items=tuple(items)))

    def commit_point(self, paths: list[Path]) -> None:
        files = {}
        for path in paths:
            rel = self._rel(path)
            if rel is not None:
                try:
                    files[rel] = path.read_bytes()
                except FileNotFoundError:
                    files[rel] = b""
        with self._lock:
            self._add(Op("commit", files=files))

    # ---- outside events ----------------------------------------------------------------------
    def wiped(self, path: str | os.PathLike) -> None:
        """Someone removed ``path`` and everything under it (an operator's ``rm -rf``; its
        directory made durable at once, as the test does it with a sync)."""
        rel = self._rel(path)
        if rel is None:
            return
        with self._lock:
            self._add(Op("ack", what="wiped"))  # nothing written before it is owed any more
            prefix = rel + os.sep
            for name in [n for n in self._names if n == rel or n.startswith(prefix)]:
                del self._names[name]
            self._add(Op("unlink", path=rel))
            self._add(Op("dsync", path=os.path.dirname(rel), offset=len(self.ops)))

    def acks(self, upto: int | None = None) -> list[Op]:
        return [op for op in self.ops[:upto] if op.kind == "ack"]
