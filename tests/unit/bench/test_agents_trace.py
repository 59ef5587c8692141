"""The agent workload: the seeded generator, token ids identical across arms, trace files."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvtier.bench.agents.trace import (
    AgentMix,
    TurnSpec,
    generate,
    materialize,
    read_trace,
    unique_tokens,
    with_hints,
    write_trace,
)
from kvtier.errors import UsageError

MIX = AgentMix(shared_tokens=256, prefix_median=128, tool_median=32, max_context=2048, subagent_frac=0.5)


def test_the_same_seed_makes_the_same_trace_and_another_seed_another():
    a, b, c = generate(MIX, 3, 20_000), generate(MIX, 3, 20_000), generate(MIX, 4, 20_000)
    assert a == b
    assert a != c
    assert materialize(a, 3) == materialize(b, 3)


def test_sessions_are_added_until_the_working_set_is_reached():
    specs = generate(MIX, 0, 50_000)
    size = unique_tokens(specs)
    assert 50_000 <= size < 50_000 + MIX.max_context * 2  # at most one session (and its subagent) past it
    assert unique_tokens(generate(MIX, 0, 50_000, max_sessions=3)) < size


def test_prompts_grow_append_only_and_share_the_system_prompt():
    specs = generate(MIX, 1, 30_000)
    prompts = materialize(specs, 1)
    shared = None
    for spec in specs:
        prompt = prompts[(spec.session, spec.turn)]
        assert len(prompt) == spec.input_tokens
        if spec.turn > 1:
            before = prompts[(spec.session, spec.turn - 1)]
            assert prompt[:len(before)] == before  # the previous prompt, then the answer and a tool result
        elif spec.parent:
            parent = prompts[(spec.parent, spec.parent_turn)]
            assert prompt[:len(parent)] == parent  # a subagent forks with its parent's context
        else:
            head = prompt[:MIX.shared_tokens]
            shared = shared or head
            assert head == shared
    firsts = [prompts[(s.session, 1)][MIX.shared_tokens:] for s in specs if s.turn == 1 and not s.parent]
    assert len({tuple(p[:16]) for p in firsts}) == len(firsts)  # each session's own prefix is its own


def test_the_mix_has_its_long_pauses_subagents_and_turn_cap():
    specs = generate(replace(MIX, turns_cap=6), 2, 400_000)
    later = [s for s in specs if s.turn > 1]
    assert 0.18 < sum(s.long_pause for s in later) / len(later) < 0.32
    assert all(s.think_s == MIX.long_pause_s for s in later if s.long_pause)
    assert max(s.turn for s in specs) <= 6
    assert any(s.parent for s in specs)
    firsts = sorted(s.arrival_s for s in specs if s.turn == 1 and not s.parent)
    gaps = [b - a for a, b in zip(firsts, firsts[1:])]
    assert 0.35 < sum(gaps) / len(gaps) < 0.65  # Poisson arrivals at 2 sessions a second


def test_hints_go_to_every_other_session_before_its_long_pauses():
    specs = with_hints(generate(MIX, 5, 40_000), retain_s=30)
    hinted = [s for s in specs if s.hint_s]
    assert hinted and all(s.hint_s == 30 for s in hinted)
    pauses = {(s.session, s.turn - 1) for s in specs if s.long_pause}
    assert all((s.session, s.turn) in pauses for s in hinted)
    sessions = list(dict.fromkeys(s.session for s in specs))
    assert {s.session for s in hinted} <= set(sessions[::2])


def test_a_trace_file_round_trips(tmp_path):
    specs = generate(MIX, 6, 20_000)
    path = tmp_path / "trace.jsonl"
    write_trace(specs, path)
    assert read_trace(path) == specs
    assert materialize(read_trace(path), 6) == materialize(specs, 6)


GOOD = {"session": "a", "turn": 1, "arrival_s": 0, "input_tokens": 100, "output_tokens": 8}


@pytest.mark.parametrize("lines, message", [
    (["{not json"], "line 1: not JSON"),
    ([json.dumps([1, 2])], "a JSON object is expected"),
    ([json.dumps({**GOOD, "colour": "red"})], "unknown field 'colour'"),
    ([json.dumps({k: v for k, v in GOOD.items() if k != "input_tokens"})], "missing input_tokens"),
    ([json.dumps({**GOOD, "input_tokens": "many"})], "input_tokens must be int"),
    ([json.dumps({**GOOD, "input_tokens": -5})], "must be a finite number >= 0"),
    ([json.dumps({**GOOD, "arrival_s": None})], "arrival_s must be float"),
    ([json.dumps({k: v for k, v in GOOD.items() if k != "arrival_s"})], "no arrival_s or think_s"),
    ([json.dumps(GOOD), json.dumps({**GOOD, "turn": 3, "input_tokens": 200})], "has turns [1, 3]"),
    ([json.dumps(GOOD), json.dumps({**GOOD, "turn": 2, "input_tokens": 50})], "fewer input tokens"),
    ([json.dumps({**GOOD, "session": "b", "parent": "z", "parent_turn": 1})], "forks from 'z'"),
    ([], "has no turns"),
])
def test_a_malformed_trace_is_refused_with_its_line_and_a_hint(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UsageError) as caught:
        read_trace(path)
    assert message in str(caught.value)
    assert caught.value.hint


def test_a_trace_longer_than_the_server_takes_is_refused(tmp_path):
    path = tmp_path / "long.jsonl"
    write_trace([TurnSpec("a", 1, 5000, 8, arrival_s=0.0)], path)
    with pytest.raises(UsageError, match="over the server's 4096"):
        read_trace(path, max_context=4096)
