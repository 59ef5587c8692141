"""``python -m benchmarks memory``: what a ``kvtier serve`` with its DRAM tier full costs in RAM, against
plain vLLM with the same engine flags.

The pure half (no vLLM, no torch at import): the figures and the target check
(:func:`size_figures`, :func:`summarize`), the RSS / PSS / USS of a whole process tree
(:func:`tree_memory`), and the model the bench serves (:func:`ensure_fatkv_model`). The servers
are driven by ``benchmarks.memory_served``.

**Target**, for each DRAM budget N: RSS(kvtier serve, N filled) - RSS(plain vLLM) <= 1.05 x N +
256 MiB, both RSS summed over every process of the launched server (``kvtier serve``'s supervisor,
vLLM's API server, its engine core, any workers). ``rss_excess_mib`` is RSS - plain RSS - 1.05 x N
in MiB: the target holds while it is at most 256. A sum of RSS counts a page shared by two
processes twice (the same for both sides); PSS (shares split between the processes) and USS (pages
no other process maps) are reported beside it, the target is on RSS.

**The model** (``kvtier-fatkv``): filling GiBs through real requests takes forever with the demo
models (the tiny one has 2 KiB of KV per token), so this one is built for it: a random-weight Llama
with a narrow residual stream (hidden 256) but 32 layers x 8 KV heads x head_dim 128 in bf16, so
every token leaves 128 KiB of KV (8 GiB is 65,536 tokens) while a forward pass costs about what a
47M-parameter model's does. Built once per cache directory like the demo models (``build_once``).
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from kvtier.config import default_cache_dir

__all__ = ["ALLOWANCE_MIB", "FATKV", "FILLED_AT_LEAST", "MEMORY_KEYS", "QUICK_SIZES_GIB", "SIZES_GIB", "SLACK",
           "MEMORY_COLUMNS", "cpu_model", "ensure_fatkv_model", "fatkv_model_dir", "kv_bytes_per_token",
           "memory_rows", "parse_sizes", "size_figures", "summarize", "tree_memory"]

MiB = 1 << 20
GiB = 1 << 30
SIZES_GIB = (1.0, 4.0, 8.0)
QUICK_SIZES_GIB = (1.0,)
SLACK = 1.05  # the DRAM tier may cost its budget plus 5% ...
ALLOWANCE_MIB = 256  # ... plus this much, whatever the budget
FILLED_AT_LEAST = 0.95  # a run counts as "filled" when the tier holds at least this share of N
MEMORY_KEYS = ("rss_excess_mib_max", "target_met", "filled", "pinned")

FATKV_VERSION = 1
# 32 layers x 2 (K, V) x 8 KV heads x 128 dims x 2 bytes = 128 KiB of KV per token
FATKV: dict[str, int] = {"hidden": 256, "layers": 32, "heads": 8, "kv_heads": 8, "head_dim": 128,
                         "intermediate": 512, "vocab": 2048, "max_positions": 8192}
FATKV_INFO = "kvtier-fatkv.json"


# ---- the figures ---------------------------------------------------------------------------------
def size_figures(gib: float, rss: int, plain_rss: int) -> dict[str, float]:
    """The figures of one DRAM budget: RSS over plain vLLM, the target, the excess beyond 1.05 x N
    (the target holds while it is at most ``ALLOWANCE_MIB``), and what is left beyond N itself."""
    over = (rss - plain_rss) / MiB
    budget = SLACK * gib * 1024
    return {"rss_over_plain_mib": round(over, 1), "target_mib": round(budget + ALLOWANCE_MIB, 1),
            "rss_excess_mib": round(over - budget, 1), "rss_over_budget_mib": round(over - gib * 1024, 1),
            "met": over <= budget + ALLOWANCE_MIB}


def summarize(sizes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline over every budget measured: the worst excess, whether every budget met the
    target, whether every tier was filled (``FILLED_AT_LEAST``); budgets that were skipped (no
    ``rss_mib``) count as not met."""
    measured = [entry for entry in sizes.values() if entry.get("rss_mib") is not None]
    worst = max((entry["rss_excess_mib"] for entry in measured), default=None)
    return {"rss_excess_mib_max": worst,
            "target_met": bool(measured) and len(measured) == len(sizes) and all(e["met"] for e in measured),
            "filled": bool(measured) and all((e.get("dram_filled") or 0) >= FILLED_AT_LEAST for e in measured)}


def parse_sizes(text: str) -> tuple[float, ...]:
    """"1,4,8" -> (1.0, 4.0, 8.0) GiB; empty -> (). Refuses what is not a positive size up to 1 TiB."""
    from kvtier.errors import UsageError

    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            gib = float(part.lower().removesuffix("gib").removesuffix("g"))
        except ValueError:
            raise UsageError(f"--sizes: {part!r} is not a size in GiB", hint="e.g. --sizes 1,4,8") from None
        if not 0 < gib <= 1024 or not math.isfinite(gib):
            raise UsageError(f"--sizes: {part!r} is out of range", hint="GiB above 0, at most 1024")
        out.append(gib)
    return tuple(sorted(set(out)))


def label(gib: float) -> str:
    """A budget as a JSON key: 1 -> "1", 0.25 -> "0.25"."""
    return f"{gib:g}"


MEMORY_COLUMNS = ["--dram GiB", "RSS MiB", "plain MiB", "over plain", "less 1.05 N", "target", "filled", "met?"]


def memory_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    """One table row per budget (text output and docs)."""
    rows = []
    for key, e in results["sizes"].items():
        if e.get("rss_mib") is None:
            rows.append((key, "-", "-", "-", "-", "-", "-", e.get("skipped") or "not measured"))
            continue
        rows.append((key, f"{e['rss_mib']:,.0f}", f"{e['plain_rss_mib']:,.0f}", f"{e['rss_over_plain_mib']:,.0f}",
                     f"{e['rss_excess_mib']:,.0f}", f"{e['target_mib']:,.0f}",
                     f"{100 * e['dram_filled']:.1f}%", "yes" if e["met"] else "NO"))
    return rows


# ---- memory of a process tree --------------------------------------------------------------------
def tree_memory(pid: int) -> dict[str, Any]:
    """RSS, PSS and USS summed over ``pid`` and every descendant, with each process's own figures.
    PSS and USS come from ``/proc/PID/smaps_rollup`` (psutil's ``memory_full_info``); a process that
    exits or cannot be read meanwhile is left out of them (``complete`` False)."""
    import psutil

    root = psutil.Process(pid)
    family = [root, *root.children(recursive=True)]
    total = {"rss": 0, "pss": 0, "uss": 0}
    processes, complete = [], True
    for proc in family:
        try:
            name = _role(proc.cmdline())
            rss = proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            complete = False
            continue
        entry = {"pid": proc.pid, "role": name, "rss_mib": round(rss / MiB, 1)}
        total["rss"] += rss
        try:
            full = proc.memory_full_info()
            total["pss"] += full.pss
            total["uss"] += full.uss
            entry.update(pss_mib=round(full.pss / MiB, 1), uss_mib=round(full.uss / MiB, 1))
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            complete = False
        processes.append(entry)
    return {**total, "processes": processes, "complete": complete}


def _role(cmdline: list[str]) -> str:
    """What a server process is, from its command line."""
    text = " ".join(cmdline)
    if "kvtier.cli.main" in text and " serve" in text:
        return "kvtier serve (supervisor)"
    if "vllm.entrypoints" in text:
        return "vLLM API server"
    if "multiprocessing.resource_tracker" in text:
        return "resource tracker"
    if "multiprocessing" in text or "spawn_main" in text:
        return "vLLM engine core / worker"
    return (cmdline[0].rsplit("/", 1)[-1] if cmdline else "?")[:40]


def settled_memory(pid: int, seconds: float = 2.0, samples: int = 3) -> dict[str, Any]:
    """The tree's memory once it is quiet: ``samples`` readings ``seconds`` apart, the last one kept,
    and the spread of their RSS sums (``rss_spread_mib``: how still it was)."""
    readings = []
    for k in range(samples):
        if k:
            time.sleep(seconds)
        readings.append(tree_memory(pid))
    rss = [r["rss"] for r in readings]
    return {**readings[-1], "rss_spread_mib": round((max(rss) - min(rss)) / MiB, 1)}


# ---- the box ----------------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``) and how many cores this process may use."""
    name = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores"


# ---- the model ------------------------------------------------------------------------------------
def kv_bytes_per_token(geometry: dict[str, int] = FATKV, dtype_bytes: int = 2) -> int:
    return geometry["layers"] * 2 * geometry["kv_heads"] * geometry["head_dim"] * dtype_bytes


def fatkv_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    base = Path(cache_dir) if cache_dir is not None else Path(default_cache_dir()) / "models"
    return base.expanduser() / f"kvtier-fatkv-v{FATKV_VERSION}"


def ensure_fatkv_model(cache_dir: str | os.PathLike[str] | None = None,
                       progress: Callable[[str], None] | None = None) -> Path:
    """The fat-KV model's directory, building it first (seconds) if no complete copy exists."""
    from kvtier.models.demo import build_once

    return build_once(fatkv_model_dir(cache_dir), _build, progress)


def _words() -> list[str]:
    return ["<s>", "</s>", "<pad>"] + [f"t{i}" for i in range(3, FATKV["vocab"])]


def _build(out: Path, say: Callable[[str], None]) -> None:
    from kvtier.models.demo import import_hf, seal

    torch, tk, transformers = import_hf()
    words = _words()
    tok = tk.Tokenizer(tk.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tk.decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", model_max_length=FATKV["max_positions"])
    fast.save_pretrained(out)
    geo = FATKV
    cfg = transformers.LlamaConfig(
        vocab_size=len(words), hidden_size=geo["hidden"], intermediate_size=geo["intermediate"],
        num_hidden_layers=geo["layers"], num_attention_heads=geo["heads"], num_key_value_heads=geo["kv_heads"],
        head_dim=geo["head_dim"], max_position_embeddings=geo["max_positions"], bos_token_id=0, eos_token_id=1,
        pad_token_id=2, tie_word_embeddings=False, rope_theta=10000.0)
    say(f"building the fat-KV model: {geo['layers']} layers x {geo['kv_heads']} KV heads x {geo['head_dim']} "
        f"dims ({kv_bytes_per_token() >> 10} KiB of KV per token), random weights (seed 0)")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    info = {"kvtier_fatkv": True, "version": FATKV_VERSION, "geometry": geo, "params": params,
            "kv_bytes_per_token": kv_bytes_per_token(),
            "note": "random weights: for filling KV tiers quickly (python -m benchmarks memory), not for text"}
    (out / FATKV_INFO).write_text(json.dumps(info, indent=2) + "\n")
    seal(out)


def random_prompts(count: int, tokens: int, seed: int = 0, first: int = 0) -> Iterable[list[int]]:
    """``count`` distinct prompts of random token ids (no two share a first block), prompt ``first``
    onwards of one seeded sequence: the same prompts for kvtier and for plain vLLM."""
    import random

    for index in range(first, first + count):
        rng = random.Random(f"{seed}:{index}")
        yield [rng.randrange(3, FATKV["vocab"]) for _ in range(tokens)]


def expected_prompts(capacity_bytes: int, slot_bytes: int, block_tokens: int, prompt_tokens: int) -> int:
    """How many distinct prompts fill a DRAM tier of ``capacity_bytes`` (full blocks only are stored)."""
    slots = capacity_bytes // slot_bytes
    per_prompt = max(1, prompt_tokens // block_tokens)
    return max(1, math.ceil(slots / per_prompt))
