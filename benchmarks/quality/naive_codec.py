"""The naive 4-bit reference: a benchmark's quantizer stored through the tiers like a codec.

``int4-naive`` is what "4-bit KV" means without KIVI's or KVQuant's care: asymmetric int4 with one
scale and one zero point per tensor, here per (layer, KV head, K or V) of a block (16 or 128 tokens
x head_dim values). An attention sink or a few outlier channels set that one range, and every
ordinary value rounds to one of a handful of levels: the failure kvtier's ``int4-lc`` exists to
avoid. It is not a product codec: configuration never accepts it (``kvtier.config`` validates
against ``SPEC_RE``); a benchmark registers it (``register``) to send blocks through the real NVMe
path, encoder and decoder as it does every codec, so the trap is measured through the tier.

Payload (after the 8-byte preamble): float32 zero points and steps [R, 2] | packed nibbles [R, B*D/2],
R = layers x heads x 2 rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.codecs.base import PREAMBLE, Codec, pack_preamble, read_preamble
from kvtier.errors import CorruptBlockError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.layout import KVGeometry

__all__ = ["SPEC", "NaiveInt4", "naive_levels", "register"]

SPEC = "int4-naive"
KIND = 250  # a preamble kind no product codec uses


def naive_levels(x: "torch.Tensor", dims: tuple[int, ...]) -> "tuple[torch.Tensor, torch.Tensor]":
    """Zero point and step of asymmetric 16-level quantization of ``x`` over ``dims``."""
    import torch

    lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    return lo, torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))


class NaiveInt4(Codec):
    spec = SPEC
    lossy = True

    @staticmethod
    def _rows(geometry: "KVGeometry") -> tuple[int, int]:
        L, H, two, B, D = geometry.block_shape
        return L * H * two, B * D

    def _offsets(self, geometry: "KVGeometry") -> tuple[int, int, int]:
        rows, cols = self._rows(geometry)
        params = PREAMBLE.size
        packed = params + rows * 8
        return params, packed, packed + rows * cols // 2

    def max_bytes(self, geometry: "KVGeometry") -> int:
        return self._offsets(geometry)[2]

    def encode(self, block: "torch.Tensor", out: "torch.Tensor", first: bool = False) -> int:
        import torch

        from kvtier.codecs.base import _geometry_of

        geometry = _geometry_of(block)
        rows, cols = self._rows(geometry)
        params, packed, total = self._offsets(geometry)
        x = block.reshape(rows, cols).float()
        lo, step = naive_levels(x, (1,))
        q = torch.round((x - lo) / step).clamp_(0, 15).to(torch.uint8)
        pack_preamble(out, KIND)
        out[params:packed].view(torch.float32).view(rows, 2).copy_(torch.cat([lo, step], 1))
        out[packed:total].copy_((q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1))
        return total

    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        import torch

        from kvtier.codecs.base import _geometry_of

        geometry = _geometry_of(out)
        rows, cols = self._rows(geometry)
        params, packed, total = self._offsets(geometry)
        if payload.numel() != total:
            raise CorruptBlockError(f"codec {SPEC}: payload holds {payload.numel()} bytes, expected {total}")
        read_preamble(payload, SPEC, KIND)
        lo, step = payload[params:packed].clone().view(torch.float32).view(rows, 2).split(1, dim=1)
        nibbles = payload[packed:total].view(rows, cols // 2)
        q = torch.stack([nibbles & 15, nibbles >> 4], dim=2).view(rows, cols).float()
        out.copy_((q * step + lo).to(out.dtype).view(out.shape))


def register() -> None:
    """Make ``int4-naive`` a spec the tiers accept in this process (benchmarks only)."""
    from kvtier.codecs import register_reference

    register_reference(SPEC, NaiveInt4())
