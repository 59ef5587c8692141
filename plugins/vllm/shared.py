"""The shared tier in the connector's scheduler half: lookups, fetches, session entries, health.

A request whose prompt goes on past what this box holds may find the rest in the shared store
(another box served the session's earlier turns). Asking the store is a network round trip, and
vLLM's scheduler calls ``get_num_new_matched_tokens`` on its step path, so the question is asked
on a thread of its own and the request is answered ``None`` ("ask again next step") meanwhile:
vLLM skips it for that step and schedules everything else. Once the answer is in, the cost model
decides whether fetching the blocks (the store's measured rate and round trip) and loading them
beats recomputing them; if so a FETCH job brings them into DRAM slots (it ships with the next
step like any job and runs on the worker's mover threads) and, once it is done, the request's
normal lookup finds them and loads them. Every wait is bounded (``LOOKUP_WAIT_S``, ``fetch_wait``):
past it the request goes on without the shared tier and recomputes. A store that is down is not
asked at all until its back-off ends (``SharedStore``), so an outage costs requests nothing.

About once a second (a thread of its own: a store that hangs must not delay the session catalog's
writes) the sessions that changed are published (their ordered
keys, token ids and pin: what another box needs to list and restore them), the store's memory
figures are read for status, and its health becomes a status warning or stops being one.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from kvtier.plugins.vllm.state import RequestState
from kvtier.tiers.shared.store import SharedConfig, SharedStore, SharedUnavailable

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.jobs import Job
    from kvtier.plan.costmodel import CostModel
    from kvtier.plan.manager import TierManager

__all__ = ["SharedLookups", "LOOKUP_WAIT_S"]

log = logging.getLogger("kvtier.connector")

LOOKUP_WAIT_S = 0.25  # a request waits this long at most for the store's answer
FETCH_WAIT_S = 2.0  # ... and at least this long (4x the predicted time if longer) for a fetch
MEASURE_EVERY_S = 300.0
INFO_EVERY_S = 2.0


class SharedLookups:
    def __init__(self, manager: "TierManager", cost: "CostModel", lock: "threading.RLock",
                 enqueue: "Callable[[Job], None]", shards: int, config: SharedConfig, box: str):
        """``lock``: the scheduler's (vLLM's engine thread and the admin API share the manager and
        the cost model through it); ``enqueue``: ships a job with the next step; ``shards``: the
        tensor-parallel ranks, each holding its own shard of every block."""
        self.manager, self.cost, self.lock, self.enqueue, self.shards = manager, cost, lock, enqueue, shards
        self.config = config
        self.box = box
        self.store = SharedStore(config, rank=0)
        self.manager.catalog_log.share_sessions()
        self.reports: dict[int, dict] = {}  # rank -> its worker's last shared-tier report
        self.server: dict | None = None  # the store's memory and eviction figures (INFO), refreshed by tick
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-shared")
        self._measured_at = -MEASURE_EVERY_S
        self._info_at = -INFO_EVERY_S
        self._ticking = threading.Lock()
        self._stopping = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="kvtier-shared-tick", daemon=True)
        self._ticker.start()

    def _tick_loop(self) -> None:
        while not self._stopping.wait(1.0):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the shared tier must never take the engine down
                log.warning("kvtier: shared tier upkeep failed: %s", exc)

    # ---- admission (vLLM's engine thread, under the scheduler's lock) -------------------------------
    def pending(self, state: "RequestState", request: Any, have: int, usable: int) -> bool:
        """True while the request should wait (answer None): its lookup or fetch is under way.
        ``have``: blocks this box holds from the prompt's start; ``usable``: full blocks to ask about."""
        count = self.manager.telemetry.count
        phase = state.shared
        now = time.monotonic()
        if phase is None:
            if not self.store.available:
                count("shared_lookups_skipped")
                state.shared = ("done",)
                return False
            keys = list(request.block_hashes[have:usable])
            future = self._pool.submit(self.store.blocks.lengths, state.namespace, keys, self.shards)
            state.shared = ("looking", now, future, have, keys)
            return True
        if phase[0] == "looking":
            _, asked, future, start, keys = phase
            if not future.done():
                if now - asked < LOOKUP_WAIT_S:
                    return True
                count("shared_lookup_timeouts")
                state.shared = ("done",)
                return False
            state.shared = ("done",)
            try:
                sizes = future.result()
            except SharedUnavailable:
                count("shared_lookup_failures")
                return False
            found = self.store.blocks.stored_prefix(sizes)
            count("shared_lookups")
            if not found:
                count("shared_lookup_misses")
                return False
            cost = self.cost
            fetch, fetch_s, recompute_s = cost.fetch_beats_recompute(start * cost.block_tokens, found,
                                                                     sum(sizes[:found]))
            if not fetch:
                count("shared_recomputed_blocks", found)  # the link is too slow for it to pay
                return False
            job = self.manager.planner.prepare_fetch(state.namespace, keys[:found], sizes[:found], start=start,
                                                     session_id=state.session_id)
            if job is None:
                return False
            job.req_id = request.request_id
            self.enqueue(job)
            count("shared_fetches")
            count("shared_fetch_blocks", len(job.moves))
            state.shared = ("fetching", now, job.job_id, max(FETCH_WAIT_S, 4 * fetch_s))
            return True
        if phase[0] == "fetching":
            _, started, job_id, patience = phase
            if job_id in self.manager.jobbook.jobs:  # not completed yet
                if now - started < patience:
                    return True
                count("shared_fetch_timeouts")  # it completes later; this request recomputes
            state.shared = ("done",)
        return False

    # ---- about once a second (its own thread) ---------------------------------------------------------
    def tick(self) -> None:
        if not self._ticking.acquire(blocking=False):
            return
        try:
            self._publish()
            now = time.monotonic()
            if self.store.available and now - self._info_at >= INFO_EVERY_S:
                self._info_at = now
                try:
                    self.server = self.store.client.server_info()
                except SharedUnavailable:
                    pass
            if self.store.available and now - self._measured_at >= MEASURE_EVERY_S:
                self._measured_at = now
                try:
                    bps, rtt = self.store.client.measure()
                    with self.lock:
                        self.cost.set_shared_link(bps, rtt)
                except SharedUnavailable:
                    self._measured_at = now - MEASURE_EVERY_S + 5.0  # again soon
            self._warn()
        finally:
            self._ticking.release()

    def _publish(self) -> None:
        lock = self.lock
        with lock:
            entries = self.manager.catalog_log.shared_batch(self.box)
        if not entries:
            return
        try:
            if not self.store.available:
                raise SharedUnavailable("down")
            self.store.sessions.publish_sessions(self.manager.fingerprint.digest, entries)
        except SharedUnavailable:
            with lock:
                self.manager.catalog_log.requeue_shared(entry["session_id"] for entry in entries)

    def _warn(self) -> None:
        problems = []
        if self.store.state == "down":
            problems.append(self.store.problem or "down")
        for rank, report in sorted(self.reports.items()):
            if report.get("state") == "down" and report.get("problem") not in problems:
                problems.append(f"rank {rank}: {report.get('problem')}" if self.shards > 1
                                else report.get("problem") or "down")
        rejected = self.counters().get("rejected_unsigned", 0)
        with self.lock:
            if problems:
                warning = (f"shared store {self.store.client.url} is {'; '.join(problems)}: serving "
                           "without it (requests recompute what it holds)")
            elif rejected:
                warning = (f"{rejected} shared-tier values were not signed by a key this box trusts: "
                           "boxes that share a store must share the snapshot keys file")
            else:
                warning = None
            self.manager.telemetry.warn("shared", warning)

    # ---- views ---------------------------------------------------------------------------------------
    def counters(self) -> dict:
        total = dict(self.store.counters)
        for report in self.reports.values():
            for name, value in (report.get("counters") or {}).items():
                total[name] = total.get(name, 0) + value
        return total

    def status(self) -> dict:
        """The shared tier for status and ``kvtier top`` (no network: cached figures). Under the lock."""
        counters = self.counters()
        manager = self.manager.telemetry.counters
        link = self.cost.shared_link
        return {"url": self.store.client.url, "state": self.store.state, "problem": self.store.problem,
                "cluster": self.store.client.cluster, "policy": self.config.policy, "codec": self.config.codec,
                "ttl_s": self.config.ttl_s, "box": self.box,
                "link": None if link is None else {"gbps": link[0] / 1e9, "rtt_ms": link[1] * 1e3},
                "server": self.server, "queued": sum(r.get("queued", 0) for r in self.reports.values()),
                "published_blocks": counters.get("published_blocks", 0),
                "published_bytes": counters.get("published_bytes", 0),
                "fetched_blocks": manager.get("fetched_blocks", 0), "lookups": manager.get("shared_lookups", 0),
                "hits": counters.get("hits", 0), "misses": counters.get("misses",
                                                                        0) + manager.get("shared_lookup_misses", 0),
                "rejected": counters.get("rejected", 0), "counters": counters}

    def close(self) -> None:
        self._stopping.set()
        self.tick()  # the last sessions changed before the stop
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()
