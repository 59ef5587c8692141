"""Issue 45: the served benchmarks empty vLLM's prefix cache for real before they time a turn, and the
slow-disk bench calls a turn "recomputed" only on kvtier's record of it. vLLM's ``/reset_prefix_cache``
answers 200 with ``{"success": false}`` while blocks are held; the next prompt is then a prefix-cache
hit, which loads nothing and is fast: a "noticed the slow disk and recomputed" that never happened.

The served engine is a stand-in on a real loopback socket (vLLM's reset and completions endpoints,
kvtier's turn record through an admin stand-in); the slow-disk figures are fed recorded turns."""
from __future__ import annotations

import pytest
from support.standin import JsonStandIn

from kvtier.bench.checks import FigureRefused
from kvtier.launch.served import Served

PROMPT = 8256  # the slow-disk bench's session after two more messages (8192 + 64 tokens each)


class EngineStandIn(JsonStandIn):
    """vLLM's dev endpoints as the served benches use them: refuses ``refusals`` resets, then accepts;
    a turn after a refused reset is a prefix-cache hit (every full block cached), after an accepted
    one it is computed in full. kvtier's record of each turn is kept for the admin stand-in."""

    def __init__(self, refusals: int):
        self.refusals, self.paths, self.records = refusals, [], {}
        self.cache_empty = False
        super().__init__(self.reply)

    def reply(self, path: str, body, headers) -> dict:
        self.paths.append(path)
        if path == "/reset_prefix_cache":
            ok = self.refusals <= 0
            self.cache_empty = ok
            self.refusals -= 1
            return {"success": ok}
        return self.complete(body["prompt"], headers.get("X-Session-ID"))

    def complete(self, prompt: list[int], session: str | None) -> dict:
        cached = 0 if self.cache_empty else (len(prompt) - 1) // 128 * 128
        if session is not None:
            self.records.setdefault(session, []).append(
                {"prompt_tokens": len(prompt), "vllm_cached_tokens": cached, "loaded_tokens": 0,
                 "recomputed_tokens": len(prompt) - cached, "reason": "vllm_prefix_cache" if cached else "recompute"})
        return {"choices": [{"text": "x"}], "kv_transfer_params": {"kvtier": {"loaded_tokens": 0}}}

    def served(self) -> Served:
        """The benches' own ``Served`` client, pointed at this stand-in (no process started)."""
        server = Served.__new__(Served)
        server.url, server.served_name = self.url, "tiny"
        return server

class AdminStandIn:
    """kvtier serve's admin API as the slow-disk turn uses it: evictions done at once, each session's
    turns as the engine stand-in recorded them."""

    def __init__(self, engine: EngineStandIn):
        self.engine = engine

    def post(self, path: str, body: dict | None = None) -> dict:
        return {"state": "done", "path": path}

    def wait(self, job: dict, timeout: float = 600.0) -> dict:
        return job

    def get(self, path: str) -> dict:
        if path == "/v1/status":
            return {"warnings": {}}
        return {"turns": self.engine.records.get(path.rsplit("/", 1)[1], [])}


@pytest.fixture
def engine():
    made = []

    def make(refusals: int) -> EngineStandIn:
        made.append(EngineStandIn(refusals))
        return made[-1]

    yield make
    for stand_in in made:
        stand_in.close()


def test_the_slow_disk_turn_resets_until_vllm_accepts_and_records_what_the_turn_was(engine):
    from benchmarks.faults.slowdisk import _turn

    stand_in = engine(refusals=2)
    failures: list[str] = []
    row = _turn(stand_in.served(), AdminStandIn(stand_in), "s0", list(range(3, 3 + PROMPT)), 10_000, failures)
    assert failures == []
    assert stand_in.paths[:5] == ["/reset_prefix_cache", "/v1/completions", "/reset_prefix_cache",
                                  "/v1/completions", "/reset_prefix_cache"]  # refused twice, a step between
    assert row["loaded"] == 0 and row["record"]["vllm_cached_tokens"] == 0 and row["outcome"] == "recomputed"


def test_the_full_path_report_forgets_hbm_only_once_vllm_accepts(engine):
    from benchmarks.fullpath import _forget_hbm

    stand_in = engine(refusals=1)
    _forget_hbm(stand_in.served())
    assert stand_in.paths == ["/reset_prefix_cache", "/v1/completions", "/reset_prefix_cache"]
    assert stand_in.cache_empty


def _row(turn: int, phase: str, loaded: int, cached: int, ttft: float, recompute: float = 2.0) -> dict:
    """A turn as the slow-disk bench records it (figures from a run on this box: 8k-token sessions,
    about 2 s to recompute one)."""
    return {"session": f"s{turn % 3}", "prompt_tokens": PROMPT, "turn": turn, "phase": phase, "started": 100.0 + turn,
            "ttft_s": ttft, "loaded": loaded, "recompute_s": recompute, "ratio": ttft / recompute,
            "record": {"prompt_tokens": PROMPT, "vllm_cached_tokens": cached, "loaded_tokens": loaded,
                       "recomputed_tokens": PROMPT - cached - loaded, "reason": "recompute"}}


def _slow_phase(third: dict) -> list[dict]:
    return [_row(0, "healthy", 8192, 0, 0.3), _row(1, "200x", 8192, 0, 9.0), _row(2, "200x", 8192, 0, 8.5),
            third, _row(4, "recovered", 8192, 0, 0.3)]


def test_a_prefix_cache_hit_is_not_taken_for_noticing_the_slow_disk():
    """Turn 3 loaded nothing because vLLM's prefix cache served it (a reset that did not take): 0.1 s.
    Counted as "recomputed", it made the bench notice after 2 loads at 0.05x recompute time."""
    from benchmarks.faults.slowdisk import _figures

    rows = _slow_phase(_row(3, "200x", 0, 8192, 0.1))
    with pytest.raises(FigureRefused, match="neither loaded from kvtier nor recomputed") as err:
        _figures(rows, {"recovered": 103.5}, 200.0)
    assert "turn 3 (200x)" in err.value.message and "prefix-cache hits" in err.value.hint


def test_a_turn_recomputed_in_full_is_noticing_the_slow_disk():
    from benchmarks.faults.slowdisk import _figures

    out = _figures(_slow_phase(_row(3, "200x", 0, 0, 2.1)), {"recovered": 103.5}, 200.0)
    assert out["slow_disk_noticed_after_loads"] == 2
    assert out["slow_disk_ttft_vs_recompute_max"] == pytest.approx(2.1 / 2.0)
    assert out["slow_disk_resume_s"] == pytest.approx(0.5)


def test_turn_outcome_reads_kvtiers_record_of_the_turn():
    from benchmarks.faults.slowdisk import turn_outcome

    assert turn_outcome(_row(1, "200x", 8192, 0, 9.0)) == "loaded"
    assert turn_outcome(_row(3, "200x", 0, 0, 2.1)) == "recomputed"
    assert turn_outcome(_row(3, "200x", 0, 8192, 0.1)) == "unexplained"  # vLLM's prefix cache served it
    assert turn_outcome(_row(3, "200x", 0, 128, 1.9)) == "unexplained"  # one block of it, even
    assert turn_outcome({**_row(3, "200x", 0, 0, 2.1), "record": None}) == "unexplained"  # not recorded
    other = _row(3, "200x", 0, 0, 2.1)
    other["record"]["prompt_tokens"] = PROMPT - 64  # the session's previous turn, not this one
    assert turn_outcome(other) == "unexplained"


def test_the_heavy_slowdown_makes_a_load_lose_on_this_box():
    """At least 200x; more where the CPU recomputes slowly, so that a slowed load costs 3x its
    recompute (a fixed 200x left loading ahead on a slower CPU, and the phase measured nothing)."""
    from benchmarks.faults.slowdisk import heavy_factor

    session = 8256 * 2048  # the tiny model's 2 KiB of KV a token
    assert heavy_factor(1.5e9, session, 0.7) == 200  # a fast CPU: 200x already loses (2.3 s vs 0.7 s)
    slow = heavy_factor(1.5e9, session, 2.6)  # a slower one: 200x would read in 2.2 s, under 2.6 s
    assert slow > 200 and session * slow / 1.5e9 >= 3 * 2.6
