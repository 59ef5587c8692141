"""What the agent benchmark checks before it counts a pass, against stand-ins on real sockets (vLLM's
OpenAI server on loopback TCP, kvtier's admin API on a Unix socket: the benchmark's logic, not the
servers, is under test): prefix-cache resets accepted for real, a loading arm's determinism pass
refused when it loaded nothing, kvtier's tiers emptied or the failure raised, and a model whose
config.json cannot size the KV cache refused before any server starts."""
from __future__ import annotations

import json
import shutil
import socketserver
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlparse

import pytest
from support.clock import FakeClock
from typer.testing import CliRunner

from kvtier.bench.agents import arms as armlib
from kvtier.bench.agents import run as runlib
from kvtier.bench.agents.trace import TurnSpec
from kvtier.bench.checks import FigureRefused
from kvtier.errors import KvtierError


class _Replies(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _body(self) -> dict | None:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def _reply(self, status: int, doc: object, kind: str = "application/json") -> None:
        data = doc.encode() if isinstance(doc, str) else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class VllmStandIn:
    """vLLM's server as the benchmark sees it. A streamed completion holds its blocks until the
    engine steps (a one-token completion, as ``reset_served_prefix_cache`` sends): a reset asked
    meanwhile answers 200 ``{"success": false}``, as vLLM's does. Each streamed completion counts
    ``loads`` prompt tokens as loaded (``external_kv_transfer``) on /metrics. ``events``: what it
    was asked, in order: ("reset", accepted), ("stream", session), ("step",)."""

    def __init__(self, loads: int = 0, held: bool = False, never_accept: bool = False, clock: FakeClock | None = None):
        self.loads, self.held, self.never_accept, self.clock = loads, held, never_accept, clock
        self.events: list[tuple] = []
        self.counters = {"local_compute": 0, "external_kv_transfer": 0}
        self.lock = threading.Lock()
        stand_in = self

        class Handler(_Replies):
            def do_GET(self):
                lines = [f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="agents",source="{source}"}} '
                         f"{value:.1f}" for source, value in stand_in.counters.items()]
                self._reply(200, "\n".join(["# TYPE vllm:prompt_tokens_by_source_total counter", *lines]) + "\n",
                            "text/plain")

            def do_POST(self):
                body = self._body()
                if self.path == "/reset_prefix_cache":
                    with stand_in.lock:
                        accepted = not stand_in.held and not stand_in.never_accept
                        stand_in.events.append(("reset", accepted))
                    return self._reply(200, {"success": accepted})
                if not body.get("stream"):  # the one-token step between refused resets
                    with stand_in.lock:
                        stand_in.events.append(("step",))
                        stand_in.held = False
                    if stand_in.clock is not None:
                        stand_in.clock.advance(10)
                    return self._reply(200, {"choices": [{"text": "x"}]})
                with stand_in.lock:
                    stand_in.events.append(("stream", self.headers.get("X-Session-ID")))
                    stand_in.held = True
                    stand_in.counters["local_compute"] += len(body["prompt"]) - stand_in.loads
                    stand_in.counters["external_kv_transfer"] += stand_in.loads
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                seed = sum(body["prompt"]) % 97  # greedy: the same prompt, the same text
                for i in range(body["max_tokens"]):
                    self._chunk(f"data: {json.dumps({'choices': [{'text': f'{seed}.{i} '}]})}\n\n")
                self._chunk("data: [DONE]\n\n")
                self._chunk("")

            def _chunk(self, text: str) -> None:
                data = text.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def resets(self) -> list[bool]:
        return [e[1] for e in self.events if e[0] == "reset"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class AdminStandIn:
    """kvtier's admin API on a Unix socket: the sessions it holds, their drop (``evict`` to
    ``drop``; a status per session in ``refuse``: 404 for one gone meanwhile, unless it is in
    ``still_there``), the clean wait, and its counters."""

    def __init__(self, sessions: list[str], refuse: dict[str, int] | None = None, still_there: tuple = (),
                 refreshes: int = 0):
        self.sessions, self.refuse, self.still_there = list(sessions), refuse or {}, set(still_there)
        self.dropped: list[str] = []
        self.dir = tempfile.mkdtemp(prefix="kva-")  # short: a Unix socket's path is at most 107 bytes
        self.path = str(Path(self.dir) / "admin.sock")
        stand_in = self

        class Handler(_Replies):
            def do_GET(self):
                path = urlparse(self.path).path
                if path == "/v1/sessions":
                    return self._reply(200, {"sessions": [{"session_id": s} for s in stand_in.sessions],
                                             "total": len(stand_in.sessions)})
                if path.startswith("/v1/sessions/"):
                    session = unquote(path.rsplit("/", 1)[1])
                    if session in stand_in.sessions:
                        return self._reply(200, {"session_id": session})
                    return self._reply(404, {"error": f"no session {session!r}"})
                if path == "/v1/status":
                    return self._reply(200, {"dirty": {"dirty_blocks": 0}, "counters": {"rate_refreshes": refreshes}})
                self._reply(404, {"error": f"no such route: {path}"})

            def do_POST(self):
                self._body()
                session = unquote(urlparse(self.path).path.split("/")[3])
                status = stand_in.refuse.get(session, 202)
                if status == 202:
                    stand_in.dropped.append(session)
                    stand_in.sessions.remove(session)
                    return self._reply(202, {"job_id": "j1", "state": "done"})
                if status == 404 and session not in stand_in.still_there:
                    stand_in.sessions.remove(session)  # it went between the listing and its drop
                self._reply(status, {"error": f"refused with {status}", "hint": "a hint"})

        self.server = socketserver.ThreadingUnixStreamServer(self.path, Handler)
        self.server.daemon_threads = True  # a client's open keep-alive connection must not hold up close()
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def vllm_factory():
    made = []

    def make(**kwargs) -> VllmStandIn:
        made.append(VllmStandIn(**kwargs))
        return made[-1]

    yield make
    for stand_in in made:
        stand_in.close()


@pytest.fixture
def admin_factory():
    made = []

    def make(*args, **kwargs) -> AdminStandIn:
        made.append(AdminStandIn(*args, **kwargs))
        return made[-1]

    yield make
    for stand_in in made:
        stand_in.close()


def _arm(name: str, url: str, socket: str = "") -> armlib.Arm:
    return armlib.Arm(name, SimpleNamespace(url=url, socket=socket), name in armlib.LOADING_ARMS)


SPECS = [TurnSpec("a", 1, 40, 3, arrival_s=0.0), TurnSpec("a", 2, 60, 3, think_s=0.0),
         TurnSpec("b", 1, 40, 3, arrival_s=0.0), TurnSpec("b", 2, 70, 3, think_s=0.0)]


# ---- prefix-cache resets -----------------------------------------------------------------------
def test_a_reset_refused_between_regimes_is_retried_with_a_step_until_accepted(vllm_factory):
    vllm = vllm_factory(held=True)  # the last pass's blocks are still held
    armlib.empty_caches(_arm("vllm", vllm.url))
    assert vllm.events == [("reset", False), ("step",), ("reset", True)]


def test_a_reset_never_accepted_refuses_instead_of_timing_a_prefix_cache_hit(vllm_factory):
    clock = FakeClock()
    vllm = vllm_factory(never_accept=True, clock=clock)
    with pytest.raises(FigureRefused, match="refused to reset its prefix cache"):
        armlib.empty_caches(_arm("vllm", vllm.url), clock=clock)
    assert not any(e[0] == "stream" for e in vllm.events)


def test_every_determinism_turn_follows_a_reset_vllm_accepted(vllm_factory):
    vllm = vllm_factory()
    out = runlib._determinism(_arm("vllm", vllm.url), SPECS, 0)
    assert sorted(out["texts"]) == ["a/1", "a/2", "b/1", "b/2"]
    streamed = 0
    for n, event in enumerate(vllm.events):
        if event[0] == "stream":
            streamed += 1
            last_reset = [e for e in vllm.events[:n] if e[0] == "reset"][-1]
            assert last_reset == ("reset", True), vllm.events  # never a turn after a refused reset
    assert streamed == 4 and False in vllm.resets()  # each turn's blocks were held at the next reset


def test_the_warm_up_ends_with_a_reset_vllm_accepted(vllm_factory):
    vllm = vllm_factory()
    warm = [TurnSpec(f"warm-{i}", turn, 32 * turn, 2, arrival_s=0.0 if turn == 1 else None,
                     think_s=None if turn == 1 else 0.0) for i in range(2) for turn in (1, 2)]
    runlib.warm_up(_arm("vllm", vllm.url), warm, 2)
    assert sum(e[0] == "stream" for e in vllm.events) == 8
    assert vllm.events[-1] == ("reset", True) and vllm.events.count(("reset", True)) == 2


# ---- the determinism pass of a loading arm --------------------------------------------------------
def test_a_loading_arm_that_loaded_nothing_in_the_determinism_pass_is_refused(vllm_factory, admin_factory):
    vllm, admin = vllm_factory(loads=0), admin_factory(["old"])
    with pytest.raises(FigureRefused, match="kvtier loaded no KV in the determinism pass") as caught:
        runlib._determinism(_arm("kvtier", vllm.url, admin.path), SPECS, 0)
    assert "recompute" in caught.value.hint
    assert admin.dropped == ["old"]  # the pass began from empty tiers


def test_a_loading_arm_that_loaded_counts_its_loads(vllm_factory, admin_factory):
    vllm, admin = vllm_factory(loads=16), admin_factory([])
    out = runlib._determinism(_arm("kvtier", vllm.url, admin.path), SPECS, 0)
    assert out["loaded_tokens"] == 4 * 16 and out["turns_loading"] == 4
    plain = runlib._determinism(_arm("vllm", vllm_factory(loads=0).url), SPECS, 0)  # it should not load: no check
    assert plain["texts"] == out["texts"] and plain["loaded_tokens"] == 0


def _outputs(texts: dict, loaded: int = 0) -> dict:
    return {"texts": texts, "loaded_tokens": loaded, "turns_loading": int(loaded > 0)}


def test_an_arm_whose_determinism_pass_does_not_count_makes_no_outputs_equal():
    plain = {"a/1": "x", "a/2": "y"}
    arms = {"vllm": {"loads": False}, "floor": {"loads": False}, "kvtier": {"loads": True}}
    refused = {"arms": arms, "failed": {"kvtier determinism pass": "kvtier loaded no KV in the determinism pass"}}
    figures = runlib.determinism_figures({"vllm": _outputs(plain), "floor": _outputs(plain)}, refused)
    assert figures["outputs_equal"] is None  # not the floor's 1.0 standing in for kvtier's
    assert "loaded no KV" in figures["invalid"]["kvtier"] and figures["per_arm"]["floor"] == 1.0
    degraded = {"arms": {**arms, "kvtier": {"loads": True, "degraded": "loaded nothing in regime 2"}}}
    figures = runlib.determinism_figures({"vllm": _outputs(plain), "floor": _outputs(plain),
                                   "kvtier": _outputs(plain, 8)}, degraded)
    assert figures["outputs_equal"] is None and "degraded" in figures["invalid"]["kvtier"]
    fine = runlib.determinism_figures({"vllm": _outputs(plain), "floor": _outputs(plain),
                                "kvtier": _outputs({"a/1": "x", "a/2": "z"}, 8)}, {"arms": arms})
    assert fine["outputs_equal"] == 0.5 and "invalid" not in fine
    assert fine["loaded"] == {"kvtier": {"tokens": 8, "turns": 1}}


# ---- emptying kvtier's tiers ---------------------------------------------------------------------
def test_emptying_kvtier_skips_only_a_session_gone_meanwhile(vllm_factory, admin_factory):
    vllm, admin = vllm_factory(), admin_factory(["a", "gone", "b"], refuse={"gone": 404})
    assert armlib.empty_caches(_arm("kvtier", vllm.url, admin.path)) == 0
    assert admin.dropped == ["a", "b"] and vllm.resets() == [True]


@pytest.mark.parametrize("status, still_there", [(409, ()), (500, ()), (400, ()), (404, ("b",))])
def test_emptying_kvtier_raises_any_other_refusal_or_fault(vllm_factory, admin_factory, status, still_there):
    vllm, admin = vllm_factory(), admin_factory(["a", "b"], refuse={"b": status}, still_there=still_there)
    with pytest.raises(KvtierError):
        armlib.empty_caches(_arm("kvtier", vllm.url, admin.path))
    assert vllm.resets() == []  # tiers not emptied: no regime starts on them


# ---- kvtier's link re-measurement ------------------------------------------------------------------
def test_kvtiers_link_remeasurements_are_off_and_a_count_refuses_the_figures(vllm_factory, admin_factory):
    """The kvtier arm runs with re-measurement off (a re-measurement while the other arms are timed
    would compete with them); if kvtier re-measured anyway, its figures are refused."""
    from kvtier.config import load_settings
    from kvtier.launch.serve import build_kv_transfer_config

    settings, sources = load_settings(env=armlib.KVTIER_ENV)
    assert sources["rates_refresh"] == "env KVTIER_RATES_REFRESH"  # what kvtier serve reads
    extra = build_kv_transfer_config(settings, "m")["kv_connector_extra_config"]
    assert extra["rates_refresh_s"] == 0  # what the connector runs with
    quiet = _arm("kvtier", vllm_factory().url, admin_factory([], refreshes=0).path)
    results = {"arms": {}}
    runlib._record_remeasurements(quiet, results)
    assert results["arms"]["kvtier"]["link_remeasurements"] == 0
    noisy = _arm("kvtier", vllm_factory().url, admin_factory([], refreshes=3).path)
    assert armlib.link_remeasurements(noisy) == 3
    assert armlib.link_remeasurements(_arm("vllm", "http://127.0.0.1:9")) is None
    with pytest.raises(FigureRefused, match="re-measured its links 3 times"):
        runlib._record_remeasurements(noisy, {"arms": {}})


# ---- a model the benchmark cannot size -----------------------------------------------------------
runner = CliRunner()


@pytest.mark.parametrize("config, named", [
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, ["num_hidden_layers", "hidden_size"]),
    ({"num_hidden_layers": 4, "hidden_size": 256}, ["num_attention_heads"]),
    ({"num_hidden_layers": "4", "num_attention_heads": 4, "hidden_size": 256}, ["num_hidden_layers"]),
    ([1, 2], ["not a JSON object"]),
    ("{not json", ["not valid JSON"]),
    (None, ["cannot read"]),
])
def test_a_model_whose_config_cannot_size_the_kv_cache_is_refused_before_any_server(tmp_path, config, named):
    model = tmp_path / "model"
    model.mkdir()
    if config is not None:
        (model / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    result = runner.invoke(__import__("kvtier.cli.main", fromlist=["app"]).app,
                           ["bench", "agents", "--model", str(model), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, (result.output, result.exception)
    first, hint = result.stderr.strip().splitlines()[:2]
    assert first.startswith("error: ") and str(model / "config.json") in first
    assert all(name in first for name in named), first
    assert hint.startswith("hint: ")
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
