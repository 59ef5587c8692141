"""The order vLLM's CPU attention writes each block's values in, measured on the running vLLM.

vLLM's CPU backend packs a (block, head)'s K and V for the ISA its attention kernel runs
(``_get_attn_isa``: ``amx``, ``vec``, ``vec16``, ``neon``, ...). kvtier asks vLLM which ISA that is,
calls its ``cpu_attn_reshape_and_cache`` for that ISA on index-valued tensors
(``kvtier.move.slaborder.probe_map``: milliseconds, once per process) and hands the orders found to
the CPU layout adapter, which copies through them: blocks leave and enter vLLM in canonical order.

The fingerprint says which: ``kv_order`` is ``canonical`` when the orders are known, else
``packed:<isa>`` (this vLLM did not say, or packs in an order kvtier does not know: blocks are
copied as stored, and only a box packing them the same way may share them).
"""
from __future__ import annotations

import functools
import logging
from typing import Any

from kvtier.layout import KVGeometry, LayoutAdapter, adapter_for

__all__ = ["CpuKvOrder", "cpu_kv_order", "kv_adapter", "layout_name"]

log = logging.getLogger("kvtier.connector")
CpuKvOrder = tuple  # (label for the fingerprint, (K's SlabOrder, V's SlabOrder) or None)


def cpu_kv_order(vllm_config: Any, geometry: KVGeometry) -> "CpuKvOrder | None":
    """None off the CPU platform; else (``kv_order`` label, orders or None). Both halves of the
    connector call it (the scheduler for the fingerprint, the worker for its copies): same answer."""
    from kvtier.plugins.vllm.compat import current_platform

    if current_platform.device_type != "cpu":
        return None
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    cache_dtype = str(cache_config.cache_dtype)
    try:
        from kvtier.plugins.vllm.compat import _get_attn_isa

        isa = _get_attn_isa(model_config.dtype, cache_config.block_size, model_config.get_head_size(), cache_dtype)
    except Exception as exc:  # another vLLM: copies as stored, and the fingerprint says so
        log.warning("kvtier: vLLM did not say which CPU attention ISA it runs (%s); KV blocks are copied in "
                    "its packed order", exc)
        return "packed:unknown", None
    orders = _probed(str(isa), geometry, str(model_config.dtype).removeprefix("torch."), cache_dtype)
    return ("canonical", orders) if orders is not None else (f"packed:{isa}", None)


@functools.lru_cache(maxsize=8)
def _probed(isa: str, geometry: KVGeometry, model_dtype: str, cache_dtype: str):
    """K's and V's slab orders for ``isa`` (None when the probe fails or finds no known order)."""
    import torch

    from kvtier.move.slaborder import SlabOrder, probe_map
    from kvtier.plugins.vllm.compat import cpu_attn_reshape_and_cache

    spec = cache_dtype if geometry.itemsize == 1 else "auto"
    stored = getattr(torch, geometry.dtype)

    def write(key, value, key_cache, value_cache, slots):
        cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, spec)

    try:  # vLLM allocates fp8 caches as uint8 and writes the model's dtype into them
        maps = probe_map(write, geometry.block_tokens, geometry.head_dim,
                         torch.uint8 if geometry.itemsize == 1 else stored, stored, getattr(torch, model_dtype))
        orders = tuple(SlabOrder.find(m, geometry.block_tokens, geometry.head_dim) for m in maps)
    except Exception as exc:
        log.warning("kvtier: measuring vLLM's CPU KV order (%s) failed: %s; blocks are copied as stored", isa, exc)
        return None
    if None in orders:
        log.warning("kvtier: vLLM's CPU attention (%s) packs KV in an order kvtier does not know; blocks are "
                    "copied as stored", isa)
        return None
    log.info("kvtier: vLLM CPU attention %s: K slab %s, V slab %s", isa, orders[0], orders[1])
    return orders


def kv_adapter(kv_layer: Any, geometry: KVGeometry, orders: Any) -> LayoutAdapter:
    """The layout adapter for vLLM's KV tensors; on the CPU backend, copying through ``orders``."""
    name = layout_name(kv_layer)
    return adapter_for(name, geometry, orders if name == "cpu" else None)


def layout_name(kv_layer: Any) -> str:
    """The layout adapter for one of vLLM's per-layer KV tensors, by its logical shape: the CPU
    backend's ``[n, H, B, 2D]`` (contiguous), the CUDA backends' same logical view over strided
    memory, or the older 5-D ``[2, n, B, H, D]`` / ``[n, 2, B, H, D]`` forms (vLLM 0.32's and 0.33's
    ``kv_cache_layout.py`` are the same file)."""
    if kv_layer.dim() == 5:
        return "kv_first" if kv_layer.shape[0] == 2 and kv_layer.shape[1] != 2 else "block_first"
    return "cpu" if kv_layer.device.type == "cpu" else "head_split"
