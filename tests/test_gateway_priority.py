"""`priority` in an OpenAI request body (vLLM's server field) reaches the router's GenerateRequest, whence
the router passes it to the decode worker's scheduler (tests/test_priority_preemption.py: what it does)."""

from __future__ import annotations

import pydantic
import pytest

from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.router_client import chat_requests, completion_requests


def test_priority_travels_into_every_router_call():
    body = CompletionRequest(model="m", prompt=["a", "b"], priority=-3)
    assert [r.priority for r in completion_requests(body)] == [-3, -3]
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], priority=7)
    assert [r.priority for r in chat_requests(chat)] == [7]
    assert completion_requests(CompletionRequest(model="m", prompt="a"))[0].priority == 0  # the default


def test_a_priority_outside_int32_is_refused():
    with pytest.raises(pydantic.ValidationError, match="priority"):
        CompletionRequest(model="m", prompt="a", priority=2**40)
