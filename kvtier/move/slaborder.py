"""How vLLM's CPU attention kernel orders one (block, head)'s K or V, and the copies that undo it.

vLLM's CPU backend allocates each layer's KV as ``[num_blocks, H, B, 2*D]``, read as ``[2B, D]`` per
(block, head): B rows of K, then B rows of V. But its ``cpu_attn_reshape_and_cache`` does not write
token t, channel d at row t, column d: each ISA packs the slab for its own kernel (vLLM 0.32,
measured with the op itself on index-valued tensors, ``probe_map``):

* ``amx`` (bf16, block sizes a multiple of 32, AMX CPUs): K in tiles of 16 tokens x 2 channels
  (``[B/16, D/2, 16, 2]``); V as pairs of tokens (``[D/16, B/2, 16, 2]``);
* ``vec`` / ``vec16`` (AVX-512, AVX2 and others): K transposed, ``[D, B]``; V as it is.

Every order seen is the slab viewed as ``(B/t0, t0, D/d0, d0)`` with its four axes permuted: a
``SlabOrder``. Copying through the permuted view turns the kernel's order into kvtier's canonical
``[B, D]`` and back, so a codec's "per channel" is a channel and a block written on an AMX box loads
on an AVX2 box. A copy with an inner run of d0 contiguous values moves them as one wider integer.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SlabOrder", "probe_map"]


@dataclass(frozen=True)
class SlabOrder:
    """The stored slab is ``logical.view(shape).permute(perm)``, contiguous; logical is ``[B, D]``."""

    shape: tuple[int, int, int, int]  # (B / t0, t0, D / d0, d0)
    perm: tuple[int, int, int, int]

    @property
    def identity(self) -> bool:
        return self.perm == (0, 1, 2, 3)

    @classmethod
    def find(cls, stored_map: "torch.Tensor", tokens: int, dim: int) -> "SlabOrder | None":
        """The order whose stored position p holds logical element ``stored_map[p]`` (= t * D + d);
        None when no (B/t0, t0, D/d0, d0) permutation gives it."""
        import torch

        logical = torch.arange(tokens * dim)
        for t0 in (x for x in range(1, tokens + 1) if tokens % x == 0):
            for d0 in (x for x in range(1, dim + 1) if dim % x == 0):
                shape = (tokens // t0, t0, dim // d0, d0)
                grid = logical.view(shape)
                for perm in itertools.permutations(range(4)):
                    if torch.equal(grid.permute(perm).reshape(-1), stored_map):
                        return cls(shape, perm)  # type: ignore[arg-type]
        return None

    def views(self, stored: "torch.Tensor", logical: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor]":
        """Two views with one shape and the same element at each index: of ``stored`` (``[..., B*D]``
        in this order) and of ``logical`` (``[..., B, D]``). ``a.copy_(b)`` between them converts."""
        import torch

        shape, perm = list(self.shape), list(self.perm)
        wide = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(shape[3] * stored.element_size())
        if perm[3] == 3 and shape[3] > 1 and wide is not None:  # d0 values stay together: move them as one
            stored, logical = stored.view(wide), logical.view(wide)
            shape, perm = shape[:3], perm[:3]
        lead = stored.dim() - 1
        inverse = [perm.index(i) for i in range(len(perm))]
        stored_view = stored.unflatten(-1, [shape[i] for i in perm]).permute(
            *range(lead), *(lead + i for i in inverse))
        if len(shape) == 4:
            logical = logical.unflatten(-1, shape[2:])
        return stored_view, logical.unflatten(-2 if len(shape) == 3 else -3, shape[:2])  # views, never copies


def probe_map(write, tokens: int, dim: int, cache_dtype, read_dtype, src_dtype=None
              ) -> "tuple[torch.Tensor, torch.Tensor]":
    """(K map, V map): the logical index ``t * D + d`` each stored position of a (block, head) slab
    holds, found by calling ``write(key, value, key_cache, value_cache, slot_mapping)`` (vLLM's
    reshape-and-cache for one ISA) on tensors of ``src_dtype`` (the model's dtype, which the kernel
    dispatches on; default ``read_dtype``) whose values are base-4 digits of t or d: 0..3 are exact
    in every KV dtype, fp8 included, so one call per digit reads the order back. The cache is
    allocated as ``cache_dtype`` (vLLM's fp8 caches are uint8) and read back as ``read_dtype``."""
    import torch

    cache = torch.zeros(1, 1, tokens, 2 * dim, dtype=cache_dtype)
    key_cache, value_cache = cache.view(1, 1, 2 * tokens, dim).chunk(2, dim=2)
    found = [torch.zeros(tokens * dim, dtype=torch.long) for _ in range(2)]
    for size, place in ((tokens, dim), (dim, 1)):  # t, weighted D; then d, weighted 1
        weight = 1
        while weight < size:
            digits = (torch.arange(size) // weight % 4).to(src_dtype or read_dtype)
            src = (digits.view(size, 1) if place > 1 else digits.view(1, size)).expand(tokens, dim)
            src = src.reshape(tokens, 1, dim).contiguous()
            cache.zero_()
            write(src, src.clone(), key_cache, value_cache, torch.arange(tokens))
            for n, part in enumerate((key_cache, value_cache)):
                found[n] += part[0, 0].reshape(-1).view(read_dtype).float().round().long() * weight * place
            weight *= 4
    return found[0], found[1]
