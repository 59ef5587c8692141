"""The connector's scheduler half: lookups, load and store planning, sessions, maintenance.

Runs in vLLM's engine-core process beside the scheduler. It owns the ``TierManager`` (index,
sessions, DRAM slot allocator, NVMe budget, policies) and turns vLLM's per-step view into kvtier
jobs, shipped to the worker half in the step's connector metadata. Results come back through the
worker metadata (``update_connector_output``), the only way block state changes.

Rules that follow from how vLLM's scheduler calls a connector (see docs/architecture.md):
* ``get_num_new_matched_tokens`` may be called several times per request and its answer may be
  discarded: it has no side effects. Loads are planned in ``update_state_after_alloc``.
* The last prompt token is never claimed (vLLM must compute at least one token).
* A block is stored once its KV has been computed: at the step where the request's computed tokens
  (before the step + scheduled in it) cover the whole block. Chunked prefill and decode follow.
* Preemption frees a request's HBM blocks; its next admission is a fresh lookup with a new block
  table, and stores resume from what kvtier already holds. Stores of a preempted request still
  running are named in the next step's ``flush_jobs``: the workers finish them before the forward
  pass that may reuse those blocks.
* Loads are asynchronous: ``(n, True)``; the request waits inside vLLM until every rank reported
  its load done. Stores run behind the step: a request that finishes with stores in flight is held
  (``request_finished`` returns True) until every rank reports them done.
* With tensor parallelism every job runs on every rank; a job is applied once all ranks reported
  it (``jobs.RankMerger``), and a block written behind counts once every rank wrote its shard.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.codecs import resolve_codec
from kvtier.codecs.recall import load_figures, recall_warning
from kvtier.config import write_behind_seconds
from kvtier.connector_config import ConnectorConfig
from kvtier.jobs import Job, JobKind, RankMerger
from kvtier.layout import ModelFingerprint
from kvtier.plan.decide import LoadCandidate, blocks_to_load, worth_keeping
from kvtier.plan.diskwatch import DiskWatch
from kvtier.plan.index import namespace_of
from kvtier.plan.manager import TierManager
from kvtier.plugins.vllm.compat import running_vllm_version, vllm_info
from kvtier.plugins.vllm.geometry import VllmBlockKeys
from kvtier.plugins.vllm.hbm import HbmCache, events_endpoint, hbm_usage
from kvtier.plugins.vllm.sleep import switch_weights
from kvtier.plugins.vllm.state import RequestState, anonymous_session, retain_hint_of, session_of, valid_session
from kvtier.plugins.vllm.timing import EngineClock, build_cost_model
from kvtier.plugins.vllm.turns import TurnRecorder, store_skipped
from kvtier.plugins.vllm.wake import EngineWaker
from kvtier.tiers.nvme.drives import drive_dirs, primary_dir, scan_drives

__all__ = ["KVTierScheduler", "RequestState", "StepPlan", "anonymous_session", "session_of"]

log = logging.getLogger("kvtier.connector")


def admin_token_of(config: ConnectorConfig, environ: Any = None) -> str | None:
    """The admin TCP bearer token: from the engine's environment (``kvtier serve`` puts it there,
    never on vLLM's command line), else an ``admin_token`` in the connector config of a hand-written
    vLLM command line."""
    environ = os.environ if environ is None else environ
    return environ.get("KVTIER_ADMIN_TOKEN") or config.admin_token


@dataclass
class StepPlan:
    """What one step ships to every rank."""

    jobs: list[Job] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # HBM blocks promised but not loadable: load errors
    recv_now: list[str] = field(default_factory=list)  # async loads with no job left: done at once
    flush_jobs: list[int] = field(default_factory=list)  # running stores of preempted requests
    finish_after_stores: list[str] = field(default_factory=list)  # finished requests held for their stores


class KVTierScheduler:
    def __init__(self, vllm_config: Any, fingerprint: ModelFingerprint, config: ConnectorConfig):
        self.fingerprint = fingerprint
        self.block_tokens = fingerprint.geometry.block_tokens
        self.shards = fingerprint.shards  # tensor-parallel ranks: each reports every job
        self.config = config
        dram_bytes, nvme_bytes = config.shard_budgets(self.shards)  # per rank: the manager plans one rank's slots
        nvme_dir = config.nvme_dir
        cold_dir = nvme_dir if nvme_dir and nvme_bytes else None  # the NVMe tier's dir, when it is on
        records, removed = scan_drives(nvme_dir, nvme_bytes, self.shards, config.direct_io) if cold_dir else ([], 0)
        catalog_dir = primary_dir(cold_dir) if config.catalog else None  # drive 0 holds it
        self.catalog, catalog_problem = self._open_catalog(catalog_dir, fingerprint)
        geometry = fingerprint.geometry
        warm_codec = resolve_codec(config.warm_codec, geometry, "warm")
        cold_codec = resolve_codec(config.cold_codec, geometry, "cold")
        # measured links and the fitted prefill: admission, stores and demotion all ask it
        self.cost = build_cost_model(config, geometry, warm_codec, cold_codec, cold_dir)
        # what stores, loads and demotions ask: none with always_load (every hit is kept and loaded)
        self.decide_cost = None if config.always_load else self.cost
        self.manager = TierManager(
            fingerprint,
            dram_bytes=dram_bytes,
            nvme_bytes=nvme_bytes if nvme_dir else 0,
            policy=config.policy,
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
            nvme_records=records,
            warm_codec=warm_codec,
            cold_codec=cold_codec,
            nvme_removed_at_start=removed,
            catalog=self.catalog,
            cost=self.decide_cost,
            block_keys=VllmBlockKeys(vllm_config, self.block_tokens),  # restores recompute keys with vLLM's hash
        )
        if catalog_problem:
            self.manager.telemetry.warn("catalog", catalog_problem)
        max_context = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
        figures = load_figures()
        for tier, spec in (("warm", warm_codec), ("cold", cold_codec)):  # lossy codecs and long contexts
            self.manager.telemetry.warn(f"{tier}_codec_recall", recall_warning(spec, max_context, tier, figures))
        self.write_behind_s = write_behind_seconds(config.write_behind) if cold_dir else None
        self._stopping = threading.Event()
        self.requests: dict[str, RequestState] = {}
        self.turns = TurnRecorder(self.manager, self.cost, self.decide_cost, fingerprint, self.requests)
        # the engine's steps, timed: the prefill model's samples, and how long the engine has been idle
        telemetry = self.manager.telemetry
        self.clock = EngineClock(config, self.cost, telemetry.count, self.requests, cold_dir, self._stopping)
        self.disk = DiskWatch(self.cost, telemetry.warn, shards=self.shards).follow(self.clock)  # a slow disk
        self._ranks = RankMerger(self.shards)  # a job is applied once every rank reported it
        self._stores_of: dict[str, set[int]] = {}  # request -> its STORE jobs not yet done on every rank
        self._finish_after_stores: list[str] = []  # finished, held by vLLM until their stores are done
        self._recv_now: list[str] = []  # async loads that found nothing left to load
        self._jobs: list[Job] = []  # planned this step, shipped by build_connector_meta
        self._missing: list[int] = []  # HBM blocks promised but not loadable: load errors
        log.info("kvtier: %s, DRAM %d slots, NVMe %s (%d blocks found)", fingerprint.model_id,
                 self.manager.table.slots.num_slots, nvme_dir or "off", len(records))
        # the admin API's threads and vLLM's engine thread share the manager through this lock
        self.lock = threading.RLock()
        self.ops = None
        self.admin = None
        self._hbm_capacity_blocks = getattr(getattr(vllm_config, "cache_config", None), "num_gpu_blocks", None)
        self._api_url = config.api_url
        # makes steps while admin jobs are in flight and the engine is idle
        self.waker = EngineWaker(config.api_url, str(config.model_id or fingerprint.model_id.rpartition("@")[0]),
                                 self._in_flight)
        self.shared = None  # the shared tier's scheduler side: lookups, fetches, session entries
        from kvtier.tiers.shared.store import SharedConfig

        shared_config = SharedConfig.from_connector(config)
        if shared_config is not None:
            from kvtier.plugins.vllm.shared import SharedLookups

            self.shared = SharedLookups(self.manager, self.cost, self.lock, self.enqueue, self.shards, shared_config,
                                        box=str(config.instance or os.uname().nodename))
        self.hbm_cache = self._listen_hbm(vllm_config)  # vLLM's prefix cache, from its KV events
        if config.admin_socket:
            self._start_admin(config)
        threading.Thread(target=self._keep_catalog, args=(config.catalog_interval_s,),
                         name="kvtier-catalog", daemon=True).start()

    # ---- durability -----------------------------------------------------------------------------
    @staticmethod
    def _open_catalog(nvme_dir: str | None, fingerprint: ModelFingerprint) -> tuple[Any, str | None]:
        """The session catalog of this NVMe dir and model; a server that cannot have it still serves
        (without sessions surviving a restart) and says why in status."""
        if not nvme_dir:
            return None, None
        from kvtier.persist.catalog import Catalog, CatalogError

        try:
            return Catalog(nvme_dir, fingerprint), None
        except (CatalogError, OSError) as exc:
            message = f"no session catalog: {exc}" + (f" ({exc.hint})" if getattr(exc, "hint", None) else "")
            log.error("kvtier: %s", message)
            return None, message

    def _keep_catalog(self, every_s: float) -> None:
        """Write the sessions that changed, about once a second, in one transaction (the lock is held
        only to copy them). While the engine is idle, also make one step when the worker should have
        written blocks behind, so their state (and status's dirty count) comes back."""
        poked_at = 0.0
        while not self._stopping.wait(every_s):
            with self.lock:  # timed pins and retention hints end on time on an idle engine too
                self.manager.planner.expire()
            self.manager.catalog_log.sync_catalog(self.lock)
            with self.lock:  # (a failing disk keeps blocks dirty: nothing to bring back then)
                dirty_age = self.manager.views.dirty_stats()["dirty_age_s"] \
                    if self.write_behind_s is not None and "nvme" not in self.manager.telemetry.warnings else 0.0
            window = self.write_behind_s
            if window is not None and dirty_age > window + 2 * every_s and self.clock.idle_for() > every_s \
                    and time.monotonic() - poked_at > max(window, 2.0):
                poked_at = time.monotonic()
                self.waker.poke()

    def _listen_hbm(self, vllm_config: Any) -> "HbmCache | None":
        """Follow vLLM's KV cache events when it publishes them (``kvtier serve`` turns them on)."""
        endpoint = events_endpoint(vllm_config)
        if endpoint is None:
            return None
        cache = HbmCache(valid_session)
        try:
            cache.listen(endpoint, vllm_config.kv_events_config.topic)
        except Exception as exc:  # noqa: BLE001 - HBM then shows running requests only
            log.warning("kvtier: not following vLLM's KV cache events at %s: %s", endpoint, exc)
            return None
        self.manager.views.follow_hbm(cache.sessions)  # sessions, inspect and top: each one's HBM share
        return cache

    # ---- admin API ------------------------------------------------------------------------------
    def _start_admin(self, config: ConnectorConfig) -> None:
        from kvtier.control.server import AdminServer, Ops

        info = {"model": self.fingerprint.model_id, "api_url": self._api_url,
                "kv_dtype": self.fingerprint.geometry.dtype,
                "block_tokens": self.block_tokens, "instance": config.instance,
                "revision": config.revision, "commit": config.commit, "weights": self.fingerprint.weights,
                "nvme_drives": drive_dirs(config.cold_dir), "vllm": vllm_info(running_vllm_version())}
        self.ops = Ops(self.manager, self.lock, self.enqueue, self.waker.wake, config.snapshot_dir, info,
                       hbm=self.hbm_usage, cost=self.cost, shared=self.shared)
        tcp = None
        if config.admin_tcp:
            host, _, port = config.admin_tcp.rpartition(":")
            tcp = (host or "127.0.0.1", int(port))
        try:
            self.admin = AdminServer(self.ops, config.admin_socket, tcp, admin_token_of(config)).start()
        except Exception as exc:  # the engine still serves; only the admin plane is missing
            log.error("kvtier: admin API not started: %s", exc)

    def hbm_usage(self) -> dict:
        """vLLM's KV cache in HBM (``hbm.hbm_usage``): running requests' blocks, and the prefix
        cache's besides them. Called under the lock."""
        running = sum(len(state.block_ids) for state in self.requests.values())
        return hbm_usage(self.hbm_cache, running, self._hbm_capacity_blocks, self.fingerprint.geometry.block_bytes)

    def _in_flight(self) -> bool:
        with self.lock:
            return bool(self._jobs) or (self.ops is not None and any(
                r.state in ("queued", "running") for r in self.ops.jobs.values()))

    def shutdown(self) -> None:
        self._stopping.set()
        if self.hbm_cache is not None:
            self.hbm_cache.close()
        if self.shared is not None:
            self.shared.close()
        if self.admin is not None:
            self.admin.stop()
            self.admin = None
        if self.catalog is not None:
            self.manager.catalog_log.sync_catalog(self.lock)
            self.catalog.close()
            self.catalog = None

    # ---- admission ----------------------------------------------------------------------------
    def _state(self, request: Any) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            namespace = namespace_of(self.fingerprint.digest, getattr(request, "cache_salt", None))
            hint, ignored = retain_hint_of(request)
            state = RequestState(request, namespace, session_of(request), retain=hint, hint_ignored=ignored)
            self.requests[request.request_id] = state
            arrival = getattr(request, "arrival_time", None)  # vLLM's handling of it until now: part of a TTFT
            if isinstance(arrival, float) and 0 < arrival <= time.time():
                self.cost.observe_request(int(request.num_tokens), time.time() - arrival)
        return state

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvtier can load beyond vLLM's own hit, and True: the load is asynchronous (vLLM
        holds the request until the workers report it done). None: ask again next step -- the
        shared store is being asked about the rest of the prompt, or its blocks are on their way
        into DRAM (``SharedLookups``: bounded waits, never a wait on the step itself)."""
        state = self._state(request)
        state.local_tokens = num_computed_tokens  # vLLM's own hit; update_state_after_alloc needs it
        bs = self.block_tokens
        usable = min(len(request.block_hashes), (request.num_tokens - 1) // bs)  # never the last token
        start = num_computed_tokens // bs
        state.lookup = (usable * bs, None, None, None)  # for the turn's record (kvtier.plan.reasons)
        if start >= usable:
            return 0, False
        rows = self.manager.table.peek(state.namespace, request.block_hashes[:usable])
        if self.shared is not None and len(rows) < usable:
            if self.shared.pending(state, request, len(rows), usable):
                return None, False
            rows = self.manager.table.peek(state.namespace, request.block_hashes[:usable])  # fetched ones too
        hit = len(rows) - start
        state.lookup = (usable * bs, len(rows) * bs, None, None)
        if hit <= 0:
            return 0, False
        flags = self.manager.table.in_dram(rows[start:])
        candidate = LoadCandidate(start, hit, int(flags.sum()), bs, in_dram=tuple(flags.tolist()),
                                  prompt_tokens=request.num_tokens)
        n = blocks_to_load(candidate, self.decide_cost)
        state.decision = "recompute" if n == 0 else "load" if n == hit else "split"
        state.lookup = (usable * bs, len(rows) * bs, candidate, state.decision)
        return n * bs, n > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._state(request)
        first = not state.counted
        if first:  # hit rates: prompt tokens admitted, and how many vLLM's HBM cache held
            state.counted = True
            self._note_session(state, request)
            telemetry = self.manager.telemetry
            telemetry.count("prompt_tokens", int(getattr(request, "num_prompt_tokens", request.num_tokens)))
            telemetry.count("hbm_hit_tokens", state.local_tokens)
            if state.decision is not None:
                telemetry.count(f"decision_{state.decision}")
        if num_external_tokens <= 0:
            if first:
                self.turns.admitted(state, request, None, 0, 0)
            return
        block_ids = list(blocks.get_block_ids()[0])
        start = state.local_tokens // self.block_tokens
        count = num_external_tokens // self.block_tokens
        rows = self.manager.table.lookup(state.namespace, request.block_hashes[: start + count])[start:]
        job = self.manager.prepare_load(rows, block_ids[start : start + len(rows)])
        loaded = len(job.moves) if job else 0
        if job is not None:
            job.session_id, job.req_id = state.session_id, request.request_id
            self._jobs.append(job)
        else:  # nothing left to load: the workers report the request done at once
            self._recv_now.append(request.request_id)
        if loaded < count:  # blocks gone since the lookup: reported as load errors, vLLM recomputes them
            self._missing.extend(block_ids[start + loaded : start + count])
        state.loaded_tokens = num_external_tokens
        self.manager.telemetry.count("loaded_tokens", num_external_tokens)
        if first:
            self.turns.admitted(state, request, job, count * self.block_tokens,
                           (count - loaded) * self.block_tokens)

    def _note_session(self, state: RequestState, request: Any) -> None:
        """A session is listed from its first request, before it has a whole block to store (its
        row then says why nothing is stored: ``reasons.stored_note``). A request with neither a
        session id nor a whole block (a health check, kvtier's own wake-up poke) is no session."""
        if not request.block_hashes and not getattr(request, "session_id", None):
            return
        session = self.manager.table.sessions.get(state.session_id)
        if session is None:
            session = self.manager.planner.record_session(state.session_id, state.namespace, [], request.num_tokens)
        session.hot = True

    # ---- per step -----------------------------------------------------------------------------
    def build_jobs(self, scheduler_output: Any) -> StepPlan:
        """This step's jobs (loads planned at admission, stores of the blocks it completes,
        watermark pressure), the HBM blocks that were promised but cannot be loaded, and the
        fences: stores of preempted requests to finish first, finished requests held for theirs."""
        self._track_block_tables(scheduler_output)
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        self.manager.telemetry.count("preempted_requests", len(preempted))
        flush = [job_id for req_id in preempted for job_id in self._stores_of.get(req_id, ())]
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is not None:
                self._plan_stores(state, state.request.num_computed_tokens + scheduled)
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        jobs, self._jobs = self._jobs, []
        missing, self._missing = self._missing, []
        jobs.extend(self.manager.maintenance())
        if self.ops is not None:
            self.ops.shipped(job.job_id for job in jobs)
        plan = StepPlan(jobs, missing, self._recv_now, flush, self._finish_after_stores)
        self._recv_now, self._finish_after_stores = [], []
        return plan

    def _track_block_tables(self, scheduler_output: Any) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            state = self.requests.get(req_id)
            if state is None or new_ids is None:
                continue
            if req_id in resumed:  # preempted and re-admitted: a whole new block table
                state.block_ids = list(new_ids[0])
            else:
                state.block_ids.extend(new_ids[0])

    def _plan_stores(self, state: RequestState, computed_after_step: int) -> None:
        request = state.request
        full = min(computed_after_step // self.block_tokens, len(request.block_hashes), len(state.block_ids))
        if full <= state.stored_blocks:
            return
        keys = list(request.block_hashes[:full])
        session = self.manager.planner.record_session(state.session_id, state.namespace, keys, computed_after_step,
                                                      token_ids=request.all_token_ids)
        session.hot = True
        if state.retain is not None:  # the request's retention hint, from its first scheduled step
            self.manager.planner.retain(state.session_id, state.retain.seconds, state.retain.priority)
            state.retain = None
        if session.pinned is None and not worth_keeping(max(request.num_tokens, computed_after_step), self.decide_cost,
                                                         on_nvme=False):
            # shorter than the DRAM break-even: loading it back would be slower than recomputing it.
            # Stores resume (from the first block) if the request grows past it while it holds them.
            self.manager.telemetry.count("store_skipped_blocks", full - max(state.skipped_blocks, state.stored_blocks))
            state.skipped_blocks = max(state.skipped_blocks, full)
            store_skipped(state)
            return
        first = state.stored_blocks
        job = self.manager.prepare_store(state.session_id, state.namespace, keys[first:full],
                                         state.block_ids[first:full],
                                         start=first)
        if job is not None:
            job.req_id = request.request_id
            self._stores_of.setdefault(job.req_id, set()).add(job.job_id)
            self._jobs.append(job)
        # Blocks DRAM had no room for are offered again next step (demotion makes room meanwhile),
        # as long as the request holds them in HBM.
        state.stored_blocks = self.manager.table.first_unstored(state.namespace, keys, first, full)

    def enqueue(self, job: Job | None) -> None:
        """Ship an operator's job (evict, pin, snapshot...) with the next step's metadata."""
        if job is not None:
            self._jobs.append(job)

    def complete(self, results: list) -> None:
        for result in results:
            self.disk.observe_result(result)  # NVMe reads of loads, promotions and probes: the disk's speed
            if result.job_id < 0 and result.shared is not None:  # a worker's shared-tier report
                if self.shared is not None:
                    self.shared.reports[result.rank] = result.shared
                continue
            if result.job_id < 0 and result.written_behind is not None:  # the worker's own write-behind
                self.enqueue(self.manager.pressure.note_written_behind(self._ranks.written(result), result.error,
                                                                       result.nvme_recreated, result.disk_ok,
                                                                       result.disk_free))
                continue
            if result.job_id < 0:
                continue
            result = self._ranks.job(result)
            if result is None:
                continue
            job = self.manager.jobbook.jobs.get(result.job_id)
            if job is not None and job.kind == JobKind.LOAD and not result.ok:  # recomputed: the turn says why
                self.turns.load_failed(job, result)
            if job is not None and job.kind == JobKind.STORE and job.req_id is not None:
                pending = self._stores_of.get(job.req_id)
                if pending is not None:
                    pending.discard(result.job_id)
                    if not pending:
                        del self._stores_of[job.req_id]
            if job is not None and job.kind == JobKind.LOAD and result.ok and \
                    not any(move.from_nvme for move in job.moves):
                # the live DRAM->HBM cost, in the model's own unit (blocks at the warm codec's size)
                self.cost.observe_load(len(job.moves) * self.cost.dram_block_bytes, result.seconds)
            self.manager.complete(result)
            if self.ops is not None:
                self.ops.finished(result)
        if results and self.ops is not None:
            self.ops.applied()  # a write-behind report changes the dirty count too

    def weights_reported(self, weights: str) -> None:
        """A worker woke up from a sleep with other weights: plan under their fingerprint from now on,
        and drop the sessions computed with the old ones (``sleep.switch_weights``)."""
        if weights != self.fingerprint.weights:
            self.fingerprint = switch_weights(self.fingerprint, weights, self.manager, self.enqueue)

    def request_finished(self, request: Any) -> tuple[bool, dict | None]:
        """(hold the request's blocks until its stores are done on every rank, its transfer params)."""
        held = bool(self._stores_of.get(request.request_id))
        if held:
            self._finish_after_stores.append(request.request_id)
        state = self.requests.get(request.request_id)
        if state is None:
            return held, None
        if not held:  # vLLM frees its blocks now (to its prefix cache): HBM counts them there, not here
            state.block_ids = []
        self.turns.finished(state)
        session = self.manager.table.sessions.get(state.session_id)
        if session is not None:
            session.hot = False
            if not session.keys:  # shorter than a block: its length with the reply
                session.num_tokens = max(session.num_tokens, int(request.num_tokens))
        ours = {"session_id": state.session_id, "loaded_tokens": state.loaded_tokens}
        if state.hint_ignored:  # the client hears why its hint did nothing (the server log is not theirs)
            ours["hint_ignored"] = state.hint_ignored
        return held, {"kvtier": ours}

