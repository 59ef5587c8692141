"""Where a lossy codec's recall falls, from a model's own needle figures (mission trap 2).

``kvtier bench quality`` measures, through vLLM, how often a model that really retrieves (the
constructed ``kvtier.models.constructed``, to 128k tokens, or the locally trained
``kvtier.models.retrieval``) gets a needle back when its KV came through each
codec, at each context length. This module reads those figures and says, for a configured codec
and the longest context a server accepts, whether they show recall falling within that context:
``kvtier status`` (through the connector's warnings) and ``kvtier doctor`` warn then.

Figures come from the last full ``kvtier bench quality`` run on this box
(``<cache>/quality/model-needle.json``), else from the figures shipped with kvtier
(``kvtier/data/model_needle.json``, the run reported in docs/benchmarks.md). A run on this box
replaces the shipped figures only when it is at least as strong evidence (``run_problems``):

* a full run: not ``--quick``, at least ``FULL_TRIALS`` trials per length (the shipped run's 8
  haystacks of 5 needles) at every length of ``FULL_LENGTHS`` (the shipped run's); a quick run, a
  run with fewer haystacks or one that stops short of 128k (a trained-model run, a box that cannot
  hold 128k) never replaces them. The bench marks such a run ``_full_run: true``, ``_quick: false``;
* every codec's blocks were loaded (``loaded_problems``): each entry but ``direct`` (the model on its
  own KV, no tier in the way) carries ``_loaded_blocks >= _expected_blocks > 0``, so a codec whose
  loads silently did not happen (its figures would be the full-precision model's) is never read.

``load_figures`` checks both of a saved file (and the second of the shipped one, which records its
loads too) and falls back to the shipped figures when they do not hold. A codec "falls" at the
first measured length where its accuracy is more than ``TOLERANCE`` below the uncompressed
baseline's at that length, among the lengths the model handles (baseline at least ``HANDLED``:
past them the model fails on its own and the figures say nothing about the codec).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvtier.codecs import is_lossless, parse_spec
from kvtier.config import default_cache_dir

__all__ = ["FULL_LENGTHS", "FULL_TRIALS", "TOLERANCE", "falls_at", "figures_path", "label_tokens", "length_label",
           "keep_figures", "load_figures", "loaded_problems", "recall_warning", "run_problems", "save_figures"]

TOLERANCE = 0.01  # one point of accuracy
HANDLED = 0.95  # lengths where the uncompressed baseline is below this are past the model's own reach
SHIPPED = Path(__file__).parents[1] / "data" / "model_needle.json"
KEY_PREFIXES = ("constructed_needle_acc_", "model_needle_acc_")  # the constructed model's, the trained one's
FULL_LENGTHS = (4096, 16384, 65536, 131072)  # a full run measures at least these (the shipped run's lengths)
FULL_TRIALS = 40  # trials per length of a full run at least (the shipped run's: 8 haystacks x 5 depths)
UNLOADED = ("direct",)  # entries measured without the tier: no blocks loaded, none expected


def figures_path() -> Path:
    return Path(default_cache_dir()) / "quality" / "model-needle.json"


def length_label(tokens: int) -> str:
    """4096 -> "4k", 384 -> "384": how benchmark keys name a context length."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def label_tokens(label: str) -> int:
    """"4k" -> 4096, "384" -> 384 (the length labels of the needle keys); ValueError otherwise."""
    label = label.strip().lower()
    return int(label[:-1]) * 1024 if label.endswith("k") else int(label)


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
    """Why a run's figures may not replace the shipped ones (empty: they may; see the module
    docstring): not marked a full run, too few trials or lengths, or a codec's loads missing."""
    if not isinstance(doc, dict):
        return ["not a figures object"]
    out = []
    if doc.get("_full_run") is not True or doc.get("_quick") is not False:
        out.append("not a full run (a --quick run, or one from before runs were checked)")
    trials, lengths = doc.get("_trials_per_length"), doc.get("_lengths")
    if not (isinstance(trials, int) and trials >= FULL_TRIALS):
        out.append(f"{trials} trials per length, fewer than a full run's {FULL_TRIALS}")
    missing = [n for n in FULL_LENGTHS if not (isinstance(lengths, list) and n in lengths)]
    if missing:
        out.append(f"not measured at {', '.join(length_label(n) for n in missing)} (a full run measures "
                   f"{', '.join(length_label(n) for n in FULL_LENGTHS)})")
    return out + loaded_problems(doc)


def load_figures(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """{"per_codec": {spec: {"model_needle_acc_<len>": acc}}, "source": ...} or None when no readable
    figures exist. A damaged file, or a saved run that is not full or whose codecs' loads are not
    recorded (``run_problems``), is ignored (the shipped figures are used, and say why in
    ``ignored``), never fatal."""
    ignored: dict[str, list[str]] = {}
    for candidate in ([Path(path)] if path else [figures_path(), SHIPPED]):
        try:
            doc = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        problems = loaded_problems(doc) if candidate == SHIPPED else run_problems(doc)
        if problems:
            ignored[str(candidate)] = problems
            continue
        doc.setdefault("source", str(candidate))
        if ignored:
            doc["ignored"] = ignored
        return doc
    return None


def save_figures(result: dict[str, Any], path: str | os.PathLike[str] | None = None) -> Path:
    """Keep a benchmark run's model-needle figures for ``recall_warning`` (atomically)."""
    target = Path(path) if path else figures_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)
    return target


def keep_figures(result: dict[str, Any], quick: bool,
                 path: str | os.PathLike[str] | None = None) -> tuple[Path | None, list[str]]:
    """Mark a benchmark run's figures (``_quick``, ``_full_run``) and keep them for ``recall_warning``
    when they may replace the shipped ones (``run_problems``): (where kept, None when not; why not).
    A quick or smaller run is never kept: figures already there stay."""
    result.update(_quick=bool(quick), _full_run=not quick)
    problems = run_problems(result)
    if problems:
        result["_full_run"] = False
        return None, problems
    return save_figures(result, path), []


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
