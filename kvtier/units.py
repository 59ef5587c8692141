"""How kvtier writes sizes and durations for people: binary units (1 GiB = 2^30 bytes), one decimal;
durations as 90s, 30m, 2h, 1d. Stdlib only."""
from __future__ import annotations

import math
import re

from kvtier.errors import UsageError

__all__ = ["DURATION_HINT", "human_bytes", "human_duration", "parse_duration"]

DURATION_HINT = "a duration like 90s, 30m, 2h, 1d or 1h30m (a bare number is seconds)"
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``1.5 KiB``; None -> ``N/A`` (not known)."""
    if n is None:
        return "N/A"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def parse_duration(text: str, what: str = "duration") -> float:
    """``"90s"`` -> 90.0, ``"30m"``, ``"2h"``, ``"1d"``, ``"1h30m"``, ``"45"`` (seconds): more than zero
    seconds, or a ``UsageError`` naming ``what`` with a hint."""
    value = str(text).strip().lower().replace(" ", "")
    try:
        seconds = float(value) if value and value[-1].isdigit() else None
    except ValueError:
        seconds = None
    if seconds is None and value and _DURATION_PART.sub("", value) == "":
        seconds = sum(float(number) * _UNIT_S[unit] for number, unit in _DURATION_PART.findall(value))
    if seconds is None or not math.isfinite(seconds):
        raise UsageError(f"invalid {what} {text!r}", hint=DURATION_HINT)
    if seconds <= 0:
        raise UsageError(f"invalid {what} {text!r}: must be more than 0 seconds", hint=DURATION_HINT)
    return seconds


def human_duration(seconds: float | None) -> str:
    """``1830`` -> ``30m30s``, ``7260`` -> ``2h01m``, ``90000`` -> ``1d01h``; None -> ``-``."""
    if seconds is None:
        return "-"
    s = max(0, int(math.ceil(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s % 60 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m" if s % 3600 // 60 else f"{s // 3600}h"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h" if s % 86400 // 3600 else f"{s // 86400}d"
