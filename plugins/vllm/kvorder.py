"""The order vLLM's CPU attention writes each block's values in, measured on the running vLLM.

vLLM's CPU backend packs a (block, head)'s K and V for the ISA its attention kernel runs
(``_get_attn_isa``: ``amx``, ``vec``, ``vec16``, ``neon``, ...). kvtier asks vLLM which ISA that is,
calls its ``cpu_attn_reshape_and_cache`` for that ISA on index-valued tensors
(``kvtier.move.slaborder.probe_map``: milliseconds, at start) and hands the orders found to the CPU
layout adapter, which copies through them: blocks leave and enter vLLM in canonical order.
"""
from __future__ import annotations

import logging
from typing import Any

from kvtier.layout import KVGeometry, LayoutAdapter, adapter_for
from kvtier.plugins.vllm.geometry import layout_name

__all__ = ["cpu_attn_isa", "kv_adapter"]

log = logging.getLogger("kvtier.connector")


def cpu_attn_isa(vllm_config: Any) -> str | None:
    """The ISA vLLM's CPU attention runs for this engine; None off the CPU platform or when this
    vLLM does not say (then blocks are copied as stored, as kvtier did before it knew)."""
    from kvtier.plugins.vllm.compat import current_platform

    if current_platform.device_type != "cpu":
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:  # pragma: no cover - another vLLM
        log.warning("kvtier: this vLLM does not say which CPU attention ISA it runs; KV blocks are copied "
                    "in its packed order (lossy codecs then group values as stored)")
        return None
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    return _get_attn_isa(model_config.dtype, cache_config.block_size, model_config.get_head_size(),
                         str(cache_config.cache_dtype))


def kv_adapter(kv_layer: Any, geometry: KVGeometry, isa: str | None) -> LayoutAdapter:
    """The layout adapter for vLLM's KV tensors; on the CPU backend, copying through the slab
    orders vLLM's reshape-and-cache writes for ``isa``."""
    name = layout_name(kv_layer)
    if name != "cpu" or isa is None:
        return adapter_for(name, geometry)
    return adapter_for(name, geometry, _orders(isa, geometry, kv_layer.dtype))


def _orders(isa: str, geometry: KVGeometry, cache_dtype: Any):
    import torch
    from vllm import _custom_ops as ops

    from kvtier.move.slaborder import SlabOrder, probe_map

    fp8 = geometry.itemsize == 1
    spec = ("fp8_e5m2" if "e5m2" in geometry.dtype else "fp8") if fp8 else "auto"

    def write(key, value, key_cache, value_cache, slots):
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, spec)

    maps = probe_map(write, geometry.block_tokens, geometry.head_dim, cache_dtype, getattr(torch, geometry.dtype))
    orders = tuple(SlabOrder.find(m, geometry.block_tokens, geometry.head_dim) for m in maps)
    if orders[0] is None or orders[1] is None:
        log.warning("kvtier: vLLM's CPU attention (%s) packs KV in an order kvtier does not know; blocks are "
                    "copied as stored (lossy codecs then group values as stored)", isa)
        return None
    log.info("kvtier: vLLM CPU attention %s: K slab %s, V slab %s", isa, orders[0], orders[1])
    return orders
