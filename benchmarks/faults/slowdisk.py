"""A disk that turns slow while serving (``python -m benchmarks faults --slow-disk``).

A real ``kvtier serve`` on the tiny demo model; three sessions of ``tokens`` tokens are computed, then
turns go round them, each session evicted to NVMe and vLLM's prefix cache reset before its turn
(``kvtier.bench.checks.reset_served_prefix_cache``: a reset vLLM refuses is retried, never taken for
done), so the turn's prefix is on the disk: loaded from NVMe or recomputed, as the cost model
decides. A turn counts as recomputed only on kvtier's own record of it (``turn_outcome``: nothing
loaded, nothing in vLLM's prefix cache, every prompt token computed); a turn that is neither loaded
nor recomputed (a prefix-cache hit: fast, and no evidence of anything) refuses the figures. Right
after each turn a fresh prompt of the same length (no stored prefix) is timed: the turn's recompute
reference, in the same server and minute. Phases: healthy; the disk slowed 10x; slowed ``factor``x
(``heavy_factor``: at least 200x, and enough that a slowed load costs 3x a recompute measured on this
box, so that loading from NVMe loses to recomputing whatever the CPU); healthy again.

How the disk is slowed (``method``):
* ``blkio``: a real throttle. The server's processes are moved into a cgroup v1 ``blkio`` group of
  their own, whose ``read_bps_device`` / ``write_bps_device`` on the NVMe directory's device are set
  to the disk's measured direct-read rate / factor (only the server's IO is throttled; O_DIRECT IO,
  which the tier uses, is what v1 throttles).
* ``injected``: the fault file (``KVTIER_FAULT_FILE``): every data IO of the NVMe tier takes factor x
  its own time (``kvtier.tiers.fileio.set_slowdown``, a sleep after the syscall).
The fault file is set in both: at each phase change the worker logs its step-path counters.

Keys: ``slow_disk_noticed_after_loads`` (turns that loaded from the slowed disk before the first that
recomputed), ``slow_disk_ttft_vs_recompute_max`` (the turns after that: TTFT / the median of the slow phase's
recompute references; ``_ttft_vs_adjacent_reference_max``: against the one timed right after each),
``slow_disk_failed_requests``, ``slow_disk_resume_s`` (the disk healthy again -> the start of the
first turn that loaded from NVMe).
"""
from __future__ import annotations

import math
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

__all__ = ["run_slow_disk_bench", "SLOW_DISK_KEYS", "turn_outcome"]

SLOW_DISK_KEYS = ("slow_disk_ttft_vs_recompute_max", "slow_disk_failed_requests", "slow_disk_noticed_after_loads",
                  "slow_disk_resume_s")
BLKIO = Path("/sys/fs/cgroup/blkio")


def _prompt(seed: int, tokens: int) -> list[int]:
    return [3 + (i * 131 + seed * 7919) % 1900 for i in range(tokens)]


class _Blkio:
    """A blkio cgroup of the server's own, throttled on the NVMe directory's device."""

    def __init__(self, directory: Path, pids: list[int]):
        dev = os.stat(directory).st_dev
        self.device = f"{os.major(dev)}:{os.minor(dev)}"
        self.group = BLKIO / f"kvtier-slow-disk-{os.getpid()}"
        self.group.mkdir(exist_ok=True)
        for pid in pids:
            (self.group / "cgroup.procs").write_text(str(pid))

    def limit(self, bps: int) -> None:  # 0: no limit
        for name in ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device"):
            (self.group / name).write_text(f"{self.device} {bps}")

    def served_bytes(self) -> dict:
        """Bytes the group read and wrote on the device (every process of the server, every file)."""
        out = {}
        for line in (self.group / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == self.device and parts[1] in ("Read", "Write"):
                out[parts[1].lower()] = int(parts[2])
        return out

    def close(self) -> None:
        self.limit(0)
        for pid in (self.group / "cgroup.procs").read_text().split():
            (BLKIO / "cgroup.procs").write_text(pid)
        self.group.rmdir()


def blkio_writable(directory: Path) -> bool:
    """Whether a child blkio group can be made and throttled here (root in a VM; not in most containers)."""
    probe = BLKIO / f"kvtier-probe-{os.getpid()}"
    try:
        probe.mkdir()
        try:
            dev = os.stat(directory).st_dev
            (probe / "blkio.throttle.read_bps_device").write_text(f"{os.major(dev)}:{os.minor(dev)} 0")
            return True
        finally:
            probe.rmdir()
    except OSError:
        return False


def _server_pids(pid: int) -> list[int]:
    import psutil

    proc = psutil.Process(pid)
    return [proc.pid] + [child.pid for child in proc.children(recursive=True)]


def turn_outcome(row: dict) -> str:
    """What a timed turn was, from what was recorded of it: ``loaded`` (kvtier loaded some of its
    prefix), ``recomputed`` (kvtier's record of the turn, ``vllm_cached_tokens`` / ``recomputed_tokens``
    of ``GET /v1/sessions/<id>``'s last turn, shows this prompt computed in full: nothing in vLLM's
    prefix cache), or ``unexplained`` (nothing loaded, but no such record: a prefix-cache hit, which
    a refused reset leaves, or a turn not recorded)."""
    if row.get("loaded", 0) > 0:
        return "loaded"
    record = row.get("record") or {}
    prompt = row.get("prompt_tokens")
    if (prompt and record.get("prompt_tokens") == prompt and record.get("vllm_cached_tokens") == 0
            and record.get("loaded_tokens") == 0 and record.get("recomputed_tokens") == prompt):
        return "recomputed"
    return "unexplained"


def _turn(server, admin, name: str, prompt: list[int], ref_seed: int, failures: list[str]) -> dict:
    from kvtier.bench.checks import FigureRefused, reset_served_prefix_cache
    from kvtier.control.client import AdminClient

    row: dict = {"session": name, "prompt_tokens": len(prompt)}
    try:
        admin.wait(admin.post(AdminClient.session_path(name, "evict"), {"to": "nvme"}), timeout=600)
        reset_served_prefix_cache(server.url, server.served_name)
        row["started"] = time.monotonic()
        got = server.turn(name, prompt, max_tokens=1)
        row.update(ttft_s=got["seconds"], loaded=got["loaded"])
        turns = admin.get(AdminClient.session_path(name)).get("turns") or [{}]
        row["record"] = {k: turns[-1].get(k) for k in ("prompt_tokens", "vllm_cached_tokens", "loaded_tokens",
                                                        "recomputed_tokens", "reason")}
        row["outcome"] = turn_outcome(row)
        ref = server.turn(f"ref-{ref_seed}", _prompt(ref_seed, len(prompt)), max_tokens=1)
        row.update(recompute_s=ref["seconds"], ratio=got["seconds"] / ref["seconds"])
    except FigureRefused:  # a reset vLLM never accepted: not a failed request, no figure at all
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is counted
        failures.append(f"{name}: {type(exc).__name__}: {exc}")
    status = admin.get("/v1/status")
    row["nvme_slow_warning"] = bool((status.get("warnings") or {}).get("nvme_slow"))
    return row


def _phases(server, control: Path, sessions: dict, slow: Callable[[float], None] | None, factor: float,
            quick: bool, say: Callable[[str], None]) -> tuple[list[dict], dict, list[str]]:
    """``slow(x)``: throttle the disk x times (None: the injected fault, through ``control``)."""
    plan = [("healthy", 1.0, 2 if quick else 3), ("10x", 10.0, 3), (f"{factor:g}x", factor, 6 if quick else 9),
            ("recovered", 1.0, 5 if quick else 6)]
    rows, marks, failures = [], {}, []
    admin = server.admin()
    names = list(sessions)
    turn = 0
    for phase, slowdown, turns in plan:
        if slow is not None:
            slow(slowdown)
        injected = f"nvme_slowdown={slowdown:g}\n" if slow is None else ""
        control.write_text(f"{injected}# phase {phase}\n")  # the worker logs its step-path counters at each change
        marks[phase] = time.monotonic()
        say(f"phase {phase}: NVMe slowed {slowdown:g}x")
        for _ in range(turns):
            name = names[turn % len(names)]
            sessions[name] = sessions[name] + _prompt(500 + turn, 64)  # the next message
            row = _turn(server, admin, name, sessions[name], 10_000 + turn, failures)
            row.update(turn=turn, phase=phase, slowdown=slowdown, at_s=row.get("started", 0) - marks[phase])
            rows.append(row)
            say(f"  turn {turn} {name} {len(sessions[name]):,} tok: TTFT {row.get('ttft_s', float('nan')):.2f} s, "
                f"recompute {row.get('recompute_s', float('nan')):.2f} s, loaded {row.get('loaded', 0):,}"
                + (", model: slow disk" if row["nvme_slow_warning"] else ""))
            turn += 1
    admin.close()
    return rows, marks, failures


def _figures(rows: list[dict], marks: dict, factor: float) -> dict:
    """The keys from the turns' rows; refused (``FigureRefused``) when a timed turn was neither loaded
    nor recomputed (``turn_outcome``): its TTFT would time a prefix-cache hit."""
    from kvtier.bench.checks import require

    unexplained = [f"turn {r.get('turn')} ({r.get('phase')}): {r.get('record')}" for r in rows
                   if "ratio" in r and turn_outcome(r) == "unexplained"]  # every complete turn
    require(not unexplained, f"{len(unexplained)} turn(s) neither loaded from kvtier nor recomputed in full: "
            + "; ".join(unexplained[:3]),
            hint="vLLM's prefix cache served them (a reset that did not take?): the slow-disk figures would "
                 "time prefix-cache hits")
    slow = [r for r in rows if r["phase"] == f"{factor:g}x" and "ratio" in r]
    loads_before = 0
    noticed_at = None
    for i, row in enumerate(slow):
        if turn_outcome(row) == "recomputed":
            noticed_at = i
            break
        loads_before += 1
    after = slow[noticed_at:] if noticed_at is not None else []
    # a turn's recompute time: the median of the phase's references (fresh prompts of the same length,
    # within 1%), not the one timed beside it: on 2 shared cores one prefill of 8k tokens varies by
    # +-25%, and a max over single pairs measures that spread more than kvtier
    reference = statistics.median([r["recompute_s"] for r in slow]) if slow else None
    recovered = [r for r in rows if r["phase"] == "recovered" and "loaded" in r]
    first_load = next((r for r in recovered if r["loaded"] > 0), None)
    return {"slow_disk_noticed_after_loads": loads_before if noticed_at is not None else None,
            "slow_disk_ttft_vs_recompute_max": max((r["ttft_s"] / reference for r in after), default=None),
            "slow_disk_resume_s": first_load["started"] - marks["recovered"] if first_load else None,
            "_ttft_vs_adjacent_reference_max": max((r["ratio"] for r in after), default=None),
            "_recompute_reference_s": reference,
            "_recompute_reference_spread_s": [min(r["recompute_s"] for r in slow), max(r["recompute_s"] for r in slow)]
            if slow else None,
            "_slow_loaded_ratio_max": max((r["ratio"] for r in slow[:noticed_at]), default=None)}


def heavy_factor(disk_bps: float, session_bytes: int, recompute_s: float, least: float = 200.0) -> float:
    """The heavy slowdown: at least ``least``, and enough that reading a session's KV from the slowed
    disk takes 3x its recompute here. A fixed 200x was chosen on a box whose CPU recomputes fast; on a
    slower CPU a load at 200x still won (kvtier rightly kept loading) and the phase measured nothing."""
    return float(max(least, math.ceil(3 * recompute_s * disk_bps / max(session_bytes, 1))))


def run_slow_disk_bench(quick: bool = False, progress: Callable[[str], None] = print, method: str | None = None,
                        factor: float | None = None, model: str | None = None) -> dict:
    """``method``: ``blkio`` or ``injected`` (default: blkio where writable). ``factor``: the heavy
    slowdown (default: ``heavy_factor``, what makes a load cost 3x its recompute on this box)."""
    from kvtier.bench.agents.regimes import kv_bytes_per_token
    from kvtier.launch.served import Served
    from kvtier.models.demo import ensure_demo_model
    from kvtier.plan.costmodel import measure_nvme_read_bps
    from kvtier.plugins.vllm.diskprobe import FAULT_ENV

    model = str(model or ensure_demo_model("tiny", progress=progress))
    tokens = 4096 if quick else 8192
    out: dict = {"_tokens_per_session": tokens}
    with tempfile.TemporaryDirectory(prefix="kvtier-slowdisk-") as tmp:
        base = Path(tmp)
        (base / "nvme").mkdir()
        method = method or ("blkio" if blkio_writable(base / "nvme") else "injected")
        control = base / "fault"
        control.write_text("")
        saved = os.environ.get(FAULT_ENV)
        os.environ[FAULT_ENV] = str(control)
        try:
            server = Served(model, base, "slowdisk", tokens + 2048, "2", dram="1GiB")
        finally:
            os.environ.pop(FAULT_ENV) if saved is None else os.environ.__setitem__(FAULT_ENV, saved)
        cgroup = None
        try:
            disk_bps, _how = measure_nvme_read_bps(base / "nvme", 64 << 20)
            out.update(_disk_read_gbps=disk_bps / 1e9)
            if factor is None:  # a fresh prompt of a session's length, recomputed: what a load must lose to
                recompute_s = server.turn("probe", _prompt(999, tokens + 64), max_tokens=1)["seconds"]
                factor = heavy_factor(disk_bps, kv_bytes_per_token(model) * (tokens + 64), recompute_s)
                out.update(_factor_from={"recompute_s": round(recompute_s, 3), "disk_read_gbps": disk_bps / 1e9})
            out["_factor"] = factor
            if method == "blkio":
                cgroup = _Blkio(base / "nvme", _server_pids(server.proc.pid))

                def slow(x: float) -> None:
                    cgroup.limit(0 if x <= 1 else int(disk_bps / x))
                out["slow_disk_method"] = ("blkio throttle (cgroup v1 read_bps_device / write_bps_device of the "
                                           "server's processes) at the disk's measured direct-read rate / factor")
            else:
                slow = None
                out["slow_disk_method"] = ("injected delay (KVTIER_FAULT_FILE -> kvtier.tiers.fileio.set_slowdown: "
                                           "every NVMe data IO takes factor x its own time)")
            progress(f"server up in {server.start_s:.0f} s; slowing the disk by {method}")
            sessions = {f"s{i}": _prompt(i, tokens) for i in range(3)}
            for name, prompt in sessions.items():
                server.turn(name, prompt, max_tokens=1)
            rows, marks, failures = _phases(server, control, sessions, slow, factor, quick, progress)
            admin = server.admin()
            out["_links"] = admin.get("/v1/status").get("links")  # kvtier's own bytes, beside the group's
            admin.close()
        finally:
            if cgroup is not None:
                out["_blkio_bytes"] = cgroup.served_bytes()
                cgroup.close()
            server.stop()
        log = server.log_path.read_text()
    out.update(_figures(rows, marks, factor))
    out["slow_disk_failed_requests"] = len(failures)
    out["_failures"] = failures[:10]
    out["_turns"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "started"}
                     for r in rows]
    out["_worker_fault_log"] = re.findall(r"INJECTED FAULT.*", log)
    out["_model_log"] = re.findall(r"kvtier: NVMe reads (?:take|are back).*", log)
    return out
