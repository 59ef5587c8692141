"""KV geometry, model fingerprints, and adapters from vLLM's per-layer KV tensors to kvtier blocks.

A kvtier *block* is one vLLM block (``block_tokens`` tokens) across all attention layers, stored in
one canonical, backend-independent order::

    [num_layers, 2 (K then V), block_tokens, num_kv_heads, head_dim]

so a block written by the CPU backend loads into a CUDA backend and a snapshot is portable. The
adapters gather whole blocks from vLLM's tensors into that order and scatter them back; the
canonical order also gives codecs their K and V views (``k_view`` / ``v_view``).

Backend layouts handled (one tensor per layer, all from vLLM 0.32):

* ``cpu``          ``[num_blocks, kv_heads, block_size, 2*head_dim]``; each (block, head) slab is
                   read as ``[2*block_size, head_dim]``: K for the block's tokens, then V.
* ``kv_first``     ``[2, num_blocks, block_size, kv_heads, head_dim]`` (FlashAttention).
* ``block_first``  ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (FlashInfer).

torch is imported lazily so that ``kvtier --help`` stays fast.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Sequence

from kvtier.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DTYPE_ITEMSIZE",
    "KVGeometry",
    "ModelFingerprint",
    "LayoutAdapter",
    "CpuLayout",
    "KVFirstLayout",
    "BlockFirstLayout",
    "adapter_for",
    "k_view",
    "v_view",
]

# Element sizes, so geometry arithmetic needs no torch import.
DTYPE_ITEMSIZE = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one model's KV cache as kvtier stores it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UsageError(f"KV geometry: {name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise UsageError(
                f"KV geometry: unsupported KV dtype {self.dtype!r}",
                hint="one of: " + ", ".join(sorted(DTYPE_ITEMSIZE)),
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Canonical shape of one block: ``[layers, 2, tokens, kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    @property
    def layer_block_bytes(self) -> int:
        return 2 * self.block_tokens * self.num_kv_heads * self.head_dim * self.itemsize

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KVGeometry":
        return cls(**{k: data[k] for k in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "dtype")})


@dataclass(frozen=True)
class ModelFingerprint:
    """Identity of the KV a block holds: model + geometry + KV dtype.

    Every stored block and snapshot carries ``digest``; a block is only ever served to an engine
    with the same digest, so two models (or two layouts of one model) never share a block.
    """

    model_id: str
    geometry: KVGeometry

    @property
    def digest(self) -> bytes:
        """16-byte identity of (model, geometry, dtype)."""
        canonical = json.dumps({"model": self.model_id, **self.geometry.to_dict()}, sort_keys=True)
        return hashlib.blake2b(canonical.encode(), digest_size=16).digest()

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def to_dict(self) -> dict:
        return {"model_id": self.model_id, "geometry": self.geometry.to_dict(), "digest": self.hex}

    @classmethod
    def from_dict(cls, data: dict) -> "ModelFingerprint":
        return cls(model_id=data["model_id"], geometry=KVGeometry.from_dict(data["geometry"]))


def k_view(block: "torch.Tensor") -> "torch.Tensor":
    """K of a canonical block (or a batch of them): ``[..., layers, tokens, heads, head_dim]``."""
    return block.select(-4, 0)


def v_view(block: "torch.Tensor") -> "torch.Tensor":
    """V of a canonical block (or a batch of them)."""
    return block.select(-4, 1)


class LayoutAdapter:
    """Moves whole blocks between vLLM's per-layer tensors and canonical block buffers.

    ``gather(kv_layers, block_ids, out)`` fills ``out[i]`` (canonical shape) with vLLM block
    ``block_ids[i]``; ``scatter(src, kv_layers, block_ids)`` is its inverse. Subclasses only say how
    one layer's blocks map to ``[n, 2, tokens, heads, head_dim]``.
    """

    name = "abstract"

    def __init__(self, geometry: KVGeometry):
        self.geometry = geometry

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        raise NotImplementedError

    def _blocks_as_canonical(self, selected: "torch.Tensor") -> "torch.Tensor":
        """View of ``selected`` (this layout's tensor indexed by block) as ``[n, 2, B, H, D]``."""
        raise NotImplementedError

    def _select(self, kv_layer: "torch.Tensor", index: "torch.Tensor") -> "torch.Tensor":
        return kv_layer.index_select(0, index)

    def _assign(self, kv_layer: "torch.Tensor", index: "torch.Tensor", native: "torch.Tensor") -> None:
        kv_layer.index_copy_(0, index, native)

    def _canonical_to_native(self, canonical: "torch.Tensor") -> "torch.Tensor":
        raise NotImplementedError

    def _check(self, kv_layers: Sequence["torch.Tensor"]) -> None:
        if len(kv_layers) != self.geometry.num_layers:
            raise UsageError(
                f"{self.name} layout: got {len(kv_layers)} KV layers, geometry says {self.geometry.num_layers}"
            )
        want = self.layer_shape(kv_layers[0].shape[self._block_dim])
        if tuple(kv_layers[0].shape) != want:
            raise UsageError(f"{self.name} layout: KV tensor shape {tuple(kv_layers[0].shape)}, expected {want}")

    _block_dim = 0

    def gather(self, kv_layers: Sequence["torch.Tensor"], block_ids: Sequence[int], out: "torch.Tensor") -> None:
        """Copy vLLM blocks ``block_ids`` into ``out`` of shape ``[n, *geometry.block_shape]``."""
        import torch

        self._check(kv_layers)
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv_layers[0].device)
        for layer, kv in enumerate(kv_layers):
            selected = self._select(kv, index)
            out[:, layer].copy_(self._blocks_as_canonical(selected), non_blocking=True)

    def scatter(self, src: "torch.Tensor", kv_layers: Sequence["torch.Tensor"], block_ids: Sequence[int]) -> None:
        """Copy canonical blocks ``src[i]`` into vLLM block ``block_ids[i]`` of every layer."""
        import torch

        self._check(kv_layers)
        device = kv_layers[0].device
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
        for layer, kv in enumerate(kv_layers):
            native = self._canonical_to_native(src[:, layer].to(device, non_blocking=True))
            self._assign(kv, index, native)


class CpuLayout(LayoutAdapter):
    """vLLM CPU backend: ``[num_blocks, H, B, 2*D]``, each head slab being K rows then V rows."""

    name = "cpu"

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        g = self.geometry
        return (num_blocks, g.num_kv_heads, g.block_tokens, 2 * g.head_dim)

    def _blocks_as_canonical(self, selected: "torch.Tensor") -> "torch.Tensor":
        g = self.geometry
        n = selected.shape[0]
        # [n, H, B, 2D] is laid out as [n, H, 2, B, D]; reorder to [n, 2, B, H, D].
        return selected.view(n, g.num_kv_heads, 2, g.block_tokens, g.head_dim).permute(0, 2, 3, 1, 4)

    def _canonical_to_native(self, canonical: "torch.Tensor") -> "torch.Tensor":
        g = self.geometry
        n = canonical.shape[0]
        return canonical.permute(0, 3, 1, 2, 4).reshape(n, g.num_kv_heads, g.block_tokens, 2 * g.head_dim)


class BlockFirstLayout(LayoutAdapter):
    """CUDA (FlashInfer-style): ``[num_blocks, 2, B, H, D]``: a block is already canonical."""

    name = "block_first"

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        g = self.geometry
        return (num_blocks, 2, g.block_tokens, g.num_kv_heads, g.head_dim)

    def _blocks_as_canonical(self, selected: "torch.Tensor") -> "torch.Tensor":
        return selected

    def _canonical_to_native(self, canonical: "torch.Tensor") -> "torch.Tensor":
        return canonical


class KVFirstLayout(LayoutAdapter):
    """CUDA (FlashAttention-style): ``[2, num_blocks, B, H, D]``: K and V blocks live apart."""

    name = "kv_first"
    _block_dim = 1

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        g = self.geometry
        return (2, num_blocks, g.block_tokens, g.num_kv_heads, g.head_dim)

    def _select(self, kv_layer: "torch.Tensor", index: "torch.Tensor") -> "torch.Tensor":
        return kv_layer.index_select(1, index)

    def _assign(self, kv_layer: "torch.Tensor", index: "torch.Tensor", native: "torch.Tensor") -> None:
        kv_layer.index_copy_(1, index, native)

    def _blocks_as_canonical(self, selected: "torch.Tensor") -> "torch.Tensor":
        return selected.transpose(0, 1)  # [2, n, B, H, D] -> [n, 2, B, H, D]

    def _canonical_to_native(self, canonical: "torch.Tensor") -> "torch.Tensor":
        return canonical.transpose(0, 1)


_ADAPTERS = {cls.name: cls for cls in (CpuLayout, KVFirstLayout, BlockFirstLayout)}


def adapter_for(name: str, geometry: KVGeometry) -> LayoutAdapter:
    """The adapter for a backend layout name (``cpu``, ``kv_first``, ``block_first``)."""
    try:
        return _ADAPTERS[name](geometry)
    except KeyError:
        raise UsageError(f"unknown KV layout {name!r}", hint="one of: " + ", ".join(_ADAPTERS)) from None
