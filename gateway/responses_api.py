"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) over the chat path.

A Responses request becomes a chat completions request (`ResponsesRequest.chat_body`): `instructions` is the
system turn, `input` items become messages (a `function_call` item an assistant turn's tool call, a
`function_call_output` item a tool turn), `text.format` is `response_format`, function tools and
`tool_choice` are chat's (gateway/tools.py). It runs as a chat request does, and its answer is turned back:
reasoning, message and function-call output items (`output_items`), or, streamed, the Responses events
(`ResponseEvents`: `response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`).

With `store` (the default, as OpenAI's) the gateway keeps a response and the conversation that led to it in
memory (`ResponseStore`, per tenant, the least recently used dropped past its bounds), so that
`previous_response_id` continues it and `GET /v1/responses/{id}` returns it. A gateway's store is its own:
behind several gateways, a conversation continues on the gateway that holds it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.errors import APIError
from gateway.protocol import INT32
from gateway.responses import Totals

# fields of OpenAI's Responses API this server does not implement: refused by name when set
_REFUSED = {
    "background": "background responses are not supported by this server",
    "reasoning": "reasoning settings (effort, summary) are not supported by this server",
    "top_logprobs": "top_logprobs is not supported on /v1/responses by this server",
    "include": "include is not supported by this server",
    "conversation": "conversations are not supported by this server: use previous_response_id",
    "prompt": "prompt templates are not supported by this server",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ContentPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Body):
    """A reasoning item given back as input: the model's own earlier reasoning, which chat templates drop."""

    type: Literal["reasoning"]


Item = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=1024)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop the oldest turns) is refused by validation

    @model_validator(mode="before")
    @classmethod
    def _typed_messages(cls, data: Any) -> Any:
        """OpenAI's easy input messages ({"role", "content"} with no type) are message items."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {
                **data,
                "input": [
                    {**i, "type": "message"} if isinstance(i, dict) and "type" not in i and "role" in i else i
                    for i in data["input"]
                ],
            }
        return data

    def refused(self) -> APIError | None:
        for name, reason in _REFUSED.items():
            if (self.model_extra or {}).get(name) not in (None, False, [], {}):
                return APIError(400, reason, name, "unsupported")
        return None

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_body(self, history: list[dict]) -> dict:
        """The chat completions request this runs as; `history`: the earlier turns (previous_response_id)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + messages_of(self.items()),
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name, value in (
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("user", self.user),
        ):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError(
                    400, "text.format json_schema needs a schema", "text.format", "invalid_request"
                )
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.name, "schema": fmt.schema_},
            }
        return body

    def echo(self) -> dict:
        """The request's settings as a response object repeats them."""
        tool_choice: Any = self.tool_choice if self.tool_choice is not None else "auto"
        if isinstance(tool_choice, NamedFunction):
            tool_choice = tool_choice.model_dump()
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": None,
            "store": self.store,
            "temperature": self.temperature if self.temperature is not None else 1.0,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": tool_choice,
            "tools": [t.model_dump() for t in self.tools or ()],
            "top_p": self.top_p if self.top_p is not None else 1.0,
            "truncation": "disabled",
            "user": self.user,
        }


def messages_of(
    items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem],
) -> list[dict]:
    """Input items as chat messages: a run of function_call items is one assistant turn's tool calls."""
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {
        "type": "reasoning",
        "id": _id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def message_item(text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": _id("msg"),
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict, finish: str | None) -> list[dict]:
    """A chat answer's message (gateway/responses.py: Formatter) as Responses output items."""
    status = "incomplete" if finish == "length" else "completed"
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"]))
    if message.get("content"):
        items.append(message_item(message["content"], status))
    for call in message.get("tool_calls") or ():
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def usage_of(usage: dict) -> dict:
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        },
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def response_object(
    rid: str, created: int, model: str, request: ResponsesRequest, output: list[dict], usage: dict | None,
    finish: str | None, status: str | None = None,
) -> dict:  # fmt: skip
    """OpenAI's response object; status from the finish reason unless given ("in_progress" while streaming)."""
    if status is None:
        status = "incomplete" if finish == "length" else "completed"
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "usage": usage,
        **request.echo(),
    }


def history_of(turns: list[dict], output: list[dict]) -> list[dict]:
    """The conversation a stored response continues: the turns it answered (without the instructions, which
    previous_response_id does not carry, as OpenAI's does not) and its answer, less its reasoning."""
    text = "".join(i["content"][0]["text"] for i in output if i["type"] == "message")
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call"
    ]
    if not (text or calls):
        return list(turns)
    return [
        *turns,
        {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})},
    ]


class ResponseStore:
    """Stored responses by (tenant, id): the response object and the conversation to continue, the least
    recently used dropped past `max_responses` or `max_chars` of conversation text."""

    def __init__(self, max_responses: int = 4096, max_chars: int = 64 << 20) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[tuple[str | None, str], tuple[dict, list[dict], int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, tenant: str | None, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(conversation, ensure_ascii=False)) + len(json.dumps(response["output"]))
        with self._lock:
            self._items[(tenant, response["id"])] = (response, conversation, size)
            self._chars += size
            while self._items and (len(self._items) > self.max_responses or self._chars > self.max_chars):
                _, (_, _, dropped) = self._items.popitem(last=False)
                self._chars -= dropped

    def get(self, tenant: str | None, rid: str) -> tuple[dict, list[dict]]:
        with self._lock:
            found = self._items.get((tenant, rid))
            if found is None:
                raise APIError(404, f"Response with id {rid!r} not found", "response_id", "not_found")
            self._items.move_to_end((tenant, rid))
            return found[0], found[1]

    def delete(self, tenant: str | None, rid: str) -> None:
        with self._lock:
            found = self._items.pop((tenant, rid), None)
            if found is None:
                raise APIError(404, f"Response with id {rid!r} not found", "response_id", "not_found")
            self._chars -= found[2]


class ResponseEvents:
    """A streamed chat answer's chunks (gateway/responses.py: Formatter.stream) as Responses events. One output
    item is open at a time: reasoning, then the message, then each function call; each is closed (its done
    events) before the next opens. `end` closes the last and sends the whole response."""

    def __init__(self, rid: str, created: int, model: str, request: ResponsesRequest) -> None:
        self.rid, self.created, self.model, self.request = rid, created, model, request
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None
        self.finish: str | None = None
        self.response: dict = {}  # the whole response, once ended

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _response(self, status: str | None, usage: dict | None) -> dict:
        return response_object(
            self.rid, self.created, self.model, self.request, self.items, usage, self.finish, status
        )

    def start(self) -> list[str]:
        snapshot = self._response("in_progress", None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _open(self, item: dict) -> list[str]:
        out = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        out.append(
            self._event(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress"}
            )
        )
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))  # fmt: skip
        return out

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        where = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                   text=item["content"][0]["text"]))  # fmt: skip
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]
                )
            )
            out.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        else:
            out.append(
                self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])
            )
        if item["type"] == "message" and self.finish == "length":
            item["status"] = "incomplete"
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def chunk(self, chunk: dict) -> list[str]:
        out: list[str] = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta", {})
            if delta.get("reasoning"):
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._open(reasoning_item("", "completed"))
                assert self.open is not None
                self.open["content"][0]["text"] += delta["reasoning"]
                out.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                       output_index=len(self.items) - 1, content_index=0, delta=delta["reasoning"]))  # fmt: skip
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._open(message_item(""))
                assert self.open is not None
                self.open["content"][0]["text"] += delta["content"]
                out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                       output_index=len(self.items) - 1, content_index=0, delta=delta["content"],
                                       logprobs=[]))  # fmt: skip
            for entry in delta.get("tool_calls") or ():
                if "id" in entry:
                    out += self._open(call_item(entry["id"], entry["function"]["name"], ""))
                assert self.open is not None and self.open["type"] == "function_call"
                args = entry["function"].get("arguments", "")
                if args:
                    self.open["arguments"] += args
                    out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                           output_index=len(self.items) - 1, delta=args))  # fmt: skip
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def whole(self, output: list[dict], usage: dict, finish: str | None) -> dict:
        self.items, self.finish = output, finish
        return self._response(None, usage)

    def end(self, usage: dict) -> list[str]:
        out = self._close()
        response = self._response(None, usage_of(usage))
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=response))
        self.response = response
        return out

    def error(self, body: dict) -> list[str]:
        error = body.get("error", {})
        return [
            self._event(
                "error", code=error.get("code"), message=error.get("message"), param=error.get("param")
            )
        ]


class ResponsesOutput:
    """One /v1/responses request's answer, whole (`whole`, from the chat JSON) or streamed (the chat chunks
    through ResponseEvents); kept in the store when the request asks (`store`)."""

    def __init__(
        self,
        request: ResponsesRequest,
        turns: list[dict],
        model: str,
        store: ResponseStore,
        tenant: str | None,
    ) -> None:
        self.request, self.turns, self.store, self.tenant = request, turns, store, tenant
        self.rid, created = _id("resp"), int(time.time())
        self.events = ResponseEvents(self.rid, created, model, request)

    def whole(self, chat: dict) -> dict:
        choice = chat["choices"][0]
        output = output_items(choice["message"], choice["finish_reason"])
        response = self.events.whole(output, usage_of(chat["usage"]), choice["finish_reason"])
        self._keep(response)
        return response

    def start(self) -> list[str]:
        return self.events.start()

    def chunk(self, chunk: dict) -> list[str]:
        return self.events.chunk(chunk)

    def end(self, totals: Totals) -> list[str]:
        out = self.events.end(totals.to_json())
        self._keep(self.events.response)
        return out

    def error(self, body: dict) -> list[str]:
        return self.events.error(body)

    def done(self) -> list[str]:
        return []  # the stream ends with response.completed (or an error event), no [DONE]

    def _keep(self, response: dict) -> None:
        if self.request.store:
            self.store.put(self.tenant, response, history_of(self.turns, response["output"]))
