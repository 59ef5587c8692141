"""What the admin API works on: the engine's manager, its lock, and a way to run jobs (``Ops``), the
jobs it started (``JobRecord``), its errors (``ApiError``) and where it may read and write snapshot
files (``resolve_snapshot_path``). The HTTP server (``server.py``) and the routes (``api.py``) both
build on this module; neither needs the other's insides.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["API_VERSION", "ApiError", "JobRecord", "LINK_KINDS", "Ops", "SNAPSHOT_SUFFIX", "resolve_snapshot_path"]

API_VERSION = "v1"
SNAPSHOT_SUFFIX = ".kvsnap"
LINK_KINDS = ("store", "load", "demote", "flush", "promote", "snapshot", "restore", "fetch")


class ApiError(Exception):
    def __init__(self, status: int, message: str, hint: str | None = None):
        super().__init__(message)
        self.status, self.message, self.hint = status, message, hint


@dataclass
class JobRecord:
    job_id: int
    kind: str
    session_id: str | None
    state: str = "queued"  # queued -> running -> done | failed
    created: float = field(default_factory=time.time)
    finished: float | None = None
    blocks: int = 0
    bytes: int = 0
    error: str | None = None
    seconds: float | None = None
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"id": self.job_id, "kind": self.kind, "session_id": self.session_id, "state": self.state,
                "progress": 1.0 if self.state in ("done", "failed") else 0.0, "blocks": self.blocks,
                "bytes": self.bytes, "created": self.created, "finished": self.finished,
                "seconds": self.seconds, "error": self.error, **self.detail}


class Ops:
    """What the server needs from the engine: the manager, its lock, and a way to run jobs."""

    def __init__(self, manager, lock: threading.RLock, enqueue: Callable, wake: Callable[[], None] = lambda: None,
                 snapshot_dir: str | os.PathLike | None = None, info: dict | None = None,
                 hbm: Callable[[], dict] | None = None, cost=None, shared=None):
        self.manager = manager
        self.lock = lock
        self.enqueue = enqueue
        self.wake = wake
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir else None
        if self.snapshot_dir is not None:  # what a killed snapshot writer left behind
            from kvtier.persist.snapshot import remove_stale_temp_files

            remove_stale_temp_files(self.snapshot_dir)
        self.info = dict(info or {})
        self.started = time.time()
        self.jobs: dict[int, JobRecord] = {}
        self.busy: dict[str, int] = {}  # session -> job in flight
        self.latency: dict[str, list[float]] = {}  # job kind -> seconds (recent)
        self.cost = cost  # a kvtier.plan.costmodel.CostModel (the connector's), or None
        self.shared = shared  # the shared tier's scheduler side (plugins/vllm/shared.SharedLookups), or None
        self.held_fds: dict[int, int] = {}  # job -> a file a client handed over, open until the job ends
        self.hbm = hbm or (lambda: {"used_bytes": None, "blocks": None, "capacity_bytes": None})
        # notified (under the lock) whenever job results were applied: a long poll waits on it
        self.changed = threading.Condition(lock)
        self.waiting = 0  # requests in wait_for now

    def applied(self) -> None:
        """Results were applied to the manager (call under the lock): wake the waiting requests."""
        self.changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until ``predicate()`` (read under the lock) holds or ``timeout`` passes; whether it holds."""
        with self.changed:
            self.waiting += 1
            self.changed.notify_all()  # whoever waits for a waiter (a test) sees this one
            try:
                return self.changed.wait_for(predicate, timeout)
            finally:
                self.waiting -= 1

    def link_bytes(self) -> dict[str, int]:
        """Bytes moved per kind of move since start (the manager's counters, applied job by job)."""
        counters = self.manager.telemetry.counters
        return {kind: counters.get(f"bytes_{kind}", 0) for kind in LINK_KINDS}

    # ---- job bookkeeping (called by the scheduler half, under the lock) -----------------------
    def shipped(self, job_ids) -> None:
        for job_id in job_ids:
            record = self.jobs.get(job_id)
            if record is not None and record.state == "queued":
                record.state = "running"

    def finished(self, result) -> None:
        self.applied()  # any result may change what a waiter waits for, a job with no record too
        held = self.held_fds.pop(result.job_id, None)
        if held is not None:
            os.close(held)
        record = self.jobs.get(result.job_id)
        if record is None:
            return
        record.state = "done" if result.ok else "failed"
        record.error = result.error
        record.seconds = result.seconds
        record.bytes = result.bytes_moved
        record.finished = time.time()
        if result.path is not None:
            record.detail["path"] = result.path
        self.latency.setdefault(record.kind, []).append(result.seconds)
        del self.latency[record.kind][:-1000]
        if record.session_id and self.busy.get(record.session_id) == record.job_id:
            del self.busy[record.session_id]
        self._trim()

    def _trim(self) -> None:
        if len(self.jobs) > 1000:
            for job_id in sorted(self.jobs)[: len(self.jobs) - 1000]:
                if self.jobs[job_id].state in ("done", "failed"):
                    del self.jobs[job_id]

    def _submit(self, kind: str, session_id: str | None, job) -> JobRecord:
        """Record (and enqueue) a planned job; ``job`` None means nothing had to move: done at once."""
        if job is None:
            job_id = self.manager.jobbook.new_job_id()
            record = JobRecord(job_id, kind, session_id, state="done", finished=time.time(), seconds=0.0)
        else:
            record = JobRecord(job.job_id, kind, session_id, blocks=len(job.moves) + len(job.drops))
            if session_id:
                self.busy[session_id] = job.job_id
            self.enqueue(job)
        self.jobs[record.job_id] = record
        return record

    def _check_free(self, session_id: str) -> None:
        running = self.busy.get(session_id)
        if running is not None:
            record = self.jobs[running]
            raise ApiError(409, f"session {session_id} has job {running} in progress ({record.kind})",
                           hint=f"wait for it: kvtier jobs {running}, then retry")


def resolve_snapshot_path(ops: Ops, given: Any, session_id: str) -> Path:
    """Where a snapshot named by a client goes or comes from: always inside the server's snapshot
    directory. A relative name is taken there; an absolute path only if it resolves there (its
    directories' symlinks followed, then checked); a symlink or special file at the end is refused
    without being opened. Anywhere else, the CLI opens the file itself and hands it over the Unix
    socket (``{"fd": 0}``), so the server touches only what the caller could."""
    import stat as stat_mod

    outside = ("name a file in the snapshot directory, or let the CLI hand the file over: "
               "`kvtier snapshot S --out FILE`, `kvtier restore FILE`")
    if ops.snapshot_dir is None:
        raise ApiError(400, "no snapshot directory is configured", hint=outside)
    if given is None:
        return ops.snapshot_dir / f"{session_id}{SNAPSHOT_SUFFIX}"
    if not isinstance(given, str) or not given or "\0" in given or len(given) > 4096:
        raise ApiError(400, "path must be a non-empty string", hint="e.g. agent.kvsnap (in the snapshot directory)")
    if not given.endswith(SNAPSHOT_SUFFIX):
        raise ApiError(400, f"snapshot path {given[:200]!r} does not end in {SNAPSHOT_SUFFIX}",
                       hint=f"name snapshot files *{SNAPSHOT_SUFFIX} (kvtier never overwrites other files)")
    path = Path(given)
    if len(path.name.encode()) > 255:
        raise ApiError(400, "file name too long", hint="at most 255 bytes")
    if not path.is_absolute():
        if ".." in path.parts:
            raise ApiError(400, f"relative path {given[:200]!r} leaves the snapshot directory", hint=outside)
        path = ops.snapshot_dir / path
    root = os.path.realpath(ops.snapshot_dir)
    parent = os.path.realpath(path.parent)
    if parent != root and not parent.startswith(root.rstrip("/") + "/"):
        raise ApiError(400, f"{given[:200]} is outside the server's snapshot directory {ops.snapshot_dir}",
                       hint=outside)
    final = Path(parent) / path.name
    try:
        mode = os.lstat(final).st_mode
    except FileNotFoundError:
        return final
    except OSError as exc:
        raise ApiError(400, f"cannot use {given[:200]}: {exc.strerror}") from None
    if stat_mod.S_ISLNK(mode):
        raise ApiError(400, f"{given[:200]} is a symbolic link: refused", hint="name the file itself")
    if not stat_mod.S_ISREG(mode):
        raise ApiError(400, f"{given[:200]} is not a regular file", hint="snapshots are regular files")
    return final
