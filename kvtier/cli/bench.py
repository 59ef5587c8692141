"""``kvtier bench ...``: every figure a ratio against a reference run in the same process (memcpy,
raw direct IO, recompute, the same client's plain calls), because shared machines are noisy.
Imports stay lazy: a benchmark's code loads only when it runs."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvtier.cli.output import bench_progress, emit_bench, emit_json, handle_errors, print_table, run_vllm_bench

__all__ = ["bench_app", "check_bench_dir"]

bench_app = typer.Typer(help="Measure kvtier on this box and model; every figure is a ratio against a "
                             "same-run reference.",
                        no_args_is_help=True, rich_markup_mode=None)


def check_bench_dir(directory: Optional[Path]) -> None:
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

    check_bench_dir(directory)
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
    from kvtier.bench.serve import SERVE_KEYS, run_serve_bench, tp2_figures

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

    check_bench_dir(directory)
    results = run_codecs_bench(quick=quick, directory=str(directory) if directory else None,
                               progress=bench_progress(json_out))
    emit_bench("kvtier bench codecs", codec_keys(), results, json_out)


@bench_app.command("costmodel")
@handle_errors
def bench_costmodel(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="1k/2k/4k tokens instead of 2k/8k/16k."),
    size: str = typer.Option("tiny", "--size", help="Demo model: tiny or mid (mid: a 16k recompute takes minutes)."),
) -> None:
    """Cost-model predictions vs measured TTFT (restore, recompute), and a capped link on real vLLM."""
    from kvtier.bench.costmodel import COSTMODEL_KEYS, run_costmodel_bench
    from kvtier.errors import UsageError

    if size not in ("tiny", "mid"):
        raise UsageError(f"unknown --size {size!r}", hint="tiny or mid")
    run_vllm_bench("kvtier bench costmodel", COSTMODEL_KEYS,
                   lambda progress: run_costmodel_bench(quick=quick, size=size, progress=progress), json_out)


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


