"""How kvtier writes sizes for people: binary units (1 GiB = 2^30 bytes), one decimal. Stdlib only."""
from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``1.5 KiB``; None -> ``N/A`` (not known)."""
    if n is None:
        return "N/A"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
