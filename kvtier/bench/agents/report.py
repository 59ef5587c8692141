"""From per-request records to the figures: percentiles per arm and regime, medians and ranges
over seeds, the summary ratios, and a picture of the TTFT distributions."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Iterable

import numpy as np

__all__ = ["AGENT_KEYS", "combine_seeds", "hinted_ratio", "plot_cdfs", "summarize", "summary_keys", "tables",
           "ttft_curves", "withheld_keys"]

AGENT_KEYS = ("r1_ttft_p50_vs_vllm", "r1_ttft_p99_vs_vllm", "r2_ttft_p50_vs_vllm", "r2_ttft_p99_vs_vllm",
              "r2_recomputed_vs_vllm", "r3_ttft_p50_vs_vllm", "r3_resumed_p50_vs_vllm", "r2_ttft_p50_vs_floor",
              "r3_ttft_p50_vs_floor", "itl_p50_vs_vllm_max", "itl_p99_vs_vllm_max",
              "first_turn_ttft_p50_vs_vllm_max", "errors", "outputs_equal", "hinted_resumed_p50_vs_unhinted")

EXTRA_KEYS = ("r2_reprefill_vs_vllm", "r3_wait_p50_vs_vllm")  # context beside the targets
# the summary keys that come from kvtier's arm (the others: a count over every arm, and the hints pass)
KVTIER_KEYS = tuple(k for k in AGENT_KEYS + EXTRA_KEYS if k not in ("errors", "hinted_resumed_p50_vs_unhinted"))

GROUPS = {"all": lambda r: True, "later": lambda r: r["turn"] >= 2, "first": lambda r: r["turn"] == 1,
          "resumed": lambda r: r["long_pause"]}


def _pct(values: Iterable[float], q: float) -> float | None:
    values = list(values)
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[dict], counters: dict[str, float], wall_s: float, nominal_s: float,
              rss_peak: int | None = None, disk_bytes: int | None = None) -> dict:
    """One arm, one regime, one seed: a flat dict of figures (seconds, tokens, bytes)."""
    ok = [r for r in records if not r["error"]]
    out: dict = {"requests": len(records), "errors": len(records) - len(ok)}
    for group, keep in GROUPS.items():
        ttft = [r["ttft_s"] for r in ok if keep(r)]
        out[f"ttft_{group}_n"] = len(ttft)
        for q in (50, 90, 99):
            out[f"ttft_{group}_p{q}"] = _pct(ttft, q)
    waits = [r["sent_s"] - r["ready_s"] + r["ttft_s"] for r in ok]  # what the agent waits: a slot, then the token
    for q in (50, 99):
        out[f"wait_p{q}"] = _pct(waits, q)
    gaps = [g for r in ok for g in r["itl_s"]]
    e2e = [r["e2e_s"] for r in ok]
    for q in (50, 99):
        out[f"itl_p{q}"] = _pct(gaps, q)
        out[f"e2e_p{q}"] = _pct(e2e, q)
        out[f"lag_p{q}"] = _pct([r["sent_s"] - r["ready_s"] for r in records], q)
    out["requests_per_s"] = len(ok) / wall_s if wall_s else None
    out["output_tokens_per_s"] = sum(r["chunks"] for r in ok) / wall_s if wall_s else None
    out["target_requests_per_s"] = len(records) / nominal_s if nominal_s else None
    prompt = sum(counters.values())
    out.update({k: v for k, v in counters.items()})
    out["engine_hit_rate"] = counters.get("engine_hit_tokens", 0) / prompt if prompt else None
    out["loaded_hit_rate"] = counters.get("loaded_tokens", 0) / prompt if prompt else None
    out["wall_s"], out["rss_peak_bytes"], out["disk_bytes"] = wall_s, rss_peak, disk_bytes
    return out


def combine_seeds(runs: list[dict]) -> dict:
    """Per figure: the median over seeds, and its range as ``<key>_min`` / ``<key>_max``."""
    out: dict = {}
    for key in runs[0]:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if not values:
            out[key] = None
            continue
        out[key] = statistics.median(values)
        if len(runs) > 1:
            out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    return out


def hinted_ratio(records: list[dict]) -> tuple[float | None, dict]:
    """Resumed-turn TTFT p50 of the sessions that sent retention hints over the others'."""
    hinted_sessions = {r["session"] for r in records if r["hinted"]}
    resumed = [r for r in records if r["long_pause"] and not r["error"]]
    hinted = [r["ttft_s"] for r in resumed if r["session"] in hinted_sessions]
    plain = [r["ttft_s"] for r in resumed if r["session"] not in hinted_sessions]
    a, b = _pct(hinted, 50), _pct(plain, 50)
    detail = {"hinted_resumed_p50_s": a, "unhinted_resumed_p50_s": b, "hinted_n": len(hinted), "unhinted_n": len(plain)}
    return (a / b if a is not None and b else None), detail


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratios(kv: dict, vl: dict, fl: dict, regimes: list[int]) -> dict:
    """The ratio keys of ``kv``'s regime figures over plain vLLM's (``vl``) and the floor's (``fl``)."""
    def fig(side: dict, regime: int, key: str) -> float | None:
        return (side.get(str(regime)) or {}).get(key)

    out: dict = {}
    keys = {"r1_ttft_p50_vs_vllm": (1, "ttft_all_p50", vl), "r1_ttft_p99_vs_vllm": (1, "ttft_all_p99", vl),
            "r2_ttft_p50_vs_vllm": (2, "ttft_later_p50", vl), "r2_ttft_p99_vs_vllm": (2, "ttft_later_p99", vl),
            "r2_recomputed_vs_vllm": (2, "recomputed_tokens", vl), "r2_ttft_p50_vs_floor": (2, "ttft_later_p50", fl),
            "r3_ttft_p50_vs_vllm": (3, "ttft_later_p50", vl), "r3_resumed_p50_vs_vllm": (3, "ttft_resumed_p50", vl),
            "r3_ttft_p50_vs_floor": (3, "ttft_later_p50", fl), "r3_wait_p50_vs_vllm": (3, "wait_p50", vl)}
    for name, (regime, key, other) in keys.items():
        if regime in regimes:
            out[name] = _ratio(fig(kv, regime, key), fig(other, regime, key))
    for name, key in (("itl_p50_vs_vllm_max", "itl_p50"), ("itl_p99_vs_vllm_max", "itl_p99"),
                      ("first_turn_ttft_p50_vs_vllm_max", "ttft_first_p50")):
        ratios = [r for r in (_ratio(fig(kv, g, key), fig(vl, g, key)) for g in regimes) if r is not None]
        out[name] = max(ratios) if ratios else None
    if 2 in regimes:  # what the floor recomputes, every arm must (new tokens): the rest is re-prefill
        floor, plain, mine = (fig(side, 2, "recomputed_tokens") for side in (fl, vl, kv))
        if None not in (floor, plain, mine):
            out["r2_reprefill_vs_vllm"] = _ratio(max(0.0, mine - floor), plain - floor)
    return out


def withheld_keys(results: dict) -> dict[str, str]:
    """The summary keys that would come from an arm that is no result, with the reason: kvtier's arm
    degraded (it loaded nothing where it should), its determinism pass not counting, the hints pass
    (kvtier on tight tiers) degraded. Those keys are None, never a figure."""
    out: dict[str, str] = {}
    kv = (results.get("arms") or {}).get("kvtier") or {}
    if kv.get("degraded"):
        out.update(dict.fromkeys(KVTIER_KEYS, f"kvtier's arm is degraded ({kv['degraded']})"))
    invalid = ((results.get("determinism") or {}).get("invalid") or {}).get("kvtier")
    if invalid:
        out.setdefault("outputs_equal", f"kvtier's determinism figure does not count: {invalid}")
    hints = (results.get("hints") or {}).get("degraded")
    if hints:
        out["hinted_resumed_p50_vs_unhinted"] = f"the hints pass is degraded ({hints})"
    return out


def summary_keys(results: dict, regimes: list[int]) -> dict:
    """The top-level ratios: kvtier's arm over plain vLLM's (or the floor's), per regime medians;
    and under ``bounds``, the floor's own ratios over plain vLLM's: the best any tier could do.
    A key that would come from an arm that is no result is None, its reason under ``withheld``."""
    arms = results.get("arms", {})
    kv, vl, fl = (arms.get(name, {}).get("regimes", {}) for name in ("kvtier", "vllm", "floor"))
    out: dict = {k: None for k in AGENT_KEYS + EXTRA_KEYS}
    out.update(_ratios(kv, vl, fl, regimes))
    out["errors"] = sum(int(((side.get(str(r)) or {}).get("errors") or 0)) for side in (kv, vl, fl) for r in regimes) \
        + len(results.get("failed") or {})  # a pass that failed whole counts once
    out["outputs_equal"] = results.get("determinism", {}).get("outputs_equal")
    out["hinted_resumed_p50_vs_unhinted"] = results.get("hints", {}).get("ratio")
    if fl:
        out["bounds"] = {k: v for k, v in _ratios(fl, vl, fl, regimes).items() if k.endswith(("_vllm", "_max"))}
    out["withheld"] = withheld = withheld_keys(results)
    out.update(dict.fromkeys(withheld))
    return out


# ---- the picture --------------------------------------------------------------------------------
COLOURS = {"vllm": (214, 39, 40), "floor": (44, 160, 44), "kvtier": (31, 119, 180), "native": (255, 127, 14),
           "lmcache": (148, 103, 189)}


def plot_cdfs(curves: dict[int, dict[str, list[float]]], path: Path, title: str) -> Path:
    """TTFT CDFs, one panel per regime, one line per arm (log time axis), as a PNG."""
    from PIL import Image, ImageDraw

    regimes = sorted(curves)
    panel_w, panel_h, margin = 420, 320, 60
    image = Image.new("RGB", (panel_w * len(regimes) + margin, panel_h + 2 * margin), "white")
    draw = ImageDraw.Draw(image)
    draw.text((margin, 12), title, fill="black")
    values = [v for per in curves.values() for ts in per.values() for v in ts if v > 0]
    lo, hi = (np.log10(min(values)), np.log10(max(values))) if values else (-3.0, 0.0)
    lo, hi = np.floor(lo), np.ceil(hi) if np.ceil(hi) > np.floor(lo) else np.floor(lo) + 1
    for i, regime in enumerate(regimes):
        x0, y0 = margin + i * panel_w, margin
        w, h = panel_w - 40, panel_h - 40
        draw.rectangle([x0, y0, x0 + w, y0 + h], outline="black")
        draw.text((x0 + 4, y0 - 16), f"regime {regime}", fill="black")
        for decade in range(int(lo), int(hi) + 1):
            x = x0 + (decade - lo) / (hi - lo) * w
            draw.line([x, y0, x, y0 + h], fill=(220, 220, 220))
            draw.text((x - 14, y0 + h + 4), _seconds_label(10.0 ** decade), fill="black")
        for frac in (0.5, 0.9, 0.99):
            y = y0 + h - frac * h
            draw.line([x0, y, x0 + w, y], fill=(235, 235, 235))
            draw.text((x0 - 34, y - 6), f"p{int(frac * 100)}", fill="black")
        for n, (arm, ttfts) in enumerate(sorted(curves[regime].items())):
            colour = COLOURS.get(arm, (0, 0, 0))
            ordered = np.sort([t for t in ttfts if t > 0])
            points = [(x0 + (np.log10(t) - lo) / (hi - lo) * w, y0 + h - (k + 1) / len(ordered) * h)
                      for k, t in enumerate(ordered)]
            if len(points) > 1:
                draw.line(points, fill=colour, width=2)
            draw.text((x0 + 8, y0 + 6 + 14 * n), arm, fill=colour)
        draw.text((x0 + w // 2 - 60, y0 + h + 20), "time to first token", fill="black")
    image.save(path)
    return path


def _seconds_label(seconds: float) -> str:
    return f"{seconds * 1e3:g} ms" if seconds < 1 else f"{seconds:g} s"


def ttft_curves(records_path: Path) -> dict:
    """TTFTs per regime and arm (every seed) from the per-request records, for the picture."""
    import json

    curves: dict = {}
    with open(records_path) as f:
        for line in f:
            r = json.loads(line)
            if not r["error"] and str(r["regime"]).isdigit():
                curves.setdefault(int(r["regime"]), {}).setdefault(r["arm"], []).append(r["ttft_s"])
    return curves


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _num(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


TARGETS = {"r1_ttft_p50_vs_vllm": 1.05, "r1_ttft_p99_vs_vllm": 1.05, "r2_ttft_p50_vs_vllm": 0.10,
           "r2_ttft_p99_vs_vllm": 0.25, "r2_recomputed_vs_vllm": 0.10, "r3_ttft_p50_vs_vllm": 0.25,
           "r3_resumed_p50_vs_vllm": 0.25, "r2_ttft_p50_vs_floor": 1.25, "r3_ttft_p50_vs_floor": 1.5,
           "itl_p50_vs_vllm_max": 1.03, "itl_p99_vs_vllm_max": 1.03, "first_turn_ttft_p50_vs_vllm_max": 1.03,
           "errors": 0, "hinted_resumed_p50_vs_unhinted": 0.5}


def verdict(key: str, value) -> str:
    if value is None:
        return "not measured"
    if key == "outputs_equal":
        return "met" if value == 1 else "MISSED (target 1.0)"
    target = TARGETS.get(key)
    if target is None:
        return ""
    return "met" if value <= target else f"MISSED (target <= {target})"


FIGURES = (  # (row label, figure keys, unit): the per-regime table, a column per arm
    ("TTFT p50 / p90 / p99", ("ttft_all_p50", "ttft_all_p90", "ttft_all_p99"), "ms"),
    ("  turns >= 2: p50 / p99", ("ttft_later_p50", "ttft_later_p99"), "ms"),
    ("  first turns: p50 / p99", ("ttft_first_p50", "ttft_first_p99"), "ms"),
    ("  resumed after a long pause: p50 / p99", ("ttft_resumed_p50", "ttft_resumed_p99"), "ms"),
    ("ITL p50 / p99", ("itl_p50", "itl_p99"), "ms"),
    ("end to end p50 / p99", ("e2e_p50", "e2e_p99"), "ms"),
    ("send lag p50 / p99 (C full)", ("lag_p50", "lag_p99"), "ms"),
    ("ready to first token p50 / p99", ("wait_p50", "wait_p99"), "ms"),
    ("requests/s (trace asks)", ("requests_per_s", "target_requests_per_s"), "rate"),
    ("output tokens/s", ("output_tokens_per_s",), "rate"),
    ("prompt tokens: engine hit / loaded", ("engine_hit_rate", "loaded_hit_rate"), "rate"),
    ("recomputed prefill tokens", ("recomputed_tokens",), "count"),
    ("errors / requests", ("errors", "requests"), "count"),
    ("server RSS peak MiB", ("rss_peak_bytes",), "mib"),
    ("kvtier disk MiB", ("disk_bytes",), "mib"),
    ("unsettled blocks: DRAM-only a minute after the pass (worst seed)", ("unsettled_blocks",), "worst"),
)


def _cell(figures: dict, keys: tuple, unit: str) -> str:
    def one(key: str) -> str:
        value = figures.get(f"{key}_max", figures.get(key)) if unit == "worst" else figures.get(key)
        if value is None:
            return "-"
        text = {"ms": lambda v: f"{v * 1e3:.0f}", "rate": lambda v: f"{v:.2f}", "count": lambda v: f"{v:.0f}",
                "worst": lambda v: f"{v:.0f}", "mib": lambda v: f"{v / 2**20:.0f}"}[unit](value)
        low, high = figures.get(f"{key}_min"), figures.get(f"{key}_max")
        if unit == "ms" and low is not None and high is not None and high > low:
            text += f" ({low * 1e3:.0f}-{high * 1e3:.0f})"
        return text

    return " / ".join(one(key) for key in keys)


def tables(results: dict) -> list[tuple[str, list[str], list[tuple]]]:
    """What the command prints: the sizes, one table per regime (a column per arm; medians over
    seeds, their range in brackets), the skipped arms, the summary against the targets."""
    out = [("kvtier bench agents: sizes (this box's defaults unless overridden)", ["setting", "value"],
            list(results["sizes"].items()))]
    labels = sorted({label for arm in results["arms"].values() for label in arm["regimes"]})
    for label in labels:
        names = sorted((name for name, arm in results["arms"].items() if arm["regimes"].get(label)),
                       key=lambda name: list(COLOURS).index(name) if name in COLOURS else 99)
        columns = ["figure"] + [name + (" (DEGRADED)" if results["arms"][name].get("degraded") else "")
                                for name in names]
        rows = [(title, *[_cell(results["arms"][name]["regimes"][label], keys, unit) for name in names])
                for title, keys, unit in FIGURES]
        out.append((f"regime {label}", columns, rows))
    if results.get("hints"):
        out.append(("retention hints (kvtier on tight tiers)", ["figure", "value"],
                    [(k, _num(v) if isinstance(v, float) else v) for k, v in results["hints"].items()]))
    if results.get("failed"):
        out.append(("passes that failed (their figures are missing)", ["pass", "error"],
                    list(results["failed"].items())))
    if results["skipped"]:
        out.append(("arms skipped", ["arm", "reason"], list(results["skipped"].items())))
    bounds, withheld = results.get("bounds") or {}, results.get("withheld") or {}
    out.append(("summary: kvtier over plain vLLM (or the floor); the floor's own ratio is the best any tier "
                "could do", ["key", "kvtier", "floor", "target"],
                [(k, _num(results.get(k)), _num(bounds.get(k)),
                  f"NOT A RESULT: {withheld[k]}" if k in withheld else verdict(k, results.get(k)))
                 for k in AGENT_KEYS + EXTRA_KEYS]))
    return out
