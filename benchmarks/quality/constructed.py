"""A constructed (not trained) retrieval model: a two-layer induction circuit with analytic weights.

Same task, vocabulary, tokenizer and checkpoint format as :mod:`benchmarks.quality.retrieval` (a haystack
of filler words holding a few ``KEY k v1 v2`` records; ``KEY k`` asks for ``v1 v2``), but no weight
is learned: they are set so that retrieval works at any length up to 131072 tokens (the trained
model fails past 4k), exactly, in float32 and in bf16. Built in seconds, once per cache directory.

**Geometry.** Llama, 2 layers, hidden 256, 2 heads of head_dim 128 (2 KV heads), MLPs all zero,
RMSNorm weights 1, untied embeddings, plain RoPE with ``rope_theta`` 1e16 (not 2.5e11: that leaves
only 32 slow pairs, all taken by the codes below, and no slow pair for the outlier channels).
RoPE pair i is dims (i, i + 64), angular speed w_i = theta^(-i/64): pairs 0..19 span 1 .. 1.8e-5
rad/token (positional attention); pairs 24..63 turn < 0.14 rad over 135168 positions and pairs
32..63 < 0.002 rad (content matching there does not decay with distance). HF (``from_pretrained``)
and vLLM compute the RoPE frequencies in float32 and round cos/sin to bf16: the positional gap
below stays 23.8-24.3 nats at every position up to 135167 (measured); a model cast in memory with
``.to(torch.bfloat16)`` also rounds the frequencies and keeps ~15 nats (still ample).

**Residual stream** (every token embedding has the same norm, so the first RMSNorm scales all
alike): a 32-dim key code block and a 32-dim value code block, a constant dim (16, the RMSNorm
input's dominant, massive-activation-like dim), a BOS flag, 16 dims of random per-token "texture";
layer 1 writes PREV (the codes of token p-1, 64 dims) and PREV2 (key code of token p-2); layer 2
writes ANS (the value code it retrieved). Codes are +-1 Gold-code words, (-1)^Tr(a x + b x^3) over
GF(2^5): distinct words have inner products 0 or +-8 of 32 (coherence 1/4). Keys have a key code,
values a value code, fillers both (each / sqrt 2), KEY/EOS/PAD/QUERY a value code only, BOS none.

**Layer 1** (positional, content-independent q and k from the constant dim, in pairs 0..19): head 0
scores s(d) = L sum_i a_i cos(w_i (d - 1)) at distance d = query - key position, peaking at d = 1;
head 1 the same peaking at d = 2. a_i >= 0 maximise the worst gap s(1) - s(d) over d in {0, 2, ...,
135167} (a max-min LP; scipy is not a dependency, so smoothed-min ascent on a growing set of worst
offsets), then L makes that worst gap 24 nats (ln 131072 = 11.8). Values copy the codes into PREV
(head 0) and PREV2 (head 1).

**Layer 2** (the induction head; slow pairs 32..63 only): query = code(t) + g keycode(PREV(t)),
key = code(PREV(p)) + g keycode(PREV2(p)), g = 0.6, scaled so a full code match is 48 logits. At
``KEY k`` the query (k's key code) matches the v1 position of k's record (PREV = k): 48, against
0.6 x 48 at v2 (PREV2 = k), <= 1/4 of 48 for other keys and ~<= 0.28 x 48 for filler positions. At
the next step the query v1 + g k matches v2's position at (1 + g^2) 48: the PREV2 term breaks the
tie when v1 also occurs in another record (a pure previous-token match would miss ~2% of questions).
The value copies the value code into ANS; the LM head scores each value token by its code (24
logits for the right one, <= 6 for the others, 0 for all other tokens).

**Key statistics like real models'** (these do not change any score: the queries are zero in the
RoPE pairs that carry them). Fixed outlier channels: dims 24..27 of every head (slow pairs, so a
constant sign after RoPE), 15x the median channel magnitude, as KIVI (Liu et al. 2024) and KVQuant
(Hooper et al. 2024) report for keys; an attention-sink-like BOS at position 0 (StreamingLLM, Xiao
et al. 2023) whose key norm is 40x the median key norm; all other free channels carry per-token
noise at the median channel magnitude. Per-tensor 4-bit quantization then has its scale set by the
sink and outliers and rounds the matching dims away; the exact model is unaffected.

**Measured** (2-core CPU; 4 records per haystack, one random question each, both answer tokens
exact). HF transformers' own forward (``check_lengths``, sdpa: causal flash attention, no length x
length matrix; peak RSS 1.6 GiB bf16, 2.9 GiB float32 at 131072): bf16 checkpoint 20/20 at 1024,
20/20 at 32768, 10/10 at 131072 (~36 s a trial); float32 3/3 at 131072. Layer-2 logits at 131072
(bf16): the match 49.2 (step 1) and 65.3 (step 2), the best other position 28.1 and 30.2, and all
131k others together (logsumexp) 28.1 and 30.9. vLLM 0.32 CPU (bf16, in-process, greedy): 6/6 at
4096, 3/3 at 32768 and 6/6 at 131072 (depths 2%, 50%, 98%). Key statistics (cached keys, 4096
tokens, both layers): median key norm 129 / 97, BOS key 40x that, outlier channels 14.8x the
median channel magnitude, sign constant at every position. ``kvtier-constructed.json`` holds the
build-time figures (1024 tokens, float32 and bf16) and the key statistics of the saved checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from benchmarks.quality.retrieval import (
    BOS,
    EOS,
    FILLER0,
    KEY,
    KEY0,
    N_FILLER,
    N_KEYS,
    N_VALUES,
    PAD,
    QUERY,
    VALUE0,
    VOCAB,
    accuracy,
    make_haystack,
    read_info,
    save,
)
from benchmarks.quality.retrieval import INFO_FILE as RETRIEVAL_INFO
from kvtier.config import default_cache_dir
from kvtier.models.demo import build_once, import_hf, seal

__all__ = ["CONSTRUCTED_VERSION", "PARAMS", "build_constructed_model", "check_lengths", "construct",
           "constructed_info", "constructed_model_dir", "ensure_constructed_model", "gold_codes",
           "key_statistics", "prev_token_amplitudes"]

CONSTRUCTED_VERSION = 1
INFO_FILE = "kvtier-constructed.json"
MAX_POSITIONS = 131072 + 4096
HIDDEN, HEAD_DIM, HEADS, INTERMEDIATE = 256, 128, 2, 64
HALF = HEAD_DIM // 2  # RoPE pair i is dims (i, i + HALF): the neox layout of HF's and vLLM's Llama
PARAMS: dict[str, float] = {
    "rope_theta": 1e16,
    "positional_pairs": 20,  # pairs 0..19 carry the previous-token heads' positional scores
    "prev_margin": 24.0,  # nats: the previous-token heads' worst gap, any distance up to MAX_POSITIONS
    "match_logit": 48.0,  # layer 2: the logit of a full code match
    "gamma": 0.6,  # layer 2: weight of the previous token's key code in query and key
    "answer_logit": 24.0,  # LM head: the retrieved value token's logit
    "outlier_ratio": 15.0,  # outlier channels / median channel magnitude
    "sink_ratio": 40.0,  # BOS key norm / median key norm
    "seed": 0,  # noise and texture
}
CODE = 32  # code length: Gold codes over GF(2^5)
K_DIMS = list(range(32, 48)) + list(range(96, 112))  # layer 2: key-code block in pairs 32..47
V_DIMS = list(range(48, 64)) + list(range(112, 128))  # value-code block in pairs 48..63
OUTLIER_DIMS, OUTLIER_SIGNS = (24, 25, 26, 27), (1.0, -1.0, 1.0, -1.0)
# the residual stream
ID_K, ID_V, BOS_DIM, CONST_DIM, TEX = slice(0, 32), slice(32, 64), 64, 65, slice(66, 82)
PREV_K, PREV_V, PREV2_K, ANS = slice(82, 114), slice(114, 146), slice(146, 178), slice(178, 210)
CONST, TEX_NORM = 16.0, 2.0
EMB_SQ = CODE + TEX_NORM ** 2 + CONST ** 2  # every token embedding's squared norm
LAYER2_SQ = EMB_SQ + CODE + CODE / 2  # nominal, at layer 2: + PREV (a code) + PREV2 (a filler's key half)
CALIBRATION_LENGTH, STATS_LENGTH, BUILD_LENGTH, BUILD_TRIALS = 2048, 4096, 1024, 20
EVAL_SEED = 4242


def constructed_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    base = Path(cache_dir) if cache_dir is not None else Path(default_cache_dir()) / "models"
    return base.expanduser() / f"kvtier-constructed-v{CONSTRUCTED_VERSION}"


def gold_codes() -> Any:
    """The 1024 +-1 words (-1)^Tr(a x + b x^3), x over GF(2^5) (row 32 b + a): distinct words have
    inner product 0 or +-8 (x^3 is almost bent on GF(2^5)); words of one b are orthogonal."""
    import numpy as np

    exp = [1]
    for _ in range(30):  # powers of the primitive element, modulo x^5 + x^2 + 1
        v = exp[-1] << 1
        exp.append(v ^ 0b100101 if v & 32 else v)
    log = {v: i for i, v in enumerate(exp)}

    def mul(u: int, v: int) -> int:
        return 0 if u == 0 or v == 0 else exp[(log[u] + log[v]) % 31]

    def trace(y: int) -> int:
        total, power = y, y
        for _ in range(4):
            power = mul(power, power)
            total ^= power
        return total  # 0 or 1

    cubes = [mul(x, mul(x, x)) for x in range(32)]
    words = [[1 - 2 * trace(mul(a, x) ^ mul(b, cubes[x])) for x in range(32)] for b in range(32) for a in range(32)]
    return np.array(words, dtype=np.float64)


def prev_token_amplitudes(theta: float, pairs: int, positions: int = MAX_POSITIONS, rounds: int = 8,
                          steps: int = 400) -> tuple[Any, float]:
    """Amplitudes a_i >= 0 (sum 1) of s(d) = sum_i a_i cos(w_i (d - 1)), w_i = theta^(-i/64), that
    maximise the worst gap s(1) - s(d) over d in {0, 2, ..., positions - 1}; (a, that gap). A max-min
    LP, solved by smoothed-min ascent (Adam on softmax weights) over a growing set of the worst d."""
    import numpy as np
    import torch

    omega = float(theta) ** (-np.arange(pairs) / HALF)
    offsets = np.concatenate([[-1.0], np.arange(1, positions - 1, dtype=np.float64)])  # d - 1
    gaps = 1.0 - np.cos(np.outer(offsets, omega))
    active = set(range(256)) | set(np.unique(np.geomspace(1, len(offsets) - 1, 512).astype(int)).tolist())
    with _one_thread():
        z = _maximin(torch, gaps, active, torch.zeros(pairs, dtype=torch.float64), rounds, steps)
    a = torch.softmax(z, 0).numpy()
    a = np.where(a < 1e-3, 0.0, a)  # pairs the optimum leaves (nearly) unused: exactly unused
    a /= a.sum()
    return a, float((gaps @ a).min())


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread: this model's ops are tiny, and on a busy box two threads only contend
    (the LP took 27 s instead of 1.5 s, a 1024-token forward 0.8 s instead of 0.06 s)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _maximin(torch: Any, gaps: Any, active: set, z: Any, rounds: int, steps: int) -> Any:
    import numpy as np

    for _ in range(rounds):
        rows = torch.tensor(gaps[sorted(active)])
        z = z.clone().requires_grad_(True)
        opt = torch.optim.Adam([z], lr=0.05)
        for step in range(steps):
            tau = 0.01 * 0.05 ** (step / steps)
            loss = tau * torch.logsumexp(-(rows @ torch.softmax(z, 0)) / tau, 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        z = z.detach()
        active |= set(np.argsort(gaps @ torch.softmax(z, 0).numpy())[:32].tolist())
    return z


# ---- the weights ------------------------------------------------------------------------------------
def _config(transformers: Any, params: dict) -> Any:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        tie_word_embeddings=False, rope_theta=params["rope_theta"], rms_norm_eps=1e-6)


def _embeddings(np: Any, rng: Any) -> Any:
    """(VOCAB, HIDDEN): codes, the constant, the BOS flag and texture; every row of norm sqrt(EMB_SQ)."""
    words = gold_codes()
    emb = np.zeros((VOCAB, HIDDEN))
    emb[KEY0:KEY0 + N_KEYS, ID_K] = words[32:32 + N_KEYS]  # b = 1..8
    emb[VALUE0:VALUE0 + N_VALUES, ID_V] = words[32:32 + N_VALUES]
    emb[FILLER0:FILLER0 + N_FILLER, ID_K] = words[288:288 + N_FILLER] / math.sqrt(2)  # b = 9..16
    emb[FILLER0:FILLER0 + N_FILLER, ID_V] = words[544:544 + N_FILLER] / math.sqrt(2)  # b = 17..24
    for i, special in enumerate((EOS, PAD, KEY, QUERY)):
        emb[special, ID_V] = words[800 + i]  # b = 25
    emb[BOS, BOS_DIM] = math.sqrt(CODE)
    emb[:, CONST_DIM] = CONST
    tex = rng.standard_normal((VOCAB, TEX.stop - TEX.start))
    emb[:, TEX] = TEX_NORM * tex / np.linalg.norm(tex, axis=1, keepdims=True)
    return emb


def _previous_token_layer(attn: Any, params: dict, amps: Any, peak_logit: float) -> None:
    """Layer 1: head h attends to the token h + 1 back (constant q, k in pairs 0..P-1) and copies its
    codes: head 0 both blocks into PREV, head 1 the key block into PREV2."""
    import numpy as np
    import torch

    rms = math.sqrt(EMB_SQ / HIDDEN)
    const = CONST / rms  # the constant dim after the RMSNorm
    omega = float(params["rope_theta"]) ** (-np.arange(len(amps)) / HALF)
    q, k, v, o = (torch.zeros_like(m.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    for head in range(HEADS):
        shift, row = head + 1, head * HEAD_DIM
        for i, a in enumerate(amps):
            amp = math.sqrt(a * peak_logit * math.sqrt(HEAD_DIM)) / const
            q[row + i, CONST_DIM] = amp
            k[row + i, CONST_DIM] = amp * math.cos(omega[i] * shift)
            k[row + HALF + i, CONST_DIM] = amp * math.sin(omega[i] * shift)
    for j in range(2 * CODE):  # head 0: both code blocks -> PREV
        v[j, ID_K.start + j] = rms
        o[PREV_K.start + j, j] = 1.0
    for j in range(CODE):  # head 1: the key block -> PREV2
        v[HEAD_DIM + j, ID_K.start + j] = rms
        o[PREV2_K.start + j, HEAD_DIM + j] = 1.0
    for module, weight in zip((attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj), (q, k, v, o)):
        module.weight.data.copy_(weight)


def _induction_layer(attn: Any, params: dict) -> None:
    """Layer 2, head 0: query code(t) + g keycode(t-1) matches key code(p-1) + g keycode(p-2) in the
    slow pairs; the value copies the value code into ANS. Head 1 attends nowhere in particular."""
    import torch

    rms = math.sqrt(LAYER2_SQ / HIDDEN)
    scale = math.sqrt(params["match_logit"] * math.sqrt(HEAD_DIM) * rms ** 2 / CODE)
    g = params["gamma"]
    q, k, v, o = (torch.zeros_like(m.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    for j in range(CODE):
        kd, vd = K_DIMS[j], V_DIMS[j]
        q[kd, ID_K.start + j], q[kd, PREV_K.start + j], q[vd, ID_V.start + j] = scale, g * scale, scale
        k[kd, PREV_K.start + j], k[kd, PREV2_K.start + j], k[vd, PREV_V.start + j] = scale, g * scale, scale
        v[j, ID_V.start + j] = rms
        o[ANS.start + j, j] = 1.0
    for module, weight in zip((attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj), (q, k, v, o)):
        module.weight.data.copy_(weight)


def _free_dims(layer: int, head: int, params: dict) -> list[int]:
    """Dims of a head's keys in RoPE pairs where its query is zero: they never change a score."""
    if layer == 0:
        used = range(int(params["positional_pairs"]))
    else:
        used = range(32, 64) if head == 0 else range(0)
    return [d for d in range(HEAD_DIM) if d % HALF not in used]


def _cached_keys(model: Any, tokens: Sequence[int]) -> list[Any]:
    """The keys the forward caches (after RoPE), per layer, (heads, positions, head_dim), float32."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(tokens)]), use_cache=True, logits_to_keep=1)
    return [layer.keys[0].float() for layer in out.past_key_values.layers]


def _add_key_statistics(model: Any, params: dict, rng: Any, tokens: Sequence[int]) -> dict:
    """Give every head's free key dims per-token noise at its median channel magnitude m, fixed
    outlier channels (outlier_ratio x m, constant sign) and a BOS sink (sink_ratio x median key norm);
    returns the calibration: m per head and the median key norm per layer."""
    import numpy as np
    import torch

    keys = _cached_keys(model, tokens)
    rms_at = (math.sqrt(EMB_SQ / HIDDEN), math.sqrt(LAYER2_SQ / HIDDEN))
    tex_std = TEX_NORM / math.sqrt(TEX.stop - TEX.start)  # one texture entry, before the RMSNorm
    mags = []
    for layer, attn in enumerate(a.self_attn for a in model.model.layers):
        weight = attn.k_proj.weight.data
        chan = keys[layer][:, 1:].abs().mean(dim=1)  # (heads, head_dim)
        used = chan[0][chan[0] > 0]  # head 0 carries each layer's scores
        mag = float(used.median())
        mags.append(mag)
        rms = rms_at[layer]
        per_weight = mag / (math.sqrt(2 / math.pi) * tex_std / rms)  # noise row norm for mean |k| = mag
        for head in range(HEADS):
            for d in _free_dims(layer, head, params):
                row = rng.standard_normal(TEX.stop - TEX.start)
                ratio = params["outlier_ratio"] if d in OUTLIER_DIMS else 1.0
                noise = per_weight * ratio * (0.25 if d in OUTLIER_DIMS else 1.0)
                weight[head * HEAD_DIM + d, TEX] = torch.from_numpy(noise * row / np.linalg.norm(row)).float()
                if d in OUTLIER_DIMS:
                    sign = OUTLIER_SIGNS[OUTLIER_DIMS.index(d)]
                    weight[head * HEAD_DIM + d, CONST_DIM] = sign * ratio * mag * rms / CONST
    norms = [float(k[:, 1:].norm(dim=-1).median()) for k in _cached_keys(model, tokens)]
    bos = math.sqrt(CODE) / rms_at[0]  # BOS's flag after the RMSNorm (its residual is its embedding)
    for layer, attn in enumerate(a.self_attn for a in model.model.layers):
        for head in range(HEADS):
            dims = [d for d in _free_dims(layer, head, params) if d not in OUTLIER_DIMS]
            row = rng.standard_normal(len(dims))
            sink = params["sink_ratio"] * norms[layer] * row / np.linalg.norm(row) / bos
            attn.k_proj.weight.data[[head * HEAD_DIM + d for d in dims], BOS_DIM] = torch.from_numpy(sink).float()
    return {"median_channel_magnitude": [round(m, 4) for m in mags],
            "median_key_norm": [round(n, 3) for n in norms]}


def construct(params: dict | None = None) -> tuple[Any, dict]:
    """The constructed model in float32 (HF LlamaForCausalLM, sdpa) and its construction record."""
    import numpy as np
    import torch

    params = {**PARAMS, **(params or {})}
    _, _, transformers = import_hf()
    config = _config(transformers, params)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).float().eval()
    for p in model.parameters():
        p.data.zero_()
    for norm in [model.model.norm] + [n for layer in model.model.layers
                                      for n in (layer.input_layernorm, layer.post_attention_layernorm)]:
        norm.weight.data.fill_(1.0)
    rng = np.random.default_rng([int(params["seed"]), 7])
    model.model.embed_tokens.weight.data.copy_(torch.tensor(_embeddings(np, rng)))
    amps, gap = prev_token_amplitudes(params["rope_theta"], int(params["positional_pairs"]))
    peak = params["prev_margin"] / gap
    _previous_token_layer(model.model.layers[0].self_attn, params, amps, peak)
    _induction_layer(model.model.layers[1].self_attn, params)
    rms = math.sqrt((LAYER2_SQ + CODE) / HIDDEN)  # at the final norm: + ANS
    values = torch.tensor(gold_codes()[32:32 + N_VALUES]) * params["answer_logit"] * rms / CODE
    model.lm_head.weight.data[VALUE0:VALUE0 + N_VALUES, ANS] = values
    calib = make_haystack(np.random.default_rng([int(params["seed"]), 8]), CALIBRATION_LENGTH)
    calibration = _add_key_statistics(model, params, rng, calib.tokens)
    record = {"constructed": True, "params": params, "geometry": geometry(params),
              "prev_token": {"amplitudes": [round(float(a), 5) for a in amps], "worst_gap_fraction": round(gap, 5),
                             "peak_logit": round(peak, 3), "worst_gap_nats": params["prev_margin"]},
              "calibration": calibration}
    return model, record


def geometry(params: dict = PARAMS) -> dict:
    return {"hidden": HIDDEN, "layers": 2, "heads": HEADS, "kv_heads": HEADS, "head_dim": HEAD_DIM,
            "intermediate": INTERMEDIATE, "rope_theta": params["rope_theta"], "max_positions": MAX_POSITIONS}


# ---- measurements ------------------------------------------------------------------------------------
def _load(path: str | os.PathLike[str], dtype: str = "bfloat16") -> Any:
    torch, _, transformers = import_hf()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                              attn_implementation="sdpa")
    return model.eval()


def key_statistics(model_or_path: Any, length: int = STATS_LENGTH, seed: int = EVAL_SEED) -> dict:
    """Per layer, the cached (post-RoPE) keys of one haystack of ``length`` tokens: median key norm
    (positions 1..), BOS's key norm (mean over heads) and its ratio to the median; per-channel mean
    |k| (positions 1..): the median over all heads' channels, the outlier channels' mean and ratio
    to it, and how often an outlier channel has its usual sign."""
    import numpy as np

    model = _load(model_or_path) if isinstance(model_or_path, (str, os.PathLike)) else model_or_path
    stack = make_haystack(np.random.default_rng([seed, length]), length)
    stats = {}
    for layer, keys in enumerate(_cached_keys(model, stack.tokens)):
        body = keys[:, 1:]
        median_norm = float(body.norm(dim=-1).median())
        sink = float(keys[:, 0].norm(dim=-1).mean())
        chan = body.abs().mean(dim=1)
        median_chan = float(chan.flatten().median())
        outliers = body[:, :, list(OUTLIER_DIMS)]
        usual = outliers.mean(dim=1, keepdim=True).sign()
        stats[f"layer{layer}"] = {
            "median_key_norm": round(median_norm, 3), "sink_key_norm": round(sink, 2),
            "sink_to_median_norm": round(sink / median_norm, 2), "median_channel_magnitude": round(median_chan, 4),
            "outlier_channel_magnitude": round(float(chan[:, list(OUTLIER_DIMS)].mean()), 3),
            "outlier_to_median_channel": round(float(chan[:, list(OUTLIER_DIMS)].mean()) / median_chan, 2),
            "outlier_sign_constancy": round(float((outliers.sign() == usual).float().mean()), 4),
            "max_abs_key": round(float(keys.abs().max()), 2)}
    stats["length"] = length
    return stats


def check_lengths(path: str | os.PathLike[str], lengths: Sequence[int], trials: int, dtype: str = "bfloat16",
                  seed: int = EVAL_SEED, progress: Callable[[str], None] | None = None) -> dict:
    """HF (transformers, sdpa, no kvtier) retrieval accuracy of a model directory per length:
    {"<length>": accuracy, "_dtype", "_trials", "_seconds": {...}}. At 131072 tokens a trial takes
    minutes on CPU; sdpa runs causal flash attention, so no length x length matrix is built."""
    say = progress or (lambda _msg: None)
    model = _load(path, dtype)
    result: dict[str, Any] = {"_dtype": dtype, "_trials": trials, "_seconds": {}}
    for length in lengths:
        started = time.perf_counter()
        result[str(length)] = accuracy(model, length, trials, seed)
        result["_seconds"][str(length)] = round(time.perf_counter() - started, 1)
        say(f"{length} tokens ({dtype}): accuracy {result[str(length)]:.2f} "
            f"({result['_seconds'][str(length)]} s)")
    return result


# ---- built once, cached ------------------------------------------------------------------------------
def build_constructed_model(out: Path, say: Callable[[str], None]) -> None:
    """Construct, measure (HF, float32 then the saved bf16 checkpoint, at BUILD_LENGTH tokens; key
    statistics), and save as a retrieval-model directory vLLM serves, with ``kvtier-constructed.json``."""
    say("constructing the retrieval model (analytic weights, seconds)")
    with _one_thread():
        _build(out, say)
    seal(out)


def _build(out: Path, say: Callable[[str], None]) -> None:
    model, record = construct()
    f32 = accuracy(model, BUILD_LENGTH, BUILD_TRIALS, EVAL_SEED)
    save(model, out, record, {str(BUILD_LENGTH): f32})  # tokenizer, bf16 weights, kvtier-retrieval.json
    served = _load(out, "bfloat16")
    bf16 = accuracy(served, BUILD_LENGTH, BUILD_TRIALS, EVAL_SEED)
    stats = key_statistics(served)
    say(f"accuracy at {BUILD_LENGTH} tokens (HF): float32 {f32:.2f}, bf16 {bf16:.2f}")
    measured = {"float32": {str(BUILD_LENGTH): f32}, "bfloat16": {str(BUILD_LENGTH): bf16}}
    info = {"kvtier_constructed": True, "version": CONSTRUCTED_VERSION, **record, "hf_accuracy": measured,
            "eval_trials": BUILD_TRIALS, "key_statistics": stats,
            "note": "constructed (not trained) induction circuit; see benchmarks/quality/constructed.py"}
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    retrieval = json.loads((out / RETRIEVAL_INFO).read_text())  # what the needle benchmark reads
    retrieval.update(geometry=record["geometry"], hf_accuracy={str(BUILD_LENGTH): bf16}, eval_trials=BUILD_TRIALS,
                     note=info["note"])
    (out / RETRIEVAL_INFO).write_text(json.dumps(retrieval, indent=2) + "\n")


def ensure_constructed_model(cache_dir: str | os.PathLike[str] | None = None,
                             progress: Callable[[str], None] | None = print) -> Path:
    """The constructed model's directory, building it first (seconds) if no complete copy exists."""
    return build_once(constructed_model_dir(cache_dir), build_constructed_model, progress)


def constructed_info(path: str | os.PathLike[str]) -> dict | None:
    """The construction record, measured accuracies and key statistics of a directory (None: not one)."""
    return read_info(path, INFO_FILE, "kvtier_constructed")
