"""Which model-needle figures kvtier may ship (``kvtier/data/model_needle.json``, what
``kvtier.codecs.recall`` reads for the recall warnings of ``kvtier status`` and ``kvtier doctor``).

A run replaces the shipped figures only when it is at least as strong evidence (``run_problems``):

* a full run: not ``--quick``, at least ``FULL_TRIALS`` trials per length (8 haystacks of 5 needles)
  at every length of ``FULL_LENGTHS``; a quick run, a run with fewer haystacks or one that stops short
  of 128k (a trained-model run, a box that cannot hold 128k) never does;
* every codec's blocks were loaded (``loaded_problems``): each entry but ``direct`` (the model on its
  own KV, no tier in the way) carries ``_loaded_blocks >= _expected_blocks > 0``, so a codec whose
  loads silently did not happen (its figures would be the full-precision model's) is never shipped.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvtier.codecs.recall import SHIPPED, length_label

__all__ = ["FULL_LENGTHS", "FULL_TRIALS", "loaded_problems", "run_problems", "ship_figures"]

FULL_LENGTHS = (4096, 16384, 65536, 131072)  # a full run measures at least these (the shipped run's lengths)
FULL_TRIALS = 40  # trials per length of a full run at least (8 haystacks x 5 depths)
UNLOADED = ("direct",)  # entries measured without the tier: no blocks loaded, none expected


def loaded_problems(doc: Any) -> list[str]:
    """Why ``doc``'s figures cannot say what each codec does (empty: they can): a codec entry without
    ``_loaded_blocks >= _expected_blocks > 0`` was not measured through its decoder."""
    per_codec = doc.get("per_codec") if isinstance(doc, dict) else None
    if not isinstance(per_codec, dict) or "none" not in per_codec:
        return ["no per_codec figures with the uncompressed baseline (none)"]
    out = []
    for spec, entry in per_codec.items():
        if spec in UNLOADED:
            continue
        entry = entry if isinstance(entry, dict) else {}
        loaded, expected = entry.get("_loaded_blocks"), entry.get("_expected_blocks")
        if not (isinstance(loaded, int) and isinstance(expected, int) and loaded >= expected > 0):
            out.append(f"{spec}: {loaded} of {expected} blocks loaded through its decoder")
    return out


def run_problems(doc: Any) -> list[str]:
    """Why a run's figures may not be shipped (empty: they may; see the module docstring): a quick
    run, too few trials or lengths, or a codec's loads missing."""
    if not isinstance(doc, dict):
        return ["not a figures object"]
    out = []
    if doc.get("_quick") is True:
        out.append("a --quick run")
    trials, lengths = doc.get("_trials_per_length"), doc.get("_lengths")
    if not (isinstance(trials, int) and trials >= FULL_TRIALS):
        out.append(f"{trials} trials per length, fewer than a full run's {FULL_TRIALS}")
    missing = [n for n in FULL_LENGTHS if not (isinstance(lengths, list) and n in lengths)]
    if missing:
        out.append(f"not measured at {', '.join(length_label(n) for n in missing)} (a full run measures "
                   f"{', '.join(length_label(n) for n in FULL_LENGTHS)})")
    return out + loaded_problems(doc)


def ship_figures(result: dict[str, Any], quick: bool,
                 path: str | os.PathLike[str] | None = None) -> tuple[Path | None, list[str]]:
    """Mark a run's figures (``_quick``) and, when they may be shipped (``run_problems``), write them
    where kvtier reads them (``SHIPPED``, or ``path``), atomically: (where written or None; why not)."""
    result["_quick"] = bool(quick)
    problems = run_problems(result)
    if problems:
        return None, problems
    target = Path(path) if path else SHIPPED
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)
    return target, []
