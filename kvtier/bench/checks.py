"""What a benchmark checks before it records a figure: the thing the figure depends on happened
(blocks were loaded, a prefix-cache reset was accepted, bytes compared equal). When it did not, the
figure is refused and the benchmark fails, loudly: a silent failure must never look like a result."""
from __future__ import annotations

import json
import time
import urllib.request
from typing import Callable

from kvtier.errors import KvtierError

__all__ = ["FigureRefused", "loaded_tokens", "require", "require_loaded", "reset_served_prefix_cache"]


class FigureRefused(KvtierError):
    """A figure's precondition did not hold; nothing is recorded."""


def require(condition: object, message: str, hint: str | None = None) -> None:
    """Refuse the figure (raise ``FigureRefused``) unless ``condition`` holds."""
    if not condition:
        raise FigureRefused(message, hint=hint or "the benchmark refused to record a figure it could not check")


def loaded_tokens(output: object) -> int:
    """Tokens kvtier loaded for a vLLM request (its output's ``kv_transfer_params``), 0 if none."""
    params = getattr(output, "kv_transfer_params", None) or {}
    return int((params.get("kvtier") or {}).get("loaded_tokens") or 0)


def require_loaded(loaded: int, prompt_tokens: int, block_tokens: int, what: str, share: float = 0.9) -> None:
    """Refuse a figure that times a restore unless the restore loaded (at least ``share`` of) the
    prompt's full blocks: one that loaded nothing timed a recompute or a prefix-cache hit."""
    full = (prompt_tokens - 1) // block_tokens * block_tokens  # the last token is always computed
    require(full > 0 and loaded >= share * full,
            f"{what}: kvtier loaded {loaded:,} of the prompt's {full:,} full-block tokens",
            hint="a restore that did not load is a recompute or a prefix-cache hit, not a restore")


def _post_json(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        doc = {}
    return doc if isinstance(doc, dict) else {}


def reset_served_prefix_cache(url: str, model: str, timeout_s: float = 60.0,
                              clock: Callable[[], float] = time.monotonic) -> int:
    """Empty a served vLLM's prefix cache, for real; the tries it took.

    vLLM's ``POST /reset_prefix_cache`` answers 200 with ``{"success": false}`` while blocks are
    held (a request whose stores a connector has not reported done): the next prompt would then be a
    prefix-cache hit, not a load or a recompute. An idle engine reports finished stores only in a
    step, so between tries a one-token request (shorter than a block: it caches nothing) steps it.
    A reset still refused after ``timeout_s`` refuses the figure."""
    deadline = clock() + timeout_s
    tries = 0
    while True:
        tries += 1
        if _post_json(url + "/reset_prefix_cache").get("success") is True:
            return tries
        if clock() > deadline:
            raise FigureRefused(f"vLLM at {url} refused to reset its prefix cache for {timeout_s:.0f} s "
                                f"({tries} tries): blocks are still held",
                                hint="a figure timed after a failed reset would time a prefix-cache hit")
        _post_json(url + "/v1/completions", {"model": model, "prompt": [7, 8, 9], "max_tokens": 1,
                                             "temperature": 0})
