"""Retention hints: a request asking kvtier to keep its session for a while (vLLM#57103, LMCache#4456).

A request may carry ``kv_transfer_params: {"kvtier": {"retain_s": N, "priority": P}}``: keep this
session's blocks N seconds, at priority P (an integer, default 1; higher is kept longer). It is a soft
retention, not a pin: it never refuses a store, a load or an operator's action. While it is live, the
session's blocks come last among eviction victims, after every unhinted block, in DRAM demotion and
NVMe drops alike (``BlockTable.victims``: a stable re-ordering of the tier policy's order by a
per-block ``retain`` value, 0 for none, else the strongest live priority + 1 among the sessions
holding the block). ``retain_s: 0`` ends a session's retention; a later hint replaces an earlier one.

This module only reads hints; a bad one raises ``UsageError`` (the connector logs it and serves the
request as if it had none).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtier.errors import UsageError

__all__ = ["DEFAULT_PRIORITY", "HINT_KEY", "MAX_PRIORITY", "MAX_RETAIN_S", "RetainHint", "parse_retain_hint"]

HINT_KEY = "kvtier"  # kv_transfer_params' key of kvtier's own fields
MAX_RETAIN_S = 30 * 86400.0  # longer is taken for a mistake (milliseconds, a timestamp)
MAX_PRIORITY = 1_000_000
DEFAULT_PRIORITY = 1
_SHAPE = 'kv_transfer_params: {"kvtier": {"retain_s": 600, "priority": 2}}'


@dataclass(frozen=True)
class RetainHint:
    seconds: float  # from when the request is first scheduled; 0 ends the session's retention
    priority: int = DEFAULT_PRIORITY


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_retain_hint(params: Any) -> RetainHint | None:
    """The retention hint in a request's ``kv_transfer_params`` (None: it has none); ``UsageError``
    for one that is malformed: ``retain_s`` not a number, negative, or over 30 days; ``priority`` not
    an integer from 0 to 1,000,000."""
    if not isinstance(params, dict):
        return None
    ours = params.get(HINT_KEY)
    if not isinstance(ours, dict) or ("retain_s" not in ours and "priority" not in ours):
        return None
    seconds = ours.get("retain_s")
    if not _is_number(seconds) or not math.isfinite(seconds):
        raise UsageError(f"retain_s {seconds!r} is not a number of seconds", hint=_SHAPE)
    if not 0 <= seconds <= MAX_RETAIN_S:
        raise UsageError(f"retain_s {seconds!r} is out of range", hint="0 to 2592000 seconds (30 days)")
    priority = ours.get("priority", DEFAULT_PRIORITY)
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= MAX_PRIORITY:
        raise UsageError(f"priority {priority!r} is not an integer from 0 to {MAX_PRIORITY:,}",
                         hint="higher is kept longer; the default is 1")
    return RetainHint(float(seconds), priority)
