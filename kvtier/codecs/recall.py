"""Where a lossy codec's recall falls, from a model's own needle figures (mission trap 2).

The test rig (``python -m benchmarks quality``) measures, through vLLM, how often a model that really
retrieves (a constructed one, to 128k tokens) gets a needle back when its KV came through each codec,
at each context length. Its full, checked run is shipped with kvtier as data
(``kvtier/data/model_needle.json``, the run reported in docs/benchmarks.md). This module reads those
figures and says, for a configured codec and the longest context a server accepts, whether they show
recall falling within that context: ``kvtier status`` (through the connector's warnings) and
``kvtier doctor`` warn then.

A codec "falls" at the first measured length where its accuracy is more than ``TOLERANCE`` below the
uncompressed baseline's at that length, among the lengths the model handles (baseline at least
``HANDLED``: past them the model fails on its own and the figures say nothing about the codec).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvtier.codecs import is_lossless, parse_spec

__all__ = ["SHIPPED", "TOLERANCE", "falls_at", "label_tokens", "length_label", "load_figures", "recall_warning"]

TOLERANCE = 0.01  # one point of accuracy
HANDLED = 0.95  # lengths where the uncompressed baseline is below this are past the model's own reach
SHIPPED = Path(__file__).parents[1] / "data" / "model_needle.json"
KEY_PREFIXES = ("constructed_needle_acc_", "model_needle_acc_")  # the constructed model's, the trained one's


def length_label(tokens: int) -> str:
    """4096 -> "4k", 384 -> "384": how benchmark keys name a context length."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def label_tokens(label: str) -> int:
    """"4k" -> 4096, "384" -> 384 (the length labels of the needle keys); ValueError otherwise."""
    label = label.strip().lower()
    return int(label[:-1]) * 1024 if label.endswith("k") else int(label)


def load_figures(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """{"per_codec": {spec: {"<prefix><len>": acc}}, "source": ...}: the shipped figures (or those at
    ``path``); None when they cannot be read, which is never fatal (no warning is given then)."""
    candidate = Path(path) if path else SHIPPED
    try:
        doc = json.loads(candidate.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("per_codec"), dict) or "none" not in doc["per_codec"]:
        return None
    doc.setdefault("source", str(candidate))
    return doc


def _curve(entry: Any) -> dict[int, float]:
    """{length: accuracy} of one codec's entry; what does not parse is skipped (a hand-edited or
    damaged figures file must never stop an engine from starting)."""
    out: dict[int, float] = {}
    for key, value in (entry.items() if isinstance(entry, dict) else ()):
        prefix = next((p for p in KEY_PREFIXES if str(key).startswith(p)), None)
        if prefix is not None and isinstance(value, (int, float)):
            try:
                out[label_tokens(str(key)[len(prefix):])] = float(value)
            except ValueError:
                continue
    return out


def falls_at(spec: str, figures: dict[str, Any]) -> int | None:
    """The first measured context length (tokens) where ``spec``'s needle accuracy is more than
    ``TOLERANCE`` below the baseline's where the baseline holds (``HANDLED``); None when it never
    is, or when it was not measured."""
    per_codec = figures["per_codec"]
    entry = per_codec.get(spec) or per_codec.get(spec.partition("+")[0])  # +zstd is lossless on top
    if entry is None:
        return None
    base, own = _curve(per_codec["none"]), _curve(entry)
    for length in sorted(own):
        if length in base and base[length] >= HANDLED and own[length] < base[length] - TOLERANCE:
            return length
    return None


def recall_warning(spec: str, max_context: int | None, tier: str = "cold",
                   figures: dict[str, Any] | None = None) -> str | None:
    """A sentence when ``spec`` is lossy and the needle figures show its recall falling at a length
    this server accepts (``max_context`` tokens); None otherwise."""
    canonical = parse_spec(spec)
    if is_lossless(canonical) or not max_context:
        return None
    figures = figures if figures is not None else load_figures()
    if figures is None:
        return None
    length = falls_at(canonical, figures)
    if length is None or length > max_context:
        return None
    curve = _curve(figures["per_codec"].get(canonical) or figures["per_codec"][canonical.partition("+")[0]])
    base = _curve(figures["per_codec"]["none"])
    return (f"{tier} codec {canonical}: the needle figures show recall falling from {length:,} tokens "
            f"({curve[length]:.2f} exact-match vs {base[length]:.2f} uncompressed), and this server accepts "
            f"{max_context:,}-token contexts; use int4-lc or fp8 for long contexts "
            f"(figures: {figures.get('source')})")
