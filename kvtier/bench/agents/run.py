"""``kvtier bench agents``: every arm, started once, replays every regime's trace (each seed),
then the determinism pass; kvtier's arm on tight tiers replays a hinted trace. Records go to a
JSONL file as they come; the figures are returned as one dict."""
from __future__ import annotations

import http.client
import json
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import psutil

from kvtier.bench.agents import arms as armlib
from kvtier.bench.agents.load import Target, nominal_duration, replay, stream_completion
from kvtier.bench.agents.regimes import DEFAULTS, Sizes, check_box, kv_bytes_per_token, regime_trace
from kvtier.bench.agents.report import combine_seeds, hinted_ratio, summarize, summary_keys
from kvtier.bench.agents.trace import AgentMix, TurnSpec, materialize, read_trace, unique_tokens, with_hints
from kvtier.bench.checks import require

__all__ = ["AgentRun", "run_agents_bench"]


@dataclass
class AgentRun:
    """What the command line asked for."""

    model: str | None = None
    regimes: list[int] = field(default_factory=lambda: [1, 2, 3])
    arms: list[str] = field(default_factory=lambda: list(armlib.QUICK_ARMS))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    engine_kv: int = DEFAULTS["engine_kv"]
    dram: int = DEFAULTS["dram"]
    concurrency: int = DEFAULTS["concurrency"]
    sessions: int | None = None
    trace: Path | None = None
    records: Path | None = None  # per-request JSONL
    workdir: Path | None = None
    passthrough: tuple[str, ...] = ()  # vLLM flags after `--`, given to every arm
    mix: AgentMix = field(default_factory=AgentMix)
    hints: bool = True
    together: bool | None = None  # every server up at once, arms taking turns (None: on a CPU box)


def _cache_dtype(args: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith("--kv-cache-dtype"):
            return arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else None)
    return None


def plan_sizes(run: AgentRun, model: str, user_trace: list[TurnSpec] | None) -> Sizes:
    per_token = kv_bytes_per_token(model, _cache_dtype(run.passthrough))
    longest = max((t.input_tokens + t.output_tokens for t in user_trace), default=0) if user_trace else \
        run.mix.max_context + run.mix.output_tokens
    max_len = -(-(longest + 16) // 256) * 256
    sizes = Sizes(per_token, run.engine_kv, run.dram, 0, run.concurrency, max_len)
    return replace(sizes, nvme=max(64 << 20, 2 * sizes.working_set(3)))


class _RssSampler:
    """The peak resident memory of a server's process tree while a regime runs (one sample a second)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        try:
            root = psutil.Process(self.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return 0

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self._sample())
            if self._stop.wait(1.0):
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._sample())


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def _one_regime(arm, specs: list[TurnSpec], seed: int, concurrency: int, label: str, sink,
                server: str | None = None, settle: bool = True) -> tuple[dict, list]:
    armlib.empty_caches(arm)
    prompts = materialize(specs, seed)
    target = Target(arm.url, armlib.SERVED_NAME, hints=arm.name == "kvtier")
    before = armlib.server_counters(arm.url)
    sampler = _RssSampler(arm.server.proc.pid)
    started = time.perf_counter()
    records = replay(target, specs, prompts, concurrency)
    wall = time.perf_counter() - started
    rss = sampler.stop()
    counters = _delta(armlib.server_counters(arm.url), before)
    unsettled = armlib.settle(arm) if settle else None
    disk = _disk_bytes(arm.server.log_path.parent / f"{arm.server.log_path.stem}-nvme") if arm.name == "kvtier" \
        else None
    for record in records:
        sink({"arm": arm.name, "server": server or arm.name, "regime": label, "seed": seed, **record})
    summary = summarize(records, counters, wall, nominal_duration(specs), rss, disk)
    summary["unsettled_blocks"] = unsettled  # DRAM-only blocks the write-behind had not written a minute after
    return summary, records


def _determinism(arm, specs: list[TurnSpec], seed: int, clock: Callable[[], float] = time.monotonic) -> dict:
    """The same turns one at a time, the engine's prefix cache emptied (a reset vLLM accepted)
    before each, so a loading arm loads what plain vLLM recomputes: greedy outputs by turn
    (``texts``), the tokens the arm loaded and the turns that loaded any. A loading arm that loaded
    nothing in the pass is refused (``FigureRefused``): equal outputs from a recompute prove
    nothing about loaded KV."""
    armlib.empty_caches(arm, clock)
    prompts = materialize(specs, seed)
    target = Target(arm.url, armlib.SERVED_NAME)
    texts, loaded = {}, []
    host = urlparse(arm.url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=600)
    try:
        for spec in sorted(specs, key=lambda s: (s.session, s.turn)):
            armlib.reset_prefix_cache(arm, clock)
            before = armlib.server_counters(arm.url)["loaded_tokens"]
            texts[f"{spec.session}/{spec.turn}"] = stream_completion(conn, target, spec.session,
                                                                     prompts[(spec.session, spec.turn)],
                                                                     spec.output_tokens)["text"]
            loaded.append(armlib.server_counters(arm.url)["loaded_tokens"] - before)
    finally:
        conn.close()
    if arm.loads:
        require(sum(loaded) > 0, f"{arm.name} loaded no KV in the determinism pass ({len(texts)} turns, each after "
                                 f"a prefix-cache reset): its outputs come from recomputing",
                hint="equal outputs from a recompute prove nothing about loaded KV; see the arm's server log")
    return {"texts": texts, "loaded_tokens": sum(loaded), "turns_loading": sum(n > 0 for n in loaded)}


def _determinism_pass(arm, check: list[TurnSpec], outputs: dict, results: dict, progress) -> None:
    """Run the arm's determinism pass into ``outputs``; one that fails or is refused is reported
    under ``failed`` (the arm then has no determinism figure)."""
    progress(f"arm {arm.name}: determinism pass ({len(check)} turns, one at a time)")
    try:
        outputs[arm.name] = _determinism(arm, check, 77)
    except Exception as exc:  # noqa: BLE001 - reported, and the figures are kept
        results.setdefault("failed", {})[f"{arm.name} determinism pass"] = str(exc)[:300]
        progress(f"arm {arm.name}: determinism pass FAILED: {exc}")


def determinism_figures(outputs: dict[str, dict], results: dict) -> dict:
    """Each started arm's determinism outputs against plain vLLM's, turn by turn. An arm whose pass
    failed or was refused (a loading arm that loaded nothing), or that is degraded, counts for no
    figure (``invalid``, with the reason); ``outputs_equal`` is the lowest share among the arms that
    count, and None when kvtier's arm does not."""
    plain = (outputs.get("vllm") or {}).get("texts")
    if not plain:
        return {}
    arms, failed = results.get("arms") or {}, results.get("failed") or {}
    invalid = {}
    for name, entry in arms.items():
        if name == "vllm":
            continue
        if name not in outputs:
            invalid[name] = f"its determinism pass failed: {failed.get(f'{name} determinism pass', 'no outputs')}"
        elif entry.get("degraded"):
            invalid[name] = f"the arm is degraded: {entry['degraded']}"
    per_arm = {name: sum(o["texts"].get(k) == v for k, v in plain.items()) / len(plain)
               for name, o in outputs.items()}
    equal = [share for name, share in per_arm.items() if name != "vllm" and name not in invalid]
    out = {"turns": len(plain), "per_arm": per_arm,
           "loaded": {name: {"tokens": o["loaded_tokens"], "turns": o["turns_loading"]}
                      for name, o in outputs.items() if arms.get(name, {}).get("loads")},
           "outputs_equal": None if "kvtier" in invalid else (min(equal) if equal else None)}
    if invalid:
        out["invalid"] = invalid
    return out


def _determinism_trace(mix: AgentMix, sizes: Sizes) -> list[TurnSpec]:
    specs = regime_trace(replace(mix, subagent_frac=0.0), sizes, 2, seed=77)
    keep = list(dict.fromkeys(s.session for s in specs))[:3]
    return [s for s in specs if s.session in keep and s.turn <= 5]


def run_agents_bench(run: AgentRun, progress: Callable[[str], None]) -> dict:
    from kvtier.models.demo import ensure_demo_model

    model = run.model or str(ensure_demo_model("tiny", progress=progress))
    user_trace = read_trace(run.trace) if run.trace else None
    sizes = plan_sizes(run, model, user_trace)
    base = Path(run.workdir or tempfile.mkdtemp(prefix="kvtier-agents-"))
    base.mkdir(parents=True, exist_ok=True)
    from kvtier.launch.serve import is_cpu_only

    run = replace(run, together=is_cpu_only() if run.together is None else run.together)
    check_box(sizes, base, run.arms, run.together)
    labels = ["trace"] if user_trace else [str(r) for r in run.regimes]
    traces = {(label, seed): (user_trace if user_trace else
                              regime_trace(run.mix, sizes, int(label), seed, run.sessions))
              for label in labels for seed in (run.seeds if not user_trace else run.seeds[:1])}
    for (label, seed), specs in sorted(traces.items()):
        progress(f"regime {label} seed {seed}: {len({s.session for s in specs})} sessions, {len(specs)} turns, "
                 f"working set {unique_tokens(specs) * sizes.kv_bytes_per_token >> 20} MiB")
    check = _determinism_trace(run.mix, sizes)
    mix = run.mix
    workload = [("think time", f"lognormal, median {mix.think_median_s:g} s; {mix.long_pause_frac:.0%} of turns "
                                f"after a long pause of {mix.long_pause_s:g} s"),
                ("sessions", f"Poisson, {mix.arrival_rate:g}/s; shared prefix {mix.shared_tokens}, own context "
                             f"~{mix.prefix_median}, tool results ~{mix.tool_median}, answers {mix.output_tokens} "
                             f"tokens; {mix.subagent_frac:.0%} fork a subagent"),
                ("seeds", ", ".join(map(str, run.seeds)))]
    results: dict = {"sizes": dict(sizes.describe() + ([] if user_trace else workload)), "defaults": DEFAULTS,
                     "arms": {}, "skipped": {}, "determinism": {}, "hints": {}, "model": model,
                     "workdir": str(base)}
    if "kvtier" in run.arms:
        results["sizes"]["kvtier link re-measurement"] = _remeasure_note()
    records_path = run.records or base / "requests.jsonl"
    outputs: dict[str, dict] = {}
    with open(records_path, "w") as sink_file:
        def sink(record: dict) -> None:
            sink_file.write(json.dumps(record) + "\n")
            sink_file.flush()  # a record is on disk as soon as its request ends

        _run_arms(model, base, sizes, run, traces, check, results, outputs, sink, progress)
        if run.hints and "kvtier" in run.arms and "kvtier" not in results["skipped"] and not user_trace:
            _run_hints(model, base, sizes, run, sink, results, progress)
    results["records"] = str(records_path)
    results["determinism"] = determinism_figures(outputs, results)
    results["concurrent_outputs_differ"] = _concurrent_differences(records_path)
    results.update(summary_keys(results, [int(x) for x in labels if x.isdigit()]))
    return results


def _remeasure_note() -> str:
    """What the kvtier arm's connector does about its links during the run (``armlib.KVTIER_ENV``)."""
    return ("off (KVTIER_RATES_REFRESH=0): the links measured at start only, so nothing of kvtier's runs "
            "while the other arms are timed; the count is under the arm's link_remeasurements")


def _start_arms(names: list[str], model, base, sizes, run, results, progress, label: str = "") -> dict:
    """The arms' servers, each started once and warmed up (the store and load paths both: the
    second round comes from kvtier's tiers). An arm that cannot start is skipped with its reason."""
    live = {}
    warm = [TurnSpec(f"warm-{i}", turn, 256 * turn, 8, arrival_s=0.0 if turn == 1 else None,
                     think_s=None if turn == 1 else 0.0) for i in range(run.concurrency) for turn in (1, 2)]
    for name in names:
        progress(f"arm {label or name}: starting its server")
        try:
            arm = armlib.start_arm(name, model, base, sizes, run.passthrough, label=label or None)
        except armlib.ArmSkipped as exc:
            results["skipped"][name] = str(exc)
            progress(f"arm {name}: skipped: {exc}")
            continue
        live[name] = arm
        progress(f"arm {label or name}: up in {arm.server.start_s:.0f} s; warming up")
        warm_up(arm, warm, run.concurrency)
    return live


def warm_up(arm, warm: list[TurnSpec], concurrency: int, clock: Callable[[], float] = time.monotonic) -> None:
    """Replay the warm-up turns twice (the store and load paths both: the second round comes from
    kvtier's tiers), the engine's prefix cache emptied after each (a reset vLLM accepted)."""
    for _ in range(2):
        replay(Target(arm.url, armlib.SERVED_NAME), warm, materialize(warm, 999), concurrency)
        armlib.reset_prefix_cache(arm, clock)


def _passes(names: list[str], round_: int) -> list[tuple[str, str]]:
    """One round's order, as (arm, pass label): plain vLLM first and again last (its drift between
    the two is the round's noise band), the others between, their order turned every round."""
    middle = [n for n in names if n != "vllm"]
    middle = middle if round_ % 2 == 0 else middle[::-1]
    if "vllm" not in names:
        return [(n, n) for n in middle]
    return [("vllm", "vllm"), *[(n, n) for n in middle], *([("vllm", "vllm-again")] if middle else [])]


def _run_arms(model, base, sizes, run, traces, check, results, outputs, sink, progress) -> None:
    """On a CPU box every server is up at once (an idle one costs nothing) and the arms take turns
    on each regime and seed, so they share the box's moments of load. Where each holds a GPU's
    memory, one server at a time, in the same order (plain vLLM started again at the end)."""
    together = bool(run.together)
    groups = [run.arms] if together else [[name] for name, _ in _passes(run.arms, 0)]
    raw: dict[str, dict[str, list]] = {}
    servers: dict[str, object] = {}
    for n, group in enumerate(groups):
        again = not together and n == len(groups) - 1 and len(groups) > 1
        live = _start_arms(group, model, base, sizes, run, results, progress, "vllm-again" if again else "")
        try:
            for round_, ((regime, seed), specs) in enumerate(sorted(traces.items())):
                for name, label in _passes(list(live), round_) if together else [(g, "vllm-again" if again else g)
                                                                                  for g in live]:
                    progress(f"regime {regime} seed {seed}: {label}")
                    try:
                        summary, _ = _one_regime(live[name], specs, seed, run.concurrency, regime, sink, label)
                    except Exception as exc:  # noqa: BLE001 - one failed pass must not lose the rest of the run
                        results.setdefault("failed", {})[f"{label} regime {regime} seed {seed}"] = str(exc)[:300]
                        progress(f"regime {regime} seed {seed}: {label}: FAILED: {exc}")
                        continue
                    raw.setdefault(label, {}).setdefault(regime, []).append(summary)
                    progress(f"regime {regime} seed {seed}: {label}: TTFT p50 {summary['ttft_all_p50'] or 0:.3f} s, "
                             f"turns>=2 p50 {summary['ttft_later_p50'] or 0:.3f} s, errors {summary['errors']}, "
                             f"recomputed {summary['recomputed_tokens']:.0f} tokens, "
                             f"loaded {summary['loaded_tokens']:.0f}")
            for name, arm in live.items():
                if not again:
                    servers[name] = arm
                    _determinism_pass(arm, check, outputs, results, progress)
                    _record_remeasurements(arm, results)
        finally:
            for arm in live.values():
                arm.server.stop()
    for name, arm in servers.items():
        _merge_arm(results, raw, name, arm)


def _record_remeasurements(arm, results: dict) -> None:
    """kvtier's link re-measurements during the run (``armlib.link_remeasurements``), in the arm's
    figures: re-measurement is off for the run, so any count but 0 refuses its figures."""
    if arm.name != "kvtier":
        return
    count = armlib.link_remeasurements(arm)
    require(count == 0, f"kvtier re-measured its links {count} times while other arms were timed",
            hint="the kvtier arm runs with KVTIER_RATES_REFRESH=0; check that kvtier serve takes it")
    results["arms"].setdefault(arm.name, {})["link_remeasurements"] = count


def _merge_arm(results: dict, raw: dict, name: str, arm) -> None:
    """An arm's figures: medians over seeds (plain vLLM's over both its passes; the drift between
    them, per regime, is the run's noise band)."""
    regimes = raw.get(name, {})
    entry = results["arms"].setdefault(name, {})
    entry["start_s"], entry["loads"] = arm.server.start_s, arm.loads
    again = raw.get(f"{name}-again")
    if again:
        entry["drift"] = {regime: _ratio_or_none(combine_seeds(again[regime]).get("ttft_all_p50"),
                                                 combine_seeds(regimes[regime]).get("ttft_all_p50"))
                          for regime in regimes if regime in again}
        regimes = {regime: runs + again.get(regime, []) for regime, runs in regimes.items()}
    entry["regimes"] = combined = {regime: combine_seeds(runs) for regime, runs in regimes.items()}
    if arm.loads:
        silent = [regime for regime, figs in combined.items()
                  if regime in ("2", "3", "trace") and not figs.get("loaded_tokens")]
        if silent:
            entry["degraded"] = f"loaded nothing in regime {', '.join(silent)}"


def _ratio_or_none(a, b):
    return a / b if a is not None and b else None


def _run_hints(model, base, sizes, run, sink, results, progress) -> None:
    """kvtier on tight tiers (DRAM and NVMe each a quarter of regime 3's working set, so together
    they hold half of it) replays regime 3's trace; every other session asks, on each turn before
    a long pause, to be kept for three pauses' time. Resumed-turn TTFT, hinted sessions vs the rest."""
    tight = sizes.working_set(3) // 4
    progress(f"hints: kvtier with tight tiers ({tight >> 20} MiB DRAM, {tight >> 20} MiB NVMe)")
    try:
        arm = armlib.start_arm("kvtier", model, base, sizes, run.passthrough, dram=tight, nvme=tight,
                               label="kvtier-tight")
    except armlib.ArmSkipped as exc:
        results["hints"] = {"skipped": str(exc)}
        return
    try:
        retain_s = 3 * run.mix.long_pause_s
        specs = with_hints(regime_trace(run.mix, sizes, 3, run.seeds[0], run.sessions), retain_s)
        try:
            # no next arm to settle for; and on tiers this tight the disk stays full: DRAM never gets clean
            summary, records = _one_regime(arm, specs, run.seeds[0], run.concurrency, "hints", sink, "kvtier-tight",
                                           settle=False)
        except Exception as exc:  # noqa: BLE001 - reported; the arms' figures are kept
            results["hints"] = {"failed": str(exc)[:300]}
            results.setdefault("failed", {})["hints"] = str(exc)[:300]
            progress(f"hints: FAILED: {exc}")
            return
        ratio, detail = hinted_ratio(records)
        results["hints"] = {"ratio": ratio, **detail, "dram_bytes": tight, "nvme_bytes": tight,
                            "errors": summary["errors"], "retain_s": retain_s,
                            "loaded_tokens": summary["loaded_tokens"]}
        if not summary["loaded_tokens"]:  # tight tiers that load nothing make no result
            results["hints"]["degraded"] = "kvtier on tight tiers loaded nothing in the hints pass"
        progress(f"hints: resumed-turn TTFT p50 hinted {detail['hinted_resumed_p50_s'] or 0:.3f} s vs unhinted "
                 f"{detail['unhinted_resumed_p50_s'] or 0:.3f} s")
    finally:
        arm.server.stop()
        shutil.rmtree(base / "kvtier-tight-nvme", ignore_errors=True)


def _concurrent_differences(path: Path) -> dict[str, float]:
    """Under C > 1, the fraction of each arm's outputs that differ from plain vLLM's for the same
    turn (vLLM on CPU is not batch-invariant: reported, not judged)."""
    texts: dict[str, dict] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r["regime"] != "hints" and not r["error"] and not r.get("server", "").endswith("-again"):
                texts.setdefault(r["arm"], {})[(r["regime"], r["seed"], r["session"], r["turn"])] = r["text"]
    plain = texts.get("vllm", {})
    return {arm: sum(t.get(k) != v for k, v in plain.items()) / len(plain)
            for arm, t in texts.items() if arm != "vllm" and plain}


def finish_agents_bench(run: AgentRun, plot: Path | None, progress: Callable[[str], None]) -> dict:
    """Run it, then write results.json (and the picture) beside the per-request records."""
    from kvtier.bench.agents.report import plot_cdfs, ttft_curves

    results = run_agents_bench(run, progress)
    base = Path(results["workdir"])
    if plot is not None:
        curves = ttft_curves(Path(results["records"]))
        results["plot"] = str(plot_cdfs(curves, plot, f"TTFT per arm and regime ({Path(results['model']).name}, "
                                                       f"C={run.concurrency})"))
    (base / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True, default=str))
    progress(f"per-request records: {results['records']}; figures: {base / 'results.json'}")
    return results
