"""``python -m benchmarks quality``: how much each codec changes what attention sees.

Three measurements, no model hub needed:

1. **Reconstruction** (``rel_mse_k``, ``rel_mse_v``, ``attn_err``): relative MSE of K and V after an
   encode/decode round trip, and the relative error of the attention output softmax(qK^T/sqrt d)V,
   on KV captured from the demo model through vLLM (when available) and on synthetic keys with
   outlier channels (``synthetic_*``).
2. **Needle retrieval** (``needle_acc_<N>``): one needle key among N distractor keys (head_dim 128,
   keys Gaussian with 1/16 of the channels 8-20x larger, as pre-RoPE keys have); the query's score
   on the needle beats the strongest distractor by ``NEEDLE_MARGIN`` standard deviations of the
   scores. A trial succeeds when the top-1 attention score over the *decoded* keys is the needle.
   Keys go through the codec block by block (128 tokens), exactly as the tiers store them. Two
   reference quantizers that are not kvtier codecs show the known failures: ``int4-naive`` (one
   scale and zero point per block, per tensor) and ``int4-per-token`` (keys per token, like values).
3. **Through vLLM** (``top1_agreement``, ``kl``): see ``benchmarks.quality.through_vllm``.
"""
from __future__ import annotations

import math
from typing import Callable

from kvtier.codecs.recall import length_label

__all__ = ["NEEDLE_MARGIN", "NEEDLE_SIZES", "QUALITY_CODECS", "needle_accuracy", "reconstruction",
           "quantizer_for", "run_quality_harness"]

QUALITY_CODECS = ("fp8", "fp8:e5m2", "fp8:head", "int8", "int4", "int4:g32", "int4-lc", "int4-lc:g32")
REFERENCES = ("int4-naive", "int4-per-token")
NEEDLE_SIZES = (1024, 4096, 16384, 65536, 131072)
NEEDLE_MARGIN = 0.25  # needle score - best distractor score, in standard deviations of the scores
HEAD_DIM = 128
BLOCK = 128


# ---- quantizers: a codec's round trip, or a reference ---------------------------------------
def _naive_int4(x, per_token: bool):
    """Asymmetric int4 over a whole block's keys (``per_token=False``: the ``int4-naive`` codec of
    ``benchmarks.quality.naive_codec``) or over each token."""
    import torch

    from benchmarks.quality.naive_codec import naive_levels

    lo, step = naive_levels(x, (-1,) if per_token else (-2, -1))
    return torch.round((x - lo) / step).clamp(0, 15) * step + lo


def quantizer_for(spec: str) -> Callable:
    """``f(keys [n_blocks, 128, d] bf16, first: bool) -> decoded keys`` through codec ``spec``."""
    import torch

    if spec in REFERENCES:
        return lambda keys, first=False: _naive_int4(keys.float(), per_token=spec == "int4-per-token").to(keys.dtype)

    from kvtier.codecs import get_codec
    from kvtier.layout import KVGeometry

    codec = get_codec(spec)

    def roundtrip(keys, first: bool = False):
        n, tokens, dim = keys.shape
        # one "layer" whose KV heads are the blocks: codecs work per (layer, head), so each block is
        # quantized on its own, as if stored alone; values are zero (only keys matter here)
        block = torch.zeros((1, n, 2, tokens, dim), dtype=keys.dtype)
        block[0, :, 0] = keys
        geometry = KVGeometry(1, n, dim, tokens, str(keys.dtype).removeprefix("torch."))
        buf = torch.empty(codec.max_bytes(geometry), dtype=torch.uint8)
        size = codec.encode(block, buf, first=first)
        out = torch.empty_like(block)
        codec.decode(buf[:size], out)
        return out[0, :, 0]

    return roundtrip


# ---- needle retrieval ----------------------------------------------------------------------------
def _channel_scales(gen, dim: int):
    import torch

    scales = torch.ones(dim)
    outliers = torch.randperm(dim, generator=gen)[: dim // 16]
    scales[outliers] = torch.linspace(8, 20, len(outliers))
    return scales


def needle_accuracy(quantize: Callable, n: int, trials: int, seed: int = 0, margin: float = NEEDLE_MARGIN,
                    refresh: int = 25, dim: int = HEAD_DIM) -> float:
    """Fraction of ``trials`` where the top-1 score over decoded keys is the needle's."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + n)
    scales = _channel_scales(gen, dim)
    blocks = max(1, n // BLOCK)
    hits = 0
    keys = decoded = None
    for trial in range(trials):
        if trial % refresh == 0:  # a fresh haystack every ``refresh`` trials
            keys = (torch.randn((blocks, BLOCK, dim), generator=gen) * scales).to(torch.bfloat16)
            decoded = torch.cat([quantize(keys[:1], first=True), quantize(keys[1:])]) if blocks > 1 \
                else quantize(keys, first=True)
        q = torch.randn(dim, generator=gen)
        flat = keys.view(-1, dim).float()
        scores = flat @ q
        pos = int(torch.randint(0, blocks * BLOCK, (1,), generator=gen))
        others = torch.cat([scores[:pos], scores[pos + 1:]])
        target = float(others.max()) + margin * float(others.std())
        needle = torch.randn(dim, generator=gen) * scales
        needle = needle + q * (target - float(needle @ q)) / float(q @ q)  # exact score: target
        b = pos // BLOCK
        block = keys[b].clone()
        block[pos % BLOCK] = needle.to(torch.bfloat16)
        decoded_b = quantize(block[None], first=b == 0)[0]
        view = decoded.view(-1, dim).float()
        trial_scores = view @ q
        trial_scores[b * BLOCK:(b + 1) * BLOCK] = decoded_b.float() @ q
        hits += int(torch.argmax(trial_scores)) == pos
    return hits / trials


# ---- reconstruction --------------------------------------------------------------------------
def reconstruction(spec: str, blocks) -> dict:
    """Relative MSE of K and V and attention-output error for canonical ``blocks`` [n, L, H, 2, B, D].

    Queries are the blocks' own keys (a stand-in for real queries, which live in the key space),
    attending over every token of the same (layer, head).
    """
    import torch

    from kvtier.codecs import get_codec
    from kvtier.layout import KVGeometry

    codec = get_codec(spec)
    n, L, H, _, B, D = blocks.shape
    geometry = KVGeometry(L, H, D, B, str(blocks.dtype).removeprefix("torch."))
    buf = torch.empty(codec.max_bytes(geometry), dtype=torch.uint8)
    out = torch.empty_like(blocks)
    sizes = []
    for i in range(n):
        sizes.append(codec.encode(blocks[i], buf, first=i == 0))
        codec.decode(buf[: sizes[-1]], out[i])
    steady = codec.nbytes_for(geometry, False) or sum(sizes) / n  # a block that holds no sink tokens
    x, y = blocks.float(), out.float()

    def rel(a, b):
        return float(((a - b) ** 2).mean() / (b ** 2).mean().clamp_min(1e-30))

    # attention per (layer, head) over all n*B tokens
    def attend(kv):
        k = kv[:, :, :, 0].permute(1, 2, 0, 3, 4).reshape(L, H, n * B, D)
        v = kv[:, :, :, 1].permute(1, 2, 0, 3, 4).reshape(L, H, n * B, D)
        return k, v

    k, v = attend(x)
    k2, v2 = attend(y)
    q = k[:, :, :: max(1, (n * B) // 64)]  # up to 64 queries per head
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v
    approx = torch.softmax(q @ k2.transpose(-1, -2) / math.sqrt(D), -1) @ v2
    return {"rel_mse_k": rel(y[:, :, :, 0], x[:, :, :, 0]), "rel_mse_v": rel(y[:, :, :, 1], x[:, :, :, 1]),
            "attn_err": float((approx - exact).norm() / exact.norm().clamp_min(1e-30)),
            "size_ratio": steady / geometry.block_bytes}


def run_quality_harness(quick: bool = False, captured=None, progress: Callable[[str], None] = print,
                        codecs=QUALITY_CODECS, trials: int | None = None, long_trials: int | None = None) -> dict:
    """Reconstruction and needle figures for every codec (+ the two references for the needle)."""
    from kvtier.bench.codecs import synthetic_blocks
    from kvtier.layout import KVGeometry

    sizes = NEEDLE_SIZES[:3] if quick else NEEDLE_SIZES
    trials = trials or (40 if quick else 200)
    long_trials = long_trials or trials  # at the largest N (where the targets are)

    def trials_for(n: int) -> int:
        return long_trials if n == sizes[-1] else trials

    synthetic = synthetic_blocks(KVGeometry(4, 4, HEAD_DIM, BLOCK), 4, seed=11)
    results: dict[str, dict] = {}
    for spec in (*codecs, *REFERENCES):
        entry: dict = {}
        if spec not in REFERENCES:
            progress(f"{spec}: reconstruction error")
            synth = reconstruction(spec, synthetic)
            entry.update({f"synthetic_{k}": v for k, v in synth.items() if k != "size_ratio"})
            entry["size_ratio"] = synth["size_ratio"]
            if captured is not None:
                entry.update({k: v for k, v in reconstruction(spec, captured).items() if k != "size_ratio"})
            else:
                entry.update(rel_mse_k=synth["rel_mse_k"], rel_mse_v=synth["rel_mse_v"], attn_err=synth["attn_err"])
        quantize = quantizer_for(spec)
        for n in sizes:
            progress(f"{spec}: needle among {n:,} keys, {trials_for(n)} trials")
            entry[f"needle_acc_{length_label(n)}"] = needle_accuracy(quantize, n, trials_for(n))
        entry["_needle_trials"] = {length_label(n): trials_for(n) for n in sizes}
        results[spec] = entry
    progress("reference: uncompressed keys")
    results["none"] = {"size_ratio": 1.0, "rel_mse_k": 0.0, "rel_mse_v": 0.0, "attn_err": 0.0,
                       **{f"needle_acc_{length_label(n)}": needle_accuracy(lambda k, first=False: k, n, trials_for(n))
                          for n in sizes}}
    return results
