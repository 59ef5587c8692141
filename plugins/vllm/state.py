"""What the connector's scheduler half knows of one request, from its first lookup to its end.

Its own module so that the parts beside the scheduler (turn recording, shared-tier lookups) name it
without importing the scheduler.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import KvtierError
from kvtier.plan.index import validate_session_id
from kvtier.plan.retention import RetainHint, parse_retain_hint

__all__ = ["RequestState", "anonymous_session", "retain_hint_of", "session_of", "valid_session"]

log = logging.getLogger("kvtier.connector")


def session_of(request: Any) -> str:
    """The request's session: ``session_id`` (body, X-Session-ID header) or one derived from its prefix."""
    session_id = getattr(request, "session_id", None)
    if session_id:
        try:
            return validate_session_id(str(session_id))
        except Exception:  # an odd id must not fail the request: fall back to an anonymous one
            log.warning("kvtier: ignoring invalid session id %r", session_id)
    hashes = request.block_hashes
    return anonymous_session(hashes[0]) if hashes else f"anon-{request.request_id}"[:128]


def valid_session(session_id: str) -> bool:
    try:
        validate_session_id(session_id)
        return True
    except Exception:  # noqa: BLE001 - session_of names such a request anonymously, and so do its blocks
        return False


def anonymous_session(first_block_hash: bytes) -> str:
    """The session of a request without a session id: named after its first block's hash."""
    return f"anon-{bytes(first_block_hash).hex()[:16]}"


def retain_hint_of(request: Any) -> tuple[RetainHint | None, str | None]:
    """The retention hint a request carries in ``kv_transfer_params`` (``{"kvtier": {"retain_s": N,
    "priority": P}}``, see ``kvtier.plan.retention``), and why it was ignored: a malformed one never
    fails the request; it is logged once, and the reason goes back to the client in the response's
    ``kv_transfer_params.kvtier.hint_ignored`` (``request_finished``)."""
    try:
        return parse_retain_hint(getattr(request, "kv_transfer_params", None)), None
    except KvtierError as exc:
        why = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
        log.warning("kvtier: ignoring the retention hint of request %s: %s", getattr(request, "request_id", "?"), why)
        return None, f"retention hint ignored: {why}"


@dataclass
class RequestState:
    request: Any
    namespace: bytes
    session_id: str
    block_ids: list[int] = field(default_factory=list)  # the request's HBM block table
    stored_blocks: int = 0  # blocks [0, stored_blocks) are held by kvtier (or were offered)
    local_tokens: int = 0  # vLLM's own prefix hit at admission
    loaded_tokens: int = 0  # tokens loaded from kvtier at admission
    counted: bool = False  # its prompt is in the hit-rate counters
    decision: str | None = None  # load | split | recompute, for the hit it had at admission
    skipped_blocks: int = 0  # blocks not stored because the prefix was below the break-even (counted once)
    lookup: tuple | None = None  # what the last lookup saw: (servable tokens, tokens held, LoadCandidate, decision)
    facts: Any = None  # kvtier.plan.reasons.TurnFacts of its turn (from its first admission)
    turn: Any = None  # kvtier.plan.reasons.TurnRecord: its entry in the session's turn log
    shared: Any = None  # its shared-store lookup / fetch (kvtier.plugins.vllm.shared.SharedLookups)
    retain: RetainHint | None = None  # its retention hint, until applied to its session (first stores)
    hint_ignored: str | None = None  # why its retention hint was ignored (told to the client at its end)
