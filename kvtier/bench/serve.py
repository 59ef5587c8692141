"""``kvtier bench serve``: restore vs recompute on real vLLM, decode and prefill overheads.

On the locally built "mid" demo model (16 layers, 4 KV heads x 64 dims: 16 KiB of KV per token):
* TTFT of a returning session restored from NVMe (its DRAM copy released, page cache dropped) vs
  the same prompt recomputed, at 4k and 16k tokens: in-process engines, one at a time, each warmed
  up, the connector as served (asynchronous loads and stores); the engine without kvtier runs
  before and after the one with it and kvtier is compared with the mean of the two;
* decode tokens/s and 4k-token prefill time (store path included) through real servers
  (``served_decode``): plain vLLM and ``kvtier serve`` alternating, one server at a time. The
  in-process figures are kept (``_in_process_*``) with the connector's own share of decode time
  (``_connector_share_of_decode_time``): in one process the engine, the worker and kvtier's threads
  share one interpreter, which no server deployment does.

Tensor parallelism, on the tiny demo model (2 KV heads, one per rank) through real servers:
``kvtier serve MODEL -- -tp 2`` against plain vLLM at TP=2 on the same prompts, greedy:
* ``tp2_outputs_identical``: the share of prompts whose text, loaded from kvtier's NVMe tier (both
  ranks' shards), equals plain vLLM's at the same split (plain vLLM's prefix cache holding the
  same full blocks);
* ``tp2_restore_vs_recompute_ttft``: time to first token of those loaded prompts vs the same
  prompts recomputed by plain vLLM at TP=2.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

from kvtier.bench.checks import loaded_tokens, require, require_loaded

__all__ = ["run_serve_bench", "SERVE_KEYS"]

SERVE_KEYS = ("restore_vs_recompute_ttft_4k", "restore_vs_recompute_ttft_16k", "decode_with_vs_without",
              "prefill_store_overhead", "tp2_outputs_identical", "tp2_restore_vs_recompute_ttft")
TP2 = ("--tensor-parallel-size", "2")


def _prompt(seed: int, tokens: int) -> list[int]:
    return [3 + (seed * 7919 + i * 131) % 1900 for i in range(tokens)]


def _decode_rate(engine, seed: int, tokens: int, rounds: int = 5) -> float:
    """Decode tokens/s, the median of ``rounds``: two fresh prompts of the same length (no cache
    hits) each, 1 vs ``tokens`` outputs."""
    import statistics

    rates = []
    for r in range(rounds):
        one, _ = engine.timed(_prompt(seed + 100 * r, 256), 1)
        many, out = engine.timed(_prompt(seed + 100 * r + 1000, 256), tokens)
        rates.append((len(out.outputs[0].token_ids) - 1) / max(many - one, 1e-9))
    return statistics.median(rates)


def served_decode(model: str, base: Path, tokens: int, rounds: int = 5, alternations: int = 2,
                  progress: Callable[[str], None] = print, write_behind: str = "10") -> dict:
    """Decode tokens/s and 4k-token prefill time (``prefill_store_overhead``: kvtier's store path
    included) through real servers, as users run them, one server at a time (an idle vLLM
    server's worker keeps polling its queue: two side by side slow each other down): plain vLLM,
    ``kvtier serve``, plain, kvtier... (``alternations`` of each; the same environment,
    ``serve.vllm_cpu_env``), so the shared box's drift hits both alike. Each request: a fresh
    256-token prompt, streamed, (tokens - 1) / (time to the last token - time to the first); each
    side's figure is the median of all its requests."""
    import statistics

    from kvtier.launch.served import Served

    rates: dict[bool, list[float]] = {False: [], True: []}
    prefill: dict[bool, list[float]] = {False: [], True: []}
    for k in range(alternations):
        for kvtier in (False, True):
            which = "kvtier serve" if kvtier else "plain vLLM"
            progress(f"decode through a real server: {which} ({k + 1}/{alternations})")
            server = Served(model, base, f"decode-{k}-{kvtier}", 4096 + 256, connector=kvtier,
                            write_behind=write_behind)
            try:
                server.streamed("warm", _prompt(499, 300), 4)
                for r in range(2):  # fresh 4k-token prompts: the prefill, with kvtier's store path
                    prefill[kvtier].append(server.streamed(f"p{r}", _prompt(700 + 10 * r + k, 4096), 2)["ttft"])
                for r in range(rounds):
                    started = time.perf_counter()
                    out = server.streamed(f"d{r}", _prompt(500 + 10 * r + k, 256), tokens)
                    rates[kvtier].append((tokens - 1) / max(time.perf_counter() - started - out["ttft"], 1e-9))
            finally:
                server.stop()
    with_kvtier, without = statistics.median(rates[True]), statistics.median(rates[False])
    return {"decode_with_vs_without": with_kvtier / without,
            "prefill_store_overhead": statistics.median(prefill[True]) / statistics.median(prefill[False]) - 1,
            "_prefill_4k_ttft_s": {"with": [round(x, 2) for x in prefill[True]],
                                   "without": [round(x, 2) for x in prefill[False]]},
            "_decode_tok_s_with": round(with_kvtier, 2),
            "_decode_tok_s_without": round(without, 2),
            "_decode_tok_s_all": {"with": [round(x, 1) for x in rates[True]],
                                  "without": [round(x, 1) for x in rates[False]]}}


def _connector_seconds() -> float:
    """Time both halves of the in-process connector spent in vLLM's calls on forward steps."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    return worker.step_seconds


def _drop_page_cache(directory: Path) -> None:
    from kvtier.bench.tiers import drop_page_cache

    drop_page_cache(directory)


def tp2_figures(quick: bool = False, progress: Callable[[str], None] = print) -> dict:
    """Plain vLLM at TP=2 vs kvtier serve at TP=2 (loads from NVMe, both ranks), tiny model."""
    import statistics

    from kvtier.bench.checks import reset_served_prefix_cache
    from kvtier.launch.served import Served
    from kvtier.models.demo import ensure_demo_model

    model = str(ensure_demo_model("tiny", progress=lambda m: progress(m)))
    count, tokens = (2, 8000) if quick else (3, 16000)  # long enough that recompute is not the step floor
    prompts = [_prompt(100 + i, tokens) for i in range(count)]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-tp2-", dir=Path.cwd()) as tmp:
        base = Path(tmp)
        progress(f"plain vLLM at TP=2: {count} prompts of {tokens} tokens recomputed")
        plain = Served(model, base, "plain-tp2", tokens + 256, vllm_args=TP2, connector=False)
        try:
            plain.streamed("warm", _prompt(1, 300))
            reference = [plain.streamed(f"s{i}", p) for i, p in enumerate(prompts)]  # recomputed: the TTFT reference
            # the same prompts again: vLLM's prefix cache holds their full blocks, so it computes only
            # the tail, exactly the split a kvtier load leaves (vLLM on CPU is not batch-invariant:
            # the text is compared at the same split)
            same_split = [plain.streamed(f"s{i}", p) for i, p in enumerate(prompts)]
        finally:
            plain.stop()
        progress("kvtier serve at TP=2: store, evict to NVMe, forget HBM, load back")
        served = Served(model, base, "kvtier-tp2", tokens + 256, vllm_args=TP2)
        try:
            admin = served.admin()
            served.streamed("warm", _prompt(2, 300))
            for i, p in enumerate(prompts):
                served.streamed(f"s{i}", p)
            for i in range(count):
                for _ in range(600):  # stores finish behind the step
                    session = admin.get(admin.session_path(f"s{i}"))
                    if session["blocks_dram"] + session["blocks_nvme"] >= (tokens - 1) // 128:
                        break
                    time.sleep(0.1)
                admin.wait(admin.post(admin.session_path(f"s{i}", "evict"), {"to": "nvme"}))
            reset_served_prefix_cache(served.url, served.served_name)  # refused while blocks are held: retried
            _drop_page_cache(base)
            before = admin.get("/v1/status")["counters"].get("hit_nvme_blocks", 0)
            loaded = [served.streamed(f"s{i}", p) for i, p in enumerate(prompts)]
            hit = admin.get("/v1/status")["counters"].get("hit_nvme_blocks", 0) - before
        finally:
            served.stop()
    require(hit >= 0.9 * count * ((tokens - 1) // 128), f"TP=2: {hit} blocks loaded from NVMe for {count} prompts "
            f"of {tokens:,} tokens", hint="the restored TTFT would time a recompute, not a load")
    same = sum(a["text"] == b["text"] for a, b in zip(same_split, loaded))
    return {"tp2_outputs_identical": same / count,
            "_tp2_plain_recomputed_vs_prefix_hit_identical": sum(a["text"] == b["text"] for a, b in
                                                                 zip(reference, same_split)) / count,
            "tp2_restore_vs_recompute_ttft": statistics.median(b["ttft"] / a["ttft"] for a, b in zip(reference,
                                                                                                     loaded)),
            "_tp2_recompute_ttft_s": [round(r["ttft"], 3) for r in reference],
            "_tp2_restored_ttft_s": [round(r["ttft"], 3) for r in loaded],
            "_tp2_prompt_tokens": tokens, "_tp2_hit_nvme_blocks": hit}


def run_serve_bench(quick: bool = False, progress: Callable[[str], None] = print, tp2: bool = True) -> dict:
    from kvtier.bench.harness import Engine, cpu_environment
    from kvtier.models.demo import ensure_demo_model
    from kvtier.plan.index import Tier

    cpu_environment()
    sizes = {"4k": 4096, "16k": 4096 if quick else 16384}
    decode_tokens = 32 if quick else 96
    progress("building / loading the mid demo model")
    model = str(ensure_demo_model("mid", progress=lambda m: progress(m)))
    results: dict = {}

    def plain_run(label: str) -> tuple[dict, float]:
        progress(f"engine without kvtier ({label}): recompute TTFT, decode rate")
        plain = Engine(model, kvtier=False)
        try:
            plain.timed(_prompt(1, 512), 2)  # warm-up (the first forward of a process is slow)
            recompute = {name: plain.timed(_prompt(10 + i, n))[0] for i, (name, n) in enumerate(sizes.items())}
            return recompute, _decode_rate(plain, 30, decode_tokens)
        finally:
            plain.close()

    # the box is shared and drifts: the engine without kvtier runs before and after the one with it,
    # and kvtier's figures are compared with the mean of the two
    recompute_before, decode_before = plain_run("before")

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-", dir=Path.cwd()) as tmp:
        progress("engine with kvtier: store path, decode rate, restore from NVMe")
        tiered = Engine(model, kvtier=True, nvme_dir=Path(tmp) / "nvme")
        tiered.timed(_prompt(2, 512), 2)
        stored = {name: tiered.timed(_prompt(10 + i, n))[0] for i, (name, n) in enumerate(sizes.items())}
        spent = tiered.connector.step_seconds + _connector_seconds()
        started = time.perf_counter()
        decode_tiered = _decode_rate(tiered, 30, decode_tokens)
        decode_wall = time.perf_counter() - started
        decode_share = (tiered.connector.step_seconds + _connector_seconds() - spent) / decode_wall
        for session in list(tiered.manager.table.sessions):
            tiered.run_job(tiered.manager.planner.evict(session, Tier.NVME))
        tiered.forget_hbm()
        restored = {}
        for i, (name, n) in enumerate(sizes.items()):
            _drop_page_cache(Path(tmp))
            restored[name], out = tiered.timed(_prompt(10 + i, n))
            require_loaded(loaded_tokens(out), n, tiered.manager.geometry.block_tokens, f"the {name} restore")
        counters = dict(tiered.manager.telemetry.counters)
        syncs = tiered.worker.step_syncs
        tiered.close()

    recompute_after, decode_after = plain_run("after")
    recompute = {k: (recompute_before[k] + recompute_after[k]) / 2 for k in recompute_before}
    decode_plain = (decode_before + decode_after) / 2
    results["_connector_share_of_decode_time"] = decode_share
    results["_step_syncs"] = syncs
    results["_in_process_decode_with_vs_without"] = decode_tiered / decode_plain
    results["_in_process_decode_tok_s"] = {"without_before_after": [decode_before, decode_after], "with": decode_tiered}
    results["restore_vs_recompute_ttft_4k"] = restored["4k"] / recompute["4k"]
    results["restore_vs_recompute_ttft_16k"] = restored["16k"] / recompute["16k"]
    results["_in_process_prefill_store_overhead"] = sum(stored.values()) / sum(recompute.values()) - 1
    results.update({f"_recompute_ttft_{k}_s": v for k, v in recompute.items()})
    results.update({f"_restored_ttft_{k}_s": v for k, v in restored.items()})
    results.update({f"_prefill_with_store_{k}_s": v for k, v in stored.items()})
    results.update(_hit_nvme_blocks=counters.get("hit_nvme_blocks", 0), _quick=quick)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-decode-", dir=Path.cwd()) as tmp:
        results.update(served_decode(model, Path(tmp), decode_tokens, progress=progress))
    if tp2:
        results.update(tp2_figures(quick, progress))
    return results
