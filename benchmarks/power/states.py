"""Crash states of a power cut, built from a recorded trace (ALICE's and SQLite's method).

A power cut at point ``upto`` of a trace keeps every operation a sync made durable before it, and
any subset of the others, torn down to 4 KiB sectors:

* a data operation (write, truncate, allocate, punch) on a file is durable once an ``fsync`` or
  ``fdatasync`` of that file followed it;
* a name operation (create, rename, unlink, mkdir) is durable once an ``fsync`` of its directory
  followed it (no filesystem ordering is assumed beyond these barriers).

``CrashState.mode`` says what happens to the operations no barrier covers:

* ``all``: every one was kept (the crash of a process: what SIGKILL leaves);
* ``synced``: every one was lost;
* ``subset``: each kept or lost on its own (seeded);
* ``torn``: as ``subset``, and each write kept sector by sector;
* ``reorder``: as ``subset``, the kept writes applied in a shuffled order (overlapping ones land
  in either order).

SQLite's files come from the catalog's commit points (``_commit_files``): the state holds those of
the last commit before ``upto`` (``synchronous=FULL``: a returned commit is durable) with part of
the next commit's log frames, the commit in flight, torn sector by sector.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.power.trace import DATA_OPS, NAME_OPS, Op, Recorder

__all__ = ["SECTOR", "MODES", "CrashState", "FileImage", "build", "materialize", "sample_states"]

SECTOR = 4096
MODES = ("all", "synced", "subset", "torn", "reorder")


@dataclass(frozen=True)
class CrashState:
    upto: int  # the operations issued before the power cut: trace.ops[:upto]
    mode: str
    seed: int
    lost_commits: int = 0  # catalog commits lost (0 to 2; only where no checkpoint came between)

    def label(self) -> str:
        return f"cut after op {self.upto}, {self.mode}, seed {self.seed}, {self.lost_commits} commits lost"


@dataclass
class FileImage:
    """A file's bytes and which of its sectors are allocated (a hole reads zeros and takes no space)."""

    data: bytearray = field(default_factory=bytearray)
    allocated: bytearray = field(default_factory=bytearray)  # one flag a sector

    @classmethod
    def of(cls, data: bytes) -> "FileImage":
        image = cls(bytearray(data))
        image.allocated = bytearray(b"\1" * _sectors(len(data)))
        return image

    def _size(self, size: int) -> None:
        if size < len(self.data):
            del self.data[size:]
        else:
            self.data.extend(bytes(size - len(self.data)))
        sectors = _sectors(size)
        if sectors < len(self.allocated):
            del self.allocated[sectors:]
        else:
            self.allocated.extend(bytes(sectors - len(self.allocated)))

    def _mark(self, start: int, end: int, flag: int, whole_only: bool = False) -> None:
        first = (start + SECTOR - 1) // SECTOR if whole_only else start // SECTOR
        last = end // SECTOR if whole_only else _sectors(end)
        for sector in range(first, min(last, len(self.allocated))):
            self.allocated[sector] = flag

    def apply(self, op: Op, pieces: list[tuple[int, int]] | None = None) -> None:
        """``pieces``: for a torn write, the (start, end) ranges of it that reached the disk."""
        if op.kind == "write":
            for start, end in pieces if pieces is not None else [(op.offset, op.offset + len(op.data))]:
                if end > len(self.data):
                    self._size(end)
                self.data[start:end] = op.data[start - op.offset : end - op.offset]
                self._mark(start, end, 1)
        elif op.kind == "trunc":
            self._size(op.length)
        elif op.kind == "alloc":
            if op.offset + op.length > len(self.data):
                self._size(op.offset + op.length)
            self._mark(op.offset, op.offset + op.length, 1)
        elif op.kind == "punch":
            end = min(op.offset + op.length, len(self.data))
            if end > op.offset:
                self.data[op.offset : end] = bytes(end - op.offset)
                self._mark(op.offset, end, 0, whole_only=True)


def _sectors(nbytes: int) -> int:
    return (nbytes + SECTOR - 1) // SECTOR


def _torn(op: Op, rng: random.Random) -> list[tuple[int, int]]:
    start, end = op.offset, op.offset + len(op.data)
    edges = [start, *range((start // SECTOR + 1) * SECTOR, end, SECTOR), end]
    return [(a, b) for a, b in zip(edges, edges[1:]) if rng.random() < 0.5]


@dataclass
class Image:
    """A directory as a crash left it: files by name, directories, and SQLite's files."""

    files: dict[str, FileImage]
    dirs: set[str]
    sqlite: dict[str, bytes]


def _barriers(ops: list[Op]) -> tuple[dict[int, int], dict[str, int]]:
    """Per file and per directory: the ops before this index are covered by a sync that returned
    (one covers what was recorded before it began, not what finished while it ran)."""
    last_fsync: dict[int, int] = {}
    last_dsync: dict[str, int] = {}
    for op in ops:
        if op.kind == "fsync":
            last_fsync[op.ino] = max(last_fsync.get(op.ino, 0), op.offset)
        elif op.kind == "dsync":
            last_dsync[op.path] = max(last_dsync.get(op.path, 0), op.offset)
    return last_fsync, last_dsync


def _commit_files(trace: Recorder, ops: list[Op], state: CrashState, rng: random.Random) -> tuple[int, dict]:
    """(index of the commit whose files the state holds, those files); (-1, {}) when none.

    With ``synchronous=FULL`` a returned commit is durable: the state holds the last one's files,
    and, unless every unsynced write was lost or kept, part of the next one's log frames (the
    commit in flight). With ``NORMAL`` the log is synced only at checkpoints: one or two returned
    commits may be lost too (where no checkpoint came between) and the last one's frames torn."""
    from kvtier.persist.catalog import SYNCHRONOUS

    commits = [i for i, op in enumerate(ops) if op.kind == "commit"]
    if not commits:
        return -1, {}
    chosen = len(commits) - 1
    if SYNCHRONOUS != "FULL":
        back = state.lost_commits if state.mode != "all" else 0
        while back and chosen > 0 and _same_db(ops[commits[chosen - 1]], ops[commits[-1]]):
            chosen, back = chosen - 1, back - 1
    files = dict(ops[commits[chosen]].files)
    if SYNCHRONOUS == "FULL":
        following = [op for op in trace.ops[len(ops) :] if op.kind == "commit"][:1]
        if following and state.mode in ("subset", "torn", "reorder"):
            files.update({name: _torn_tail(files.get(name, b""), data, rng)
                          for name, data in following[0].files.items() if name.endswith("-wal")})
    elif state.mode == "torn" and chosen > 0:
        before = ops[commits[chosen - 1]].files
        files.update({name: _torn_tail(before.get(name, b""), data, rng)
                      for name, data in files.items() if name.endswith("-wal")})
    return commits[chosen], files


def _same_db(a: Op, b: Op) -> bool:
    return {k: v for k, v in a.files.items() if not k.endswith("-wal")} == \
        {k: v for k, v in b.files.items() if not k.endswith("-wal")}


def _torn_tail(old: bytes, new: bytes, rng: random.Random) -> bytes:
    """``new``, its sectors past ``old``'s length (or differing from it) each kept or reverted."""
    out = bytearray(new)
    for start in range(0, len(new), SECTOR):
        piece = new[start : start + SECTOR]
        if old[start : start + SECTOR] != piece and rng.random() < 0.5:
            was = old[start : start + SECTOR]
            out[start : start + len(piece)] = was + bytes(len(piece) - len(was))
    cut = len(out)
    while cut > len(old) and not any(out[cut - SECTOR : cut]):  # lost appends leave no zeros behind
        cut -= SECTOR
    return bytes(out[: max(cut, len(old))])


def build(trace: Recorder, state: CrashState) -> Image:
    """The directory's image after a power cut at ``state``."""
    rng = random.Random(state.seed)
    ops = trace.ops[: state.upto]
    last_fsync, last_dsync = _barriers(ops)

    def kept(i: int, op: Op) -> bool:
        durable = last_fsync.get(op.ino, -1) > i if op.kind in DATA_OPS else last_dsync.get(op.parent, -1) > i
        if durable or state.mode == "all":
            return True
        return state.mode != "synced" and rng.random() < 0.5

    commit_at, sqlite = _commit_files(trace, ops, state, rng)
    names = dict(trace.initial_inos)
    dirs = set(trace.initial_dirs)
    inodes = {ino: FileImage.of(trace.initial[name]) for name, ino in trace.initial_inos.items()}
    late: list[tuple[Op, list | None]] = []  # kept writes no barrier covers (reorder mode shuffles them)
    for i, op in enumerate(ops):
        if op.kind in DATA_OPS:
            if not kept(i, op):
                continue
            durable = last_fsync.get(op.ino, -1) > i
            pieces = _torn(op, rng) if op.kind == "write" and not durable and state.mode == "torn" else None
            if not durable and state.mode == "reorder":
                late.append((op, pieces))
            else:
                inodes.setdefault(op.ino, FileImage()).apply(op, pieces)
        elif op.kind in NAME_OPS:
            if kept(i, op):
                _name_op(op, names, dirs, sqlite if i > commit_at else {})
            if op.kind == "create":
                inodes.setdefault(op.ino, FileImage())
    rng.shuffle(late)
    for op, pieces in late:
        inodes.setdefault(op.ino, FileImage()).apply(op, pieces)
    files = {name: inodes.setdefault(ino, FileImage()) for name, ino in names.items()
             if os.path.dirname(name) in dirs}
    sqlite = {name: data for name, data in sqlite.items() if os.path.dirname(name) in dirs and name not in files
              and (state.mode == "all" or _entry_synced(ops, name, last_dsync) or rng.random() < 0.5)}
    return Image(files, dirs, sqlite)


def _entry_synced(ops: list[Op], name: str, last_dsync: dict[str, int]) -> bool:
    """Whether a file SQLite made (seen first at a commit point) has its directory entry synced."""
    first = next((i for i, op in enumerate(ops) if op.kind == "commit" and op.files.get(name)), None)
    return first is not None and last_dsync.get(os.path.dirname(name), -1) > first


def _name_op(op: Op, names: dict[str, int], dirs: set[str], sqlite: dict[str, bytes]) -> None:
    if op.kind == "create":
        names[op.path] = op.ino
    elif op.kind == "mkdir":
        dirs.add(op.path)
    elif op.kind == "rename":
        if op.path in names:
            names[op.dst] = names.pop(op.path)
        elif op.path in sqlite:
            sqlite[op.dst] = sqlite.pop(op.path)
    elif op.kind == "unlink":
        prefix = op.path + os.sep
        for table in (names, sqlite):
            for name in [n for n in table if n == op.path or n.startswith(prefix)]:
                del table[name]
        for name in [d for d in dirs if d == op.path or d.startswith(prefix)]:
            dirs.discard(name)


def materialize(image: Image, root: Path) -> None:
    """Write ``image`` into the empty directory ``root`` (holes left as holes)."""
    for name in sorted(image.dirs, key=len):
        (root / name).mkdir(parents=True, exist_ok=True)
    for name, file in image.files.items():
        fd = os.open(root / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, len(file.data))
            sector = 0
            while sector < len(file.allocated):
                if not file.allocated[sector]:
                    sector += 1
                    continue
                end = sector
                while end < len(file.allocated) and file.allocated[end]:
                    end += 1
                os.pwrite(fd, file.data[sector * SECTOR : end * SECTOR], sector * SECTOR)
                sector = end
        finally:
            os.close(fd)
    for name, data in image.sqlite.items():
        if data:
            (root / name).write_bytes(data)


def sample_states(trace: Recorder, count: int, seed: int) -> list[CrashState]:
    """``count`` crash states of ``trace``: cut points spread over the whole run (every sync
    barrier and acknowledgement first, then at random), each mode in turn."""
    rng = random.Random(seed)
    ops = trace.ops
    marks = [i + 1 for i, op in enumerate(ops) if op.kind in ("fsync", "dsync", "ack", "commit")]
    points = sorted(set(marks))
    rng.shuffle(points)
    states = []
    for k in range(count):
        upto = points[k] if k < len(points) else rng.randint(1, len(ops))
        if k % 7 == 3:  # just before a barrier: the writes it was about to make durable are in flight
            upto = max(1, upto - 1)
        states.append(CrashState(upto, MODES[k % len(MODES)], seed * 1_000_003 + k, rng.choice((0, 0, 1, 2))))
    if ops:
        states[0] = CrashState(len(ops), "synced", seed)
    return states
