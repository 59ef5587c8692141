"""``kvtier bench serve``: restore vs recompute on real vLLM, decode and prefill overheads.

On the locally built "mid" demo model (16 layers, 4 KV heads x 64 dims: 16 KiB of KV per token):
* TTFT of a returning session restored from NVMe (its DRAM copy released, page cache dropped) vs
  the same prompt recomputed, at 4k and 16k tokens;
* decode tokens/s with the connector idle vs an engine without it;
* prefill time with the store path vs without the connector (``prefill_store_overhead``).
Engines run one at a time, in this process, each warmed up first.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["run_serve_bench", "SERVE_KEYS"]

SERVE_KEYS = ("restore_vs_recompute_ttft_4k", "restore_vs_recompute_ttft_16k", "decode_with_vs_without",
              "prefill_store_overhead")


def _prompt(seed: int, tokens: int) -> list[int]:
    return [3 + (seed * 7919 + i * 131) % 1900 for i in range(tokens)]


def _decode_rate(engine, seed: int, tokens: int) -> float:
    """Decode tokens/s: two fresh prompts of the same length (no cache hits), 1 vs ``tokens`` outputs."""
    one, _ = engine.timed(_prompt(seed, 256), 1)
    many, out = engine.timed(_prompt(seed + 1000, 256), tokens)
    return (len(out.outputs[0].token_ids) - 1) / max(many - one, 1e-9)


def _drop_page_cache(directory: Path) -> None:
    from kvtier.bench.tiers import drop_page_cache

    drop_page_cache(directory)


def run_serve_bench(quick: bool = False, progress: Callable[[str], None] = print) -> dict:
    from kvtier.demo_model import ensure_demo_model
    from kvtier.index import Tier
    from kvtier.plugins.vllm.harness import Engine, cpu_environment

    cpu_environment()
    sizes = {"4k": 4096, "16k": 4096 if quick else 16384}
    decode_tokens = 32 if quick else 96
    progress("building / loading the mid demo model")
    model = str(ensure_demo_model("mid", progress=lambda m: progress(m)))
    results: dict = {}
    progress("engine without kvtier: recompute TTFT, decode rate")
    plain = Engine(model, kvtier=False)
    plain.timed(_prompt(1, 512), 2)  # warm-up (the first forward of a process is slow)
    recompute = {name: plain.timed(_prompt(10 + i, n))[0] for i, (name, n) in enumerate(sizes.items())}
    decode_plain = _decode_rate(plain, 30, decode_tokens)
    plain.close()

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-", dir=Path.cwd()) as tmp:
        progress("engine with kvtier: store path, decode rate, restore from NVMe")
        tiered = Engine(model, kvtier=True, nvme_dir=Path(tmp) / "nvme")
        tiered.timed(_prompt(2, 512), 2)
        stored = {name: tiered.timed(_prompt(10 + i, n))[0] for i, (name, n) in enumerate(sizes.items())}
        decode_tiered = _decode_rate(tiered, 31, decode_tokens)
        for session in list(tiered.manager.sessions):
            tiered.run_job(tiered.manager.evict(session, Tier.NVME))
        tiered.forget_hbm()
        restored = {}
        for i, (name, n) in enumerate(sizes.items()):
            _drop_page_cache(Path(tmp))
            restored[name] = tiered.timed(_prompt(10 + i, n))[0]
        counters = dict(tiered.manager.counters)
        tiered.close()

    results["restore_vs_recompute_ttft_4k"] = restored["4k"] / recompute["4k"]
    results["restore_vs_recompute_ttft_16k"] = restored["16k"] / recompute["16k"]
    results["decode_with_vs_without"] = decode_tiered / decode_plain
    results["prefill_store_overhead"] = sum(stored.values()) / sum(recompute.values()) - 1
    results.update({f"_recompute_ttft_{k}_s": v for k, v in recompute.items()})
    results.update({f"_restored_ttft_{k}_s": v for k, v in restored.items()})
    results.update({f"_prefill_with_store_{k}_s": v for k, v in stored.items()})
    results.update(_decode_tok_s_without=decode_plain, _decode_tok_s_with=decode_tiered,
                   _hit_nvme_blocks=counters.get("hit_nvme_blocks", 0), _quick=quick)
    return results
