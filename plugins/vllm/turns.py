"""The scheduler half's record of every turn: the facts ``kvtier.plan.reasons`` classifies, gathered
where vLLM calls the connector.

* ``get_num_new_matched_tokens`` notes what the lookup saw (``RequestState.lookup``);
* ``update_state_after_alloc`` (first admission) calls ``admitted``: the load that was planned, and
  -- only when servable tokens are recomputed -- why no more: how the prompt compares with the
  session's recorded blocks and token ids, the first missing block's drop (``manager.table.drops``),
  another model's catalog listing the session;
* ``complete`` calls ``load_failed`` for a load that failed verification (the turn becomes
  ``checksum``);
* ``_plan_stores`` calls ``store_skipped`` when the turn's blocks are not stored (below the DRAM
  break-even: the next turn's miss is then ``below_store_threshold``);
* ``request_finished`` calls ``finished``: the turn is counted by reason (``/metrics``).

All of it runs under the scheduler's lock; the turn log is the manager's (``manager.turns``).
``TurnRecorder`` gets what it reads explicitly: the manager, the cost model (and the one decisions
use), the fingerprint and the scheduler's table of live requests.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvtier.plan.decide import worth_keeping
from kvtier.plan.reasons import TurnFacts, apply_facts
from kvtier.plugins.vllm.state import RequestState

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.jobs import Job, JobResult
    from kvtier.layout import ModelFingerprint
    from kvtier.plan.costmodel import CostModel
    from kvtier.plan.manager import TierManager

__all__ = ["TurnRecorder", "store_skipped", "tier_name"]

log = logging.getLogger("kvtier.connector")


def tier_name(from_nvme: list[bool]) -> str | None:
    """dram, nvme or dram+nvme for blocks loaded from those tiers (None: no block)."""
    if not from_nvme:
        return None
    nvme = sum(from_nvme)
    return "nvme" if nvme == len(from_nvme) else "dram" if nvme == 0 else "dram+nvme"


class TurnRecorder:
    """Records each request's turn in the manager's turn log, and counts it once it finishes."""

    def __init__(self, manager: "TierManager", cost: "CostModel", decide_cost: "CostModel | None",
                 fingerprint: "ModelFingerprint", requests: "dict[str, RequestState]"):
        self.manager, self.cost, self.decide_cost = manager, cost, decide_cost
        self.fingerprint, self.requests = fingerprint, requests
        self.block_tokens = fingerprint.geometry.block_tokens

    def admitted(self, state: "RequestState", request: Any, job: "Job | None",
                 planned_tokens: int, vanished_tokens: int) -> None:
        """A request's first admission: record its turn (never fails the request)."""
        try:
            self._admitted(state, request, job, planned_tokens, vanished_tokens)
        except Exception:  # noqa: BLE001 - an explanation must never cost a request
            log.exception("kvtier: could not record the turn of %s", request.request_id)

    def _admitted(self, state: "RequestState", request: Any, job: "Job | None",
                  planned_tokens: int, vanished_tokens: int) -> None:
        bt = self.block_tokens
        prompt_tokens = int(getattr(request, "num_prompt_tokens", request.num_tokens))
        lookup = state.lookup
        if lookup is None:  # not looked up by this connector: what it would have seen
            usable = min(len(request.block_hashes), (request.num_tokens - 1) // bt) * bt
            lookup = (usable, None, None, None)
        usable_tokens, found_tokens, candidate, decision = lookup
        facts = TurnFacts(prompt_tokens=prompt_tokens, block_tokens=bt, usable_tokens=usable_tokens,
                          vllm_cached_tokens=state.local_tokens, found_tokens=found_tokens,
                          loaded_tokens=planned_tokens,
                          decision=decision, vanished_tokens=vanished_tokens, now=time.time())
        if job is not None and job.moves:
            facts.load_tier = tier_name([move.from_nvme for move in job.moves])
        elif candidate is not None and candidate.in_dram:
            facts.load_tier = tier_name([not in_dram for in_dram in candidate.in_dram])
        cost = self.cost
        if decision in ("recompute", "split") and candidate is not None and cost.prefill is not None:
            split = cost.split_for(candidate.computed_blocks, candidate.dram_blocks, candidate.hit_blocks,
                                   candidate.prompt_tokens, candidate.in_dram)
            facts.restore_s, facts.recompute_s = split.all_load_s, split.none_load_s
        if facts.served_tokens < facts.usable_tokens:
            self._why_not_more(state, request, facts)
        record = apply_facts(facts, session_id=state.session_id, request_id=str(request.request_id))
        self.manager.turns.add(record)
        state.facts, state.turn = facts, record

    def _why_not_more(self, state: "RequestState", request: Any, facts: TurnFacts) -> None:
        """Servable tokens are recomputed: the facts that tell why (only paid on such turns)."""
        manager, bt = self.manager, self.block_tokens
        hashes = request.block_hashes
        usable_blocks = facts.usable_tokens // bt
        session = manager.table.sessions.get(state.session_id)
        if session is not None and session.keys:  # listed from its first request, but with no block yet: new
            facts.session_known = True
            keys = session.keys
            facts.session_tokens = len(keys) * bt
            limit = min(len(keys), usable_blocks, len(hashes))
            match = 0
            while match < limit and keys[match] == hashes[match]:
                match += 1
            facts.match_tokens = match * bt
            if match < len(keys) and match < usable_blocks:
                facts.diverged_at = _divergence(manager.catalog_log.session_tokens(session), request, match, bt)
            last = manager.turns.last(state.session_id)
            facts.stores_skipped = last.store_skipped if last is not None else \
                not worth_keeping(facts.session_tokens, self.decide_cost, on_nvme=False)
        elif manager.catalog_log.catalog is not None:
            other = manager.catalog_log.catalog.find_elsewhere(state.session_id)
            if other is not None:
                facts.foreign = self._describe_foreign(other)
        first_missing = (facts.found_tokens or 0) // bt
        if first_missing < len(hashes):
            dropped = manager.table.drops.find(state.namespace, hashes[first_missing])
            if dropped is not None:
                facts.dropped_cause, facts.dropped_at = dropped
        if self.cost.prefill is not None:
            facts.store_threshold_tokens = self.cost.break_even_tokens(from_nvme=False)

    def _describe_foreign(self, other: dict) -> str:
        mine = self.fingerprint

        def name(model: Any, weights: Any, digest: Any) -> str:
            parts = [f"model {model!r}"]
            if weights:
                parts.append(f"weights {str(weights)[:16]}")
            if digest:
                parts.append(f"fingerprint {str(digest)[:12]}")
            return ", ".join(parts)

        theirs = name(other.get("model_id"), other.get("weights"), other.get("digest"))
        return f"its blocks belong to {theirs}; this server runs {name(mine.model_id, mine.weights, mine.hex)}"

    def load_failed(self, job: "Job", result: "JobResult") -> None:
        """A LOAD job failed on some block: vLLM recomputes from the first failed block on."""
        state = self.requests.get(job.req_id) if job.req_id is not None else None
        if state is None or state.turn is None or state.facts is None or not job.moves:
            return
        try:
            failed = result.failed or range(len(job.moves))
            facts = state.facts
            facts.failed_tokens = max(facts.failed_tokens, (len(job.moves) - min(failed)) * self.block_tokens)
            facts.load_error = result.error
            apply_facts(facts, state.turn)
        except Exception:  # noqa: BLE001 - an explanation must never cost a job's completion
            log.exception("kvtier: could not record the failed load of %s", job.req_id)

    def finished(self, state: "RequestState") -> None:
        """The request is done: count its turn by reason, once."""
        record = state.turn
        if record is None or record.finished:
            return
        record.finished = True
        count = self.manager.telemetry.count
        count(f"turns_{record.reason}")
        count(f"recomputed_tokens_{record.reason}", record.recomputed_tokens)


def _divergence(tokens: Any, request: Any, block: int, bt: int) -> int:
    """The first token of block ``block`` where the prompt differs from the session's stored
    ``tokens`` (the block's first token when the token ids are not known here)."""
    start = block * bt
    prompt = request.prompt_token_ids
    if tokens is None or prompt is None:
        return start
    end = min(start + bt, len(tokens), len(prompt))
    for i in range(start, end):
        if int(tokens[i]) != int(prompt[i]):
            return i
    return start  # same tokens, another block hash: another cache salt or adapter


def store_skipped(state: "RequestState") -> None:
    if state.turn is not None:
        state.turn.store_skipped = True
