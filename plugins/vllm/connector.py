"""``KVTierConnector``: kvtier inside vLLM, as a KV connector (vLLM 0.32 and 0.33, KVConnectorBase_V1;
the vLLM internals it uses are listed in ``compat``).

A thin facade: vLLM builds it once with role SCHEDULER (engine-core process) and once per
tensor-parallel rank with role WORKER (each worker process); the first delegates to
``KVTierScheduler`` (decides), the others to ``KVTierWorker`` (move their rank's bytes). Per step
the scheduler half's jobs travel in ``KVTierMetadata`` to every rank; each rank's results come back
in ``KVTierWorkerMetadata`` (vLLM concatenates the ranks' with ``aggregate``). Loads are
asynchronous (vLLM holds the request until every rank's ``get_finished`` reports it) and stores
run behind the step, as in vLLM's own OffloadingConnector. Sleep mode (vLLM 0.33): the worker
half lets go of the KV tensors and takes them back (``unregister_kv_caches`` / ``restore_kv_caches``);
a worker that wakes up with other weights reports them, and the scheduler half switches to their
fingerprint and drops the sessions computed with the old ones (``kvtier.plugins.vllm.sleep``).

Use it from any vLLM: ``--kv-transfer-config '{"kv_connector":"KVTierConnector","kv_role":
"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"dram_bytes":...,
"nvme_dir":...,"nvme_bytes":...}}'`` (kvtier registers the name through vLLM's plugin entry point).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.connector_config import ConnectorConfig
from kvtier.jobs import Job, JobResult
from kvtier.plugins.vllm.compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    check_vllm_version,
)
from kvtier.plugins.vllm.geometry import check_supported, fingerprint_from_vllm, parallel_of

__all__ = ["KVTierConnector", "KVTierMetadata", "KVTierWorkerMetadata"]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    jobs: list[Job] = field(default_factory=list)
    missing_blocks: list[int] = field(default_factory=list)  # promised but unloadable: load errors
    freed_slots: list[int] = field(default_factory=list)  # DRAM slots the manager released
    recv_now: list[str] = field(default_factory=list)  # async loads with nothing left to load: done at once
    flush_jobs: list[int] = field(default_factory=list)  # stores of preempted requests: done before the forward
    finish_after_stores: list[str] = field(default_factory=list)  # finished requests vLLM holds for our stores
    idle: bool = False  # the step runs no forward pass (requests only wait for transfers)
    probe_disk: bool = False  # the cost model plans with a slow disk: probe it, to see it recover


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    results: list[JobResult] = field(default_factory=list)
    weights: str | None = None  # a rank woke up with these weights (sleep mode)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVTierWorkerMetadata":
        """vLLM folds every rank's metadata into one: each result says its rank, and the scheduler
        half applies a job once all ranks have reported it."""
        assert isinstance(other, KVTierWorkerMetadata)
        return KVTierWorkerMetadata(self.results + other.results, self.weights or other.weights)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        untested = check_vllm_version()  # too old: refused here, one line; untested or newer: a warning
        config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)  # parsed once
        check_supported(vllm_config, kv_cache_config)  # one clear error at start, not a traceback per step
        fingerprint = fingerprint_from_vllm(vllm_config, config.model_id)
        self._scheduler = self._worker = None
        self.step_seconds = 0.0  # time spent in this half's calls on steps that run a forward pass
        if role == KVConnectorRole.SCHEDULER:
            from kvtier.plugins.vllm.scheduler import KVTierScheduler

            self._scheduler = KVTierScheduler(vllm_config, fingerprint, config)
            if untested:
                self._scheduler.manager.telemetry.warn("vllm_version", untested)
        else:
            from kvtier.plugins.vllm.kvorder import cpu_kv_order
            from kvtier.plugins.vllm.worker import KVTierWorker

            order = cpu_kv_order(vllm_config, fingerprint.geometry)  # measured once per process (cached)
            self._worker = KVTierWorker(fingerprint, config, rank=parallel_of(vllm_config)[0],
                                        refingerprint=lambda: fingerprint_from_vllm(vllm_config, config.model_id),
                                        kv_orders=order[1] if order else None)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks before it enables sleep mode: kvtier follows the KV cache's unmapping and
        remapping (``unregister_kv_caches`` / ``restore_kv_caches``)."""
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Every layer's blocks contiguous (``[blocks, heads, tokens, K|V]``, what the CPU backend
        uses too): a block of one layer is one contiguous run, so gathers and scatters are one
        indexed copy per layer. Other layouts would still work (the adapter copies through strided
        views), only slower."""
        return "LBHNC"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is a later miss, never an error

    @contextlib.contextmanager
    def _timed(self, count: bool = True):
        started = time.perf_counter()
        try:
            yield
        finally:
            if count:
                self.step_seconds += time.perf_counter() - started

    @property
    def manager(self):
        """The scheduler half's TierManager (for the admin API and tests)."""
        return self._scheduler.manager if self._scheduler is not None else None

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        with self._timed(), self._scheduler.lock:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        with self._timed(), self._scheduler.lock:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        with self._timed(), self._scheduler.lock:
            self._scheduler.clock.step_started(scheduler_output)
            step = self._scheduler.build_jobs(scheduler_output)
            return KVTierMetadata(jobs=step.jobs, missing_blocks=step.missing, recv_now=step.recv_now,
                                  flush_jobs=step.flush_jobs, finish_after_stores=step.finish_after_stores,
                                  freed_slots=self.manager.table.slots.drain_freed(),
                                  idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 0),
                                  probe_disk=self._scheduler.disk.slow)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        with self._timed(), self._scheduler.lock:
            self._scheduler.clock.step_finished()  # vLLM calls this once per executed step
            if isinstance(meta, KVTierWorkerMetadata):
                self._scheduler.complete(meta.results)
                if meta.weights is not None:
                    self._scheduler.weights_reported(meta.weights)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        with self._timed(), self._scheduler.lock:
            return self._scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    # ---- worker side (every call here is on vLLM's step path: nothing waits for a copy) ---------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33, before its KV memory is unmapped (sleep, discard): see ``KVTierWorker``."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33, once its KV memory is mapped again (wake-up): see ``KVTierWorker``."""
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._worker.apply(meta)
        return meta

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, KVTierMetadata) and kv_connector_metadata.flush_jobs:
            with self._timed(), self._worker.on_step():
                self._worker.apply(kv_connector_metadata)
                self._worker.handle_preemptions(kv_connector_metadata.flush_jobs)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        with self._timed(), self._worker.on_step():
            meta = self._meta()
            self._worker.start_load_kv(meta.jobs, meta.missing_blocks, meta.recv_now)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: their requests run only once they are done

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are stored after the forward pass, once every layer is written

    def wait_for_save(self) -> None:
        with self._timed(), self._worker.on_step():
            meta = self._meta()
            self._worker.wait_for_save(meta.jobs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._get_connector_metadata()
        with self._timed(not getattr(meta, "idle", False)), self._worker.on_step():  # idle steps may wait
            meta = self._meta()
            return self._worker.get_finished(meta.finish_after_stores, meta.idle)

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        with self._timed():
            results, weights = self._worker.take_results(), self._worker.take_weights_report()
            return KVTierWorkerMetadata(results, weights) if results or weights else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._timed():
            return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
