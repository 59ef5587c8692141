# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KVConnectorBase_V1 Class for Distributed KV Cache & Hidden State
communication in vLLM v1

The class provides the following primitives:
    Scheduler-side: runs in the scheduler, binds metadata, which
    is used by the worker-side to load/save KV cache.
        get_num_new_matched_tokens() - get number of new tokens
            that exist in the remote KV cache. Might be called multiple
            times for a given request and should be side-effect free.
        update_state_after_alloc() - update KVConnector state after
            temporary buffer alloc by the CacheManager.
        update_connector_output() - update KVConnector state after
            output is received from worker-side connectors.
        request_finished() - called once when a request is finished,
            with the computed kv cache blocks for the request.
            Returns whether KV cache should be freed now or if the
            connector now assumes responsibility for freeing the
            the blocks asynchronously. Also optionally returns KV
            transfer params.
        take_events() - returns new KV events that were collected
            by the connector since the last call.

    Worker-side: runs in each worker, loads/saves KV cache to/from
    the Connector based on the metadata.
        handle_preemptions() - called for handling preempted requests
            or request evicted blocks before they are overwritten

        start_load_kv() - starts loading all KVs (maybe async)
        wait_for_layer_load() - blocks until layer i load is done

        save_kv_layer() - starts saving KV for layer i (maybe async)
        wait_for_save() - submits saves and performs required synchronization

        get_transfer_results() - returns async send/receive completions and
            receive failures in one snapshot.
        build_connector_worker_meta() - builds metadata to be sent
            back to the scheduler-side connector
"""

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# s_tensor_list, d_tensor_list, s_indices, d_indices, direction
CopyBlocksOp = Callable[
    [
        dict[str, torch.Tensor],
        dict[str, torch.Tensor],
        list[int],
        list[int],
        Literal["h2d", "d2h"],
    ],
    None,
]

logger = init_logger(__name__)


@dataclass
class KVConnectorTransferResults:
    """Asynchronous transfer completions from one worker snapshot.

    Failed receives also appear in ``finished_recving`` so the scheduler can
    release the request from its transfer wait state.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class SupportsHMA(ABC):
    """The class that indicates the corresponding connector supports hybrid memory
    allocator (HMA).
    This is required to use the connector together with hybrid memory allocator.
    """

    @abstractmethod
    def request_finished_all_groups(
        self,
        request: "Request",
        block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called exactly once when a request has finished for all kv cache groups,
        before its blocks are freed for each group.

        NOTE(Kuntai): This function is only supported by connectors that support HMA.

        The connector may assumes responsibility for freeing the blocks
        asynchronously by returning True.

        Returns:
            True if the request is being saved/sent asynchronously and blocks
            should not be freed until the request_id is returned from
            get_finished().
            Optional KVTransferParams to be included in the request outputs
            returned by the engine.

        """
        raise NotImplementedError


def supports_hma(connector: Any) -> bool:
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    else:
        return isinstance(connector, SupportsHMA)


class KVConnectorRole(enum.Enum):
    # Connector running in the scheduler process
    SCHEDULER = 0

    # Connector running in the worker process
    WORKER = 1


class KVConnectorHandshakeMetadata(ABC):  # noqa: B024
    """Metadata used for out of band connector handshake between
    P/D workers. This needs to serializable.
    """

    pass


class KVConnectorMetadata(ABC):  # noqa: B024
    """Abstract Metadata used to communicate
    Scheduler KVConnector -> Worker KVConnector.
    """

    pass


class KVConnectorWorkerMetadata(ABC):
    """Abstract Metadata used to communicate back
    Worker KVConnector -> Scheduler KVConnector.

    Each worker can output its own metadata.
    For a single engine step, all metadata objects returned by workers
    will be aggregated using the `aggregate` method below, before
    being passed to the Scheduler KVConnector.
    """

    @abstractmethod
    def aggregate(
        self, other: "KVConnectorWorkerMetadata"
    ) -> "KVConnectorWorkerMetadata":
        """Aggregate metadata with another `KVConnectorWorkerMetadata` object."""
        pass


class KVConnectorBase_V1(ABC):
    """Base class for KV connectors."""

    # Source label for this connector's external hits. Subclasses must set
    # HOST/DISK/P2P or override get_external_cache_hit_sources().
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """Whether external hits can complete divergent local hybrid hits.

        A capable connector restores lagging recurrent state when the local
        full-attention group reaches a deeper boundary. Defaults to False.
        """
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """Whether this connector hands off KV that must be reliably delivered.

        If True, a request preempted while its hand-off is still pending is
        recomputed rather than allowed to finish and hand off blocks that the
        preemption already freed. Defaults to the producer role, since only a
        producer hands KV off when a request completes. Best-effort caches
        return False, as a dropped save is just a future cache miss.
        """
        return self._kv_transfer_config.is_kv_producer

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: "KVTransferConfig") -> bool:
        """Whether the connector can follow the KV cache remap of sleep mode."""
        return True

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
    ):
        logger.warning(
            "Initializing KVConnectorBase_V1. This API is experimental and "
            "subject to change in the future as we iterate the design."
        )
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is not None:
            self._kv_transfer_config = vllm_config.kv_transfer_config
        else:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_cache_config = kv_cache_config
        self._kv_cache_manager: KVCacheManager | None = None
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ==============================
    # Worker-side methods
    # ==============================

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        """Return a custom KV cache allocation context, if configured.

        Returning None uses the engine's default memory pool.
        """
        return None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Set the connector metadata from the scheduler.

        This function should be called by the model runner every time
        before the model execution. The metadata will be used for runtime
        KV cache loading and saving.

        Args:
            connector_metadata (dict): the connector metadata.

        """
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Clear the connector metadata.

        This function should be called by the model runner every time
        after the model execution.
        """
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """Get the connector metadata.

        This function should only be called inside the connector.

        Returns:
            ConnectorMetadata: the connector metadata.

        """
        # Should only be called while set to valid metadata.
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        """Check whether the connector metadata is currently set.

        Returns:
            bool: True if connector metadata exists, False otherwise.

        """
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Initialize with the KV caches. Useful for pre-registering the
        KV Caches in the KVConnector (e.g. for NIXL).

        Args:
            kv_caches: dictionary of layer names, kv cache

        """
        return

    def unregister_kv_caches(self) -> None:
        """Drop KV cache registrations before sleep. Transfers are already
        drained. Idempotent."""
        return

    def restore_kv_caches(self) -> None:
        """Redo `unregister_kv_caches` after wake-up. Idempotent."""
        return

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp):
        """Set the xPU-specific ops for copying KV between host and device.
        Needed when host buffer is used for kv transfer (e.g., in NixlConnector)
        """
        return

    # TODO(NickLucche): group model-runner lifecycle hooks in the interface.
    def finish_forward(self) -> None:
        """Notify the connector that the model no longer reads this step's KV."""
        return

    def reset_capture_state(self) -> None:
        """Reset worker state mutated while capturing CUDA graphs."""
        return

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        """Handle preempted requests or evicted blocks BEFORE they are overwritten.
        Needed for connectors which use async saves (e.g., OffloadingConnector)
        """
        return

    @abstractmethod
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Start loading the KV cache from the connector to vLLM's paged
        KV buffer. Loads required by the current forward start before it;
        independent asynchronous loads may start after it is submitted.

        Args:
            forward_context (ForwardContext): the forward context.
            **kwargs: additional arguments for the load operation

        Note:
            The number of elements in kv_caches and layer_names should be
            the same.

        """
        pass

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the KV for a specific layer is loaded into vLLM's
        paged buffer. This is called from within attention layer to ensure
        async copying from start_load_kv is complete.

        This interface will be useful for layer-by-layer pipelining.

        Args:
            layer_name: the name of that layer

        """
        pass

    @abstractmethod
    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        """Start saving a layer of KV cache from vLLM's paged buffer
        to the connector. This is called from within attention layer to
        enable async copying during execution.

        Args:
            layer_name (str): the name of the layer.
            kv_layer (torch.Tensor): the paged KV buffer of the current
                layer in vLLM.
            attn_metadata (AttentionMetadata): the attention metadata.
            **kwargs: additional arguments for the save operation.

        """
        pass

    @abstractmethod
    def wait_for_save(self):
        """Submit saves and perform required synchronization.

        Called once per step, including empty steps, after any target and draft
        forwards. Metadata remains bound during this call. Do nothing if there
        is no save work.

        Async saves must retain their source blocks until completion is reported
        to the scheduler. Otherwise, wait for saves to finish before returning.
        """
        pass

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """Notifies worker-side connector ids of requests that have
        finished generating tokens on the worker.
        The scheduler process (via the Executors) will use this output
        to track which workers are done.

        Returns:
            ids of requests that have finished asynchronous transfer
            (requests that previously returned True from request_finished()),
            tuple of (sending/saving ids, recving/loading ids).
            The finished saves/sends req ids must belong to a set provided in a
            call to this method (this call or a prior one).

        """
        return None, None

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        """Return completed sends, receives, and receive failures together."""
        finished_sending, finished_recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(finished_sending or ()),
            finished_recving=set(finished_recving or ()),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Get the set of block IDs that failed to load.

        Returns:
            Set of block IDs that encountered load errors.
            Empty set if no load errors occurred.

        Notes:
            - Applies to both sync- and async-loading requests.
            - Async loading: failed blocks may be reported in any forward pass
              up to and including the pass where the request ID is returned by
              `get_transfer_results()`. Even if failures occur, the request
              must still be reported as finished receiving, and the failed
              block IDs must appear here no later than that same pass.
            - Sync loading: failed blocks should be reported in the forward
              pass in which they are detected.

        """
        return set()

    def shutdown(self):
        """Shutdown the connector. This is called when the worker process
        is shutting down to ensure that all the async operations are
        completed and the connector is cleaned up properly.
        """
        return None

    def get_kv_connector_stats(self) -> "KVConnectorStats | None":
        """Get the KV connector stats collected during the last interval."""
        return None

    def get_kv_connector_kv_cache_events(self) -> "KVConnectorKVEvents | None":
        """Get the KV connector kv cache events collected during the last interval.
        This function should be called by the model runner every time after the
        model execution and before cleanup.
        """
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Get the KVConnector handshake metadata for this connector.
        This metadata is used for out-of-band connector handshake
        between P/D workers.

        Returns:
            KVConnectorHandshakeMetadata: the handshake metadata.
            None if no handshake metadata is available.

        """
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Build the KVConnector worker metadata for this engine step.

        Returns:
            KVConnectorWorkerMetadata: the worker metadata.
            None if no worker metadata is available.

        """
        return None

    # ==============================
    # Scheduler-side methods
    # ==============================

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        """Bind the scheduler's cache manager after it has been constructed."""
        self._kv_cache_manager = kv_cache_manager
        self.bind_gpu_block_pool(kv_cache_manager.block_pool)

    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        """Bind the GPU block pool to the connector for per-GPU block status tracking.
        For example, inc/dec ref counts, or iterate over the prefix cache blocks.

        Args:
            gpu_block_pool: the GPU block pool.

        """
        return

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """KV cache groups restored by this connector's load for ``request``.

        Called after ``get_num_new_matched_tokens`` returned a positive count.
        Defaults to the prefix-cacheable groups, all a hash-addressed store
        holds; a connector transferring the request's own blocks restores
        every transfer group.
        """
        return self._kv_cache_config.prefix_cacheable_group_ids

    @abstractmethod
    def get_num_new_matched_tokens(
        self,
        request: "Request",
        num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        """Get number of new tokens that can be loaded from the
        external KV cache beyond the num_computed_tokens.

        Args:
            request (Request): the request object.
            num_computed_tokens (int): the number of locally
                computed tokens for this request

        Returns:
            A tuple with the following elements:
                - An optional number of tokens that can be loaded from the
                  external KV cache beyond what is already computed.
                  If None, it means that the connector needs more time to
                  determine the number of matched tokens, and the scheduler
                  should query for this request again later.
                - `True` if external KV cache tokens will be loaded
                  asynchronously (between scheduler steps). Must be
                  'False' if the first element is 0.

        Notes:
            The connector should only consider the largest prefix of prompt-
            tokens for which KV cache is actually available at the time of the
            call. If the cache cannot be loaded for some tokens (e.g., due to
            connectivity issues or eviction), those tokens must not be taken
            into account.

        """
        pass

    def get_external_cache_hit_sources(
        self,
        request: "Request",
        num_external_tokens: int,
    ) -> dict[CacheHitSource, int]:
        """Split ``num_external_tokens`` by the cache tier that supplied them.

        Called after :meth:`update_state_after_alloc`, so the load plan is
        known. Counts must sum to ``num_external_tokens``; a mismatch is
        reported as ``external_unspecified``. Only non-zero counts are
        included.

        Default: all tokens under ``_cache_hit_source``.
        """
        if num_external_tokens == 0:
            return {}
        return {self._cache_hit_source: num_external_tokens}

    @abstractmethod
    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ):
        """Update KVConnector state after block allocation.

        If get_num_new_matched_tokens previously returned True for a
        request, this function may be called twice for that same request -
        first when blocks are allocated for the connector tokens to be
        asynchronously loaded into, and second when any additional blocks
        are allocated, after the load/transfer is complete.

        Decide whether to load based on ``num_external_tokens``, not on
        whether ``blocks`` is empty: ``blocks`` may be non-empty even when
        ``num_external_tokens == 0`` (e.g. a non-chosen sub-connector of
        MultiConnector still receives the request's real blocks).

        Args:
            request (Request): the request object.
            blocks (KVCacheBlocks): the blocks allocated for the request.
            num_external_tokens (int): the number of tokens to load from the
                external KV cache. 0 means nothing should be loaded.

        """
        pass

    @abstractmethod
    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        """Build the connector metadata for this step.

        This function should NOT modify fields in the scheduler_output.
        FIXME: one exception:
        synchronous READ connectors may remove attention blocks they fully
        overwrite this step from new_block_ids_to_zero. They must complete
        those loads before the blocks are used and fail the step if a load fails.
        Calling this function will reset the state of the connector.

        Args:
            scheduler_output (SchedulerOutput): the scheduler output object.

        """
        pass

    def on_new_request(self, request: "Request") -> None:
        """Called by the scheduler when a new request is added.

        Connectors can override this to inspect the request and perform
        bookkeeping. The default implementation is a no-op.
        """
        return

    def update_connector_output(self, connector_output: KVConnectorOutput):
        """Update KVConnector state from worker-side connectors output.

        Args:
            connector_output (KVConnectorOutput): the worker-side
                connectors output.

        """
        return

    def request_finished(
        self,
        request: "Request",
        block_ids: list[int],
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called exactly once when a request has finished, before its blocks are
        freed.

        The connector may assumes responsibility for freeing the blocks
        asynchronously by returning True.

        Returns:
            True if the request is being saved/sent asynchronously and blocks
            should not be freed until the request_id is returned from
            get_finished().
            Optional KVTransferParams to be included in the request outputs
            returned by the engine.

        """
        return False, None

    def register_finished_partial_tail(
        self,
        request: "Request",
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        """Register finish-time partial-tail sources before block cleanup.

        Returns True when the connector accepts responsibility for the sources
        and the request's blocks must remain alive until ``get_finished()``.
        """
        return False

    def take_events(self) -> Iterable["KVCacheEvent"]:
        """Take the KV cache events from the connector.

        Yields:
            New KV cache events since the last call.

        """
        return ()

    def has_pending_block_frees(self) -> bool:
        """Whether pending transfers can release blocks instead of preemption."""
        return False

    def has_pending_push_work(self) -> bool:
        """Return True if the connector has push-mode work that requires
        the engine main loop to keep stepping (e.g. a P-side request whose
        KV blocks are waiting to be WRITTEN to a D node).

        Connectors that don't implement push-based KV transfer should
        leave this as False.
        """
        # TODO: replace with a more general connector hook for keeping the
        # scheduler alive (e.g. extend has_unfinished_requests).
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """Get the required KV cache layout for this connector.

        Args:
            vllm_config (VllmConfig): the vllm config.

        Returns:
            str: the required KV cache layout. e.g. HND, or NHD.
            None if the connector does not require a specific layout.

        """
        if cls is KVConnectorBase_V1:
            raise TypeError(
                "get_required_kvcache_layout should not be called "
                "on the abstract base class"
            )
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Check if this connector requires PIECEWISE CUDA graph mode.

        Connectors that use asynchronous layer-by-layer operations
        (wait_for_layer_load/save_kv_layer) should override this method
        to return True when those operations are enabled. These operations
        cannot be captured in CUDA graphs and will be skipped during replay,
        causing data races. PIECEWISE mode allows Python code to execute
        between graph pieces, ensuring proper synchronization.

        Args:
            extra_config: The kv_connector_extra_config dict from
                KVTransferConfig.

        Returns:
            True if this connector requires PIECEWISE CUDA graph mode,
            False otherwise.

        """
        return False

    def get_finished_count(self) -> int | None:
        """Get the count of requests expected to complete send/receive operations
        via this connector. This method is used to initialize the
        KVOutputAggregator, overwriting the default world_size.

        Returns:
            int: expected sending or receiving completion count.

        """
        return None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> "KVConnectorStats | None":
        """KVConnectorStats resolution method. This method allows dynamically
        registered connectors to return their own KVConnectorStats object,
        which can implement custom aggregation logic on the data dict.
        """
        return None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Set the KV connector handshake metadata for this connector.

        Args:
            metadata (KVConnectorHandshakeMetadata): the handshake metadata to set.

        """
        return None

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Set handshake metadata keyed by (pp_rank, tp_rank).
        - Default implementation assumes pp_rank is always 0
        - PP-aware connectors override this to consume all PP producer shards.
        """
        if any(pp_rank != 0 for pp_rank, _ in metadata):
            raise ValueError(
                f"{type(self).__name__} received pp_rank > 0 handshake metadata "
                "but does not support PP-disaggregated KV transfer."
            )
        self.set_xfer_handshake_metadata(
            {tp_rank: meta for (_, tp_rank), meta in metadata.items()}
        )

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type["PromMetric"], type["PromMetricT"]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> "KVConnectorPromMetrics | None":
        """Create a KVConnectorPromMetrics subclass which should register
        per-connector Prometheus metrics and implement observe() to
        expose connector transfer stats via Prometheus.
        """
        return None

    def reset_cache(self) -> bool | None:
        """Reset the connector's internal cache.

        Returns:
            bool: True if the cache was successfully reset, False otherwise.

        """
        logger.debug(
            "Connector cache reset requested, but %s does not implement reset_cache().",
            type(self).__name__,
        )

        return None
