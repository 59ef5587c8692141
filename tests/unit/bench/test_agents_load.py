"""The replayer against a real HTTP server on a real socket (a small streaming stand-in for vLLM's
OpenAI server: the replayer, not the server, is under test): closed loop, order, records."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.bench.agents.load import Target, nominal_duration, replay
from kvtier.bench.agents.trace import AgentMix, TurnSpec, generate, materialize


class StubServer:
    """Streams ``max_tokens`` chunks per completion; records bodies, headers and concurrency."""

    def __init__(self, fail_session: str | None = None):
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.seen: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                    stub.seen.append({**body, "session_header": self.headers.get("X-Session-ID")})
                # a request leaves the count before its last bytes go out: the client may start its
                # next request as soon as it has them, before this thread gets to run again (the
                # count can then only be low, never high: it still catches a replayer over C)
                if self.headers.get("X-Session-ID") == fail_session:
                    self._leave()
                    self.send_response(500)
                    self.send_header("Content-Length", "4")
                    self.end_headers()
                    self.wfile.write(b"boom")
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(body["max_tokens"]):
                        self._chunk(f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode())
                finally:
                    self._leave()
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")

            def _leave(self) -> None:
                with stub.lock:
                    stub.in_flight -= 1

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    server = StubServer(fail_session="broken")
    yield server
    server.close()


MIX = AgentMix(shared_tokens=64, prefix_median=64, tool_median=16, output_tokens=4, max_context=1024,
               think_median_s=0.002, long_pause_s=0.01, arrival_rate=500.0, subagent_frac=0.5)


def test_every_turn_is_sent_once_in_order_with_at_most_c_in_flight(stub):
    specs = generate(MIX, 0, 6_000)
    prompts = materialize(specs, 0)
    records = replay(Target(stub.url, "m"), specs, prompts, concurrency=3)
    assert len(records) == len(specs) and not any(r["error"] for r in records)
    assert stub.max_in_flight <= 3
    by_key = {(r["session"], r["turn"]): r for r in records}
    for spec in specs:
        record = by_key[(spec.session, spec.turn)]
        assert record["chunks"] == spec.output_tokens and len(record["itl_s"]) == spec.output_tokens - 1
        assert 0 < record["ttft_s"] <= record["e2e_s"]
        before = by_key.get((spec.session, spec.turn - 1)) or by_key.get((spec.parent, spec.parent_turn))
        if before is not None:  # never sent before the turn it follows has finished (and its think time)
            assert record["sent_s"] >= before["end_s"] + (spec.think_s or 0.0) - 1e-3
    sent = {(b["session_header"], tuple(b["prompt"])) for b in stub.seen}
    assert sent == {(s.session, tuple(prompts[(s.session, s.turn)])) for s in specs}
    assert all(b["ignore_eos"] and b["temperature"] == 0 and b["stream"] for b in stub.seen)


def test_hints_reach_only_an_arm_that_takes_them(stub):
    specs = [TurnSpec("a", 1, 32, 2, arrival_s=0.0, hint_s=30.0)]
    prompts = materialize(specs, 0)
    replay(Target(stub.url, "m"), specs, prompts, 1)
    replay(Target(stub.url, "m", hints=True), specs, prompts, 1)
    assert "kv_transfer_params" not in stub.seen[0]
    assert stub.seen[1]["kv_transfer_params"] == {"kvtier": {"retain_s": 30.0}}


def test_a_failed_request_is_a_record_and_its_session_goes_on(stub):
    specs = [TurnSpec("broken", 1, 32, 2, arrival_s=0.0), TurnSpec("broken", 2, 40, 2, think_s=0.0),
             TurnSpec("fine", 1, 32, 2, arrival_s=0.0)]
    records = replay(Target(stub.url, "m"), specs, materialize(specs, 0), 2)
    errors = {(r["session"], r["turn"]): r["error"] for r in records}
    assert errors[("fine", 1)] is None
    assert "HTTP 500" in errors[("broken", 1)] and "HTTP 500" in errors[("broken", 2)]


def test_the_nominal_duration_follows_arrivals_and_think_times():
    specs = [TurnSpec("a", 1, 10, 1, arrival_s=1.0), TurnSpec("a", 2, 20, 1, think_s=2.0),
             TurnSpec("b", 1, 10, 1, arrival_s=0.5), TurnSpec("b.sub", 1, 30, 1, parent="b", parent_turn=1,
                                                               think_s=4.0)]
    assert nominal_duration(specs) == pytest.approx(4.5)
