"""The checks a benchmark makes before it records a figure, against a real HTTP server on a real
socket (a stand-in for vLLM's dev endpoint, which answers 200 with ``{"success": false}`` while
blocks are held): a refused reset is retried with an engine step between, never taken for done."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.clock import FakeClock

from kvtier.bench.checks import FigureRefused, require, reset_served_prefix_cache


class ResetStandIn:
    """Refuses ``refusals`` resets, then accepts; records each path it was asked for."""

    def __init__(self, refusals: int, clock: FakeClock | None = None):
        self.refusals, self.paths, self.clock = refusals, [], clock
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                stand_in.paths.append((self.path, body))
                if self.path == "/reset_prefix_cache":
                    ok = stand_in.refusals <= 0
                    stand_in.refusals -= 1
                    reply = {"success": ok}
                else:  # a completion: the engine stepped (time passes for a test's clock)
                    if stand_in.clock is not None:
                        stand_in.clock.advance(10)
                    reply = {"choices": [{"text": "x"}]}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


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
