"""Where kvtier's background threads run: off the cores the forward pass is bound to.

vLLM's CPU backend binds each rank's worker process, and every thread it starts later, to the cores
of that rank's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``), and reserves the others for the
engine's own Python (``VLLM_CPU_NUM_OF_RESERVED_CPU``). kvtier's copy, IO and write-behind threads
are started in the worker after that binding, so they inherit the forward pass's cores and take
turns with its matmuls. :func:`off_forward_cores` moves the calling thread to the cores no rank
computes on; it is the ``initializer`` of kvtier's thread pools and the first call of its threads.
Where nothing is bound (a GPU worker, an in-process engine) or no core is left over, it does nothing.
"""
from __future__ import annotations

import os
import threading

__all__ = ["forward_cores", "off_forward_cores", "plan_spare", "spare_cores"]

_decided: dict[str, frozenset[int] | None] = {}
_lock = threading.Lock()


def _parse_cores(text: str) -> set[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def forward_cores(environ: dict | None = None, own: set[int] | None = None) -> set[int]:
    """The cores any rank's forward pass is bound to: every group of an explicit
    ``VLLM_CPU_OMP_THREADS_BIND`` ("0-3|4-7"), else this worker's own binding."""
    environ = os.environ if environ is None else environ
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if bind and bind not in ("auto", "all", "nobind"):
        try:
            return set().union(*(_parse_cores(group) for group in bind.split("|")))
        except ValueError:
            pass
    return set(own if own is not None else os.sched_getaffinity(0))


def spare_cores(environ: dict | None = None) -> frozenset[int] | None:
    """The cores this process may use that no rank's forward pass is bound to (decided once per
    process); None when the forward pass is not bound to a subset, or nothing is left over."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    key = str(os.getpid())
    with _lock:
        if key not in _decided:
            _decided[key] = _spare(environ)
        return _decided[key]


def _spare(environ: dict | None) -> frozenset[int] | None:
    try:
        own = set(os.sched_getaffinity(0))
        allowed = set(os.sched_getaffinity(os.getppid())) | own  # the engine process is not bound
    except OSError:
        return None
    return plan_spare(own, allowed, environ)


def plan_spare(own: set[int], allowed: set[int], environ: dict | None = None) -> frozenset[int] | None:
    """``allowed`` (the engine process's cores) less every rank's forward cores, when this worker
    (bound to ``own``) is bound to a subset of them at all."""
    if own >= allowed:
        return None  # this process is not bound to a subset: nothing to move away from
    spare = allowed - forward_cores(environ, own)
    return frozenset(spare) or None


def off_forward_cores() -> bool:
    """Move the calling thread to the spare cores (True when it moved)."""
    spare = spare_cores()
    if not spare:
        return False
    try:
        os.sched_setaffinity(threading.get_native_id(), spare)
        return True
    except OSError:
        return False
