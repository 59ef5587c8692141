"""The real-vLLM half of ``python -m benchmarks quality``: next-token agreement and KL per cold codec.

One engine on the tiny demo model with kvtier (warm tier uncompressed, NVMe cold tier). For each
prompt the reference is the full next-token distribution of a plain prefill. Then, per codec: the
cold codec is set, every session is dropped, the prompts are prefilled again (stored raw in DRAM),
evicted to NVMe (re-encoded by the codec), vLLM's prefix cache is reset, and the prompts run once
more: their KV now comes from the NVMe tier through the codec's decoder. Top-1 agreement and
KL(reference || codec) are computed over the whole vocabulary at each of 16 generated positions
(while the greedy sequences agree). The raw KV blocks of the first
round are also read back from the NVMe files, as captured demo-model KV for the reconstruction
figures.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["run_vllm_quality"]

STEPS = 16  # generated positions compared per prompt


def _prompts(count: int, tokens: int) -> list[list[int]]:
    return [[3 + (p * 7919 + i * 131 + (i * i) % 97) % 1900 for i in range(tokens)] for p in range(count)]


def _distributions(output) -> list[dict[int, float]]:
    """The next-token distribution at every generated position (full vocabulary)."""
    return [{int(token): float(lp.logprob) for token, lp in step.items()} for step in output.outputs[0].logprobs]


def _compare(reference: list[list[dict]], got: list[list[dict]]) -> tuple[int, int, float]:
    """(positions compared, top-1 agreements, summed KL). Positions are compared while the greedy
    sequences agree (after a disagreement the two runs condition on different tokens)."""
    positions = agree = 0
    kl = 0.0
    for ref_steps, got_steps in zip(reference, got):
        for r, g in zip(ref_steps, got_steps):
            positions += 1
            kl += _kl(r, g)
            same = max(r, key=r.get) == max(g, key=g.get)
            agree += same
            if not same:
                break
    return positions, agree, kl


def _kl(reference: dict[int, float], other: dict[int, float]) -> float:
    floor = min(other.values())  # tokens outside the returned set: at most the smallest returned
    return sum(math.exp(lp) * (lp - other.get(tok, floor)) for tok, lp in reference.items())


def _drop_all(engine) -> None:
    for session in list(engine.manager.table.sessions):
        job = engine.manager.planner.evict(session, None)
        if job is not None:
            engine.run_job(job)
    engine.forget_hbm()


def _evict_all_to_nvme(engine) -> None:
    from kvtier.plan.index import Tier

    for session in list(engine.manager.table.sessions):
        job = engine.manager.planner.evict(session, Tier.NVME)
        if job is not None:
            engine.run_job(job)
    engine.forget_hbm()


def _captured_blocks(nvme_dir: Path, fingerprint, limit: int = 16):
    """Raw (codec none) canonical blocks read back from the NVMe tier's files."""
    import torch

    from kvtier.tiers.nvme.store import NvmeStore

    geometry = fingerprint.geometry
    store = NvmeStore(nvme_dir, 1 << 40, io_threads=2, readonly=True)
    dtype = getattr(torch, geometry.dtype)
    blocks = []
    buf = torch.empty(geometry.block_bytes + 4096, dtype=torch.uint8)
    for record in store.scan():
        if len(blocks) >= limit:
            break
        nbytes, codec = store.read_into(record.namespace, record.key, buf, fingerprint.digest)
        if codec == "none" and nbytes == geometry.block_bytes:
            blocks.append(buf[:nbytes].view(dtype).view(geometry.block_shape).clone())
    store.close()
    return torch.stack(blocks) if blocks else None


def run_vllm_quality(codecs, quick: bool = False, progress: Callable[[str], None] = print) -> dict:
    from kvtier.bench.harness import Engine, cpu_environment
    from kvtier.codecs import resolve_codec
    from kvtier.models.demo import ensure_demo_model

    cpu_environment()
    model = str(ensure_demo_model("tiny", progress=progress))
    prompts = _prompts(4 if quick else 12, 1024)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-quality-", dir=Path.cwd()) as tmp:
        nvme = Path(tmp) / "nvme"
        engine = Engine(model, kvtier=True, nvme_dir=nvme, max_len=4096, max_logprobs=-1)
        vocab = engine.llm.llm_engine.model_config.get_vocab_size()
        try:
            progress(f"vLLM: reference distributions for {len(prompts)} prompts (vocab {vocab})")
            reference = [_distributions(engine.generate(p, STEPS, logprobs=vocab)) for p in prompts]
            _evict_all_to_nvme(engine)
            captured = _captured_blocks(nvme, engine.manager.fingerprint)
            for spec in codecs:
                progress(f"vLLM: prompts restored through codec {spec}")
                _drop_all(engine)
                engine.manager.table.cold_codec = resolve_codec(spec, engine.manager.geometry, "cold")
                for p in prompts:  # prefill again: raw blocks in DRAM
                    engine.generate(p, 1)
                _evict_all_to_nvme(engine)  # re-encoded by the codec on the way to NVMe
                before = engine.manager.telemetry.counters.get("hit_nvme_blocks", 0)
                got = [_distributions(engine.generate(p, STEPS, logprobs=vocab)) for p in prompts]
                loaded = engine.manager.telemetry.counters.get("hit_nvme_blocks", 0) - before
                positions, agree, kl = _compare(reference, got)
                results[spec] = {"top1_agreement": agree / positions, "kl": kl / positions,
                                 "_positions": positions, "_nvme_blocks_loaded": loaded}
        finally:
            engine.close()
    return {"per_codec": results, "captured": captured, "_prompts": len(prompts), "_prompt_tokens": 1024}
