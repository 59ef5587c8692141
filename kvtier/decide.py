"""The one place that decides whether a cache hit is loaded or recomputed.

Every load decision in kvtier goes through ``blocks_to_load``: the vLLM connector asks it how many
of a request's stored blocks to load. Today it loads every hit that is at least
``min_blocks`` long; the measured cost model (issue 7) plugs in here and may choose to load only
the front of a hit and recompute the rest, or nothing at all.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadCandidate", "blocks_to_load"]


@dataclass(frozen=True)
class LoadCandidate:
    """A request's hit beyond what vLLM already holds."""

    computed_blocks: int  # blocks vLLM has (its own prefix cache)
    hit_blocks: int  # stored blocks after those, in prefix order
    dram_blocks: int  # of the hit, how many sit in DRAM (the rest are on NVMe)
    block_tokens: int


def blocks_to_load(candidate: LoadCandidate, min_blocks: int = 1) -> int:
    """How many of ``candidate.hit_blocks`` to load (a prefix of them); the rest are recomputed."""
    if candidate.hit_blocks < min_blocks:
        return 0
    return candidate.hit_blocks
