"""Publishing a box's blocks to the shared store, off every other path.

The mover hands the publisher the DRAM slots it has just filled (``write-through``: after each
store batch) or given a cold copy (``demote``: after a demotion or a write-behind batch); a thread
of its own copies each slot out -- under the slot lock, after checking the slot still holds the
same block, as write-behind does -- re-encodes it to the shared codec and writes a batch (one
pipeline). It decides nothing about what exists: a block it could not publish is simply not in the
shared tier, which every reader treats as a miss.

Bounded: at most ``max_queue`` blocks wait; past that, and while the store is down, offers are
counted and dropped at once, so a slow or dead store costs the serving path nothing.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Callable, Sequence

from kvtier.codecs import get_codec, transcode

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.jobs import BlockMove
    from kvtier.move.mover import Mover
    from kvtier.tiers.shared.store import SharedStore

__all__ = ["Publisher"]

log = logging.getLogger(__name__)

BATCH_BYTES = 8 << 20  # one pipeline at most
REPORT_EVERY_S = 1.0


class Publisher:
    def __init__(self, mover: "Mover", store: "SharedStore", policy: str = "write-through", codec: str = "none",
                 max_queue: int = 4096, on_report: Callable[[dict], None] | None = None):
        self.mover, self.store = mover, store
        self.on_store = policy == "write-through"
        self.codec = codec
        self.max_queue = max_queue
        self.on_report = on_report  # called with ``stats()`` after work, at most once a second
        self.counters: Counter[str] = Counter()
        self._queue: deque[tuple[int, bytes, bytes]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._reported = 0.0
        self._thread = threading.Thread(target=self._run, name="kvtier-publish", daemon=True)
        self._thread.start()

    # ---- offers (mover threads) -----------------------------------------------------------------
    def stored(self, moves: Sequence["BlockMove"], failed: Sequence[int] = ()) -> None:
        if self.on_store:
            bad = set(failed)
            self.offer([m for i, m in enumerate(moves) if i not in bad])

    def went_cold(self, moves: Sequence["BlockMove"]) -> None:
        if not self.on_store:
            self.offer(moves)

    def offer(self, moves: Sequence["BlockMove"]) -> None:
        if not moves:
            return
        if not self.store.available:  # down: skipped at once, never queued behind a dead store
            self.counters["publish_skipped"] += len(moves)
            return
        with self._cond:
            room = self.max_queue - len(self._queue)
            for move in moves[:max(room, 0)]:
                self._queue.append((move.dram_slot, move.namespace, move.key))
            if len(moves) > room:
                self.counters["publish_dropped"] += len(moves) - max(room, 0)
            self._cond.notify()

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait(REPORT_EVERY_S)
                    self._report()
                if self._stopping and not self._queue:
                    self._busy = False
                    self._cond.notify_all()
                    return
                self._busy = True
                batch = []
                while self._queue and len(batch) * self.mover.arena.slot_bytes < BATCH_BYTES:
                    batch.append(self._queue.popleft())
            try:
                self._publish(batch)
            except Exception as exc:  # noqa: BLE001 - never let publishing take the worker down
                self.counters["publish_failed"] += len(batch)
                log.warning("kvtier: publishing to the shared tier failed: %s", exc)
            self._report()

    def _publish(self, batch: list[tuple[int, bytes, bytes]]) -> None:
        import torch

        mover = self.mover
        if not self.store.available:
            self.counters["publish_skipped"] += len(batch)
            return
        blocks = []
        for slot, namespace, key in batch:
            with mover._slots_lock:  # the slot still holds this block: copy it out
                owner = mover.slot_owner.get(slot)
                if owner is None or owner[0] != namespace or owner[1] != key:
                    self.counters["publish_missed"] += 1  # freed (and maybe reused) since: not published
                    continue
                nbytes, codec, first = owner[2], owner[3], owner[4]
                payload = mover.arena.slot(slot, nbytes).clone()
            if codec != self.codec:
                out = torch.empty(get_codec(self.codec).max_bytes(mover.fingerprint.geometry), dtype=torch.uint8)
                n = transcode(payload, codec, self.codec, mover.fingerprint.geometry, out, first=first or None)
                payload, codec = out[:n], self.codec
            blocks.append((namespace, key, payload, codec))
        if not blocks:
            return
        outcomes = self.store.write_batch(blocks, mover.fingerprint.digest)
        ok = sum(1 for outcome in outcomes if outcome is None)
        self.counters["published_blocks"] += ok
        self.counters["publish_failed"] += len(outcomes) - ok
        self.counters["published_bytes"] += sum(len(p) for (_n, _k, p, _c), o in zip(blocks, outcomes) if o is None)
        with mover._lock:
            mover.link_bytes["dram->shared"] += sum(len(p) for _n, _k, p, _c in blocks)

    def _report(self) -> None:
        now = time.monotonic()
        if self.on_report is not None and now - self._reported >= REPORT_EVERY_S:
            self._reported = now
            try:
                self.on_report(self.stats())
            except Exception as exc:  # noqa: BLE001
                log.debug("kvtier: shared report failed: %s", exc)

    # ---- control ---------------------------------------------------------------------------------
    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until everything offered so far is published (or given up); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def stats(self) -> dict:
        with self._cond:
            queued = len(self._queue)
        counters = dict(self.store.counters)
        counters.update(self.counters)
        return {"state": self.store.state, "problem": self.store.problem, "queued": queued, "counters": counters}

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
