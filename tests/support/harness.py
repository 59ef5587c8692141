"""The harnesses tests share, in one place: real servers and terminals the tests drive.

They live in ``kvtier.bench`` (the benchmarks drive the same servers); tests take them from here so
that a move inside ``kvtier.bench`` is one edit. Each name is imported on first use: a test of the
dashboard must not pull vLLM in because a served-engine harness sits beside its pseudo-terminal.

* ``demo_admin``, ``PtyApp`` (``benchmarks.top``): an in-process tier engine behind a real admin
  socket; ``kvtier top`` in a child process on a pseudo-terminal.
* ``Served`` (``kvtier.launch.served``): a real ``kvtier serve`` process, ready when constructed.
* ``free_port``, ``wait_ready`` (``kvtier.launch.served``): a free TCP port; wait until a server
  started on one answers.
* ``RedisServer``, ``start_cluster`` (``benchmarks.redisproc``): real Redis/Valkey processes for the
  shared tier.
* ``Engine``, ``cpu_environment`` (``kvtier.bench.harness``): vLLM with kvtier in this process.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "demo_admin": "benchmarks.top",
    "PtyApp": "benchmarks.top",
    "Served": "kvtier.launch.served",
    "free_port": "kvtier.launch.served",
    "wait_ready": "kvtier.launch.served",
    "RedisServer": "benchmarks.redisproc",
    "start_cluster": "benchmarks.redisproc",
    "Engine": "kvtier.bench.harness",
    "cpu_environment": "kvtier.bench.harness",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
