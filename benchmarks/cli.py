"""``python -m benchmarks ...``: the project's own test rig, run from a checkout (never shipped).

Each suite prints its figures as a table, or one JSON object with ``--json``; ``python -m benchmarks
record NAME`` runs one (a product bench through ``kvtier bench`` too) and keeps its figures under
``benchmarks/results/`` for ``python -m benchmarks.render``. Imports stay lazy: a suite's code loads
only when it runs."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvtier.cli.bench import check_bench_dir
from kvtier.cli.output import bench_progress, emit_bench, emit_json, handle_errors, print_table, run_vllm_bench

__all__ = ["app"]

app = typer.Typer(help="The project's test rig (fault, power-cut, quality, scale, memory, admin, top, shared, "
                       "restart suites), and the recording and rendering of every benchmark's figures.",
                  no_args_is_help=True, rich_markup_mode=None, add_completion=False,
                  pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]})



@app.command("admin")
@handle_errors
def bench_admin(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="10 s of latency, 300 fuzz requests."),
    vllm: bool = typer.Option(True, "--vllm/--no-vllm", help="Load a real vLLM engine (else an in-process one)."),
) -> None:
    """Admin API p99 latency under load, and a fuzz run of malformed requests."""
    from benchmarks.admin import ADMIN_KEYS, run_admin_bench

    run_vllm_bench("python -m benchmarks admin", ADMIN_KEYS,
                   lambda progress: run_admin_bench(quick=quick, progress=progress, vllm=vllm), json_out)


@app.command("faults")
@handle_errors
def bench_faults(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="20 crash and 100 corruption trials instead of 200 and 1,000."),
    vllm: bool = typer.Option(True, "--vllm/--no-vllm", help="Include load and disk faults against kvtier serve."),
    power: bool = typer.Option(False, "--power", help="Only power cuts: crash states built from recorded IO."),
    slow_disk: bool = typer.Option(False, "--slow-disk",
                                   help="Only a disk that turns slow (10x, then until loading loses) while "
                                        "kvtier serve runs sessions (real vLLM)."),
    states: int = typer.Option(250, "--states", min=1, help="With --power: crash states per workload (--quick: 25)."),
) -> None:
    """Crashes (SIGKILL), corruption, DRAM pressure, hostile input, and load with disk faults on real vLLM;
    or, with --power and/or --slow-disk, only power cuts and a disk that turns slow while serving."""
    from benchmarks.faults.suite import FAULT_KEYS, fault_part_keys, run_fault_parts, run_faults_bench

    if power or slow_disk:
        per = min(states, 25) if quick else states
        run_vllm_bench("python -m benchmarks faults", fault_part_keys(power, slow_disk),
                       lambda progress: run_fault_parts(power, slow_disk, quick, per, progress), json_out)
        return
    run_vllm_bench("python -m benchmarks faults", FAULT_KEYS,
                   lambda progress: run_faults_bench(quick=quick, progress=progress, vllm=vllm), json_out)


@app.command("shared")
@handle_errors
def bench_shared(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="2 sessions, 6 requests per phase, 3 rounds."),
) -> None:
    """The shared tier (Valkey/Redis): against its own client, across two kvtier serve processes, with the
    store stopped, paused and restarted under load, and 600 forged values. Starts its own redis-server."""
    from benchmarks.shared_served import SHARED_KEYS, run_shared_bench

    run_vllm_bench("python -m benchmarks shared", SHARED_KEYS, lambda progress: run_shared_bench(quick=quick,
                                                                                         progress=progress),
                   json_out)


@app.command("restart")
@handle_errors
def bench_restart(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="2k-token sessions, a 3 s write-behind window, one A/B round."),
) -> None:
    """Sessions across a stop and a SIGKILL of real kvtier serve processes; catalog start-up; overhead."""
    from benchmarks.restart import RESTART_KEYS, run_restart_bench

    run_vllm_bench("python -m benchmarks restart", RESTART_KEYS,
                   lambda progress: run_restart_bench(quick=quick, progress=progress), json_out)


@app.command("top")
@handle_errors
def bench_top(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="15 s of CPU measurement instead of 60 s."),
    sessions: int = typer.Option(1000, "--sessions", min=1, max=100_000, help="Sessions on the server."),
) -> None:
    """CPU of `kvtier top` at a 1 s refresh with 1,000 sessions, and key-to-screen latency (real pty)."""
    from benchmarks.top import TOP_KEYS, run_top_bench

    results = run_top_bench(quick=quick, progress=bench_progress(json_out), sessions=sessions)
    emit_bench("python -m benchmarks top", TOP_KEYS, results, json_out)


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
        if not 64 <= n <= 1 << 20:  # the model's own limit is checked next (benchmarks.quality.needle)
            raise UsageError(f"context length {n} is out of range", hint="between 64 and 131072 tokens (128k)")
        out.append(n)
    return tuple(sorted(set(out)))


@app.command("quality")
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
    ship: bool = typer.Option(False, "--ship", help="Make this full run's checked model-needle figures the ones "
                                                    "kvtier ships (kvtier/data/model_needle.json)."),
) -> None:
    """Codec quality: reconstruction error, needle retrieval up to 128k keys, top-1 and KL via vLLM."""
    import contextlib
    import sys

    from benchmarks.quality.needle import NEEDLE_LENGTHS, NEEDLE_MODELS, check_needle_lengths, key_prefix
    from benchmarks.quality.synthetic import QUALITY_CODECS, run_quality_harness
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
        from benchmarks.quality.through_vllm import run_vllm_quality

        with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; stdout is for the results
            out = run_vllm_quality(QUALITY_CODECS, quick=quick, progress=progress)
        captured, per_codec = out["captured"], out["per_codec"]
        context = {k: v for k, v in out.items() if k.startswith("_")}
    needle = _model_needle(model, lengths, haystacks or (2 if quick else 8), progress, quick, ship) \
        if vllm and model_needle else None
    if needle:
        context["model_needle"] = {k.lstrip("_"): needle.get(k) for k in (
            "_model_kind", "_lengths", "_trials_per_length", "_haystacks_per_length", "_wall_s", "_seed",
            "_model_key_statistics")}
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

    print_table("python -m benchmarks quality", columns,
                [(spec, *[fmt(entry.get(c)) for c in columns[1:]]) for spec, entry in ordered.items()])
    if context:
        typer.echo(", ".join(f"{k.lstrip('_')}={v}" for k, v in context.items() if k != "model_needle"))
    if needle:
        typer.echo("model needle: " + ", ".join(f"{k}={v}" for k, v in context["model_needle"].items()
                                                 if k != "model_key_statistics"))


def _model_needle(kind: str, lengths, haystacks: int, progress, quick: bool, ship: bool) -> dict:
    """The model needle in a child process (one vLLM engine per process), which refuses figures whose
    codecs' loads did not happen. With ``ship``, a full run's checked figures
    (``benchmarks.quality.figures.run_problems``) become the ones kvtier ships for the recall warnings
    of kvtier status / doctor (``kvtier/data/model_needle.json``); a smaller run is never shipped."""
    from benchmarks.quality.figures import run_problems, ship_figures
    from benchmarks.quality.needle import run_in_child
    from kvtier.errors import UsageError

    needle = run_in_child(lengths, haystacks, progress=progress, kind=kind)
    if not ship:
        return needle
    shipped, problems = ship_figures(needle, quick)
    if shipped is None:
        raise UsageError("the model needle figures were not shipped: " + "; ".join(problems),
                         hint="ship a full run: python -m benchmarks quality --ship (no --quick, the default "
                              "lengths and haystacks)")
    progress(f"model needle figures shipped: {shipped} (they passed {run_problems.__name__})")
    return needle


@app.command("scale")
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
    from benchmarks.scale import SCALE_KEYS, run_scale_bench

    check_bench_dir(directory)
    results = run_scale_bench(quick=quick, progress=bench_progress(json_out),
                              directory=str(directory) if directory else None)
    emit_bench("python -m benchmarks scale", SCALE_KEYS, results, json_out)


@app.command("memory")
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

    from benchmarks.memory import MEMORY_COLUMNS, MEMORY_KEYS, memory_rows, parse_sizes
    from benchmarks.memory_served import run_memory_bench

    check_bench_dir(directory)
    chosen = parse_sizes(sizes)
    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; stdout is for the results
        results = run_memory_bench(sizes=chosen or None, quick=quick, progress=bench_progress(json_out),
                                   directory=str(directory) if directory else None)
    if json_out:
        emit_json(results)
        return
    print_table("python -m benchmarks memory", MEMORY_COLUMNS, memory_rows(results))
    typer.echo(", ".join(f"{key}={results[key]}" for key in MEMORY_KEYS))


@app.command("record", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@handle_errors
def record_command(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The benchmark: tiers, codecs, restore, serve, costmodel, agents (kvtier "
                                         "bench), faults, power, slow-disk, quality, admin, top, scale, memory, "
                                         "shared, restart (this rig)."),
    quick: bool = typer.Option(False, "--quick", help="Its --quick run (kept apart: never replaces a full one)."),
) -> None:
    """Run one benchmark with --json and keep its figures, with the commit and the machine, under
    benchmarks/results/ (for python -m benchmarks.render). Arguments after `--` go to the benchmark."""
    from benchmarks.record import record

    path = record(name, quick=quick, extra=tuple(ctx.args))
    typer.echo(f"recorded {path}")
