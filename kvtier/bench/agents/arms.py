"""The serving arms: one server each, started once, with equal engine flags.

* ``vllm``: plain vLLM, prefix caching only, the run's engine KV cache;
* ``floor``: plain vLLM with an engine KV cache that holds the largest working set: the best any
  tier could do, so kvtier's own overhead shows;
* ``kvtier``: ``kvtier serve`` with the run's engine KV cache, DRAM tier and NVMe behind it;
* ``native``: vLLM's own CPU offloading (OffloadingConnector) with the same host bytes;
* ``lmcache``: LMCache's connector with the same host and disk bytes, when it is installed.

An arm that cannot start is skipped with its reason (the others still run); one that starts but
loads nothing it should is reported as degraded, never as a result.
"""
from __future__ import annotations

import importlib.util
import json
import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvtier.bench.agents.regimes import Sizes
from kvtier.errors import NotFoundError, UsageError

__all__ = ["ARMS", "QUICK_ARMS", "SERVED_NAME", "ArmSkipped", "empty_caches", "link_remeasurements", "parse_arms",
           "reset_prefix_cache", "server_counters", "settle", "start_arm"]

ARMS = ("vllm", "floor", "kvtier", "native", "lmcache")
QUICK_ARMS = ("vllm", "floor", "kvtier")
# kvtier re-measures its links whenever its engine is quiet: on a box where the arms take turns that is
# while the others are timed, so its arm runs with re-measurement off (the setting `rates_refresh`)
KVTIER_ENV = {"KVTIER_RATES_REFRESH": "0"}
LOADING_ARMS = ("kvtier", "native", "lmcache")  # arms that should load KV from outside the engine
SERVED_NAME = "agents"  # every arm's --served-model-name


class ArmSkipped(Exception):
    """The arm could not start here; its message is the reason."""


def parse_arms(text: str | None, quick: bool) -> list[str]:
    if not text:
        return list(QUICK_ARMS if quick else ARMS)
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise UsageError(f"unknown arm {unknown[0]!r}" if unknown else "no arm given",
                         hint=f"--arms takes a comma-separated list of: {', '.join(ARMS)}")
    if "vllm" not in arms:
        arms.insert(0, "vllm")  # every figure is a ratio against plain vLLM
    return list(dict.fromkeys(arms))


@dataclass
class Arm:
    name: str
    server: object  # a kvtier.launch.served.Served
    loads: bool  # should load KV from outside the engine

    @property
    def url(self) -> str:
        return self.server.url


def _root_cause(log: Path) -> str:
    """What a server that died at start said first (its root cause; vLLM's later lines only point
    back at it)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in lines:
        match = re.search(r"\b\w*(?:Error|Exception): (.+)$", line)
        if match and " WARNING " not in line:
            return match.group(1)[:240]
    return (lines[-1] if lines else "no output")[:240]


def _engine_args(sizes: Sizes, kv_bytes: int, passthrough: tuple[str, ...]) -> tuple[str, ...]:
    return ("--kv-cache-memory-bytes", str(kv_bytes), *passthrough)


def start_arm(name: str, model: str, base: Path, sizes: Sizes, passthrough: tuple[str, ...],
              dram: int | None = None, nvme: int | None = None, label: str | None = None) -> Arm:
    """Start one arm's server (raises ArmSkipped with the reason when it cannot start)."""
    from kvtier.launch.serve import is_cpu_only
    from kvtier.launch.served import Served

    common = dict(max_len=sizes.max_len, max_seqs=sizes.concurrency, served_name=SERVED_NAME)
    label = label or name
    try:
        if name in ("vllm", "floor"):
            kv = sizes.floor_kv if name == "floor" else sizes.engine_kv
            return Arm(name, Served(model, base, label, connector=False,
                                    vllm_args=_engine_args(sizes, kv, passthrough), **common), False)
        if name == "kvtier":
            server = Served(model, base, label, nvme_dir=base / f"{label}-nvme",
                            dram=str(dram if dram is not None else sizes.dram),
                            nvme=str(nvme if nvme is not None else sizes.nvme),
                            vllm_args=_engine_args(sizes, sizes.engine_kv, passthrough), env=KVTIER_ENV,
                            **common)
            return Arm(name, server, True)
        if name == "native":
            gib = f"{sizes.dram / (1 << 30):.3f}"
            args = ("--kv-offloading-size", gib, "--kv-offloading-backend", "native")
            return Arm(name, Served(model, base, label, connector=False,
                                    vllm_args=_engine_args(sizes, sizes.engine_kv, (*args, *passthrough)),
                                    **common), True)
        if name == "lmcache":
            if importlib.util.find_spec("lmcache") is None:
                raise ArmSkipped("LMCache is not installed (`pip install lmcache` on a GPU box)")
            if is_cpu_only():
                raise ArmSkipped("LMCache has no CPU connector (its GPU-connector factory: "
                                 "'No supported cpu connector found'); run this arm on a GPU box")
            return _start_lmcache(model, base, label, sizes, passthrough, common)
    except ArmSkipped:
        raise
    except RuntimeError as exc:  # the server exited while starting
        log = base / f"{label}.log"
        raise ArmSkipped(_root_cause(log) if log.exists() else str(exc)[:240]) from None
    raise UsageError(f"unknown arm {name!r}")


def _start_lmcache(model: str, base: Path, label: str, sizes: Sizes, passthrough: tuple[str, ...],
                   common: dict) -> Arm:  # pragma: no cover - needs a GPU box
    import os

    from kvtier.launch.served import Served

    disk = base / f"{label}-disk"
    disk.mkdir(exist_ok=True)
    os.environ.update(LMCACHE_LOCAL_CPU="True", LMCACHE_MAX_LOCAL_CPU_SIZE=f"{sizes.dram / (1 << 30):.3f}",
                      LMCACHE_LOCAL_DISK=f"file://{disk}/",
                      LMCACHE_MAX_LOCAL_DISK_SIZE=f"{sizes.nvme / (1 << 30):.3f}", LMCACHE_CHUNK_SIZE="256")
    config = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    args = ("--kv-transfer-config", config)
    return Arm("lmcache", Served(model, base, label, connector=False,
                                 vllm_args=_engine_args(sizes, sizes.engine_kv, (*args, *passthrough)), **common), True)


def reset_prefix_cache(arm: Arm, clock: Callable[[], float] = time.monotonic) -> int:
    """Empty the arm's engine prefix cache, for real (a reset vLLM refuses while blocks are held is
    retried with an engine step between; one never accepted refuses the figure: ``FigureRefused``).
    The tries it took."""
    from kvtier.bench.checks import reset_served_prefix_cache

    return reset_served_prefix_cache(arm.url, SERVED_NAME, clock=clock)


def _admin(arm: Arm):
    """kvtier's admin API, with a client timeout past the longest wait asked of it."""
    from kvtier.control.client import AdminClient

    return AdminClient(arm.server.socket, timeout=WAIT_S + 30)


WAIT_S = 60  # the longest wait for kvtier's background work between passes


def _wait_clean(admin) -> int:
    """Wait (on the server's own condition, at most WAIT_S) until no DRAM block lacks its NVMe copy;
    the DRAM-only blocks left when it answers (0: clean)."""
    status = admin.request("GET", f"/v1/status?until=clean&wait_s={WAIT_S}")
    return int((status.get("dirty") or {}).get("dirty_blocks") or 0)


def _drop_sessions(admin) -> None:
    """Drop every session kvtier holds. A session gone between the listing and its drop (404, and
    gone when asked again) is skipped; any other refusal or fault is raised: tiers that were not
    emptied would make the next regime's loads hits of the last one."""
    for session in admin.request("GET", "/v1/sessions?limit=100000")["sessions"]:
        path = admin.session_path(session["session_id"])
        try:
            admin.request("POST", path + "/evict", {"to": "drop"})
        except NotFoundError:
            try:
                admin.request("GET", path)
            except NotFoundError:
                continue  # it went meanwhile: nothing left to drop
            raise


def empty_caches(arm: Arm, clock: Callable[[], float] = time.monotonic) -> int:
    """Forget everything between regimes: kvtier's tiers (every session dropped) and the engine's
    prefix cache (a reset vLLM accepted). Returns kvtier's DRAM-only blocks still waiting when it
    went on (0: none)."""
    left = 0
    if arm.name == "kvtier":
        admin = _admin(arm)
        try:
            _drop_sessions(admin)
            left = _wait_clean(admin)
        finally:
            admin.close()
    reset_prefix_cache(arm, clock)
    return left


def settle(arm: Arm) -> int:
    """After an arm's pass: let it finish its own background work (kvtier's write-behind of what
    the pass left in DRAM only) before the next arm takes the box. Returns the DRAM-only blocks
    still waiting when it went on (0: all written)."""
    return _wait_clean(_admin(arm)) if arm.name == "kvtier" else 0


def link_remeasurements(arm: Arm) -> int | None:
    """How many times kvtier's connector re-measured its links so far (None for the other arms): 0
    with ``KVTIER_ENV``'s re-measurement off, which the run checks."""
    if arm.name != "kvtier":
        return None
    admin = _admin(arm)
    try:
        counters = admin.request("GET", "/v1/status").get("counters") or {}
    finally:
        admin.close()
    return int(counters.get("rate_refreshes") or 0)


_SOURCES = {"local_compute": "recomputed_tokens", "local_cache_hit": "engine_hit_tokens",
            "external_kv_transfer": "loaded_tokens"}


def server_counters(url: str) -> dict[str, float]:
    """vLLM's own prompt-token counters (by source) and request errors, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    out = {name: 0.0 for name in _SOURCES.values()}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = re.search(r'source="([a-z_]+)"', line)
            if source and source.group(1) in _SOURCES:
                out[_SOURCES[source.group(1)]] += float(line.rsplit(" ", 1)[1])
    return out
