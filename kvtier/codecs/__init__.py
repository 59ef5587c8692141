"""KV block codecs for the warm (DRAM) and cold (NVMe) tiers.

A codec turns one block in canonical order ``[layers, kv_heads, 2, tokens, head_dim]`` (see
``kvtier.layout``) into bytes, and those bytes back into a block of the KV dtype. Every stored
block records the codec *spec* that wrote it (NVMe header, DRAM index, snapshot header) and every
lossy payload starts with a small preamble naming its codec, version and parameters, so a block
is never decoded by a codec other than the one that wrote it.

Specs (``--warm-codec`` / ``--cold-codec``)::

    none              bit-for-bit copy
    fp8 | fp8:e5m2    float8 e4m3 (default) or e5m2, one power-of-two scale per token and head
    fp8:head          float8 e4m3, one scale per head and block
    int8              symmetric int8, one scale per token and head
    int4[:gN]         KIVI-style asymmetric int4: keys per channel in groups of N tokens, values per
                      token in groups of N channels (N = 64 by default)
    int4-lc[:gN]      int4 + the top key channels by magnitude and the attention-sink tokens kept
                      in the KV dtype: the long-context-safe variant (see docs/codecs.md)
    <spec>+zstd       any of the above, then zstd (lossless; meant for the cold tier)

``get_codec(spec)`` parses a spec and returns a codec object; ``encode`` / ``decode`` work on CPU
or CUDA tensors (vectorised torch), with numba kernels for the CPU decode when numba is present.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.codecs.base import Codec
    from kvtier.layout import KVGeometry

__all__ = ["get_codec", "parse_spec", "register_reference", "resolve_codec", "transcode", "CODEC_HELP", "SPEC_RE",
           "is_lossless"]

CODEC_HELP = "none, fp8, fp8:e5m2, fp8:head, int8, int4[:gN], int4-lc[:gN], each optionally +zstd"
SPEC_RE = re.compile(r"^(none|fp8(?::(?:e4m3|e5m2|head))?|int8|int4(?:-lc)?(?::g(?:16|32|64|128))?)(\+zstd)?$")


def parse_spec(spec: str) -> str:
    """Validate a codec spec; returns its canonical form (``fp8:e4m3`` -> ``fp8``)."""
    text = str(spec).strip().lower()
    if text in _REFERENCES:
        return text
    match = SPEC_RE.match(text)
    if not match:
        raise ConfigError(f"unknown codec {spec!r}", hint=f"codecs: {CODEC_HELP}")
    base, lossless = match.group(1), match.group(2) or ""
    base = {"fp8:e4m3": "fp8", "int4:g64": "int4", "int4-lc:g64": "int4-lc"}.get(base, base)
    if base == "none" and lossless:
        return "none+zstd"
    return base + lossless


def is_lossless(spec: str) -> bool:
    return parse_spec(spec) in ("none", "none+zstd")


_CACHE: dict[str, "Codec"] = {}
_REFERENCES: set[str] = set()  # benchmark-only quantizers (``register_reference``), never from configuration


def register_reference(spec: str, codec: "Codec") -> None:
    """Let the tiers store blocks through a benchmark's reference quantizer (``codec``) under
    ``spec``, in this process. Configuration still refuses it: ``kvtier.config`` checks ``SPEC_RE``."""
    codec.spec = spec
    _CACHE[spec] = codec
    _REFERENCES.add(spec)


def get_codec(spec: str) -> "Codec":
    """The codec for ``spec`` (cached; codecs hold no per-block state)."""
    canonical = parse_spec(spec)
    codec = _CACHE.get(canonical)
    if codec is None:
        from kvtier.codecs import base, quant

        inner, _, lossless = canonical.partition("+")
        name, _, param = inner.partition(":")
        if name == "none":
            codec = base.Identity()
        elif name == "fp8":
            codec = quant.Fp8(fmt="e5m2" if param == "e5m2" else "e4m3", per_head=param == "head")
        elif name == "int8":
            codec = quant.Int8()
        else:
            group = int(param[1:]) if param else 64
            codec = quant.Int4(group=group, long_context=name == "int4-lc")
        codec.spec = inner
        if lossless:
            codec = base.Zstd(codec)
            codec.spec = canonical
        _CACHE[canonical] = codec
    return codec


def resolve_codec(spec: str, geometry: "KVGeometry", tier: str = "warm") -> str:
    """The codec a tier really uses for ``geometry``'s KV (canonical spec).

    A KV cache that is already 8-bit (vLLM's ``--kv-cache-dtype fp8``) is stored as it is: ``fp8``
    becomes ``none`` (no re-encoding); int8/int4 are refused, as they would decode from fp8 bits.
    """
    canonical = parse_spec(spec)
    base, _, lossless = canonical.partition("+")
    if geometry.itemsize == 1 and base != "none":
        if base.startswith("fp8"):
            return "none" + ("+" + lossless if lossless else "")
        raise ConfigError(
            f"{tier} codec {base} needs a 16-bit KV cache, but this engine's KV cache is 8-bit (fp8)",
            hint=f"with --kv-cache-dtype fp8, use --{tier}-codec none or fp8 (fp8 blocks are stored as they are)",
        )
    if geometry.itemsize > 1 and base.startswith("int4") and geometry.head_dim % 2:
        raise ConfigError(f"{tier} codec {base} needs an even head_dim, got {geometry.head_dim}",
                          hint="use fp8 or int8 for this model")
    return canonical


def transcode(payload: "torch.Tensor", src: str, dst: str, geometry: "KVGeometry", out: "torch.Tensor",
              first: bool | None = None) -> int:
    """Re-encode a block from codec ``src`` to ``dst`` (CPU); returns the bytes written to ``out``."""
    import torch

    source, target = get_codec(src), get_codec(dst)
    if first is None:
        first = source.is_first(payload)
    block = torch.empty(geometry.block_shape, dtype=getattr(torch, geometry.dtype))
    source.decode(payload, block)
    return target.encode(block, out, first=first)
