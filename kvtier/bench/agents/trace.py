"""The agent workload as a list of turns: generated from a seed, or read from a JSONL trace file.

A trace is a list of :class:`TurnSpec`, token *counts* only. :func:`materialize` turns the counts
into token ids the same way for a generated trace and a replayed one, from the seed alone, so
every arm of a run sees exactly the same prompts.

One line of a trace file is one turn::

    {"session": "a1", "turn": 1, "arrival_s": 0.0, "input_tokens": 1800, "output_tokens": 32}
    {"session": "a1", "turn": 2, "think_s": 0.4, "input_tokens": 2010, "output_tokens": 32}
    {"session": "a1.sub", "turn": 1, "parent": "a1", "parent_turn": 2, "think_s": 0.1, "input_tokens": 2300,
     "output_tokens": 32}

* ``input_tokens`` is the whole prompt of the turn; it never shrinks within a session (an agent's
  context only grows: each turn appends the previous answer and a tool result).
* When the turn may be sent: ``arrival_s`` (seconds from the start of the run), or ``think_s``
  after the previous turn (or, for a subagent's first turn, the parent's ``parent_turn``) has
  finished; both: whichever is later. A turn is never sent before the one before it finished.
* Optional: ``shared_tokens`` (first turn: how many leading tokens every session shares, the
  system prompt and tool schema), ``parent``/``parent_turn`` (a subagent: its first prompt starts
  with the parent's prompt of that turn), ``long_pause`` (true: the pause before this turn is a
  parked session's, reported apart).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable

import numpy as np

from kvtier.errors import UsageError

__all__ = ["AgentMix", "TurnSpec", "generate", "materialize", "read_trace", "unique_tokens", "with_hints",
           "write_trace"]

VOCAB = (100, 1990)  # token ids drawn here: valid for the demo models (2,000 tokens) and any real tokenizer


@dataclass(frozen=True)
class TurnSpec:
    session: str
    turn: int  # 1-based
    input_tokens: int  # the whole prompt
    output_tokens: int
    arrival_s: float | None = None  # earliest send time, from the start of the run
    think_s: float | None = None  # pause after the turn this one follows
    shared_tokens: int = 0  # first turn: leading tokens every session shares
    parent: str | None = None  # first turn of a subagent: forks from this session
    parent_turn: int = 0
    long_pause: bool = False
    hint_s: float = 0.0  # a retention hint sent with this turn (kvtier only); 0: none


@dataclass(frozen=True)
class AgentMix:
    """The generator's knobs: sizes in tokens, times in seconds; lognormals by median and sigma."""

    shared_tokens: int = 1536  # system prompt and tool schema
    prefix_median: int = 1024  # a session's own first context
    prefix_sigma: float = 0.7
    tool_median: int = 192  # a tool result appended each turn
    tool_sigma: float = 0.8
    output_tokens: int = 32
    turns_median: float = 8
    turns_sigma: float = 0.5
    turns_cap: int = 24
    think_median_s: float = 0.5
    think_sigma: float = 0.5
    long_pause_frac: float = 0.25
    long_pause_s: float = 10.0
    subagent_frac: float = 0.2  # sessions that fork one subagent
    subagent_turns_median: float = 3
    arrival_rate: float = 2.0  # sessions per second (Poisson)
    max_context: int = 6144  # a session stops growing here (C of them fit the default engine KV cache)


def _lognormal(rng: np.random.Generator, median: float, sigma: float) -> float:
    return float(median * math.exp(sigma * rng.standard_normal()))


def _session_turns(rng: np.random.Generator, mix: AgentMix, name: str, first: int, turns: int,
                   first_fields: dict) -> list[TurnSpec]:
    """One session's turns: ``first`` prompt tokens, then each turn appends the answer and a tool result."""
    out = [TurnSpec(name, 1, first, mix.output_tokens, **first_fields)]
    context = first
    for turn in range(2, turns + 1):
        tool = max(1, int(_lognormal(rng, mix.tool_median, mix.tool_sigma)))
        if context + mix.output_tokens + tool > mix.max_context:
            break
        context += mix.output_tokens + tool
        long = bool(rng.random() < mix.long_pause_frac)
        think = mix.long_pause_s if long else _lognormal(rng, mix.think_median_s, mix.think_sigma)
        out.append(TurnSpec(name, turn, context, mix.output_tokens, think_s=round(think, 3), long_pause=long))
    return out


def generate(mix: AgentMix, seed: int, target_unique_tokens: int, prefix: str = "s",
             max_sessions: int | None = None) -> list[TurnSpec]:
    """Sessions arriving as a Poisson process until their distinct tokens reach the target (the
    working set, in tokens: the shared prompt once, each session's own tokens, a subagent's beyond
    its parent's)."""
    rng = np.random.default_rng(seed)
    specs: list[TurnSpec] = []
    unique, clock, n = mix.shared_tokens, 0.0, 0
    while unique < target_unique_tokens and (max_sessions is None or n < max_sessions):
        clock += float(rng.exponential(1.0 / mix.arrival_rate))
        name = f"{prefix}{n}"
        n += 1
        own = max(16, int(_lognormal(rng, mix.prefix_median, mix.prefix_sigma)))
        first = min(mix.shared_tokens + own, mix.max_context)
        turns = min(mix.turns_cap, max(1, round(_lognormal(rng, mix.turns_median, mix.turns_sigma))))
        session = _session_turns(rng, mix, name, first, turns,
                                 {"arrival_s": round(clock, 3), "shared_tokens": mix.shared_tokens})
        specs += session
        unique += session[-1].input_tokens - mix.shared_tokens
        if len(session) > 1 and rng.random() < mix.subagent_frac:
            at = int(rng.integers(1, len(session)))  # forks after one of the parent's turns
            base = session[at - 1].input_tokens
            own = max(16, int(_lognormal(rng, mix.tool_median, mix.tool_sigma)))
            turns = min(mix.turns_cap, max(1, round(_lognormal(rng, mix.subagent_turns_median, mix.turns_sigma))))
            sub = _session_turns(rng, mix, f"{name}.sub", min(base + own, mix.max_context), turns,
                                 {"parent": name, "parent_turn": at,
                                  "think_s": round(_lognormal(rng, mix.think_median_s, mix.think_sigma), 3)})
            if sub[0].input_tokens > base:
                specs += sub
                unique += sub[-1].input_tokens - base
    return specs


def unique_tokens(specs: Iterable[TurnSpec]) -> int:
    """Distinct prompt tokens of a trace: the shared prefix once, then each session's growth."""
    specs = list(specs)
    last: dict[str, int] = {}
    base: dict[str, int] = {}
    inputs = {(s.session, s.turn): s.input_tokens for s in specs}
    shared = 0
    for spec in specs:
        last[spec.session] = max(last.get(spec.session, 0), spec.input_tokens)
        if spec.turn == 1:
            shared = max(shared, spec.shared_tokens)
            base[spec.session] = inputs.get((spec.parent, spec.parent_turn), 0) if spec.parent else \
                spec.shared_tokens
    return shared + sum(last[s] - base.get(s, 0) for s in last)


def with_hints(specs: list[TurnSpec], retain_s: float, every: int = 2) -> list[TurnSpec]:
    """The same trace where every ``every``-th session (by order of first appearance) asks kvtier
    to keep it for ``retain_s`` on each turn that is followed by a long pause: an agent that knows
    its tool call will take a while."""
    order = list(dict.fromkeys(s.session for s in specs))
    hinted = {name for i, name in enumerate(order) if i % every == 0}
    pauses = {(s.session, s.turn - 1) for s in specs if s.long_pause}
    return [replace(s, hint_s=retain_s) if s.session in hinted and (s.session, s.turn) in pauses else s
            for s in specs]


def hinted_sessions(specs: Iterable[TurnSpec]) -> set[str]:
    return {s.session for s in specs if s.hint_s > 0}


# ---- token ids ----------------------------------------------------------------------------------
def _ids(seed: int, *what: object, n: int) -> list[int]:
    digest = hashlib.blake2b("/".join(map(str, (seed, *what))).encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return rng.integers(*VOCAB, size=n).tolist() if n > 0 else []


def materialize(specs: list[TurnSpec], seed: int) -> dict[tuple[str, int], list[int]]:
    """Every turn's prompt token ids, from the seed alone: (session, turn) -> ids. Turn 1 is the
    shared prefix (or the parent's prompt) and the session's own tokens; each later turn is the
    previous prompt, then the previous answer (synthetic, so that every arm sends the same ids
    whatever it generated), then a tool result."""
    shared = _ids(seed, "shared", n=max((s.shared_tokens for s in specs), default=0))
    prompts: dict[tuple[str, int], list[int]] = {}
    for spec in sorted(specs, key=_dependency_order(specs)):
        if spec.turn == 1:
            base = list(prompts[(spec.parent, spec.parent_turn)]) if spec.parent else shared[:spec.shared_tokens]
        else:
            previous = prompts[(spec.session, spec.turn - 1)]
            room = spec.input_tokens - len(previous)
            base = previous + _ids(seed, spec.session, spec.turn - 1, "answer", n=min(room, spec.output_tokens))
        base = base[:spec.input_tokens]
        prompts[(spec.session, spec.turn)] = base + _ids(seed, spec.session, spec.turn, "tool",
                                                         n=spec.input_tokens - len(base))
    return prompts


def _dependency_order(specs: list[TurnSpec]):
    """A sort key that puts a parent's forked turn before its subagent's first turn."""
    depth: dict[str, int] = {}
    parents = {s.session: (s.parent, s.parent_turn) for s in specs if s.turn == 1 and s.parent}

    def level(session: str, seen: tuple = ()) -> int:
        if session not in depth:
            parent = parents.get(session)
            depth[session] = 0 if parent is None or parent[0] in seen else level(parent[0], (*seen, session)) + 1
        return depth[session]

    return lambda spec: (level(spec.session), spec.session, spec.turn)


# ---- files --------------------------------------------------------------------------------------
def write_trace(specs: Iterable[TurnSpec], path: Path) -> None:
    skip = {"hint_s": 0.0, "shared_tokens": 0, "parent": None, "parent_turn": 0, "long_pause": False,
            "arrival_s": None, "think_s": None}
    with open(path, "w") as f:
        for spec in specs:
            f.write(json.dumps({k: v for k, v in asdict(spec).items() if skip.get(k, ...) != v}) + "\n")


_FIELDS = {"session": str, "turn": int, "input_tokens": int, "output_tokens": int, "arrival_s": float,
           "think_s": float, "shared_tokens": int, "parent": str, "parent_turn": int, "long_pause": bool}
_HINT = "each line a JSON object: session, turn, input_tokens, output_tokens, and arrival_s or think_s " \
        "(see `kvtier bench agents --help`)"


def _field(doc: dict, name: str, where: str):
    value = doc[name]
    kind = _FIELDS[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UsageError(f"{where}: {name} must be {kind.__name__}, not {value!r}", hint=_HINT)
    if kind in (int, float) and (value < 0 or (isinstance(value, float) and not math.isfinite(value))):
        raise UsageError(f"{where}: {name} must be a finite number >= 0, not {value!r}", hint=_HINT)
    return value


def _parse_line(line: str, where: str) -> TurnSpec:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON ({exc.msg})", hint=_HINT) from None
    if not isinstance(doc, dict):
        raise UsageError(f"{where}: a JSON object is expected", hint=_HINT)
    unknown = sorted(set(doc) - set(_FIELDS))
    if unknown:
        raise UsageError(f"{where}: unknown field {unknown[0]!r}", hint=f"known: {', '.join(_FIELDS)}")
    missing = [name for name in ("session", "turn", "input_tokens", "output_tokens") if name not in doc]
    if missing:
        raise UsageError(f"{where}: missing {', '.join(missing)}", hint=_HINT)
    fields = {name: _field(doc, name, where) for name in doc}
    if fields["turn"] < 1 or fields["input_tokens"] < 1:
        raise UsageError(f"{where}: turn and input_tokens start at 1", hint=_HINT)
    if "arrival_s" not in fields and "think_s" not in fields:
        raise UsageError(f"{where}: no arrival_s or think_s: when may this turn be sent?", hint=_HINT)
    return TurnSpec(**fields)


def read_trace(path: Path, max_context: int | None = None) -> list[TurnSpec]:
    """A trace file, checked whole before anything runs: every error names its line."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read trace {path}: {exc}", hint="pass --trace a JSONL file") from None
    specs = [_parse_line(line, f"{path} line {n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not specs:
        raise UsageError(f"trace {path} has no turns", hint=_HINT)
    _check_sessions(specs, str(path), max_context)
    return specs


def _check_sessions(specs: list[TurnSpec], name: str, max_context: int | None) -> None:
    seen: dict[str, list[TurnSpec]] = {}
    for spec in specs:
        seen.setdefault(spec.session, []).append(spec)
    inputs = {(s.session, s.turn): s.input_tokens for s in specs}
    for session, turns in seen.items():
        numbers = sorted(t.turn for t in turns)
        if numbers != list(range(1, len(numbers) + 1)):
            raise UsageError(f"{name}: session {session!r} has turns {numbers[:8]}",
                             hint="turns are 1, 2, 3, ... once each")
        turns.sort(key=lambda t: t.turn)
        first = turns[0]
        if first.parent is None and first.arrival_s is None:
            raise UsageError(f"{name}: session {session!r} turn 1 has no arrival_s", hint=_HINT)
        if first.parent is not None and (first.parent, first.parent_turn) not in inputs:
            raise UsageError(f"{name}: session {session!r} forks from {first.parent!r} turn {first.parent_turn}, "
                             "which is not in the trace", hint="a subagent names its parent's session and turn")
        for before, after in zip(turns, turns[1:]):
            if after.input_tokens < before.input_tokens:
                raise UsageError(f"{name}: session {session!r} turn {after.turn} has fewer input tokens than "
                                 f"turn {before.turn}",
                                 hint="an agent's context only grows: prompts are replayed append-only")
        too_long = [t for t in turns if max_context and t.input_tokens + t.output_tokens > max_context]
        if too_long:
            t = too_long[0]
            raise UsageError(f"{name}: session {session!r} turn {t.turn} needs {t.input_tokens + t.output_tokens} "
                             f"tokens, over the server's {max_context}", hint="pass a larger --max-len")
