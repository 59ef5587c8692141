"""KV geometry, model fingerprints, and adapters from vLLM's per-layer KV tensors to kvtier blocks.

A kvtier *block* is one vLLM block (``block_tokens`` tokens) across all attention layers, stored in
one canonical, backend-independent order::

    [num_layers, num_kv_heads, 2 (K then V), block_tokens, head_dim]

so a block written by the CPU backend loads into a CUDA backend and a snapshot is portable. The
order is head-major because that is the CPU backend's own block layout, while on a GPU the
transpose is free. Within a head's slab vLLM's CPU attention packs K and V for its ISA (AMX
tiles, a transposed K): ``kvtier.move.slaborder`` measures that order on the running vLLM and
the CPU adapter copies through it, so a block is canonical (codecs group real channels and
tokens) whatever the ISA. The adapters gather whole blocks from vLLM's tensors into that order
and scatter them back; the canonical order also gives codecs their K and V views (``k_view`` /
``v_view``).

Backend layouts handled (one tensor per layer, all from vLLM 0.32):

* ``cpu``          ``[num_blocks, kv_heads, block_size, 2*head_dim]``; each (block, head) slab is
                   read as ``[2*block_size, head_dim]``: K for the block's tokens, then V.
* ``kv_first``     ``[2, num_blocks, block_size, kv_heads, head_dim]`` (FlashAttention).
* ``block_first``  ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (FlashInfer).

torch is imported lazily so that ``kvtier --help`` stays fast.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Sequence

from kvtier.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.move.slaborder import SlabOrder

__all__ = [
    "DTYPE_ITEMSIZE",
    "KVGeometry",
    "ModelFingerprint",
    "LayoutAdapter",
    "CpuLayout",
    "KVFirstLayout",
    "BlockFirstLayout",
    "HeadSplitLayout",
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
                raise UsageError(
                    f"KV geometry: {name} must be a positive integer, got {value!r}",
                    hint="take num_layers, num_kv_heads and head_dim from the model config and "
                    "block_tokens from vLLM's block size",
                )
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
        """Canonical shape of one block: ``[layers, kv_heads, 2, tokens, head_dim]``."""
        return (self.num_layers, self.num_kv_heads, 2, self.block_tokens, self.head_dim)

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
    geometry: KVGeometry  # of one rank's shard (its KV heads) with tensor parallelism
    weights: str = ""  # kvtier.persist.weights.weights_identity of the served weights ("" when unknown)
    shards: int = 1  # tensor-parallel size: how many ranks each hold a slice of every block's KV heads
    rank: int | None = None  # the rank whose shard this is (None: the whole engine, as the scheduler sees it)
    kv_scales: str = ""  # fp8 KV caches: how values were scaled into fp8 (blocks are only valid under the same)
    # how a block's values are ordered: "canonical" on vLLM's CPU backend since kvtier undoes its ISA
    # packing (kvtier.move.slaborder); before, CPU blocks were stored in the packed order and must not load
    kv_order: str = ""

    @functools.cached_property
    def digest(self) -> bytes:
        """16-byte identity of (model, weights, geometry, dtype[, scales][, shards and rank])."""
        fields = {"model": self.model_id, **self.geometry.to_dict()}
        if self.weights:
            fields["weights"] = self.weights
        if self.kv_scales:
            fields["kv_scales"] = self.kv_scales
        if self.kv_order:
            fields["kv_order"] = self.kv_order
        if self.shards > 1:  # a single rank's digest is what it always was: old blocks stay valid
            fields["shards"] = self.shards
            if self.rank is not None:
                fields["rank"] = self.rank
        canonical = json.dumps(fields, sort_keys=True)
        return hashlib.blake2b(canonical.encode(), digest_size=16).digest()

    def for_rank(self, rank: int) -> "ModelFingerprint":
        """The identity of one rank's shard: its NVMe files and snapshot files carry it."""
        return dataclasses.replace(self, rank=rank)

    @property
    def engine(self) -> "ModelFingerprint":
        """The identity of the whole engine (what namespaces and the catalog are keyed by)."""
        return dataclasses.replace(self, rank=None) if self.rank is not None else self

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def to_dict(self) -> dict:
        data = {"model_id": self.model_id, "weights": self.weights, "geometry": self.geometry.to_dict(),
                "digest": self.hex}
        if self.kv_scales:
            data["kv_scales"] = self.kv_scales
        if self.kv_order:
            data["kv_order"] = self.kv_order
        if self.shards > 1:
            data["shards"], data["rank"] = self.shards, self.rank
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ModelFingerprint":
        rank = data.get("rank")
        return cls(model_id=data["model_id"], geometry=KVGeometry.from_dict(data["geometry"]),
                   weights=str(data.get("weights") or ""), shards=int(data.get("shards") or 1),
                   rank=None if rank is None else int(rank), kv_scales=str(data.get("kv_scales") or ""),
                   kv_order=str(data.get("kv_order") or ""))

    def mismatch(self, other: "ModelFingerprint") -> str:
        """Why blocks of ``other`` cannot serve this engine, in words ("" when they can)."""
        if other.digest == self.digest:
            return ""
        if other.shards != self.shards:
            return (f"it holds KV sharded over {other.shards} tensor-parallel rank(s) and this server runs "
                    f"{self.shards}; restore it on a server with --tensor-parallel-size {other.shards}")
        if other.model_id != self.model_id:
            return f"it was taken with model {other.model_id!r}, this server serves {self.model_id!r}"
        if other.geometry != self.geometry:
            return (f"its KV layout ({other.geometry.dtype}, {other.geometry.block_tokens}-token blocks) differs "
                    f"from this server's ({self.geometry.dtype}, {self.geometry.block_tokens}-token blocks)")
        if other.weights != self.weights:
            return "it was taken with other weights of the same model"
        if other.kv_scales != self.kv_scales:
            return "its fp8 KV was scaled differently"
        if other.kv_order != self.kv_order:
            theirs = other.kv_order or "vLLM CPU's packed order, stored by an older kvtier"
            return f"its blocks are in another order ({theirs}) than this server's ({self.kv_order or 'as stored'})"
        return "its model fingerprint differs"


def k_view(block: "torch.Tensor") -> "torch.Tensor":
    """K of a canonical block (or a batch of them): ``[..., layers, heads, tokens, head_dim]``."""
    return block.select(-3, 0)


def v_view(block: "torch.Tensor") -> "torch.Tensor":
    """V of a canonical block (or a batch of them): ``[..., layers, heads, tokens, head_dim]``."""
    return block.select(-3, 1)


class LayoutAdapter:
    """Moves whole blocks between vLLM's per-layer tensors and canonical block buffers.

    ``gather(kv_layers, block_ids, out)`` fills ``out[i]`` (canonical shape) with vLLM block
    ``block_ids[i]``; ``scatter(src, kv_layers, block_ids)`` is its inverse. A subclass says how a
    run of blocks of one layer (a view, ``_blocks``) maps to and from ``[n, H, 2, B, D]``.

    On CUDA one batched index_select / index_copy_ per layer is cheapest (a few kernels). On the
    CPU, copying block by block from views avoids index_select's temporary and runs at memcpy
    speed for the CPU backend, whose blocks are already canonical.
    """

    name = "abstract"
    _block_dim = 0

    def __init__(self, geometry: KVGeometry):
        self.geometry = geometry

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        raise NotImplementedError

    def _to_canonical(self, native: "torch.Tensor") -> "torch.Tensor":
        """View of native blocks (block dim first, as ``_blocks`` returns them) as [n, H, 2, B, D]."""
        raise NotImplementedError

    def _to_native(self, canonical: "torch.Tensor") -> "torch.Tensor":
        """View of canonical blocks in the native order of ``_blocks``."""
        raise NotImplementedError

    def _blocks(self, kv_layer: "torch.Tensor", start: int, stop: int) -> "torch.Tensor":
        """View of blocks ``start:stop`` of one layer, block dimension first."""
        return kv_layer[start:stop]

    def _check(self, kv_layers: Sequence["torch.Tensor"]) -> None:
        if len(kv_layers) != self.geometry.num_layers:
            raise UsageError(
                f"{self.name} layout: got {len(kv_layers)} KV layers, geometry says {self.geometry.num_layers}"
            )
        first = kv_layers[0]
        want = self.layer_shape(first.shape[self._block_dim] if first.dim() > self._block_dim else 0)
        for layer, kv in enumerate(kv_layers):  # every layer: a bad one must not slip through
            if tuple(kv.shape) != want:
                raise UsageError(
                    f"{self.name} layout: KV tensor shape {tuple(kv.shape)} (layer {layer}), expected {want}"
                )

    def gather(self, kv_layers: Sequence["torch.Tensor"], block_ids: Sequence[int], out: "torch.Tensor") -> None:
        """Copy vLLM blocks ``block_ids`` into ``out`` of shape ``[n, *geometry.block_shape]``."""
        import torch

        self._check(kv_layers)
        if kv_layers[0].device.type != "cpu":
            index = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv_layers[0].device)
            for layer, kv in enumerate(kv_layers):
                selected = self._to_canonical(_index_select(kv, self._block_dim, index))
                dst = out[:, layer]
                dst.copy_(_same_bits_as(selected, dst), non_blocking=True)
            return
        for i, start, stop in _runs(block_ids):
            for layer, kv in enumerate(kv_layers):
                dst = out[i : i + stop - start, layer]
                dst.copy_(_same_bits_as(self._to_canonical(self._blocks(kv, start, stop)), dst))

    def scatter(self, src: "torch.Tensor", kv_layers: Sequence["torch.Tensor"], block_ids: Sequence[int]) -> None:
        """Copy canonical blocks ``src[i]`` into vLLM block ``block_ids[i]`` of every layer."""
        import torch

        self._check(kv_layers)
        device = kv_layers[0].device
        if device.type != "cpu":
            index = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
            for layer, kv in enumerate(kv_layers):
                native = self._to_native(src[:, layer].to(device, non_blocking=True))
                _index_copy(kv, self._block_dim, index, native)
            return
        for i, start, stop in _runs(block_ids):
            for layer, kv in enumerate(kv_layers):
                dst = self._blocks(kv, start, stop)
                dst.copy_(_same_bits_as(self._to_native(src[i : i + stop - start, layer]), dst))


class CpuLayout(LayoutAdapter):
    """vLLM CPU backend: ``[num_blocks, H, B, 2*D]``, each head slab being K rows then V rows.

    The slab ``[B, 2D]`` is read by the kernel as ``[2B, D]``: K's B*D values, then V's. Within
    each, vLLM's CPU attention packs the values for its ISA (``kvtier.move.slaborder``):
    ``orders`` says how (K's, V's), as the connector measured it on the running vLLM; copies go
    through those orders. ``orders`` None: the values are taken to be in canonical order already,
    ``[H, 2, B, D]``, and gather/scatter are plain copies.
    """

    name = "cpu"

    def __init__(self, geometry: KVGeometry, orders: "tuple[SlabOrder, SlabOrder] | None" = None):
        super().__init__(geometry)
        self.orders = None if orders is None or all(o.identity for o in orders) else orders

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        g = self.geometry
        return (num_blocks, g.num_kv_heads, g.block_tokens, 2 * g.head_dim)

    def _to_canonical(self, native: "torch.Tensor") -> "torch.Tensor":
        g = self.geometry
        return native.view(native.shape[0], g.num_kv_heads, 2, g.block_tokens, g.head_dim)

    def _to_native(self, canonical: "torch.Tensor") -> "torch.Tensor":
        g = self.geometry
        return canonical.reshape(canonical.shape[0], g.num_kv_heads, g.block_tokens, 2 * g.head_dim)

    def _copies(self, kv_layers: Sequence["torch.Tensor"], block_ids: Sequence[int], canonical: "torch.Tensor"):
        """(stored view, canonical view) pairs covering ``block_ids``: the same shape, the same
        element at each index, one pair per run of blocks, layer and K/V."""
        self._check(kv_layers)
        g = self.geometry
        assert self.orders is not None
        for i, start, stop in _runs(block_ids):
            for layer, kv in enumerate(kv_layers):
                slab = kv[start:stop].view(stop - start, g.num_kv_heads, 2, g.block_tokens * g.head_dim)
                block = canonical[i : i + stop - start, layer]
                slab = _same_bits_as(slab, block)
                for half, order in enumerate(self.orders):
                    yield order.views(slab[:, :, half], block[:, :, half])

    def gather(self, kv_layers: Sequence["torch.Tensor"], block_ids: Sequence[int], out: "torch.Tensor") -> None:
        if self.orders is None:
            return super().gather(kv_layers, block_ids, out)
        for stored, canonical in self._copies(kv_layers, block_ids, out):
            canonical.copy_(stored)

    def scatter(self, src: "torch.Tensor", kv_layers: Sequence["torch.Tensor"], block_ids: Sequence[int]) -> None:
        if self.orders is None:
            return super().scatter(src, kv_layers, block_ids)
        for stored, canonical in self._copies(kv_layers, block_ids, src):
            stored.copy_(canonical)


class BlockFirstLayout(LayoutAdapter):
    """CUDA (FlashInfer-style): ``[num_blocks, 2, B, H, D]``."""

    name = "block_first"

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        g = self.geometry
        return (num_blocks, 2, g.block_tokens, g.num_kv_heads, g.head_dim)

    def _to_canonical(self, native: "torch.Tensor") -> "torch.Tensor":
        return native.permute(0, 3, 1, 2, 4)  # [n, 2, B, H, D] -> [n, H, 2, B, D]

    def _to_native(self, canonical: "torch.Tensor") -> "torch.Tensor":
        return canonical.permute(0, 2, 3, 1, 4)  # [n, H, 2, B, D] -> [n, 2, B, H, D]


class KVFirstLayout(LayoutAdapter):
    """CUDA (FlashAttention-style): ``[2, num_blocks, B, H, D]``: K and V blocks live apart."""

    name = "kv_first"
    _block_dim = 1

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        g = self.geometry
        return (2, num_blocks, g.block_tokens, g.num_kv_heads, g.head_dim)

    def _blocks(self, kv_layer: "torch.Tensor", start: int, stop: int) -> "torch.Tensor":
        return kv_layer[:, start:stop].transpose(0, 1)  # [n, 2, B, H, D] view

    def _to_canonical(self, native: "torch.Tensor") -> "torch.Tensor":
        return native.permute(0, 3, 1, 2, 4)

    def _to_native(self, canonical: "torch.Tensor") -> "torch.Tensor":
        return canonical.permute(0, 2, 3, 1, 4)


class HeadSplitLayout(LayoutAdapter):
    """vLLM 0.32 CUDA backends: a logical ``[num_blocks, H, B, 2*D]`` view (physically strided,
    e.g. LBNHC) whose last dimension holds each token's K then V (``split(head_dim, -1)``)."""

    name = "head_split"

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        g = self.geometry
        return (num_blocks, g.num_kv_heads, g.block_tokens, 2 * g.head_dim)

    def _to_canonical(self, native: "torch.Tensor") -> "torch.Tensor":
        # [n, H, B, 2D] -> [n, H, B, 2, D] -> [n, H, 2, B, D] (a view; the copy does the transpose)
        return native.unflatten(-1, (2, self.geometry.head_dim)).permute(0, 1, 3, 2, 4)

    def _to_native(self, canonical: "torch.Tensor") -> "torch.Tensor":
        g = self.geometry
        n = canonical.shape[0]
        return canonical.permute(0, 1, 3, 2, 4).reshape(n, g.num_kv_heads, g.block_tokens, 2 * g.head_dim)


def _runs(block_ids: Sequence[int]):
    """(position, start, stop) for each run of consecutive block ids."""
    i = 0
    ids = list(block_ids)
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1:
            j += 1
        yield i, ids[i], ids[j - 1] + 1
        i = j


def _index_select(kv: "torch.Tensor", dim: int, index: "torch.Tensor") -> "torch.Tensor":
    selected = kv.index_select(dim, index)
    return selected.transpose(0, 1) if dim == 1 else selected


def _index_copy(kv: "torch.Tensor", dim: int, index: "torch.Tensor", native: "torch.Tensor") -> None:
    """index_copy_ through same-size integer views (not implemented for float8 on CPU)."""
    if dim == 1:
        native = native.transpose(0, 1)
    _raw(kv).index_copy_(dim, index, _raw(native.contiguous()))


def _same_bits_as(t: "torch.Tensor", like: "torch.Tensor") -> "torch.Tensor":
    """``t`` reinterpreted as ``like``'s dtype when the element sizes match: KV is copied bit for bit
    (vLLM allocates fp8 caches as uint8), never converted value by value."""
    if t.dtype != like.dtype and t.element_size() == like.element_size():
        return t.view(like.dtype)
    return t


def _raw(t: "torch.Tensor") -> "torch.Tensor":
    """A same-size integer view of ``t``: index_copy_ is not implemented for float8 on CPU."""
    import torch

    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(t.element_size())
    return t if raw is None else t.view(raw)


_ADAPTERS = {cls.name: cls for cls in (CpuLayout, KVFirstLayout, BlockFirstLayout, HeadSplitLayout)}


def adapter_for(name: str, geometry: KVGeometry, orders: "tuple[SlabOrder, SlabOrder] | None" = None
                ) -> LayoutAdapter:
    """The adapter for a backend layout name (``cpu``, ``kv_first``, ``block_first``, ``head_split``);
    ``orders``: the CPU backend's K and V slab orders (``kvtier.move.slaborder``)."""
    try:
        cls = _ADAPTERS[name]
    except KeyError:
        raise UsageError(f"unknown KV layout {name!r}", hint="one of: " + ", ".join(_ADAPTERS)) from None
    return CpuLayout(geometry, orders) if cls is CpuLayout else cls(geometry)
