"""OpenAI request bodies (chat completions, completions) as pydantic models, with vLLM's extras.

Only shapes and types are checked here; ranges of sampling values are the engine's to check
(`SamplingParams`), so the message a user sees is the same through every front end. Integers that go
into int32 proto fields are bounded here so a huge number is a 400, not a conversion error.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32 = 2**31 - 1
Int32 = Annotated[int, Field(ge=-INT32, le=INT32)]
TokenId = Annotated[int, Field(ge=0, le=INT32)]


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI does; NaN and infinity are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields both endpoints share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: Int32 | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    priority: Int32 = 0  # under --scheduling-policy priority a lower value runs first (vLLM's server field)
    # requests with different salts never share prefix-cache blocks (vLLM's extra); with tenants it is
    # scoped to the caller's tenant (gateway/tenants.py)
    cache_salt: Annotated[str, Field(max_length=1024)] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True  # vLLM's extra

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


NonEmptyIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | NonEmptyIds
        | Annotated[list[NonEmptyIds], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False

    def token_limit(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
