"""vLLM's sleep mode: the pieces ``KVTierWorker`` uses to let go of vLLM's KV memory and take it
back, and the scheduler half's answer to a worker that woke up with other weights.

vLLM 0.33 unmaps the KV cache's memory while the engine sleeps (``LLM.sleep``, or a discard of
the ``kv_cache`` tag) and maps it again on wake-up: the KV tensors stay the same Python objects,
their contents are lost. Around that it calls the connector's ``unregister_kv_caches`` and
``restore_kv_caches`` (vLLM 0.32 has neither and never sleeps with a connector's hooks). kvtier's
tiers live in host memory and on disk, so they survive the sleep; only what touches the KV tensors
has to stop (stores read them, loads write them) and start again.

What kvtier cannot keep across a sleep:
* another KV geometry on wake-up (the model's layers, heads, head size, block size or KV dtype, or
  the kept tensors' shape): every stored block has the old one -- refused, one error line;
* other weights (``update_config`` to another checkpoint, files replaced in place): blocks
  computed with the old ones are stale. The worker switches to the new weights' fingerprint
  (``retarget``): NVMe and shared-store reads then reject the old blocks by their fingerprint,
  the DRAM slots holding old blocks are forgotten (write-behind and the shared tier skip them)
  and no job reads them until the manager frees them. The worker reports the new weights; the
  scheduler half then plans under their fingerprint (new namespaces: old keys never match) and
  drops every session computed with the old ones (``switch_weights``).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvtier.errors import ConfigError
from kvtier.jobs import Job, JobKind, JobResult

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.layout import KVGeometry, ModelFingerprint
    from kvtier.move.mover import Mover
    from kvtier.plan.manager import TierManager

__all__ = ["KV_JOBS", "READS_DRAM", "attach_kv", "check_same_geometry", "kv_signature", "refused_result",
           "retarget", "switch_weights", "with_weights"]

log = logging.getLogger("kvtier.connector")

KV_JOBS = (JobKind.STORE, JobKind.LOAD)  # the jobs that touch vLLM's KV tensors
# the jobs that read DRAM slots: into vLLM's KV, to NVMe, into a snapshot file
READS_DRAM = (JobKind.LOAD, JobKind.DEMOTE, JobKind.FLUSH, JobKind.SNAPSHOT)
_HINT = ("wake vLLM with the model and KV settings it slept with, or restart the server (the tiers then "
         "start over for the new ones)")


def kv_signature(layers: Sequence[Any]) -> tuple:
    """What must not change while vLLM sleeps: each KV tensor's shape, dtype and device."""
    return tuple((tuple(layer.shape), str(layer.dtype), layer.device.type) for layer in layers)


def _describe(geometry: "KVGeometry") -> str:
    return (f"{geometry.num_layers} layers x {geometry.num_kv_heads} KV heads x {geometry.head_dim}, "
            f"{geometry.block_tokens}-token blocks, {geometry.dtype}")


def check_same_geometry(then: "ModelFingerprint", now: "ModelFingerprint", kept: tuple, found: tuple) -> None:
    """Raise ``ConfigError`` (one line, with a hint) when vLLM wakes up with KV that kvtier's tiers
    cannot serve: another geometry, KV scaling or tensor-parallel size, or kept tensors whose shape
    or dtype changed."""
    if now.geometry != then.geometry:
        raise ConfigError(f"vLLM woke up with another KV geometry ({_describe(now.geometry)}; kvtier's tiers hold "
                          f"{_describe(then.geometry)})", hint=_HINT)
    if (now.kv_scales, now.shards) != (then.kv_scales, then.shards):
        raise ConfigError(f"vLLM woke up with another KV scaling or tensor-parallel size ({now.kv_scales or 'none'}, "
                          f"{now.shards} ranks; kvtier's tiers hold {then.kv_scales or 'none'}, {then.shards})",
                          hint=_HINT)
    if found != kept:
        changed = next(i for i, (a, b) in enumerate(zip(kept, found)) if a != b) if len(found) == len(kept) else None
        where = f"layer {changed}: {found[changed]}, was {kept[changed]}" if changed is not None else \
            f"{len(found)} KV tensors, was {len(kept)}"
        raise ConfigError(f"vLLM's KV tensors changed shape while it slept ({where})", hint=_HINT)


def attach_kv(mover: "Mover", layers: "Sequence[Any] | None", adapter: Any) -> None:
    """Give the mover vLLM's KV tensors and their layout adapter (None, None: take them away; a
    store or load then fails as "mover has no KV tensors" instead of touching unmapped memory)."""
    mover.copies.kv_layers = list(layers) if layers is not None else None
    mover.copies.adapter = adapter


def retarget(mover: "Mover", fingerprint: "ModelFingerprint") -> set[int]:
    """Make every part of the mover that tags or checks blocks with the fingerprint (NVMe records,
    snapshot files, the shared store) use ``fingerprint``; forget what the DRAM slots hold, so
    write-behind and the shared tier never copy a block of the old weights out under the new one.
    Returns those slots: nothing may read them until the manager frees them."""
    for part in (mover, mover.copies, mover.disk_moves, mover.behind, mover.snapshots, mover.fetches,
                 mover.publisher):
        if part is not None:
            part.fingerprint = fingerprint
    stale = set(mover.ledger.slot_owner)
    mover.ledger.forget(sorted(stale))
    return stale


def with_weights(fingerprint: "ModelFingerprint", weights: str) -> "ModelFingerprint":
    return dataclasses.replace(fingerprint, weights=weights)


def refused_result(job: Job, rank: int, error: str | None) -> JobResult:
    """A job the worker does not run: every move failed (``error`` None: no disk trouble to report)."""
    return JobResult(job_id=job.job_id, kind=job.kind, ok=False, failed=list(range(len(job.moves))), error=error,
                     rank=rank)


def switch_weights(fingerprint: "ModelFingerprint", weights: str, manager: "TierManager",
                   enqueue: Callable[[Job], None]) -> "ModelFingerprint":
    """The scheduler half, told by a worker that vLLM woke up with other weights: drop every session
    (their blocks were computed with the old weights; the DROP jobs delete their NVMe copies) and
    return the fingerprint to plan under from now on."""
    dropped = 0
    for session_id in list(manager.table.sessions):
        if manager.table.session(session_id).pinned is not None:
            manager.planner.unpin(session_id)
        job = manager.planner.evict(session_id, None)
        if job is not None:  # a DROP of its NVMe copies
            enqueue(job)
        dropped += 1
    message = (f"the model's weights changed while vLLM slept ({fingerprint.weights or 'unknown'} -> "
               f"{weights or 'unknown'}): kvtier dropped the {dropped} sessions computed with the old ones")
    log.warning("kvtier: %s", message)
    manager.telemetry.warn("weights_changed", message)
    return with_weights(fingerprint, weights)
