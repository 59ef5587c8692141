"""The codec interface, the identity codec, the zstd layer and the payload preamble."""
from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING

from kvtier.errors import CorruptBlockError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.layout import KVGeometry

__all__ = ["Codec", "Identity", "Zstd", "PREAMBLE", "pack_preamble", "read_preamble"]

# b"KC", format version, codec kind, flags, group size, two parameters (outlier channels, sink tokens)
PREAMBLE = struct.Struct("<2sBBBBBB")
FORMAT_VERSION = 1
FLAG_SINK = 1


def pack_preamble(out: "torch.Tensor", kind: int, flags: int = 0, group: int = 0, p1: int = 0, p2: int = 0) -> None:
    import torch

    raw = PREAMBLE.pack(b"KC", FORMAT_VERSION, kind, flags, group, p1, p2)
    out[: PREAMBLE.size].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def read_preamble(payload: "torch.Tensor", spec: str, kind: int, group: int = 0) -> tuple[int, int, int]:
    """Check that ``payload`` was written by this codec; returns (flags, p1, p2)."""
    if payload.numel() < PREAMBLE.size:
        raise CorruptBlockError(f"codec {spec}: payload of {payload.numel()} bytes is too short")
    head = bytes(payload[: PREAMBLE.size].cpu().numpy().tobytes())
    magic, version, got_kind, flags, got_group, p1, p2 = PREAMBLE.unpack(head)
    if magic != b"KC" or version != FORMAT_VERSION or got_kind != kind or got_group != group:
        raise CorruptBlockError(
            f"codec {spec}: payload was not written by this codec (kind {got_kind}, version {version}, "
            f"group {got_group})",
            hint="the block is dropped and recomputed; it was stored under another codec or is corrupt",
        )
    return flags, p1, p2


class Codec:
    """Encode a canonical block into bytes; decode bytes into a canonical block."""

    spec: str = "none"
    lossy: bool = False
    # capabilities the mover plans copies by (never ``isinstance``):
    raw = False  # the payload is the block's own bytes: copy it, nothing to encode or decode
    host_unpack = False  # a host-side layer (``unpack``) comes off before the device decodes ``inner``

    def max_bytes(self, geometry: "KVGeometry") -> int:
        """Upper bound of ``encode``'s output for one block of ``geometry``."""
        raise NotImplementedError

    def nbytes_for(self, geometry: "KVGeometry", first: bool = False) -> int | None:
        """Exact size of an encoded block (None when it depends on the data, as with zstd)."""
        return self.max_bytes(geometry)

    def is_first(self, payload: "torch.Tensor") -> bool:
        """True when ``payload`` was encoded as the first block of its sequence."""
        return False

    def encode(self, block: "torch.Tensor", out: "torch.Tensor", first: bool = False) -> int:
        """Write ``block`` (``[L, H, 2, B, D]``, KV dtype) into ``out`` (uint8); returns bytes written.

        ``first`` says the block is the first of its sequence (it holds the attention sinks).
        """
        raise NotImplementedError

    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        """Write the block encoded in ``payload`` (uint8, exact length) into ``out``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<codec {self.spec}>"


class Identity(Codec):
    spec = "none"
    raw = True

    def max_bytes(self, geometry: "KVGeometry") -> int:
        return geometry.block_bytes

    def encode(self, block: "torch.Tensor", out: "torch.Tensor", first: bool = False) -> int:
        import torch

        flat = block.contiguous().view(-1).view(torch.uint8)
        out[: flat.numel()].copy_(flat)
        return flat.numel()

    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        import torch

        flat = out.view(-1).view(torch.uint8)
        if payload.numel() != flat.numel():
            raise CorruptBlockError(f"codec none: payload holds {payload.numel()} bytes, a block {flat.numel()}")
        flat.copy_(payload)


class _ZstdState(threading.local):
    def __init__(self) -> None:
        import zstandard

        self.compressor = zstandard.ZstdCompressor(level=1, write_checksum=True)
        self.decompressor = zstandard.ZstdDecompressor()


class Zstd(Codec):
    """A lossless zstd layer (level 1) over another codec's bytes; compresses on the CPU."""

    host_unpack = True

    def __init__(self, inner: Codec):
        self.inner = inner
        self.lossy = inner.lossy
        self._state: _ZstdState | None = None

    @property
    def state(self) -> _ZstdState:
        if self._state is None:
            self._state = _ZstdState()
        return self._state

    def max_bytes(self, geometry: "KVGeometry") -> int:
        n = self.inner.max_bytes(geometry)
        return n + (n >> 7) + 512  # above ZSTD_compressBound

    def nbytes_for(self, geometry: "KVGeometry", first: bool = False) -> int | None:
        return None

    def encode(self, block: "torch.Tensor", out: "torch.Tensor", first: bool = False) -> int:
        import torch

        scratch = torch.empty(self.inner.max_bytes(_geometry_of(block)), dtype=torch.uint8, device=block.device)
        n = self.inner.encode(block, scratch, first=first)
        packed = self.state.compressor.compress(scratch[:n].cpu().numpy().tobytes())
        out[: len(packed)].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))
        return len(packed)

    def unpack(self, payload: "torch.Tensor", limit: int) -> "torch.Tensor":
        """The inner codec's bytes (CPU uint8)."""
        import torch
        import zstandard

        try:
            raw = self.state.decompressor.decompress(payload.cpu().numpy().tobytes(), max_output_size=limit,
                                                     allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CorruptBlockError(f"codec {self.spec}: {exc}") from None
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        raw = self.unpack(payload, self.inner.max_bytes(_geometry_of(out)))
        self.inner.decode(raw.to(out.device), out)

    def is_first(self, payload: "torch.Tensor") -> bool:
        if not self.inner.lossy:
            return False
        return self.inner.is_first(self.unpack(payload, 1 << 31))


def _geometry_of(block: "torch.Tensor") -> "KVGeometry":
    from kvtier.layout import KVGeometry

    layers, heads, _, tokens, dim = block.shape
    return KVGeometry(layers, heads, dim, tokens, str(block.dtype).removeprefix("torch."))
