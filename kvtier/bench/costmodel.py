"""``kvtier bench costmodel``: the cost model's predictions against measured TTFT on real vLLM.

1. An engine with kvtier warms up on prompts of a few lengths, then restores two of them; its
   prefill model is fitted from those steps' own timings, its load terms from those restores (as
   when serving).
2. At each length (2k, 8k, 16k): the model predicts the recompute time of a fresh prompt, then the
   prompt runs (a recompute: nothing is stored yet) and its TTFT is measured. vLLM's prefix cache
   is then reset so the same prompt must come back from kvtier's DRAM tier: the model predicts
   that restore (load of the stored blocks + recompute of the tail) and it is measured: the median
   of three restores (the prefix cache emptied before each), since one restore is tens of ms and one
   engine step's noise on a shared 2-core box is a large share of it.
3. Capped link: a second engine whose host->device link is capped (``link_gbps``; the worker then
   really paces its loads to the cap) so that restoring is predicted slower than recomputing. It
   starts from the first engine's prefill fit (same model, same box: what it would learn again
   from its own steps, which on the mid model take many minutes) after two warm-up prompts. A
   prompt runs once (recompute), the prefix cache is reset, and the same prompt runs again: kvtier
   must not load it (it either skips storing it, below the DRAM break-even, or decides to
   recompute), and that TTFT is compared to the first (plain recompute). The tiny model uses the
   8k prompt, the mid model the 2k one (its 8k recompute takes minutes, twice).

``max_rel_error_*`` is the worst |predicted - measured| / measured over the lengths;
``capped_link_ttft_vs_recompute`` the second TTFT over the first.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Callable

from kvtier.bench.checks import loaded_tokens, require, require_loaded

__all__ = ["run_costmodel_bench", "COSTMODEL_KEYS"]

RESTORES = 3  # restores timed per length (the median counts); the prediction is made before the first

COSTMODEL_KEYS = ("max_rel_error_restore", "max_rel_error_recompute", "capped_link_ttft_vs_recompute")


def _prompt(seed: int, tokens: int) -> list[int]:
    return [3 + (seed * 7919 + i * 131) % 1900 for i in range(tokens)]


def _predict_restore(cost, blocks: int, prompt_tokens: int) -> float:
    return cost.restore_seconds(blocks, 0, prompt_tokens)


def _predict_recompute(cost, prompt_tokens: int) -> float:
    return cost.recompute_seconds(0, prompt_tokens) + cost.request_seconds(prompt_tokens)


def run_costmodel_bench(quick: bool = False, size: str = "tiny", progress: Callable[[str], None] = print) -> dict:
    from kvtier.bench.harness import Engine, cpu_environment
    from kvtier.models.demo import ensure_demo_model

    cpu_environment()
    lengths = (1024, 2048, 4096) if quick else (2048, 8192, 16384)
    model = str(ensure_demo_model(size, progress=progress))
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-cost-", dir=Path.cwd()) as tmp:
        engine = Engine(model, kvtier=True, nvme_dir=Path(tmp) / "nvme", max_len=max(lengths) + 256)
        cost = engine.connector._scheduler.cost
        progress("warm-up: the prefill model learns from the engine's own steps")
        # what serving shows the model: short prompts and long ones (whose full chunks and
        # remainders come at many offsets)
        for seed, n in ((1, 64), (2, 512), (7, 96), (3, 2048), (8, 200), (4, 4096), (9, 300), (5, 1536), (6, 3000)):
            engine.timed(_prompt(seed, n))
        # and restores, as serving shows it too: the load model learns the mover's real rate and what
        # a load adds to its request from the restores it sees (two of the prompts above, again)
        for seed, n in ((2, 512), (6, 3000)):
            engine.forget_hbm()
            engine.timed(_prompt(seed, n))
        require(cost.prefill is not None, "no prefill model after the warm-up: nothing to predict with")
        results["_model_after_warmup"] = {k: v for k, v in cost.report().items() if k != "sources"}
        errors_restore, errors_recompute = [], []
        for i, n in enumerate(lengths):
            prompt = _prompt(100 + i, n)
            predicted_recompute = _predict_recompute(cost, n)
            measured_recompute, _ = engine.timed(prompt)
            engine.forget_hbm()
            blocks = (n - 1) // cost.block_tokens  # the last token is always recomputed
            predicted_restore = _predict_restore(cost, blocks, n)
            results[f"_restore_{n}_round_trip_ms"] = cost.round_trip_seconds() * 1e3
            results[f"_restore_{n}_after_load_factor"] = cost.after_load_factor()
            results[f"_restore_{n}_request_ms"] = cost.request_seconds(n) * 1e3
            results[f"_restore_{n}_load_ms"] = float(cost.load_seconds(blocks, 0)) * 1e3
            runs = []
            for repeat in range(RESTORES):  # a restore is tens of ms: one step's noise is a large share
                if repeat:
                    engine.forget_hbm()
                seconds, out = engine.timed(prompt)
                runs.append(seconds)
            measured_restore = statistics.median(runs)
            results[f"_restore_{n}_runs_s"] = runs
            loaded = loaded_tokens(out)
            require_loaded(loaded, n, cost.block_tokens, f"the {n}-token restore")
            progress(f"{n} tokens: recompute {measured_recompute:.2f} s (predicted {predicted_recompute:.2f}), "
                     f"restore {measured_restore:.3f} s (predicted {predicted_restore:.3f}, loaded {loaded})")
            errors_recompute.append(abs(predicted_recompute - measured_recompute) / measured_recompute)
            errors_restore.append(abs(predicted_restore - measured_restore) / measured_restore)
            results[f"_recompute_{n}_s"] = measured_recompute
            results[f"_recompute_{n}_predicted_s"] = predicted_recompute
            results[f"_restore_{n}_s"] = measured_restore
            results[f"_restore_{n}_predicted_s"] = predicted_restore
            results[f"_restore_{n}_loaded_tokens"] = loaded
        results["_prefill_model"] = cost.report()["prefill"]
        engine.close()

        capped = _capped_link(model, Path(tmp) / "nvme-capped", lengths, size, cost, results, progress)
    results["max_rel_error_restore"] = max(errors_restore)
    results["max_rel_error_recompute"] = max(errors_recompute)
    results.update(capped, _model=size, _lengths=list(lengths))
    return results


def _capped_link(model: str, nvme_dir: Path, lengths: tuple[int, ...], size: str, cost, results: dict,
                 progress: Callable[[str], None]) -> dict:
    """Step 3: an engine whose link is capped so that loading this session would take ~3x its recompute."""
    from kvtier.bench.harness import Engine

    n = lengths[1] if size == "tiny" else lengths[0]
    fitted = cost.prefill
    geometry_bytes = cost.dram_block_bytes / cost.block_tokens  # bytes per token
    cap = geometry_bytes * n / (3 * results[f"_recompute_{n}_s"]) / 1e9
    progress(f"capped link: pcie={cap:.5f} GB/s, {n} tokens")
    capped = Engine(model, kvtier=True, nvme_dir=nvme_dir, max_len=max(lengths) + 256,
                    extra={"link_gbps": f"pcie={cap:.6f}"})
    for seed, m in ((1, 64), (2, 512)):
        capped.timed(_prompt(seed, m))
    capped.connector._scheduler.cost.prefill = fitted
    prompt = _prompt(300, n)
    plain, _ = capped.timed(prompt)
    capped.forget_hbm()
    again, out = capped.timed(prompt)
    counters = dict(capped.manager.telemetry.counters)
    capped.close()
    return {"capped_link_ttft_vs_recompute": again / plain, "_capped_gbps": cap, "_capped_plain_s": plain,
            "_capped_again_s": again,
            "_capped_loaded_tokens": loaded_tokens(out),
            "_capped_decisions": {k: v for k, v in counters.items() if k.startswith("decision_")},
            "_capped_store_skipped_blocks": counters.get("store_skipped_blocks", 0), "_capped_tokens": n}
