"""The run's sizes, from the box and the model: the engine's KV cache and kvtier's DRAM tier are
fixed for a run, and the three regimes differ only in the working set.

* regime 1: 0.5x the engine's KV cache (everything fits the engine: kvtier must do no harm);
* regime 2: 2x the engine's KV cache, 0.5x the DRAM tier (DRAM holds what the engine drops);
* regime 3: 2x the DRAM tier (NVMe serves part of it).

Sizes the box cannot hold are refused here, before any server starts.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from kvtier.bench.agents.trace import AgentMix, TurnSpec, generate, unique_tokens
from kvtier.errors import UsageError
from kvtier.units import human_bytes

__all__ = ["DEFAULTS", "Sizes", "kv_bytes_per_token", "regime_trace", "check_box"]

MiB = 1 << 20
# this box's defaults (2 cores, 24 GiB, the tiny demo model at 2 KiB per token)
DEFAULTS = {"engine_kv": 40 * MiB, "dram": 160 * MiB, "concurrency": 4, "think_median_s": 0.5,
            "long_pause_frac": 0.25, "long_pause_s": 10.0}
MIN_SESSIONS = 12
SERVER_OVERHEAD = 3 << 30  # one vLLM server's own memory beside its KV cache (weights, runtime), generously


@dataclass(frozen=True)
class Sizes:
    kv_bytes_per_token: int
    engine_kv: int
    dram: int
    nvme: int
    concurrency: int
    max_len: int  # the servers' --max-model-len

    def working_set(self, regime: int) -> int:
        return {1: self.engine_kv // 2, 2: 2 * self.engine_kv, 3: 2 * self.dram}[regime]

    @property
    def floor_kv(self) -> int:
        """The floor arm's engine KV cache: the largest working set, and room for the requests in flight."""
        return self.working_set(3) + self.concurrency * self.max_len * self.kv_bytes_per_token

    def describe(self) -> list[tuple[str, str]]:
        rows = [("KV per token", human_bytes(self.kv_bytes_per_token)),
                ("engine KV cache (every arm but floor)", human_bytes(self.engine_kv)),
                ("floor's engine KV cache", human_bytes(self.floor_kv)),
                ("kvtier DRAM tier / NVMe tier", f"{human_bytes(self.dram)} / {human_bytes(self.nvme)}"),
                ("requests in flight (C)", str(self.concurrency)), ("--max-model-len", str(self.max_len))]
        rows += [(f"regime {r} working set", f"{human_bytes(self.working_set(r))} "
                  f"({self.working_set(r) // self.kv_bytes_per_token} tokens)") for r in (1, 2, 3)]
        return rows


def _positive_int(config: dict, name: str) -> int | None:
    value = config.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _read_config(path: Path) -> dict:
    hint = "pass --model a model directory (a Hugging Face checkpoint) with its config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}", hint=hint) from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise UsageError(f"{path} is not valid JSON: {exc}", hint=hint) from None
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not a JSON object", hint=hint)
    return config


def kv_bytes_per_token(model_dir: str, cache_dtype: str | None = None) -> int:
    """K and V bytes one token takes in every layer, from the checkpoint's config.json. A file that
    is missing, unreadable or lacks a field the size needs is refused (``UsageError``) by name."""
    path = Path(model_dir) / "config.json"
    config = _read_config(path)
    layers, heads, hidden = (_positive_int(config, name) for name in ("num_hidden_layers", "num_attention_heads",
                                                                     "hidden_size"))
    kv_heads = _positive_int(config, "num_key_value_heads") or heads
    head_dim = _positive_int(config, "head_dim") or (hidden // heads if hidden and heads else None)
    missing = ["num_hidden_layers"] * (not layers) + ["num_attention_heads"] * (not kv_heads)
    if not head_dim:  # without head_dim: hidden_size over the attention heads
        missing += ["hidden_size"] * (not hidden) + ["num_attention_heads"] * (not heads) or ["head_dim"]
    if missing:
        raise UsageError(f"{path} lacks {', '.join(dict.fromkeys(missing))} (a positive integer each): the KV "
                         f"bytes per token cannot be sized",
                         hint="pass --model a model directory whose config.json describes it: num_hidden_layers, "
                              "num_attention_heads (num_key_value_heads), hidden_size (or head_dim)")
    elem = 1 if cache_dtype and cache_dtype.startswith("fp8") else 2
    return int(layers * kv_heads * head_dim * 2 * elem)


def regime_trace(mix: AgentMix, sizes: Sizes, regime: int, seed: int, sessions: int | None = None) -> list[TurnSpec]:
    """The regime's trace: sessions until the working set is reached, or exactly ``sessions``
    sessions whose sizes are scaled so that together they make it. A working set that the mix
    fills with fewer than ``MIN_SESSIONS`` sessions gets that many smaller ones: percentiles over
    a handful of sessions say nothing."""
    target = sizes.working_set(regime) // sizes.kv_bytes_per_token
    prefix = f"r{regime}s{seed}-"
    if sessions is None:
        specs = generate(mix, seed, target, prefix)
        if len({s.session for s in specs if s.turn == 1 and not s.parent}) >= MIN_SESSIONS:
            return specs
        sessions = MIN_SESSIONS
    best, scale = None, 1.0
    for _ in range(5):  # the sizes are drawn again at each scale: home in on the target
        scaled = replace(mix, prefix_median=max(16, int(mix.prefix_median * scale)),
                         tool_median=max(8, int(mix.tool_median * scale)))
        specs = generate(scaled, seed, 1 << 60, prefix, max_sessions=sessions)
        got = unique_tokens(specs)
        if best is None or abs(got - target) < abs(best[0] - target):
            best = (got, specs)
        scale = max(0.02, scale * (target - mix.shared_tokens) / max(1, got - mix.shared_tokens))
    return best[1]


def check_box(sizes: Sizes, nvme_dir: Path, arms: list[str], together: bool = True) -> None:
    """Refuse sizes this box cannot hold (memory for the largest server, disk for the NVMe tier)."""
    per_token = sizes.kv_bytes_per_token
    if sizes.concurrency < 1 or sizes.concurrency > 256:
        raise UsageError(f"--concurrency {sizes.concurrency} is out of range", hint="between 1 and 256")
    if sizes.engine_kv < sizes.max_len * per_token:
        raise UsageError(f"the engine KV cache ({human_bytes(sizes.engine_kv)}) cannot hold one request of "
                         f"--max-model-len {sizes.max_len} ({human_bytes(sizes.max_len * per_token)})",
                         hint="raise --engine-kv")
    if sizes.dram < sizes.working_set(2):
        raise UsageError(f"regime 2's working set ({human_bytes(sizes.working_set(2))}, 2x the engine KV cache) "
                         f"does not fit the DRAM tier ({human_bytes(sizes.dram)})",
                         hint="--dram must be at least 2x --engine-kv (default 4x)")
    # with every arm's server up at once (they take turns) their host memory adds up, the KV caches
    # too on a CPU box (on a GPU box they are in HBM); one at a time, the largest counts
    from kvtier.launch.serve import is_cpu_only

    engine = (lambda kv: kv) if is_cpu_only() else (lambda kv: 0)
    host = {"floor": engine(sizes.floor_kv), "vllm": engine(sizes.engine_kv)}
    each = [host.get(arm, engine(sizes.engine_kv) + sizes.dram) + SERVER_OVERHEAD for arm in arms]
    need = sum(each) if together else max(each)
    available = psutil.virtual_memory().available
    if need > available:
        raise UsageError(f"the arms' servers need about {human_bytes(need)} of memory (their KV caches, "
                         f"the DRAM tier and {human_bytes(SERVER_OVERHEAD)} of runtime each); this box has "
                         f"{human_bytes(available)} available",
                         hint="lower --dram or --engine-kv (the floor arm holds the largest working set in its "
                              "engine), run fewer --arms, or --one-at-a-time")
    if "kvtier" in arms:
        nvme_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(nvme_dir).free
        if sizes.nvme > free:
            raise UsageError(f"the NVMe tier ({human_bytes(sizes.nvme)}) does not fit {nvme_dir} "
                             f"({human_bytes(free)} free)", hint="lower --dram (the NVMe tier is sized from it)")
