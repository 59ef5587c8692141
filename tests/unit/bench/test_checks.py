"""The checks a benchmark makes before it records a figure, against a real HTTP server on a real
socket (a stand-in for vLLM's dev endpoint, which answers 200 with ``{"success": false}`` while
blocks are held): a refused reset is retried with an engine step between, never taken for done."""
from __future__ import annotations

import pytest
from support.clock import FakeClock
from support.standin import JsonStandIn

from kvtier.bench.checks import FigureRefused, require, reset_served_prefix_cache


class ResetStandIn(JsonStandIn):
    """Refuses ``refusals`` resets, then accepts; records each path it was asked for."""

    def __init__(self, refusals: int, clock: FakeClock | None = None):
        self.refusals, self.paths, self.clock = refusals, [], clock
        super().__init__(self.reply)

    def reply(self, path: str, body, _headers) -> dict:
        self.paths.append((path, body))
        if path == "/reset_prefix_cache":
            self.refusals -= 1
            return {"success": self.refusals < 0}
        if self.clock is not None:  # a completion: the engine stepped (time passes for a test's clock)
            self.clock.advance(10)
        return {"choices": [{"text": "x"}]}


def test_a_refused_reset_is_retried_with_a_step_between_until_accepted():
    stand_in = ResetStandIn(refusals=2)
    try:
        assert reset_served_prefix_cache(stand_in.url, "agents") == 3
    finally:
        stand_in.close()
    paths = [p for p, _ in stand_in.paths]
    assert paths == ["/reset_prefix_cache", "/v1/completions", "/reset_prefix_cache", "/v1/completions",
                     "/reset_prefix_cache"]
    step = stand_in.paths[1][1]
    assert step["model"] == "agents" and step["max_tokens"] == 1 and len(step["prompt"]) < 16


def test_a_reset_never_accepted_refuses_the_figure():
    clock = FakeClock()
    stand_in = ResetStandIn(refusals=10**6, clock=clock)
    try:
        with pytest.raises(FigureRefused, match="refused to reset its prefix cache"):
            reset_served_prefix_cache(stand_in.url, "agents", timeout_s=60, clock=clock)
    finally:
        stand_in.close()
    assert 5 <= len(stand_in.paths) <= 20  # it gave up at the deadline, on the injected clock


def test_require_refuses_in_words():
    require(True, "never raised")
    with pytest.raises(FigureRefused, match="0 of 40 blocks loaded") as info:
        require(0 >= 40, "0 of 40 blocks loaded", hint="the codec's loads did not happen")
    assert info.value.hint == "the codec's loads did not happen"


def test_a_restore_that_loaded_nothing_is_not_timed_as_one():
    from types import SimpleNamespace

    from kvtier.bench.checks import loaded_tokens, require_loaded

    out = SimpleNamespace(kv_transfer_params={"kvtier": {"session_id": "s", "loaded_tokens": 3968}})
    assert loaded_tokens(out) == 3968 and loaded_tokens(SimpleNamespace(kv_transfer_params=None)) == 0
    require_loaded(3968, 4096, 128, "the 4k restore")  # every full block but the last token's
    with pytest.raises(FigureRefused, match="the 4k restore: kvtier loaded 0 of the prompt's 3,968"):
        require_loaded(0, 4096, 128, "the 4k restore")  # a recompute, or a prefix-cache hit
    with pytest.raises(FigureRefused):
        require_loaded(0, 100, 128, "a prompt shorter than a block")  # nothing to load: nothing to time
