"""What kvtier needs to know about the served model, read from vLLM's config.

The fingerprint covers the model, an identity of its weights, its KV geometry (of one rank's
shard), the KV dtype and its fp8 scaling, the device kind and the tensor-parallel size, so blocks
never cross models, weights, dtypes, shardings or backends whose in-block packing differs.

``check_supported`` refuses, at start and with one clear error, what the connector cannot serve
correctly (vLLM versions are ``compat``'s business): pipeline parallelism, MLA,
asymmetric K/V heads, quantized KV formats other than fp8, sliding-window and hybrid models, and
speculative decoding's drafter layers are refused.
"""
from __future__ import annotations

from typing import Any

from kvtier.errors import ConfigError
from kvtier.layout import KVGeometry, ModelFingerprint

__all__ = ["check_supported", "fingerprint_from_vllm", "kv_dtype_name", "parallel_of",
           "weights_of"]

_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_PLAIN = ("auto", "", "None", "bfloat16", "float16", "half", "float32", "float")
_HINT = "run the model without kvtier's connector, or with the settings named above"


def kv_dtype_name(vllm_config: Any) -> str:
    """kvtier's name for the KV cache element type (vLLM stores fp8 caches as uint8 bits)."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype in _FP8:
        return _FP8[cache_dtype]
    if cache_dtype in ("auto", "", "None"):
        return str(vllm_config.model_config.dtype).replace("torch.", "")
    return {"half": "float16", "float": "float32"}.get(cache_dtype, cache_dtype)


def parallel_of(vllm_config: Any) -> tuple[int, int]:
    """(this process's tensor-parallel rank, tensor-parallel size). The scheduler's rank is 0."""
    parallel = vllm_config.parallel_config
    size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    return int(getattr(parallel, "rank", 0) or 0) % size, size


def _model_type(vllm_config: Any) -> str:
    hf = getattr(vllm_config.model_config, "hf_config", None)
    return str(getattr(hf, "model_type", None) or vllm_config.model_config.model)


def check_supported(vllm_config: Any, kv_cache_config: Any = None) -> None:
    """Raise ``ConfigError`` naming what kvtier cannot serve in this configuration."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in _FP8 and cache_dtype not in _PLAIN:
        raise ConfigError(f"kvtier cannot store the {cache_dtype!r} KV cache format: it supports the model's own "
                          f"dtype and fp8 ({', '.join(_FP8)})", hint="pass --kv-cache-dtype fp8 or leave it at auto")
    if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
        raise ConfigError("kvtier supports tensor parallelism, not pipeline parallelism (each stage would hold a "
                          "different slice of the layers)", hint="use --tensor-parallel-size instead of "
                          "--pipeline-parallel-size")
    if getattr(model_config, "use_mla", False):
        raise ConfigError(f"kvtier cannot store MLA latent KV ({_model_type(vllm_config)} keeps one compressed "
                          "latent per token, no K/V split)", hint=_HINT)
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ConfigError("kvtier does not keep a speculative drafter's KV: a loaded prefix would leave the "
                          "drafter's cache stale", hint="serve without --speculative-config")
    if kv_cache_config is None:
        return
    from kvtier.plugins.vllm.compat import FullAttentionSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    for group in groups:
        spec = group.kv_cache_spec
        specs = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]  # UniformTypeKVCacheSpecs
        for one in specs:
            if type(one) is not FullAttentionSpec:
                raise ConfigError(f"kvtier stores full-attention KV only; {_model_type(vllm_config)} has "
                                  f"{type(one).__name__} layers (sliding-window, hybrid or state-space models "
                                  "are not supported yet)", hint=_HINT)
            if getattr(one, "head_size_v", one.head_size) != one.head_size:
                raise ConfigError(f"kvtier needs K and V of one head size; {_model_type(vllm_config)} has K "
                                  f"{one.head_size}, V {one.head_size_v}", hint=_HINT)
    if len(groups) > 1:
        raise ConfigError(f"kvtier supports one KV cache group; {_model_type(vllm_config)} has {len(groups)} "
                          "(a hybrid model)", hint=_HINT)


def fingerprint_from_vllm(vllm_config: Any, model_id: str | None = None) -> ModelFingerprint:
    """The engine's fingerprint (``rank`` None); a worker takes ``.for_rank(rank)`` of it."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    geometry = KVGeometry(
        num_layers=model_config.get_num_layers(parallel),
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_dim=model_config.get_head_size(),
        block_tokens=vllm_config.cache_config.block_size,
        dtype=kv_dtype_name(vllm_config),
    )
    model_id = str(model_id or model_config.model)
    from kvtier.plugins.vllm.compat import current_platform

    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    # fp8 KV is scaled per layer by scales that ship with the checkpoint (the weights identity covers
    # them) or default to 1.0; a block is only valid under the same scaling
    scales = f"{cache_dtype}:checkpoint-or-unit" if cache_dtype in _FP8 else ""
    weights = weights_of(vllm_config)
    _, shards = parallel_of(vllm_config)
    from kvtier.plugins.vllm.kvorder import cpu_kv_order

    order = cpu_kv_order(vllm_config, geometry)  # CPU: how blocks are ordered (canonical once measured)
    return ModelFingerprint(f"{model_id}@{current_platform.device_type}", geometry, weights, shards=shards,
                            kv_scales=scales, kv_order=order[0] if order else "")


def weights_of(vllm_config: Any) -> str:
    """The weights identity of the model the config names now (``kvtier.persist.weights``). Read
    again after a sleep: vLLM 0.33's ``update_config`` can point the worker at another checkpoint
    before ``reload_weights``, and a directory's files may have been replaced in place."""
    from kvtier.persist.weights import weights_identity

    model_config = vllm_config.model_config
    return weights_identity(model_config.model, getattr(model_config, "revision", None))


class VllmBlockKeys:
    """vLLM's own block hash of token ids -- what ``request.block_hashes`` holds, so what kvtier
    files blocks under: chained ``hash_block_tokens`` with the engine's ``--prefix-caching-hash-algo``
    and its ``NONE_HASH`` seed, the tenant's cache salt in the first block's extra keys. A restore
    recomputes a snapshot's keys with it instead of trusting the file's. ``NONE_HASH`` is read at
    each call: vLLM sets it after the connector is built."""

    def __init__(self, vllm_config: Any, block_tokens: int):
        from kvtier.plugins.vllm.compat import get_hash_fn_by_name

        self.algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
        self.hash_fn = get_hash_fn_by_name(self.algo)
        self.block_tokens = block_tokens

    @property
    def scheme(self) -> str:
        from kvtier.plugins.vllm.compat import none_hash

        seed = none_hash()
        return f"vllm:{self.algo}:{bytes(seed).hex()[:16] if seed is not None else 'unset'}"

    def __call__(self, tokens: list[int], cache_salt: str | None) -> list[bytes]:
        from kvtier.plugins.vllm.compat import hash_block_tokens

        keys, parent, bs = [], None, self.block_tokens
        for start in range(0, len(tokens) - bs + 1, bs):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = hash_block_tokens(self.hash_fn, parent, tokens[start:start + bs], extra)
            keys.append(bytes(parent))
        return keys
