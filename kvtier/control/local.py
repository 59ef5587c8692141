"""The admin API over an in-process ``TierEngine``: the same server, with a job thread standing in
for vLLM's engine loop (jobs run in order, one step at a time, results applied under the lock).
Used by the tests, ``python -m benchmarks admin`` and the examples; the connector wires the server to
vLLM instead (``plugins/vllm/scheduler.py``)."""
from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.control.server import AdminServer, Ops

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.engine import TierEngine

__all__ = ["LocalAdmin"]


class _Hold:
    """A switch tests flip to hold jobs in the queue (``set``) and let them go (``clear``); the job
    thread waits for the release on a condition, not by polling."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False

    def set(self) -> None:
        with self._cond:
            self._held = True

    def clear(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def is_set(self) -> bool:
        return self._held

    def wait_released(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._held)


class LocalAdmin:
    def __init__(self, engine: "TierEngine", socket_path: str | Path, snapshot_dir: str | Path | None = None,
                 tcp: tuple[str, int] | None = None, token: str | None = None):
        self.engine = engine
        self.lock = threading.RLock()
        self.paused = _Hold()  # tests: hold jobs in the queue
        self._queue: "queue.Queue" = queue.Queue()
        info = {"model": engine.fingerprint.model_id, "api_url": None, "kv_dtype": engine.fingerprint.geometry.dtype,
                "block_tokens": engine.fingerprint.geometry.block_tokens}
        self.ops = Ops(engine.manager, self.lock, self._queue.put, snapshot_dir=snapshot_dir, info=info)
        self.server = AdminServer(self.ops, socket_path, tcp, token)
        self._thread = threading.Thread(target=self._loop, name="kvtier-local-engine", daemon=True)
        self._stop = False

    def start(self) -> "LocalAdmin":
        self.server.start()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.paused.wait_released()  # stop() releases it too
            with self.lock:
                self.ops.shipped([job.job_id])
            result = self.engine.mover.jobs.run(job)  # the IO runs outside the lock, as in the worker
            with self.lock:
                self.engine.manager.complete(result)
                self.engine.mover.ledger.forget(self.engine.manager.table.slots.drain_freed())
                self.ops.finished(result)  # notifies ops.changed: drain waits on it

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued job has run."""
        if not self.ops.wait_for(
                lambda: not any(r.state in ("queued", "running") for r in self.ops.jobs.values()), timeout):
            raise TimeoutError("admin jobs did not finish")

    def stop(self) -> None:
        self._stop = True
        self.paused.clear()
        self._queue.put(None)
        self._thread.join(timeout=30)
        self.server.stop()
