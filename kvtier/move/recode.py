"""Small helpers every handler shares: re-encoding a payload to another codec, and reporting what
was written for a move (the manager may run in another process)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.codecs import get_codec, transcode
from kvtier.jobs import BlockMove, JobResult

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.layout import KVGeometry

__all__ = ["transcoded", "note"]


def transcoded(move: BlockMove, payload: "torch.Tensor", geometry: "KVGeometry") -> "torch.Tensor":
    """``payload`` re-encoded from ``move.codec`` to ``move.to_codec`` (updates the move)."""
    import torch

    out = torch.empty(get_codec(move.to_codec).max_bytes(geometry), dtype=torch.uint8)
    n = transcode(payload, move.codec, move.to_codec, geometry, out, first=move.first or None)
    move.codec, move.nbytes = move.to_codec, n
    return out[:n]


def note(result: JobResult, index: int, move: BlockMove) -> None:
    """Report what was written for one move (the manager may run in another process)."""
    result.encoded[index] = (move.nbytes, move.codec)
