"""``kvtier bench ...``: every figure a ratio against a reference run in the same process (memcpy,
raw direct IO, recompute, the same client's plain calls), because shared machines are noisy.
Imports stay lazy: a benchmark's code loads only when it runs."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvtier.cli.output import bench_progress, emit_bench, emit_json, handle_errors, print_table, run_vllm_bench

__all__ = ["bench_app"]

bench_app = typer.Typer(help="Benchmarks; every figure is a ratio against a same-process reference.",
                        no_args_is_help=True, rich_markup_mode=None)


def _check_bench_dir(directory: Optional[Path]) -> None:
    if directory is not None and not directory.is_dir():
        from kvtier.errors import UsageError

        raise UsageError(f"{directory} is not a directory", hint="pass --dir an existing directory on the disk to test")


@bench_app.command("tiers")
@handle_errors
def bench_tiers(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="Smaller sizes; finishes in under a minute."),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Where to write (default: the current dir)."),
) -> None:
    """DRAM, NVMe, snapshot and index speed vs memcpy / raw direct IO."""
    from kvtier.bench.tiers import TIERS_KEYS, run_tiers_bench

    _check_bench_dir(directory)
    results = run_tiers_bench(quick=quick, directory=str(directory) if directory else None,
                              progress=bench_progress(json_out))
    emit_bench("kvtier bench tiers", TIERS_KEYS, results, json_out)


@bench_app.command("serve")
@handle_errors
def bench_serve(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="4k prompts only and a shorter decode."),
    tp2_only: bool = typer.Option(False, "--tp2-only", help="Only the tensor-parallel (TP=2) figures."),
) -> None:
    """Real vLLM: restored vs recomputed TTFT, decode and prefill overhead (mid demo model), and
    TP=2 outputs and restore TTFT against plain vLLM at TP=2 (tiny demo model)."""
    from kvtier.bench.vllm.serve import SERVE_KEYS, run_serve_bench, tp2_figures

    if tp2_only:
        run_vllm_bench("kvtier bench serve", tuple(k for k in SERVE_KEYS if k.startswith("tp2_")),
                       lambda progress: tp2_figures(quick=quick, progress=progress), json_out)
        return
    run_vllm_bench("kvtier bench serve", SERVE_KEYS, lambda progress: run_serve_bench(quick=quick, progress=progress),
                   json_out)


@bench_app.command("codecs")
@handle_errors
def bench_codecs(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="Fewer blocks and repetitions."),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Where the NVMe files go (default: the current dir)."),
) -> None:
    """Codec encode/decode throughput vs memcpy, and NVMe restore per cold codec vs raw direct IO."""
    from kvtier.bench.codecs import codec_keys, run_codecs_bench

    _check_bench_dir(directory)
    results = run_codecs_bench(quick=quick, directory=str(directory) if directory else None,
                               progress=bench_progress(json_out))
    emit_bench("kvtier bench codecs", codec_keys(), results, json_out)


@bench_app.command("admin")
@handle_errors
def bench_admin(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="10 s of latency, 300 fuzz requests."),
    vllm: bool = typer.Option(True, "--vllm/--no-vllm", help="Load a real vLLM engine (else an in-process one)."),
) -> None:
    """Admin API p99 latency under load, and a fuzz run of malformed requests."""
    from kvtier.bench.admin import ADMIN_KEYS, run_admin_bench

    run_vllm_bench("kvtier bench admin", ADMIN_KEYS,
                   lambda progress: run_admin_bench(quick=quick, progress=progress, vllm=vllm), json_out)


@bench_app.command("costmodel")
@handle_errors
def bench_costmodel(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="1k/2k/4k tokens instead of 2k/8k/16k."),
    size: str = typer.Option("tiny", "--size", help="Demo model: tiny or mid (mid: a 16k recompute takes minutes)."),
) -> None:
    """Cost-model predictions vs measured TTFT (restore, recompute), and a capped link on real vLLM."""
    from kvtier.bench.vllm.costmodel import COSTMODEL_KEYS, run_costmodel_bench
    from kvtier.errors import UsageError

    if size not in ("tiny", "mid"):
        raise UsageError(f"unknown --size {size!r}", hint="tiny or mid")
    run_vllm_bench("kvtier bench costmodel", COSTMODEL_KEYS,
                   lambda progress: run_costmodel_bench(quick=quick, size=size, progress=progress), json_out)


@bench_app.command("faults")
@handle_errors
def bench_faults(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="20 crash and 100 corruption trials instead of 200 and 1,000."),
    vllm: bool = typer.Option(True, "--vllm/--no-vllm", help="Include load and disk faults against kvtier serve."),
    power: bool = typer.Option(False, "--power", help="Only power cuts: crash states built from recorded IO."),
    slow_disk: bool = typer.Option(False, "--slow-disk",
                                   help="Only a disk slowed 10x while kvtier serve runs sessions (real vLLM)."),
    states: int = typer.Option(250, "--states", min=1, help="With --power: crash states per workload (--quick: 25)."),
) -> None:
    """Crashes (SIGKILL), corruption, DRAM pressure, hostile input, and load with disk faults on real vLLM;
    or, with --power and/or --slow-disk, only power cuts and a disk that turns slow while serving."""
    from kvtier.bench.faults import FAULT_KEYS, fault_part_keys, run_fault_parts, run_faults_bench

    if power or slow_disk:
        per = min(states, 25) if quick else states
        run_vllm_bench("kvtier bench faults", fault_part_keys(power, slow_disk),
                       lambda progress: run_fault_parts(power, slow_disk, quick, per, progress), json_out)
        return
    run_vllm_bench("kvtier bench faults", FAULT_KEYS,
                   lambda progress: run_faults_bench(quick=quick, progress=progress, vllm=vllm), json_out)


@bench_app.command("shared")
@handle_errors
def bench_shared(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="2 sessions, 6 requests per phase, 3 rounds."),
) -> None:
    """The shared tier (Valkey/Redis): against its own client, across two kvtier serve processes, with the
    store stopped, paused and restarted under load, and 600 forged values. Starts its own redis-server."""
    from kvtier.bench.vllm.shared import SHARED_KEYS, run_shared_bench

    run_vllm_bench("kvtier bench shared", SHARED_KEYS, lambda progress: run_shared_bench(quick=quick,
                                                                                         progress=progress),
                   json_out)


@bench_app.command("restart")
@handle_errors
def bench_restart(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="2k-token sessions, a 3 s write-behind window, one A/B round."),
) -> None:
    """Sessions across a stop and a SIGKILL of real kvtier serve processes; catalog start-up; overhead."""
    from kvtier.bench.vllm.restart import RESTART_KEYS, run_restart_bench

    run_vllm_bench("kvtier bench restart", RESTART_KEYS,
                   lambda progress: run_restart_bench(quick=quick, progress=progress), json_out)


@bench_app.command("top")
@handle_errors
def bench_top(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="15 s of CPU measurement instead of 60 s."),
    sessions: int = typer.Option(1000, "--sessions", min=1, max=100_000, help="Sessions on the server."),
) -> None:
    """CPU of `kvtier top` at a 1 s refresh with 1,000 sessions, and key-to-screen latency (real pty)."""
    from kvtier.bench.top import TOP_KEYS, run_top_bench

    results = run_top_bench(quick=quick, progress=bench_progress(json_out), sessions=sessions)
    emit_bench("kvtier bench top", TOP_KEYS, results, json_out)


QUALITY_KEYS = ("size_ratio", "top1_agreement", "kl", "needle_acc_128k", "rel_mse_k", "rel_mse_v")


def parse_lengths(text: str) -> tuple[int, ...]:
    """"1024,4k,16k" -> (1024, 4096, 16384); empty -> ()."""
    from kvtier.codecs.recall import label_tokens
    from kvtier.errors import UsageError
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            n = label_tokens(part)
        except ValueError:
            raise UsageError(f"bad context length {part!r}", hint="lengths in tokens, e.g. 1024,4k,16k") from None
        if not 64 <= n <= 1 << 20:  # the model's own limit is checked next (kvtier.bench.vllm.needle)
            raise UsageError(f"context length {n} is out of range", hint="between 64 and 131072 tokens (128k)")
        out.append(n)
    return tuple(sorted(set(out)))


@bench_app.command("quality")
@handle_errors
def bench_quality(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object: one entry per codec."),
    quick: bool = typer.Option(False, "--quick", help="Needles up to 16k keys, fewer trials and prompts; model "
                                                      "needles at 4k and 32k."),
    vllm: bool = typer.Option(True, "--vllm/--no-vllm", help="Include the real-vLLM figures (top-1, KL)."),
    trials: int = typer.Option(0, "--trials", min=0, max=100_000, help="Needle trials per size (default 200)."),
    long_trials: int = typer.Option(0, "--long-trials", min=0, max=100_000,
                                    help="Needle trials at the largest size (default: --trials)."),
    model_needle: bool = typer.Option(True, "--model-needle/--no-model-needle",
                                      help="Needles through vLLM on a model that retrieves, per codec."),
    model: str = typer.Option("constructed", "--model", help="The needle model: constructed (weights set so it "
                                                             "retrieves to 128k; keys with outlier channels and a "
                                                             "sink) or trained (trained here; reliable to 4k)."),
    needle_lengths: str = typer.Option("", "--needle-lengths",
                                       help="Context lengths of the model needle, comma-separated (default: "
                                            "4k,16k,64k,128k, --quick 4k,32k; trained: 1k,2k,4k,8k, --quick 1k,4k)."),
    haystacks: int = typer.Option(0, "--haystacks", min=0, max=1000,
                                  help="Haystacks per length (5 needles each; default 8, --quick 2)."),
) -> None:
    """Codec quality: reconstruction error, needle retrieval up to 128k keys, top-1 and KL via vLLM."""
    import contextlib
    import sys

    from kvtier.bench.quality import QUALITY_CODECS, run_quality_harness
    from kvtier.bench.vllm.needle import NEEDLE_LENGTHS, NEEDLE_MODELS, check_needle_lengths, key_prefix
    from kvtier.codecs.recall import label_tokens
    from kvtier.errors import UsageError
    if model not in NEEDLE_MODELS:
        raise UsageError(f"--model {model!r} is not a needle model", hint="constructed or trained")
    lengths = parse_lengths(needle_lengths) or NEEDLE_LENGTHS[model][bool(quick)]  # refused first
    if vllm and model_needle:
        check_needle_lengths(model, lengths)  # past the model's positions or this box's memory: refused now
    progress = bench_progress(json_out)
    captured, per_codec, context = None, {}, {}
    if vllm:
        from kvtier.bench.vllm.quality import run_vllm_quality

        with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; stdout is for the results
            out = run_vllm_quality(QUALITY_CODECS, quick=quick, progress=progress)
        captured, per_codec = out["captured"], out["per_codec"]
        context = {k: v for k, v in out.items() if k.startswith("_")}
    needle = _model_needle(model, lengths, haystacks or (2 if quick else 8), progress, quick) \
        if vllm and model_needle else None
    if needle:
        context["model_needle"] = {k.lstrip("_"): needle.get(k) for k in (
            "_model_kind", "_lengths", "_trials_per_length", "_haystacks_per_length", "_wall_s", "_seed",
            "_full_run", "_model_key_statistics")}
    results = run_quality_harness(quick=quick, captured=captured, progress=progress, trials=trials or None,
                                  long_trials=long_trials or None)
    for spec, entry in results.items():
        entry.update(per_codec.get(spec, {}))
        if spec == "none":
            entry.update(top1_agreement=1.0, kl=0.0)
        entry["_kv_source"] = "demo model via vLLM" if captured is not None else "synthetic"
    for spec, entry in ((needle or {}).get("per_codec") or {}).items():
        results.setdefault(spec, {}).update(entry)
    naive = {f"naive_int4_needle_acc_{k.rsplit('_', 1)[1]}": v  # the reference's figures, named by the issue
             for k, v in results.get("int4-naive", {}).items() if k.startswith(key_prefix(model))}
    ordered = {spec: {**{k: entry.get(k) for k in QUALITY_KEYS}, **{k: v for k, v in entry.items()
                                                                      if k not in QUALITY_KEYS}}
               for spec, entry in results.items()}
    if json_out:
        emit_json({**ordered, **naive, **{f"_{k.lstrip('_')}": v for k, v in context.items()}})
        return
    columns = ["codec", *QUALITY_KEYS, "attn_err"] + [k for k in next(iter(ordered.values()))
                                                     if k.startswith("needle_acc") and k != "needle_acc_128k"] + \
        sorted({k for entry in ordered.values() for k in entry if k.startswith(key_prefix(model))},
               key=lambda k: label_tokens(k.rsplit("_", 1)[1]))

    def fmt(value):
        return "-" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))

    print_table("kvtier bench quality", columns,
                [(spec, *[fmt(entry.get(c)) for c in columns[1:]]) for spec, entry in ordered.items()])
    if context:
        typer.echo(", ".join(f"{k.lstrip('_')}={v}" for k, v in context.items() if k != "model_needle"))
    if needle:
        typer.echo("model needle: " + ", ".join(f"{k}={v}" for k, v in context["model_needle"].items()
                                                 if k != "model_key_statistics"))


def _model_needle(kind: str, lengths, haystacks: int, progress, quick: bool) -> dict:
    """The model needle in a child process (one vLLM engine per process), which refuses figures whose
    codecs' loads did not happen. A full run's figures (not ``quick``, as many trials and lengths as
    the shipped ones: ``kvtier.codecs.recall.run_problems``) are kept for kvtier status / doctor's
    recall warnings; a smaller run's are shown, never kept: they would replace stronger figures."""
    from kvtier.bench.vllm.needle import run_in_child
    from kvtier.codecs.recall import keep_figures

    needle = run_in_child(lengths, haystacks, progress=progress, kind=kind)
    kept, problems = keep_figures(needle, quick)
    progress(f"model needle figures kept for the recall warnings: {kept}" if kept else
             "model needle figures not kept for the recall warnings (the shipped or a full run's stay): "
             + "; ".join(problems))
    return needle


def _regimes(text: str) -> tuple[int, ...]:
    from kvtier.errors import UsageError

    if text == "all":
        return (1, 2, 3)
    if text not in ("1", "2", "3"):
        raise UsageError(f"--regime {text!r} is not a regime", hint="1, 2, 3 or all")
    return (int(text),)


def _size(text: str, flag: str) -> int:
    from kvtier.config import parse_size
    from kvtier.errors import ConfigError, UsageError

    try:
        return parse_size(text)
    except ConfigError:
        raise UsageError(f"{flag} {text!r} is not a size", hint=f"e.g. {flag} 40MiB") from None


@bench_app.command("agents", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@handle_errors
def bench_agents(
    ctx: typer.Context,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object: the summary keys at its top level."),
    quick: bool = typer.Option(False, "--quick", help="One seed; arms vllm, floor and kvtier; all three regimes."),
    regime: str = typer.Option("all", "--regime", help="1, 2, 3 or all (the working set: 0.5x the engine's KV "
                                                        "cache, 2x it, 2x the DRAM tier)."),
    arms: str = typer.Option("", "--arms", help="Comma-separated: vllm, floor, kvtier, native, lmcache "
                                                 "(default: all; --quick: vllm,floor,kvtier)."),
    trace_file: Optional[Path] = typer.Option(None, "--trace", help="Replay this JSONL trace (one turn a line: "
                                              "session, turn, arrival_s or think_s, input_tokens, output_tokens)."),
    model: Optional[str] = typer.Option(None, "--model", help="A model directory (default: the tiny demo model)."),
    engine_kv: str = typer.Option("40MiB", "--engine-kv", help="The engine's KV cache (vLLM's "
                                                                "--kv-cache-memory-bytes), every arm but floor."),
    dram: str = typer.Option("160MiB", "--dram", help="kvtier's DRAM tier, and the host bytes of the other "
                                                       "offloading arms."),
    concurrency: int = typer.Option(4, "--concurrency", "-c", help="Requests in flight at most (C)."),
    sessions: Optional[int] = typer.Option(None, "--sessions", min=1, max=10_000,
                                           help="Sessions per regime, sized to make its working set "
                                                "(default: as many as the working set takes)."),
    seeds: int = typer.Option(3, "--seeds", min=1, max=10, help="Seeds: median and range (--quick: 1)."),
    max_context: int = typer.Option(6144, "--max-context", min=256, max=1 << 20,
                                    help="A session's context stops growing here (tokens; the servers' "
                                         "--max-model-len follows)."),
    together: Optional[bool] = typer.Option(None, "--together/--one-at-a-time",
                                            help="Every arm's server up at once, taking turns (default on a "
                                                 "CPU box), or one server at a time (default where each "
                                                 "holds a GPU's memory)."),
    hints: bool = typer.Option(True, "--hints/--no-hints", help="Also run the retention-hint phase "
                                                                  "(kvtier on tight tiers)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write the TTFT CDFs here (PNG)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Where the per-request JSONL, results.json and "
                                                               "the servers' logs go (default: a new temp dir)."),
) -> None:
    """Agent sessions (many turns, tool-call pauses, subagents) against plain vLLM, a big-cache
    floor, kvtier, vLLM's native offloading and LMCache, in three regimes sized from the box.
    vLLM flags after `--` go to every arm, e.g. `-- --kv-cache-dtype fp8`."""
    from kvtier.bench.agents.arms import parse_arms
    from kvtier.bench.agents.report import AGENT_KEYS, EXTRA_KEYS
    from kvtier.bench.agents.run import AgentRun, finish_agents_bench
    from kvtier.bench.agents.trace import AgentMix, read_trace

    run = AgentRun(model=model, regimes=list(_regimes(regime)), arms=parse_arms(arms, quick),
                   seeds=list(range(1 if quick else seeds)), engine_kv=_size(engine_kv, "--engine-kv"),
                   dram=_size(dram, "--dram"), concurrency=concurrency, sessions=sessions, trace=trace_file,
                   workdir=out_dir, passthrough=tuple(ctx.args), hints=hints,
                   mix=AgentMix(max_context=max_context), together=together)
    if trace_file is not None:
        read_trace(trace_file)  # a malformed file is refused before any server starts
    if plot is not None and plot.suffix.lower() != ".png":
        from kvtier.errors import UsageError

        raise UsageError(f"--plot {plot} is not a .png file", hint="e.g. --plot agents.png")
    if not 1 <= concurrency <= 256:
        from kvtier.errors import UsageError

        raise UsageError(f"--concurrency {concurrency} is out of range", hint="between 1 and 256")
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout, which is for the results
        results = finish_agents_bench(run, plot, bench_progress(json_out))
    if json_out:
        emit_json({key: results.get(key) for key in AGENT_KEYS + EXTRA_KEYS} | {"details": results})
        return
    from kvtier.bench.agents.report import tables

    for title, columns, rows in tables(results):
        print_table(title, columns, rows)


@bench_app.command("restore")
@handle_errors
def bench_restore(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="A 1 GiB session (and 1 GiB from RAM) instead of 8 GiB."),
    gib: Optional[float] = typer.Option(None, "--gib", min=0.001, max=4096,
                                        help="Session size in GiB (default 8; --quick: 1)."),
    nvme_dirs: Optional[list[str]] = typer.Option(None, "--nvme-dir", metavar="DIR",
                                                  help="A drive to restore from (repeat for several; default: "
                                                       "the current dir)."),
) -> None:
    """A 70B-shaped session of GiBs restored from NVMe into DRAM: vs raw direct reads, CPU, RSS, RAM ceiling."""
    from kvtier.bench.restore import RESTORE_KEYS, run_restore_bench

    results = run_restore_bench(gib=gib if gib is not None else (1.0 if quick else 8.0), quick=quick,
                                dirs=nvme_dirs or None, progress=bench_progress(json_out))
    emit_bench("kvtier bench restore", RESTORE_KEYS, results, json_out)


@bench_app.command("scale")
@handle_errors
def bench_scale(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="200k blocks and 200k catalog sessions the largest sizes "
                                                      "instead of 1M; 15 s of top's CPU instead of 60 s."),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Where the NVMe tier and catalogs are built "
                                                                 "(default: the current dir; the full run "
                                                                 "needs about 12 GiB free)."),
) -> None:
    """Costs as the work grows: NVMe start-up, RAM, lookups, victims and journal compaction at 10k-1M
    blocks; catalogs of 10k-1M sessions; `kvtier sessions --json` and `kvtier top` with 100k sessions."""
    from kvtier.bench.scale import SCALE_KEYS, run_scale_bench

    _check_bench_dir(directory)
    results = run_scale_bench(quick=quick, progress=bench_progress(json_out),
                              directory=str(directory) if directory else None)
    emit_bench("kvtier bench scale", SCALE_KEYS, results, json_out)


@bench_app.command("memory")
@handle_errors
def bench_memory(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object: the summary keys, then per "
                                                        "size under \"sizes\", the run under \"details\"."),
    quick: bool = typer.Option(False, "--quick", help="--dram 1GiB only instead of 1, 4 and 8 GiB."),
    sizes: str = typer.Option("", "--sizes", help="DRAM budgets in GiB, comma-separated (default 1,4,8)."),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Where the NVMe tiers go (default: the "
                                                                 "current dir; needs the largest size + 1 GiB)."),
) -> None:
    """RSS of every process of `kvtier serve` with --dram N filled (N = 1, 4, 8 GiB) against plain vLLM
    with the same engine flags: target RSS - plain RSS <= 1.05 x N + 256 MiB."""
    import contextlib
    import sys

    from kvtier.bench.memory import MEMORY_COLUMNS, MEMORY_KEYS, memory_rows, parse_sizes
    from kvtier.bench.vllm.memory import run_memory_bench

    _check_bench_dir(directory)
    chosen = parse_sizes(sizes)
    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; stdout is for the results
        results = run_memory_bench(sizes=chosen or None, quick=quick, progress=bench_progress(json_out),
                                   directory=str(directory) if directory else None)
    if json_out:
        emit_json(results)
        return
    print_table("kvtier bench memory", MEMORY_COLUMNS, memory_rows(results))
    typer.echo(", ".join(f"{key}={results[key]}" for key in MEMORY_KEYS))
