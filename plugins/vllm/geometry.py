"""What kvtier needs to know about the served model, read from vLLM's config.

The fingerprint covers the model, an identity of its weights, its KV geometry, the KV dtype and
the device kind, so blocks never cross models, weights, dtypes or backends whose in-block packing
differs.
"""
from __future__ import annotations

from typing import Any

from kvtier.layout import KVGeometry, ModelFingerprint

__all__ = ["fingerprint_from_vllm", "kv_dtype_name", "layout_name"]

_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_dtype_name(vllm_config: Any) -> str:
    """kvtier's name for the KV cache element type (vLLM stores fp8 caches as uint8 bits)."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype in _FP8:
        return _FP8[cache_dtype]
    if cache_dtype in ("auto", "", "None"):
        return str(vllm_config.model_config.dtype).replace("torch.", "")
    return cache_dtype


def fingerprint_from_vllm(vllm_config: Any, extra: dict) -> ModelFingerprint:
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    geometry = KVGeometry(
        num_layers=model_config.get_num_layers(parallel),
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_dim=model_config.get_head_size(),
        block_tokens=vllm_config.cache_config.block_size,
        dtype=kv_dtype_name(vllm_config),
    )
    model_id = str(extra.get("model_id") or model_config.model)
    from vllm.platforms import current_platform

    from kvtier.weights import weights_identity

    weights = weights_identity(model_config.model, getattr(model_config, "revision", None))
    return ModelFingerprint(f"{model_id}@{current_platform.device_type}", geometry, weights)


def layout_name(kv_layer: Any) -> str:
    """The layout adapter for vLLM 0.32's per-layer KV tensors on this device."""
    return "cpu" if kv_layer.device.type == "cpu" else "head_split"
