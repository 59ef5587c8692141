"""Replay a trace against one OpenAI-compatible server: closed loop, at most C requests in flight.

A session between turns (thinking, waiting on a tool) holds no slot: parked sessions pile up,
which is what tiering is for. A turn is ready when the trace allows it (its ``arrival_s``, or
``think_s`` after the turn it follows finished); ready turns are sent earliest first by C client
threads. Every request is streamed: its time to the first
token, the gaps between tokens and its end-to-end time are recorded, with its output text.
"""
from __future__ import annotations

import heapq
import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlparse

from kvtier.bench.agents.trace import TurnSpec

__all__ = ["Target", "nominal_duration", "replay", "stream_completion"]


@dataclass
class Target:
    """Where the requests go, and what the arm adds to them."""

    url: str
    model: str
    hints: bool = False  # send the trace's retention hints (kvtier's arms)
    extra_body: dict = field(default_factory=dict)


def stream_completion(conn: http.client.HTTPConnection, target: Target, session: str, prompt: list[int],
                      max_tokens: int, hint_s: float = 0.0) -> dict:
    """One streamed greedy completion of exactly ``max_tokens`` tokens: ttft, token gaps, text."""
    body = {"model": target.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, **target.extra_body}
    if hint_s and target.hints:
        body["kv_transfer_params"] = {"kvtier": {"retain_s": hint_s}}
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "X-Session-ID": session})
    response = conn.getresponse()
    if response.status != 200:
        detail = response.read()[:300].decode(errors="replace")
        raise RuntimeError(f"HTTP {response.status}: {detail}")
    stamps, text = [], []
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or ():
            stamps.append(time.perf_counter())
            text.append(choice.get("text") or "")
    ended = time.perf_counter()
    if not stamps:
        raise RuntimeError("the stream carried no token")
    return {"ttft_s": stamps[0] - started, "itl_s": [b - a for a, b in zip(stamps, stamps[1:])],
            "e2e_s": ended - started, "text": "".join(text), "chunks": len(stamps)}


def _followers(specs: list[TurnSpec]) -> tuple[dict, list]:
    """What each finished turn releases (the session's next turn, subagents forked there) and the
    turns ready from the start."""
    by_key = {(s.session, s.turn): s for s in specs}
    after: dict[tuple[str, int], list[TurnSpec]] = {}
    roots = []
    for spec in specs:
        if spec.turn > 1:
            after.setdefault((spec.session, spec.turn - 1), []).append(spec)
        elif spec.parent:
            after.setdefault((spec.parent, spec.parent_turn), []).append(spec)
        else:
            roots.append(spec)
    assert all(k in by_key for k in after), "a turn follows one that is not in the trace"
    return after, roots


def _ready_at(spec: TurnSpec, finished_at: float | None) -> float:
    """When a turn may be sent: its arrival time, and its think time after the turn it follows."""
    times = [] if spec.arrival_s is None else [spec.arrival_s]
    if finished_at is not None:
        times.append(finished_at + (spec.think_s or 0.0))
    return max(times)


def nominal_duration(specs: list[TurnSpec]) -> float:
    """How long the trace lasts if every request took no time: the pace it asks for."""
    after, roots = _followers(specs)
    pending = [(_ready_at(s, None), s.session, s.turn) for s in roots]
    end = 0.0
    while pending:
        at, session, turn = heapq.heappop(pending)
        end = max(end, at)
        for nxt in after.get((session, turn), ()):
            heapq.heappush(pending, (_ready_at(nxt, at), nxt.session, nxt.turn))
    return end


def replay(target: Target, specs: list[TurnSpec], prompts: dict, concurrency: int,
           on_record: Callable[[dict], None] | None = None, timeout_s: float = 3600.0) -> list[dict]:
    """Send every turn of the trace; one record per request (errors included, never raised)."""
    after, roots = _followers(specs)
    lock = threading.Condition()
    heap = [(_ready_at(s, None), n, s) for n, s in enumerate(roots)]
    heapq.heapify(heap)
    seq = [len(heap)]
    left = [len(specs)]
    records: list[dict] = []
    start = time.perf_counter()
    deadline = start + timeout_s
    host = urlparse(target.url)

    def push(spec: TurnSpec, finished_at: float) -> None:
        seq[0] += 1
        heapq.heappush(heap, (_ready_at(spec, finished_at), seq[0], spec))

    def take() -> tuple[float, TurnSpec] | None:
        with lock:
            while left[0] > 0 and time.perf_counter() < deadline:
                now = time.perf_counter() - start
                if heap and heap[0][0] <= now:
                    ready, _, spec = heapq.heappop(heap)
                    return ready, spec
                lock.wait(timeout=(heap[0][0] - now) if heap else 1.0)
            return None

    def worker() -> None:
        while (item := take()) is not None:
            ready, spec = item
            record = {"session": spec.session, "turn": spec.turn, "input_tokens": spec.input_tokens,
                      "output_tokens": spec.output_tokens, "long_pause": spec.long_pause,
                      "hinted": bool(spec.hint_s and target.hints), "ready_s": ready,
                      "sent_s": time.perf_counter() - start, "error": None}
            # a connection per request: a server closes an idle keep-alive connection during a long
            # pause, and a request written into a closed one fails for the client's reason, not the server's
            conn = http.client.HTTPConnection(host.hostname, host.port, timeout=600)
            try:
                record.update(stream_completion(conn, target, spec.session, prompts[(spec.session, spec.turn)],
                                                spec.output_tokens, spec.hint_s))
            except Exception as exc:  # noqa: BLE001 - a failed request is a result, counted as an error
                record["error"] = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                conn.close()
            finished = time.perf_counter() - start
            record["end_s"] = finished
            with lock:
                records.append(record)
                left[0] -= 1
                for nxt in after.get((spec.session, spec.turn), ()):
                    push(nxt, finished)
                lock.notify_all()
            if on_record is not None:
                on_record(record)

    threads = [threading.Thread(target=worker, name=f"agent-client-{i}", daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if left[0]:
        raise RuntimeError(f"{left[0]} of {len(specs)} turns were not sent within {timeout_s:.0f} s")
    return records
