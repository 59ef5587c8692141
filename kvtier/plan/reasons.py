"""Why did this turn recompute? What kvtier found for a request, and why it did not load more.

Per request, the connector's scheduler half gathers the facts (``TurnFacts``: what vLLM's own
prefix cache held, what kvtier's tiers held, what it loaded and from where, the cost model's
choice, and -- only when servable tokens were recomputed -- how the prompt compares with the
session's stored blocks and token ids, whether the first missing block was dropped and why,
whether the session is stored under another model fingerprint). ``classify`` turns them into one
stable reason code and a sentence; the manager keeps the last turns of each session
(``TurnLog``, bounded) and remembers recent drops by block (``DropLog``, bounded), which is how a
later turn can say "dropped 3 min ago by the operator".

Reason codes (stable: the admin API, ``/metrics`` and scripts use them):

``full_hit``               nothing servable was recomputed and kvtier loaded part of it (the rest of
                           the prompt was new, or was in vLLM's own prefix cache)
``vllm_prefix_cache``      vLLM's own prefix cache already held every servable token kvtier had
``diverged``               the prompt differs from the session's stored tokens at token N
``dropped``                blocks of this prefix were stored once and dropped (when, and why:
                           operator, NVMe budget, DRAM pressure, a failed read...)
``below_break_even``       the cost model predicted that recomputing beats loading (both times given)
``checksum``               a load failed verification (a corrupt or missing NVMe record): recomputed
``fingerprint``            the session is stored under another model fingerprint (model, weights,
                           KV layout): its blocks cannot serve this engine
``below_store_threshold``  the prompt is too short to store or load (under one block, or under the
                           DRAM break-even: loading it would be slower than recomputing it)
``new_session``            kvtier has nothing for this session yet
``miss``                   the session is known but nothing explains the miss further (never stored:
                           DRAM had no room; or dropped too long ago to remember)

"Servable" tokens are the prompt's full blocks minus the last token (vLLM always computes at least
one token): the tail after the last full block is recomputed on every turn and is never a miss.

No torch, no numpy at import time (the CLI formats turns with ``format_turn``).
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, fields
from typing import Any, Iterable

__all__ = ["REASONS", "HIT_REASONS", "DROP_CAUSES", "TurnFacts", "TurnRecord", "TurnLog", "DropLog", "classify",
           "format_turn", "apply_facts", "stored_note"]

REASONS: dict[str, str] = {
    "full_hit": "kvtier loaded every servable token it held; the rest was new",
    "vllm_prefix_cache": "vLLM's own prefix cache already held the tokens",
    "diverged": "the prompt diverged from the session's stored tokens",
    "dropped": "blocks of this prefix were stored once and dropped",
    "below_break_even": "the cost model predicted recomputing to be faster than loading",
    "checksum": "a load failed verification and was recomputed",
    "fingerprint": "the session is stored under another model fingerprint",
    "below_store_threshold": "the prompt is too short to be stored or loaded",
    "new_session": "nothing stored for this session yet",
    "miss": "nothing held for this prefix",
}
HIT_REASONS = ("full_hit", "vllm_prefix_cache")  # every other reason is a miss

DROP_CAUSES: dict[str, str] = {
    "operator": "by the operator (kvtier evict --to drop)",
    "nvme_budget": "to stay within the NVMe budget (least recently used blocks go first)",
    "nvme_full": "under DRAM pressure, with no room left on NVMe to demote them to",
    "dram_full": "under DRAM pressure, with no NVMe tier to demote them to",
    "not_worth_nvme": "under DRAM pressure, not demoted: reloading them from NVMe would be slower than recomputing",
    "nvme_failing": "under DRAM pressure while the NVMe disk was failing",
    "bad_read": "after a failed NVMe read (missing or corrupt record)",
}
_CAUSE_IDS = {cause: i + 1 for i, cause in enumerate(DROP_CAUSES)}
_CAUSE_NAMES = {i: cause for cause, i in _CAUSE_IDS.items()}


@dataclass(slots=True)
class TurnFacts:
    """What the scheduler half knew about one request, at admission (and after its load)."""

    prompt_tokens: int
    block_tokens: int
    usable_tokens: int  # servable: the prompt's full blocks, never its last token
    vllm_cached_tokens: int = 0  # vLLM's own prefix hit
    found_tokens: int | None = None  # the prompt's leading tokens held in kvtier's tiers (None: not looked up)
    loaded_tokens: int = 0  # kvtier's planned load
    load_tier: str | None = None  # dram, nvme or dram+nvme
    decision: str | None = None  # the cost model's choice for the stored hit: load, split, recompute
    restore_s: float | None = None  # predicted: load the whole stored hit, recompute the rest of the prompt
    recompute_s: float | None = None  # predicted: recompute everything after vLLM's own hit
    vanished_tokens: int = 0  # planned, but gone between the lookup and the load
    failed_tokens: int = 0  # loaded, then recomputed: the load failed verification
    load_error: str | None = None
    session_known: bool = False
    session_tokens: int = 0  # tokens the session's recorded blocks cover
    match_tokens: int = 0  # leading tokens of the prompt in the session's recorded blocks (whole blocks)
    diverged_at: int | None = None  # first token where the prompt differs from the session's
    dropped_cause: str | None = None  # the first block not held was dropped: why (a DROP_CAUSES key)
    dropped_at: float | None = None  # and when (wall clock)
    foreign: str | None = None  # the session is stored under another fingerprint: how it differs
    stores_skipped: bool = False  # the session's earlier turns were not stored (below the DRAM break-even)
    store_threshold_tokens: int | None = None  # the DRAM break-even, when the cost model has one
    now: float = 0.0  # wall clock of the turn

    @property
    def served_tokens(self) -> int:
        """Tokens not recomputed: vLLM's hit and what kvtier loaded successfully."""
        return self.vllm_cached_tokens + self.effective_loaded_tokens

    @property
    def effective_loaded_tokens(self) -> int:
        return max(0, self.loaded_tokens - self.vanished_tokens - self.failed_tokens)


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    return f"{seconds:.1f} s" if seconds < 120 else _ago(seconds)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _dropped(f: TurnFacts, start: int) -> tuple[str, str]:
    when = f" {_ago(f.now - f.dropped_at)} before this turn" if f.dropped_at else ""
    cause = DROP_CAUSES.get(f.dropped_cause or "", f.dropped_cause or "for an unknown cause")
    return "dropped", f"blocks from token {start} were stored once and dropped{when}, {cause}"


def classify(f: TurnFacts) -> tuple[str, str]:
    """(reason code, one sentence) for a turn's facts; the first cause that stopped kvtier from
    serving more of the prompt wins."""
    bt = f.block_tokens
    served = f.served_tokens
    if f.failed_tokens:
        error = f": {f.load_error}" if f.load_error else ""
        return "checksum", (f"a load from {f.load_tier or 'the tiers'} failed verification{error}; vLLM "
                            f"recomputed {f.failed_tokens} tokens from token "
                            f"{f.vllm_cached_tokens + f.loaded_tokens - f.failed_tokens}")
    if f.usable_tokens <= 0:
        return "below_store_threshold", (f"a prompt of {f.prompt_tokens} tokens is not longer than one block "
                                         f"({bt} tokens): nothing to store or load")
    found = f.found_tokens
    if f.vanished_tokens:
        return "dropped", (f"{f.vanished_tokens} stored tokens were dropped between the lookup and the load "
                           "(DRAM or NVMe pressure) and recomputed")
    if found is not None and found > served:
        tier = f" from {f.load_tier}" if f.load_tier else ""
        return "below_break_even", (f"the cost model recomputed {found - served} stored tokens: loading{tier} was "
                                    f"predicted at {_ms(f.restore_s)}, recomputing at {_ms(f.recompute_s)}")
    if served >= f.usable_tokens:
        return _hit(f, served)
    # some servable tokens were recomputed, and kvtier served all it held of the prefix
    if f.session_known and f.match_tokens > served:
        # the prompt repeats the session's recorded blocks past what was served: they are not held
        start = found if found is not None else served
        if f.dropped_cause:
            return _dropped(f, start)
        if f.stores_skipped:
            threshold = f" ({f.store_threshold_tokens} tokens)" if f.store_threshold_tokens else ""
            return "below_store_threshold", (f"the session's earlier prompts were shorter than the DRAM break-even"
                                             f"{threshold}: not stored, as loading them would be slower than "
                                             "recomputing them")
        return "miss", (f"the session's blocks from token {start} are not held: never stored (DRAM had no room) "
                        "or dropped too long ago to remember why")
    if f.session_known and f.diverged_at is not None:
        return "diverged", (f"prefix diverged at token {f.diverged_at} from the stored session "
                            f"({f.session_tokens} tokens)")
    if not f.session_known:
        if f.dropped_cause:
            return _dropped(f, found or 0)
        if f.foreign:
            return "fingerprint", f"the session is stored under another model fingerprint: {f.foreign}"
    if served > 0:
        return _hit(f, served)
    if not f.session_known:
        return "new_session", "nothing stored for this session yet"
    return "miss", "nothing stored for this prefix"


def _hit(f: TurnFacts, served: int) -> tuple[str, str]:
    new = max(0, f.prompt_tokens - served)
    loaded = f.effective_loaded_tokens
    if loaded:
        cached = f" (after {f.vllm_cached_tokens} in vLLM's prefix cache)" if f.vllm_cached_tokens else ""
        where = f.load_tier or "the tiers"
        return "full_hit", f"loaded {loaded} tokens from {where}{cached}; {new} new tokens computed"
    return "vllm_prefix_cache", f"vLLM's prefix cache held {f.vllm_cached_tokens} tokens; {new} new tokens computed"


@dataclass(slots=True)
class TurnRecord:
    """One request as ``kvtier inspect`` shows it (``to_dict``: the admin API's turn)."""

    session_id: str
    request_id: str
    time: float
    prompt_tokens: int
    vllm_cached_tokens: int
    stored_tokens_found: int | None  # the prompt's leading tokens held in kvtier's tiers (None: not looked up)
    loaded_tokens: int  # loaded by kvtier and used
    tier: str | None  # where they came from: dram, nvme, dram+nvme
    recomputed_tokens: int  # prefilled by vLLM this turn
    reason: str
    detail: str
    turn: int = 0  # this session's turn number (1 = the first this server saw, or remembers)
    restore_s: float | None = None  # below_break_even: predicted load (+ recompute of the rest) ...
    recompute_s: float | None = None  # ... and recompute times
    diverged_at: int | None = None
    dropped_cause: str | None = None
    dropped_at: float | None = None
    store_skipped: bool = False  # this turn's blocks were not stored (below the DRAM break-even)
    finished: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def apply_facts(facts: TurnFacts, record: TurnRecord | None = None, session_id: str = "",
                request_id: str = "") -> TurnRecord:
    """Classify ``facts`` into ``record`` (a new one when None) and return it."""
    reason, detail = classify(facts)
    loaded = facts.effective_loaded_tokens
    values = dict(prompt_tokens=facts.prompt_tokens, vllm_cached_tokens=facts.vllm_cached_tokens,
                  stored_tokens_found=facts.found_tokens, loaded_tokens=loaded,
                  tier=facts.load_tier if loaded else None,
                  recomputed_tokens=max(0, facts.prompt_tokens - facts.served_tokens), reason=reason, detail=detail,
                  restore_s=facts.restore_s if reason == "below_break_even" else None,
                  recompute_s=facts.recompute_s if reason == "below_break_even" else None,
                  diverged_at=facts.diverged_at if reason == "diverged" else None,
                  dropped_cause=facts.dropped_cause if reason == "dropped" else None,
                  dropped_at=facts.dropped_at if reason == "dropped" else None)
    if record is None:
        return TurnRecord(session_id=session_id, request_id=request_id, time=facts.now or time.time(), **values)
    for name, value in values.items():
        setattr(record, name, value)
    return record


class TurnLog:
    """The last ``per_session`` turns of the ``max_sessions`` sessions seen most recently (bounded:
    a session that falls out starts its numbering again)."""

    def __init__(self, per_session: int = 8, max_sessions: int = 1024):
        self.per_session = per_session
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[list[int], deque]] = OrderedDict()

    def add(self, record: TurnRecord) -> TurnRecord:
        entry = self._sessions.get(record.session_id)
        if entry is None:
            entry = self._sessions[record.session_id] = ([0], deque(maxlen=self.per_session))
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(record.session_id)
        entry[0][0] += 1
        record.turn = entry[0][0]
        entry[1].append(record)
        return record

    def of(self, session_id: str) -> list[TurnRecord]:
        """Oldest first."""
        entry = self._sessions.get(session_id)
        return list(entry[1]) if entry else []

    def last(self, session_id: str) -> TurnRecord | None:
        entry = self._sessions.get(session_id)
        return entry[1][-1] if entry and entry[1] else None

    def to_dicts(self, session_id: str) -> list[dict[str, Any]]:
        return [record.to_dict() for record in self.of(session_id)]

    def __len__(self) -> int:
        return len(self._sessions)


class DropLog:
    """The last ``capacity`` blocks dropped (forgotten by every tier), with when and why: a ring of
    64-bit hashes of (namespace, key), about 17 bytes a block. In memory only."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._written = 0
        self._arrays = None  # allocated on the first drop

    def note(self, namespace: bytes, key: bytes, cause: str, when: float | None = None) -> None:
        if self._arrays is None:
            import numpy as np

            self._arrays = (np.zeros(self.capacity, np.int64), np.zeros(self.capacity, np.float64),
                            np.zeros(self.capacity, np.uint8))
        hashes, times, causes = self._arrays
        i = self._written % self.capacity
        hashes[i] = hash((bytes(namespace), bytes(key)))
        times[i] = time.time() if when is None else when
        causes[i] = _CAUSE_IDS.get(cause, 0)
        self._written += 1

    def note_many(self, blocks: Iterable[tuple[bytes, bytes]], cause: str) -> None:
        when = time.time()
        for namespace, key in blocks:
            self.note(namespace, key, cause, when)

    def find(self, namespace: bytes, key: bytes) -> tuple[str, float] | None:
        """(cause, wall time) of the block's latest drop, if still remembered."""
        if self._arrays is None:
            return None
        import numpy as np

        hashes, times, causes = self._arrays
        filled = min(self._written, self.capacity)
        hits = np.flatnonzero(hashes[:filled] == hash((bytes(namespace), bytes(key))))
        if not len(hits):
            return None
        latest = int(hits[np.argmax(times[hits])])
        return _CAUSE_NAMES.get(int(causes[latest]), "unknown"), float(times[latest])

    def __len__(self) -> int:
        return min(self._written, self.capacity)


def format_turn(turn: dict[str, Any]) -> str:
    """One line for ``kvtier inspect``: "turn 3 · 512 of 540 tokens loaded from dram · recomputed
    28: prefix diverged at token 512 from the stored session (1024 tokens)"."""
    prompt, loaded = turn.get("prompt_tokens", 0), turn.get("loaded_tokens", 0)
    parts = [f"turn {turn.get('turn', '?')}"]
    if loaded:
        parts.append(f"{loaded} of {prompt} tokens loaded from {turn.get('tier') or 'the tiers'}")
    else:
        parts.append(f"{prompt} tokens, none loaded")
    if turn.get("vllm_cached_tokens"):
        parts.append(f"{turn['vllm_cached_tokens']} in vLLM's prefix cache")
    line = " · ".join(parts)
    return f"{line} · recomputed {turn.get('recomputed_tokens', 0)}: [{turn.get('reason')}] {turn.get('detail', '')}"


def stored_note(info: dict[str, Any], block_tokens: int, store_skipped: bool, break_even_tokens: int | None,
                dropped: tuple[str, float] | None) -> str | None:
    """Why a session listed with a session row (``Views.sessions_overview``) holds nothing in DRAM or
    on NVMe, in one sentence; None when it holds blocks there. A session is listed from its first
    request: this says what a reader of ``kvtier sessions`` would otherwise have to guess."""
    if info["blocks_dram"] or info["blocks_nvme"]:
        return None
    tokens = info["prompt_tokens"]
    if not info["blocks"]:
        return (f"nothing stored: {tokens} tokens, shorter than one block ({block_tokens} tokens); "
                f"kvtier stores whole blocks")
    if store_skipped:
        # the break-even now (the link and prefill rates move): shown where it still explains the row
        under = f" ({break_even_tokens:,} tokens)" if break_even_tokens and break_even_tokens > tokens else ""
        return (f"not stored: {tokens:,} tokens are under the DRAM break-even{under}, "
                f"where recomputing them beats loading them")
    if dropped is not None:
        return f"dropped {DROP_CAUSES.get(dropped[0], dropped[0])}"
    if info["state"] in ("hot", "pinned"):
        return "its blocks are being stored"
    return "nothing held: its blocks were dropped"
