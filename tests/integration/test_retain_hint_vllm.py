"""The retention hint's documented request body (docs/cli.md) through vLLM's own request parsing: the
OpenAI chat request's ``kv_transfer_params`` becomes ``Request.kv_transfer_params``, which the
connector reads. Real vLLM classes, no engine."""
from __future__ import annotations

from support.realpath import need

vllm = need("vllm")


def test_the_documented_body_reaches_the_connector():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.v1.request import Request

    from kvtier.plan.retention import RetainHint
    from kvtier.plugins.vllm.state import retain_hint_of

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "session_id": "agent-1",
            "kv_transfer_params": {"kvtier": {"retain_s": 600, "priority": 2}}}
    params = ChatCompletionRequest.model_validate(body).to_sampling_params(16, {})
    request = Request("req-1", [1, 2, 3], params, None)
    assert retain_hint_of(request) == (RetainHint(600.0, 2), None)
    plain = Request("req-2", [1, 2, 3], ChatCompletionRequest.model_validate(
        {k: v for k, v in body.items() if k != "kv_transfer_params"}).to_sampling_params(16, {}), None)
    assert retain_hint_of(plain) == (None, None)
