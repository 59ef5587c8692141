"""Tier health: one back-off for every tier that can fail (a disk, the shared store).

A failure opens a back-off (doubling from ``minimum`` to ``maximum`` seconds); until it is over the
tier counts as failing and callers skip it at once instead of queueing behind it; a success after
the back-off ends it. The clock is injected (``time.monotonic`` by default) so that a test moves
time forward instead of sleeping through a back-off.
"""
from __future__ import annotations

import time
from typing import Callable

__all__ = ["Backoff", "Clock"]

Clock = Callable[[], float]


class Backoff:
    """Retry/back-off state of one tier: when it last failed, and until when it is left alone."""

    def __init__(self, minimum: float = 1.0, maximum: float = 30.0, clock: Clock = time.monotonic):
        if not 0 < minimum <= maximum:
            raise ValueError(f"back-off needs 0 < minimum <= maximum, got {minimum}, {maximum}")
        self.minimum, self.maximum, self.clock = float(minimum), float(maximum), clock
        self.delay = 0.0  # the current back-off (0: healthy)
        self.retry_at = 0.0  # clock time before which the tier is not tried again
        self.failed_at = float("-inf")  # clock time of the last failure
        self.failing = False  # the last attempt failed (cleared by the next success)

    def failed(self) -> float:
        """Note a failure: the back-off doubles (``minimum`` at first, ``maximum`` at most); returns it."""
        now = self.clock()
        self.delay = min(self.maximum, max(self.minimum, 2 * self.delay))
        self.retry_at = now + self.delay
        self.failed_at, self.failing = now, True
        return self.delay

    def succeeded(self) -> None:
        """Note a success: the tier is healthy again and the next failure starts from ``minimum``."""
        self.delay, self.failing = 0.0, False

    @property
    def waiting(self) -> bool:
        """Inside the back-off: the tier is not to be tried now."""
        return self.clock() < self.retry_at

    def failed_within(self, seconds: float) -> bool:
        """Whether the last failure was less than ``seconds`` ago."""
        return self.clock() - self.failed_at < seconds

    def retry_now(self) -> None:
        """End the current back-off at once (the operator fixed the tier; the next call tries it)."""
        self.retry_at = self.clock()
