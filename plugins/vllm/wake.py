"""Keeping an idle vLLM engine stepping: kvtier's jobs travel with engine steps, so while admin jobs
are in flight something must make steps happen. Owns the one wake thread (at most one at a time) and
the 1-token request that makes one step."""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable

__all__ = ["EngineWaker"]

log = logging.getLogger("kvtier.connector")


class EngineWaker:
    """Sends 1-token requests to the engine's own OpenAI API while ``in_flight()`` says kvtier has
    work queued or running. ``api_url`` None (a hand-written vLLM command line): it never pokes."""

    def __init__(self, api_url: str | None, served_name: str, in_flight: Callable[[], bool],
                 sleep: Callable[[float], None] = time.sleep):
        self.api_url = api_url
        self.served_name = served_name
        self._in_flight = in_flight
        self._sleep = sleep
        self._waking = threading.Lock()

    def poke(self) -> bool:
        """One 1-token request, so an idle engine runs a step (kvtier's results travel with steps)."""
        if not self.api_url:
            return False
        body = json.dumps({"model": self.served_name, "prompt": ".", "max_tokens": 1}).encode()
        request = urllib.request.Request(self.api_url.rstrip("/") + "/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=30).read()
            return True
        except Exception as exc:  # the next real request does the same
            log.debug("kvtier: wake request failed: %s", exc)
            return False

    def wake(self) -> None:
        """Keep the engine stepping while admin jobs are in flight.

        An idle vLLM engine runs no steps, and kvtier's jobs travel with steps: a job ships with one
        step and its result comes back with a later one (background IO). So while a job is queued
        or running, one thread sends 1-token requests (each is one short step), backing off from
        20 ms to 0.5 s, and stops when nothing is in flight. Real traffic makes it unnecessary.
        """
        if not self.api_url or not self._waking.acquire(blocking=False):
            return
        threading.Thread(target=self._poke_until_idle, name="kvtier-wake", daemon=True).start()

    def _poke_until_idle(self) -> None:
        delay = 0.02
        try:
            for _ in range(10_000):
                if not self._in_flight() or not self.poke():  # jobs still run with the next real request
                    return
                self._sleep(delay)
                delay = min(delay * 1.5, 0.5)
        finally:
            self._waking.release()
