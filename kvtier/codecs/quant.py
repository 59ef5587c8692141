"""Lossy codecs: fp8 (e4m3 / e5m2), int8, int4 (KIVI) and int4-lc (long-context safe).

All work on a canonical block ``[L, H, 2, B, D]`` (K = ``[:, :, 0]``, V = ``[:, :, 1]``) with
vectorised torch, on the block's device. Scales are computed in float32. Payload layouts (after the
8-byte preamble, each array starting at an 8-byte boundary):

* fp8:  int8 exponents [R] | float8 values [R, C]. R rows of C values: one row per (layer, head,
  K/V, token) (C = D), or per (layer, head, K/V) with ``fp8:head`` (C = B*D). Scales are powers of
  two (an exponent byte, as in the MX formats): a float8 value times 2^e is exact in bf16, so
  decode is a table lookup plus an exponent add.
* int8: float32 scales [R] | int8 values [R, D]; symmetric, one scale per token and head.
* int4: K zero points and scales (fp16) [L, H, B/G, D] | V zero points and scales (fp16)
  [L, H, B, D/G] | packed K nibbles | packed V nibbles. Asymmetric: keys per channel over groups of
  G tokens, values per token over groups of G channels (KIVI, Liu et al. 2024).
* int4-lc adds: outlier key channels [L, H, O] (uint8 indices) and their exact values
  [L, H, B, O] in the KV dtype (KVQuant's dense-and-sparse split, per block), and, for the first
  block of a sequence, its first S tokens (the attention sinks) in the KV dtype.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import kvtier.codecs.fast as fast  # not "from kvtier.codecs": the package imports this module
from kvtier.codecs.base import FLAG_SINK, PREAMBLE, Codec, pack_preamble, read_preamble
from kvtier.errors import CorruptBlockError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.layout import KVGeometry

__all__ = ["Fp8", "Int8", "Int4"]

_FP16_MAX = 65504.0


def _align(n: int) -> int:
    return (n + 7) & ~7


class _Layout:
    """Byte offsets of named arrays in a payload (8-byte aligned, after the preamble)."""

    def __init__(self, *parts: tuple[str, int]):
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = PREAMBLE.size
        for name, size in parts:
            pos = _align(pos)
            self.offsets[name] = (pos, size)
            pos += size
        self.total = pos

    def view(self, payload: "torch.Tensor", name: str, dtype) -> "torch.Tensor":
        start, size = self.offsets[name]
        return payload[start : start + size].view(dtype)


def _geometry(block: "torch.Tensor") -> "KVGeometry":
    from kvtier.codecs.base import _geometry_of

    return _geometry_of(block)


def _check_size(spec: str, payload: "torch.Tensor", expected: int) -> None:
    if payload.numel() != expected:
        raise CorruptBlockError(f"codec {spec}: payload holds {payload.numel()} bytes, expected {expected}")


class _FixedRate(Codec):
    """A codec whose payload layout depends on the geometry alone."""

    kind = 0

    def _layout(self, geometry: "KVGeometry") -> _Layout:
        raise NotImplementedError

    def max_bytes(self, geometry: "KVGeometry") -> int:
        return self._layout(geometry).total

    def _checked(self, payload: "torch.Tensor", out: "torch.Tensor") -> "tuple[KVGeometry, _Layout]":
        """The geometry and layout of ``out``, once ``payload`` is known to be this codec's, whole."""
        geometry = _geometry(out)
        layout = self._layout(geometry)
        _check_size(self.spec, payload, layout.total)
        read_preamble(payload, self.spec, self.kind)
        return geometry, layout


class Fp8(_FixedRate):
    lossy = True

    def __init__(self, fmt: str = "e4m3", per_head: bool = False):
        self.fmt = fmt
        self.per_head = per_head
        self.kind = 3 if per_head else (2 if fmt == "e5m2" else 1)
        self.fmax = 57344.0 if fmt == "e5m2" else 448.0

    @property
    def dtype(self):
        import torch

        return torch.float8_e5m2 if self.fmt == "e5m2" else torch.float8_e4m3fn

    def _shape(self, geometry: "KVGeometry") -> tuple[int, int]:
        L, H, two, B, D = geometry.block_shape
        return (L * H * two, B * D) if self.per_head else (L * H * two * B, D)

    def _layout(self, geometry: "KVGeometry") -> _Layout:
        rows, cols = self._shape(geometry)
        return _Layout(("exp", rows), ("q", rows * cols))

    def encode(self, block: "torch.Tensor", out: "torch.Tensor", first: bool = False) -> int:
        import torch

        geometry = _geometry(block)
        layout = self._layout(geometry)
        rows = block.reshape(self._shape(geometry)).float()
        amax = rows.abs().amax(1)
        exp = torch.ceil(torch.log2(amax / self.fmax))
        exp = torch.where(torch.isfinite(exp), exp, torch.zeros_like(exp)).clamp_(-100, 100)
        scaled = (rows * torch.exp2(-exp)[:, None]).clamp_(-self.fmax, self.fmax)
        pack_preamble(out, self.kind)
        layout.view(out, "exp", torch.int8).copy_(exp.to(torch.int8))
        layout.view(out, "q", torch.uint8).copy_(scaled.to(self.dtype).view(torch.uint8).view(-1))
        return layout.total

    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        import torch

        geometry, layout = self._checked(payload, out)
        rows, cols = self._shape(geometry)
        exp = layout.view(payload, "exp", torch.int8)
        q = layout.view(payload, "q", torch.uint8).view(rows, cols)
        target = out.view(rows, cols)
        if fast.fp8_decode(q, exp, target, self.fmt):
            return
        target.copy_(q.view(self.dtype).float() * torch.exp2(exp.float())[:, None])


class Int8(_FixedRate):
    lossy = True
    kind = 4

    def _layout(self, geometry: "KVGeometry") -> _Layout:
        L, H, two, B, D = geometry.block_shape
        rows = L * H * two * B
        return _Layout(("scale", rows * 4), ("q", rows * D))

    def encode(self, block: "torch.Tensor", out: "torch.Tensor", first: bool = False) -> int:
        import torch

        geometry = _geometry(block)
        layout = self._layout(geometry)
        rows = block.reshape(-1, geometry.head_dim).float()
        scale = rows.abs().amax(1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        pack_preamble(out, self.kind)
        layout.view(out, "scale", torch.float32).copy_(scale)
        layout.view(out, "q", torch.int8).copy_(q.view(-1))
        return layout.total

    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        import torch

        geometry, layout = self._checked(payload, out)
        scale = layout.view(payload, "scale", torch.float32)
        q = layout.view(payload, "q", torch.int8).view(scale.numel(), geometry.head_dim)
        target = out.view(scale.numel(), geometry.head_dim)
        if fast.int8_decode(q, scale, target):
            return
        target.copy_(q.float() * scale[:, None])


class Int4(Codec):
    lossy = True

    def __init__(self, group: int = 64, long_context: bool = False, sink_tokens: int = 4):
        self.group = group
        self.long_context = long_context
        self.sink_tokens = sink_tokens
        self.kind = 6 if long_context else 5

    # ---- geometry ---------------------------------------------------------------------------
    def _groups(self, geometry: "KVGeometry") -> tuple[int, int]:
        """(tokens per key group, channels per value group)."""
        B, D = geometry.block_tokens, geometry.head_dim
        gk = self.group if B % self.group == 0 else B
        gv = self.group if D % self.group == 0 else D
        return gk, gv

    def outliers(self, geometry: "KVGeometry") -> int:
        return max(1, geometry.head_dim // 16) if self.long_context else 0

    def _layout(self, geometry: "KVGeometry", sink: bool) -> _Layout:
        L, H, _, B, D = geometry.block_shape
        gk, gv = self._groups(geometry)
        item = geometry.itemsize
        parts = [("k_min", L * H * (B // gk) * D * 2), ("k_scale", L * H * (B // gk) * D * 2),
                 ("v_min", L * H * B * (D // gv) * 2), ("v_scale", L * H * B * (D // gv) * 2),
                 ("k_q", L * H * B * D // 2), ("v_q", L * H * B * D // 2)]
        if self.long_context:
            o = self.outliers(geometry)
            parts += [("o_idx", L * H * o), ("o_val", L * H * B * o * item)]
        if sink:
            parts.append(("sink", L * H * 2 * min(self.sink_tokens, B) * D * item))
        return _Layout(*parts)

    def max_bytes(self, geometry: "KVGeometry") -> int:
        return self._layout(geometry, sink=self.long_context).total

    def nbytes_for(self, geometry: "KVGeometry", first: bool = False) -> int | None:
        return self._layout(geometry, sink=self.long_context and first).total

    def is_first(self, payload: "torch.Tensor") -> bool:
        if not self.long_context or payload.numel() < PREAMBLE.size:
            return False
        return bool(int(payload[4]) & FLAG_SINK)  # the preamble's flags byte

    # ---- encode -----------------------------------------------------------------------------
    @staticmethod
    def _quantize(x: "torch.Tensor", dim: int):
        """Asymmetric 4-bit over ``dim``: (codes uint8, zero points fp16, scales fp16)."""
        import torch

        lo = x.amin(dim).clamp_(-_FP16_MAX, _FP16_MAX).half()
        hi = x.amax(dim).clamp_(-_FP16_MAX, _FP16_MAX)
        scale = ((hi - lo.float()) / 15.0).clamp_(max=_FP16_MAX).half()
        step = scale.float()
        step = torch.where(step > 0, step, torch.ones_like(step))
        codes = torch.round((x - lo.float().unsqueeze(dim)) / step.unsqueeze(dim)).clamp_(0, 15).to(torch.uint8)
        return codes, lo, scale

    @staticmethod
    def _pack(codes: "torch.Tensor", out: "torch.Tensor") -> None:
        flat = codes.reshape(-1, 2)
        out.copy_(flat[:, 0] | (flat[:, 1] << 4))

    def encode(self, block: "torch.Tensor", out: "torch.Tensor", first: bool = False) -> int:
        import torch

        geometry = _geometry(block)
        L, H, _, B, D = block.shape
        sink = self.long_context and first
        layout = self._layout(geometry, sink)
        gk, gv = self._groups(geometry)
        x = block.float()
        k = x[:, :, 0].reshape(L, H, B // gk, gk, D)
        v = x[:, :, 1].reshape(L, H, B, D // gv, gv)
        k_codes, k_min, k_scale = self._quantize(k, 3)
        v_codes, v_min, v_scale = self._quantize(v, 4)
        flags = FLAG_SINK if sink else 0
        o = self.outliers(geometry)
        pack_preamble(out, self.kind, flags, self.group, o, min(self.sink_tokens, B) if sink else 0)
        layout.view(out, "k_min", torch.float16).copy_(k_min.view(-1))
        layout.view(out, "k_scale", torch.float16).copy_(k_scale.view(-1))
        layout.view(out, "v_min", torch.float16).copy_(v_min.view(-1))
        layout.view(out, "v_scale", torch.float16).copy_(v_scale.view(-1))
        self._pack(k_codes, layout.view(out, "k_q", torch.uint8))
        self._pack(v_codes, layout.view(out, "v_q", torch.uint8))
        if self.long_context:
            keys = block[:, :, 0]  # [L, H, B, D] in the KV dtype
            idx = x[:, :, 0].abs().amax(2).topk(o, dim=-1).indices.sort(-1).values  # [L, H, o]
            layout.view(out, "o_idx", torch.uint8).copy_(idx.to(torch.uint8).view(-1))
            vals = keys.gather(-1, idx[:, :, None, :].expand(L, H, B, o))
            layout.view(out, "o_val", block.dtype).copy_(vals.reshape(-1))
        if sink:
            s = min(self.sink_tokens, B)
            layout.view(out, "sink", block.dtype).copy_(block[:, :, :, :s].reshape(-1))
        return layout.total

    # ---- decode -----------------------------------------------------------------------------
    def decode(self, payload: "torch.Tensor", out: "torch.Tensor") -> None:
        import torch

        geometry = _geometry(out)
        L, H, _, B, D = out.shape
        if payload.numel() < PREAMBLE.size:
            raise CorruptBlockError(f"codec {self.spec}: payload of {payload.numel()} bytes is too short")
        flags, o, s = read_preamble(payload, self.spec, self.kind, self.group)
        sink = bool(flags & FLAG_SINK)
        if not self.long_context and (sink or o):
            raise CorruptBlockError(f"codec {self.spec}: unexpected long-context fields in the payload")
        if self.long_context and (o != self.outliers(geometry) or (sink and s != min(self.sink_tokens, B))):
            raise CorruptBlockError(f"codec {self.spec}: payload parameters do not match the block geometry")
        layout = self._layout(geometry, sink)
        _check_size(self.spec, payload, layout.total)
        gk, gv = self._groups(geometry)
        parts = {name: layout.view(payload, name, torch.float16) for name in ("k_min", "k_scale", "v_min", "v_scale")}
        kq, vq = layout.view(payload, "k_q", torch.uint8), layout.view(payload, "v_q", torch.uint8)
        outliers = None
        if self.long_context:
            o_idx = layout.view(payload, "o_idx", torch.uint8).view(L, H, o)
            if int(o_idx.max()) >= D:
                raise CorruptBlockError(f"codec {self.spec}: outlier channel index out of range")
            outliers = (o_idx, layout.view(payload, "o_val", out.dtype).view(L, H, B, o))
        if fast.int4_decode(kq, vq, parts, out, gk, gv, outliers):
            outliers = None  # written by the kernel
        else:
            k = self._unpack(kq).view(L, H, B // gk, gk, D).float()
            k = k * parts["k_scale"].view(L, H, B // gk, 1, D).float() + parts["k_min"].view(L, H, B // gk, 1,
                                                                                             D).float()
            v = self._unpack(vq).view(L, H, B, D // gv, gv).float()
            v = v * parts["v_scale"].view(L, H, B, D // gv, 1).float() + parts["v_min"].view(L, H, B, D // gv,
                                                                                             1).float()
            out[:, :, 0].copy_(k.view(L, H, B, D))
            out[:, :, 1].copy_(v.view(L, H, B, D))
        if outliers is not None:
            idx = outliers[0].view(L, H, 1, o).long().expand(L, H, B, o)
            out[:, :, 0].scatter_(-1, idx, outliers[1])
        if sink:
            out[:, :, :, :s].copy_(layout.view(payload, "sink", out.dtype).view(L, H, 2, s, D))

    @staticmethod
    def _unpack(packed: "torch.Tensor") -> "torch.Tensor":
        import torch

        return torch.stack((packed & 15, packed >> 4), dim=-1).view(-1)
