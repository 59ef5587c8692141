"""Publishing a box's blocks to the shared store, off every other path.

The mover's parts hand the publisher the DRAM slots it has just filled (``write-through``: after each
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
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from kvtier.codecs import get_codec, transcode
from kvtier.move.ledger import SlotLedger, SlotOwner
from kvtier.move.links import LinkBytes
from kvtier.tiers.base import BlockStore
from kvtier.tiers.threads import off_forward_cores

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.jobs import BlockMove
    from kvtier.layout import ModelFingerprint
    from kvtier.tiers.dram import DramArena

__all__ = ["Publisher", "SharedTier"]

log = logging.getLogger(__name__)

BATCH_BYTES = 8 << 20  # one pipeline at most
REPORT_EVERY_S = 1.0


@runtime_checkable
class SharedTier(BlockStore, Protocol):
    """What the worker half needs of the shared tier beyond a ``BlockStore``: whether it is up
    (offers are skipped at once while it is not), and its health for status."""

    available: bool
    state: str
    problem: Any
    counters: Mapping[str, int]


class Publisher:
    def __init__(self, ledger: SlotLedger, arena: "DramArena", links: LinkBytes, fingerprint: "ModelFingerprint",
                 store: SharedTier, policy: str = "write-through", codec: str = "none",
                 max_queue: int = 4096, on_report: Callable[[dict], None] | None = None):
        """``ledger``: what each DRAM slot of ``arena`` holds (a slot is copied out only while it still
        holds the offered block); ``links``: where the bytes published are counted."""
        self.ledger, self.arena, self.links, self.fingerprint = ledger, arena, links, fingerprint
        self.store = store
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
        off_forward_cores()
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
                while self._queue and len(batch) * self.arena.slot_bytes < BATCH_BYTES:
                    batch.append(self._queue.popleft())
            try:
                self._publish(batch)
            except Exception as exc:  # noqa: BLE001 - never let publishing take the worker down
                self.counters["publish_failed"] += len(batch)
                log.warning("kvtier: publishing to the shared tier failed: %s", exc)
            self._report()

    def _publish(self, batch: list[tuple[int, bytes, bytes]]) -> None:
        import torch

        if not self.store.available:
            self.counters["publish_skipped"] += len(batch)
            return
        geometry = self.fingerprint.geometry
        blocks = []
        for slot, namespace, key in batch:
            got = self.ledger.copy_out(slot, self._clone, block=(namespace, key))  # the slot still holds it
            if got is None:
                self.counters["publish_missed"] += 1  # freed (and maybe reused) since: not published
                continue
            owner, payload = got
            codec = owner.codec
            if codec != self.codec:
                out = torch.empty(get_codec(self.codec).max_bytes(geometry), dtype=torch.uint8)
                n = transcode(payload, codec, self.codec, geometry, out, first=owner.first or None)
                payload, codec = out[:n], self.codec
            blocks.append((namespace, key, payload, codec))
        if not blocks:
            return
        outcomes = self.store.write_batch(blocks, self.fingerprint.digest)
        ok = sum(1 for outcome in outcomes if outcome is None)
        self.counters["published_blocks"] += ok
        self.counters["publish_failed"] += len(outcomes) - ok
        self.counters["published_bytes"] += sum(len(p) for (_n, _k, p, _c), o in zip(blocks, outcomes) if o is None)
        self.links.add("dram->shared", sum(len(p) for _n, _k, p, _c in blocks))

    def _clone(self, slot: int, owner: SlotOwner) -> "torch.Tensor":
        return self.arena.slot(slot, owner.nbytes).clone()

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
