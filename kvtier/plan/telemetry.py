"""The scheduler half's telemetry: the counters the admin plane and ``kvtier top`` read, and the
lasting warnings ``kvtier status`` shows. Every part of the tier manager counts and warns here."""
from __future__ import annotations

from collections import Counter

__all__ = ["Telemetry"]


class Telemetry:
    """Owns ``counters`` (a ``Counter``) and ``warnings`` (name -> message, until cleared)."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.warnings: dict[str, str] = {}

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to one counter."""
        self.counters[name] += n

    def warn(self, name: str, message: str | None) -> None:
        """Set (or, with None or an empty message, clear) a lasting warning."""
        if message:
            self.warnings[name] = message
        else:
            self.warnings.pop(name, None)

    def warning(self, name: str) -> str | None:
        """The warning set under ``name``, if any."""
        return self.warnings.get(name)
