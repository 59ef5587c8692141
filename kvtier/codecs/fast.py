"""CPU decode kernels (numba) for bf16 KV; each returns False when it does not apply.

The torch path in ``quant.py`` is the reference: these kernels compute the same float32 values in
the same order and round to bf16 the way torch does (round to nearest even), so both paths give
identical bits (tests compare them). They run when the output is a contiguous bf16 CPU tensor and
numba imports; ``KVTIER_NO_NUMBA=1`` turns them off. Compiled on first use, cached on disk.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["available", "fp8_decode", "int8_decode", "int4_decode"]

log = logging.getLogger(__name__)
_kernels: dict[str, Any] | None = None
_failed = False


def available() -> bool:
    return _load() is not None


def _load() -> dict[str, Any] | None:
    global _kernels, _failed
    if _kernels is not None or _failed:
        return _kernels
    if os.environ.get("KVTIER_NO_NUMBA"):
        _failed = True
        return None
    try:
        _kernels = _compile()
    except Exception as exc:  # no numba, or it cannot compile here: the torch path stays correct
        log.info("kvtier codecs: numba kernels unavailable (%s); using torch", exc)
        _failed = True
    return _kernels


def _compile() -> dict[str, Any]:
    import numpy as np
    from numba import njit, prange

    @njit(parallel=True, cache=True)
    def fp8_lut(q, exp, lut, out):  # pragma: no cover - compiled
        shift = np.int16(7)
        for r in prange(q.shape[0]):
            add = np.int16(exp[r]) << shift
            for j in range(q.shape[1]):
                v = lut[q[r, j]]
                if (v & 0x7FFF) != 0 and (v & 0x7F80) != 0x7F80:
                    v = np.int16(v + add)
                out[r, j] = v

    @njit(parallel=True, cache=True)
    def int8_dec(q, scale, out):  # pragma: no cover - compiled
        rows, cols = q.shape
        chunk = 256
        for c in prange((rows + chunk - 1) // chunk):
            tmp = np.empty(cols, np.float32)
            bits = tmp.view(np.uint32)
            for r in range(c * chunk, min(rows, (c + 1) * chunk)):
                s = scale[r]
                for j in range(cols):
                    tmp[j] = np.float32(q[r, j]) * s
                for j in range(cols):  # float32 -> bf16, round to nearest even (as torch)
                    u = bits[j]
                    out[r, j] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @njit(parallel=True, cache=True)
    def int4_dec(kq, vq, klut, vlut, o_idx, o_val, out):  # pragma: no cover - compiled
        # out: [L, H, 2, B, D] as 16-bit words; klut: [L, H, B/gk, D, 16]; vlut: [L, H, B, D/gv, 16]
        L, H, _, B, D = out.shape
        gk = B // klut.shape[2]
        gv = D // vlut.shape[3]
        n_out = o_idx.shape[2]
        for lh in prange(L * H):
            l = lh // H
            h = lh % H
            base = lh * B * D
            for b in range(B):
                g = b // gk
                row = base + b * D
                for j in range(D // 2):
                    byte = kq[(row >> 1) + j]
                    out[l, h, 0, b, 2 * j] = klut[l, h, g, 2 * j, byte & 15]
                    out[l, h, 0, b, 2 * j + 1] = klut[l, h, g, 2 * j + 1, byte >> 4]
                for j in range(D // 2):
                    byte = vq[(row >> 1) + j]
                    out[l, h, 1, b, 2 * j] = vlut[l, h, b, (2 * j) // gv, byte & 15]
                    out[l, h, 1, b, 2 * j + 1] = vlut[l, h, b, (2 * j + 1) // gv, byte >> 4]
                for o in range(n_out):
                    out[l, h, 0, b, o_idx[l, h, o]] = o_val[l, h, b, o]

    return {"fp8_lut": fp8_lut, "int8": int8_dec, "int4": int4_dec}


_LUTS: dict[str, Any] = {}


def _lut(fmt: str):
    import torch

    if fmt not in _LUTS:
        dtype = torch.float8_e5m2 if fmt == "e5m2" else torch.float8_e4m3fn
        _LUTS[fmt] = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.bfloat16).view(torch.int16).numpy().copy()
    return _LUTS[fmt]


def _applies(out: "torch.Tensor") -> bool:
    import torch

    return out.device.type == "cpu" and out.dtype == torch.bfloat16 and out.is_contiguous()


def fp8_decode(q: "torch.Tensor", exp: "torch.Tensor", out: "torch.Tensor", fmt: str) -> bool:
    import torch

    if not _applies(out) or q.device.type != "cpu":
        return False
    kernels = _load()
    if kernels is None:
        return False
    kernels["fp8_lut"](q.numpy(), exp.numpy(), _lut(fmt), out.view(torch.int16).numpy())
    return True


def int8_decode(q: "torch.Tensor", scale: "torch.Tensor", out: "torch.Tensor") -> bool:
    import torch

    if not _applies(out) or q.device.type != "cpu":
        return False
    kernels = _load()
    if kernels is None:
        return False
    kernels["int8"](q.numpy(), scale.numpy(), out.view(torch.uint16).numpy())
    return True


def int4_decode(kq: "torch.Tensor", vq: "torch.Tensor", parts: dict, out: "torch.Tensor", gk: int, gv: int,
                outliers: "tuple[torch.Tensor, torch.Tensor] | None" = None) -> bool:
    """Nibbles -> 16-bit values through per-group tables of the 16 levels, built by torch with the
    reference's float32 arithmetic (so the bits match it); outlier key channels written last."""
    import torch

    if not (out.device.type == "cpu" and out.element_size() == 2 and out.dtype.is_floating_point
            and out.is_contiguous() and kq.device.type == "cpu"):
        return False
    kernels = _load()
    if kernels is None:
        return False
    L, H, _, B, D = out.shape
    levels = torch.arange(16, dtype=torch.float32)
    kscale = parts["k_scale"].view(L, H, B // gk, D, 1).float()
    kmin = parts["k_min"].view(L, H, B // gk, D, 1).float()
    klut = (levels * kscale + kmin).to(out.dtype).view(torch.int16)
    vscale = parts["v_scale"].view(L, H, B, D // gv, 1).float()
    vmin = parts["v_min"].view(L, H, B, D // gv, 1).float()
    vlut = (levels * vscale + vmin).to(out.dtype).view(torch.int16)
    if outliers is None:
        o_idx = torch.zeros((L, H, 0), dtype=torch.uint8)
        o_val = torch.zeros((L, H, B, 0), dtype=torch.int16)
    else:
        o_idx, o_val = outliers[0], outliers[1].view(torch.int16)
    kernels["int4"](kq.numpy(), vq.numpy(), klut.numpy(), vlut.numpy(), o_idx.numpy(), o_val.numpy(),
                    out.view(torch.int16).numpy())
    return True
