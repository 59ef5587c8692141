"""A clock a test moves by hand: inject it where code takes ``clock=`` instead of sleeping."""
from __future__ import annotations


class FakeClock:
    def __init__(self, start: float = 1000.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += float(seconds)
