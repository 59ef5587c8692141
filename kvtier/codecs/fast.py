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

__all__ = ["available", "use_kernels", "fp8_decode", "int8_decode", "int4_decode"]

log = logging.getLogger(__name__)
_kernels: dict[str, Any] | None = None
_failed = False


def available() -> bool:
    return _load() is not None


def use_kernels(on: bool) -> None:
    """Turn the kernels on (compiled again on next use) or off (the torch reference path): a test
    decodes the same payload both ways to compare them."""
    global _kernels, _failed
    _kernels, _failed = None, not on


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
                    out[r,
                        j] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @njit(parallel=True, cache=True)
    def int4_dec(kq, vq, ks, km, vs, vm, o_idx, o_val, out):  # pragma: no cover - compiled
        # out: [LH, 2, B, D] bf16 bits; ks/km: [LH, B/gk, D]; vs/vm: [LH, B, D/gv] (float32)
        LH, _, B, D = out.shape
        gk = B // ks.shape[1]
        gv = D // vs.shape[2]
        half = D // 2
        n_out = o_idx.shape[1]
        for lh in prange(LH):
            tmp = np.empty(D, np.float32)
            bits = tmp.view(np.uint32)
            base = lh * B * half
            for b in range(B):
                s = ks[lh, b // gk]
                m = km[lh, b // gk]
                off = base + b * half
                for j in range(half):  # code * scale + zero point, as the torch reference computes it
                    byte = kq[off + j]
                    tmp[2 * j] = np.float32(byte & 15) * s[2 * j] + m[2 * j]
                    tmp[2 * j + 1] = np.float32(byte >> 4) * s[2 * j + 1] + m[2 * j + 1]
                row = out[lh, 0, b]
                for d in range(D):  # float32 -> bf16, round to nearest even
                    u = bits[d]
                    row[d] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
                for o in range(n_out):  # exact outlier channels (int4-lc)
                    row[o_idx[lh, o]] = o_val[lh, b, o]
                vsr = vs[lh, b]
                vmr = vm[lh, b]
                for j in range(half):
                    byte = vq[off + j]
                    tmp[2 * j] = np.float32(byte & 15) * vsr[(2 * j) // gv] + vmr[(2 * j) // gv]
                    tmp[2 * j + 1] = np.float32(byte >> 4) * vsr[(2 * j + 1) // gv] + vmr[(2 * j + 1) // gv]
                row = out[lh, 1, b]
                for d in range(D):
                    u = bits[d]
                    row[d] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    return {"fp8_lut": fp8_lut, "int8": int8_dec, "int4": int4_dec}


_LUTS: dict[str, Any] = {}


def _lut(fmt: str):
    import torch

    if fmt not in _LUTS:
        dtype = torch.float8_e5m2 if fmt == "e5m2" else torch.float8_e4m3fn
        _LUTS[fmt] = torch.arange(256,
                                  dtype=torch.uint8).view(dtype).to(torch.bfloat16).view(torch.int16).numpy().copy()
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
    """Nibbles -> bf16 with the reference's float32 arithmetic; outlier key channels written after."""
    import torch

    if not _applies(out) or kq.device.type != "cpu":
        return False
    kernels = _load()
    if kernels is None:
        return False
    L, H, _, B, D = out.shape
    ks = parts["k_scale"].view(L * H, B // gk, D).float().numpy()
    km = parts["k_min"].view(L * H, B // gk, D).float().numpy()
    vs = parts["v_scale"].view(L * H, B, D // gv).float().numpy()
    vm = parts["v_min"].view(L * H, B, D // gv).float().numpy()
    if outliers is None:
        o_idx = torch.zeros((L * H, 0), dtype=torch.uint8)
        o_val = torch.zeros((L * H, B, 0), dtype=torch.uint16)
    else:
        o_idx = outliers[0].reshape(L * H, -1)
        o_val = outliers[1].view(torch.uint16).reshape(L * H, B, -1)
    kernels["int4"](kq.numpy(), vq.numpy(), ks, km, vs, vm, o_idx.numpy(), o_val.numpy(),
                    out.view(torch.uint16).view(L * H, 2, B, D).numpy())
    return True
