"""The connector reads a request's retention hint from ``kv_transfer_params`` (where vLLM puts the
request body's ``kv_transfer_params``; tests/integration/test_retain_hint_vllm.py builds a real vLLM
request from the documented body). A bad hint is ignored with one warning, never failing the request,
and the client is told why. Importing ``kvtier.plugins.vllm.state`` imports no vLLM."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvtier.plan.retention import RetainHint
from kvtier.plugins.vllm.state import retain_hint_of


def request(params):
    return SimpleNamespace(request_id="req-1", kv_transfer_params=params)


@pytest.mark.parametrize("params, hint", [
    ({"kvtier": {"retain_s": 600, "priority": 2}}, RetainHint(600.0, 2)),
    ({"kvtier": {"retain_s": 90.5}}, RetainHint(90.5, 1)),  # priority defaults to 1
    ({"kvtier": {"retain_s": 0, "priority": 0}}, RetainHint(0.0, 0)),  # 0 s: ends the session's retention
    ({"kvtier": {"retain_s": 30 * 86400}}, RetainHint(30 * 86400.0, 1)),
    ({"kvtier": {"retain_s": 5}, "do_remote_prefill": False}, RetainHint(5.0, 1)),  # beside other connectors' keys
])
def test_the_hint_is_read_from_kv_transfer_params(params, hint, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.connector"):
        assert retain_hint_of(request(params)) == (hint, None)
    assert caplog.records == []


@pytest.mark.parametrize("params", [None, {}, {"other": {"retain_s": 5}}, "retain", {"kvtier": None},
                                    {"kvtier": {"session_id": "a", "loaded_tokens": 0}}])  # kvtier's own answer
def test_no_hint_is_no_hint_and_no_warning(params, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.connector"):
        assert retain_hint_of(request(params)) == (None, None)
        assert retain_hint_of(SimpleNamespace(request_id="r")) == (None, None)  # a request without the attribute
    assert caplog.records == []


@pytest.mark.parametrize("ours, why", [
    ({"retain_s": -1}, "out of range"), ({"retain_s": "600"}, "not a number"), ({"retain_s": True}, "not a number"),
    ({"retain_s": float("nan")}, "not a number"), ({"retain_s": 30 * 86400 + 1}, "out of range"),
    ({"retain_s": 1e300}, "out of range"), ({"priority": 3}, "not a number"),
    ({"retain_s": 60, "priority": "high"}, "priority"), ({"retain_s": 60, "priority": -1}, "priority"),
    ({"retain_s": 60, "priority": 2.5}, "priority"), ({"retain_s": 60, "priority": 10**7}, "priority"),
])
def test_a_bad_hint_is_ignored_with_one_warning_and_the_reason_for_the_client(ours, why, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.connector"):
        hint, ignored = retain_hint_of(request({"kvtier": ours}))
    assert hint is None and ignored.startswith("retention hint ignored: ") and why in ignored
    assert len(caplog.records) == 1
    assert "req-1" in caplog.records[0].getMessage() and why in caplog.records[0].getMessage()

