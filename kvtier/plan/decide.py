"""The one place that decides whether a cache hit is loaded or recomputed.

Every load decision in kvtier goes through ``blocks_to_load``: the vLLM connector asks it how many
of a request's stored blocks to load. With a fitted cost model (``kvtier.plan.costmodel``) it loads the
prefix of the hit that minimizes predicted load + recompute time: all of it, its front, or none.
Without one (no prefill measured yet) it loads every hit at least ``min_blocks`` long.

The same model decides what is worth keeping (``worth_keeping``): a prefix is stored in DRAM only
when loading it from there will beat recomputing it, and demoted to NVMe (rather than dropped)
only when restoring it from NVMe will. Both answer "keep" until the model has a prefill fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.plan.costmodel import CostModel

__all__ = ["LoadCandidate", "blocks_to_load", "worth_keeping"]


@dataclass(frozen=True)
class LoadCandidate:
    """A request's hit beyond what vLLM already holds."""

    computed_blocks: int  # blocks vLLM has (its own prefix cache)
    hit_blocks: int  # stored blocks after those, in prefix order
    dram_blocks: int  # of the hit, how many sit in DRAM (the rest are on NVMe)
    block_tokens: int
    in_dram: tuple[bool, ...] = ()  # per hit block, in order (empty: the DRAM blocks come first)
    prompt_tokens: int = 0  # the whole prompt (0: unknown, the hit's end)


def blocks_to_load(candidate: LoadCandidate, model: "CostModel | None" = None, min_blocks: int = 1) -> int:
    """How many of ``candidate.hit_blocks`` to load (a prefix of them); the rest are recomputed."""
    if candidate.hit_blocks < min_blocks:
        return 0
    if model is None or model.prefill is None:
        return candidate.hit_blocks
    return model.split_for(candidate.computed_blocks, candidate.dram_blocks, candidate.hit_blocks,
                           candidate.prompt_tokens, candidate.in_dram).blocks


def worth_keeping(prefix_tokens: int, model: "CostModel | None", on_nvme: bool) -> bool:
    """Will a stored prefix of ``prefix_tokens`` tokens load faster (from NVMe when ``on_nvme``,
    else from DRAM) than it recomputes? Keep it when so, or when it is not known yet (no model,
    or a block whose prefix length was never recorded: ``prefix_tokens`` 0)."""
    if model is None or model.prefill is None or prefix_tokens <= 0:
        return True
    break_even = model.break_even_tokens(from_nvme=on_nvme)
    return break_even is not None and prefix_tokens >= break_even
