"""OpenAI request bodies (chat completions, completions) as pydantic models, with vLLM's extras.

Only shapes and types are checked here; ranges of sampling values are the engine's to check
(`SamplingParams`), so the message a user sees is the same through every front end. Integers that go
into int32 proto fields are bounded here so a huge number is a 400, not a conversion error.

Fields whose meaning this server does not implement (grammars, best_of, suffix) are refused
with a 400 naming them (`unsupported`), never ignored: an answer that ignored them would look right and not be.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

INT32 = 2**31 - 1
Int32 = Annotated[int, Field(ge=-INT32, le=INT32)]
TokenId = Annotated[int, Field(ge=0, le=INT32)]


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI does; NaN and infinity are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage so far in every chunk


# Fields of OpenAI's and vLLM's APIs that change what a request returns and that this server does not
# implement: each is refused by name when set (other than to its default, the value after the reason).
_REFUSED: dict[str, tuple[str, object]] = {
    "guided_whitespace_pattern": ("guided_whitespace_pattern is not supported by this server", None),
    "logits_processors": ("logits_processors are not supported by this server", None),
    "spaces_between_special_tokens": ("spaces_between_special_tokens false is not supported", True),
    "continue_final_message": ("continue_final_message is not supported by this server", False),
    # vLLM's chat echo (the last message's content before the answer, where the roles match); completions
    # declare their own echo, so this reaches chat requests only
    "echo": ("echo on chat completions is not supported by this server (/v1/completions takes it)", False),
    "chat_template": ("a request's own chat_template is not supported: the model's is used", None),
    "documents": ("documents are not supported by this server", None),
    "audio": ("audio output is not supported: this model writes text only", None),
    "web_search_options": ("web search is not supported by this server", None),
}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    json_schema: dict | None = None  # OpenAI's {"name", "schema", "strict"}


class StructuredOutputsBody(_Body):
    """vLLM's structured_outputs: one of json (a schema), regex, choice, json_object, grammar."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None

    def fields(self) -> dict:
        out: dict = {}
        if self.json_ is not None:
            out["json"] = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
        for name in ("regex", "choice", "json_object", "grammar"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        return out


class SamplingFields(_Body):
    """Fields both endpoints share. Unknown fields are kept (not declared) so that `unsupported` can refuse
    those of _REFUSED."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

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
    use_beam_search: bool = False  # vLLM's: n beams (engine/beam_search.py), answered whole
    length_penalty: float = 1.0  # vLLM's, for beam search
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    priority: Int32 = 0  # under --scheduling-policy priority a lower value runs first (vLLM's server field)
    # OpenAI's: token id (a string, as JSON keys are) -> added to its logit; checked by the engine. At most 300
    # entries, as OpenAI's API takes: the sampler lists them on the host every step
    logit_bias: Annotated[dict[str, float], Field(max_length=300)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32)] = 0  # vLLM's: no stop before this many tokens
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=65536)] | None = None  # vLLM's
    skip_special_tokens: bool = True  # vLLM's: false shows special tokens' text
    # vLLM's: the logprob of every prompt token after the first, with this many top ones beside it (capped as
    # logprobs are)
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's: logprobs name each token `token_id:N`, for tokens whose text JSON cannot carry (a lone byte)
    return_tokens_as_token_ids: bool = False
    # vLLM's: only the prompt's last this many tokens run (-1: max_model_len of them); the router cuts it
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32)] | None = None
    # vLLM's: words never generated (a word's last token is banned where the output ends in the ones before it)
    bad_words: (
        Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=256)] | None
    ) = None
    # requests with different salts never share prefix-cache blocks (vLLM's extra); with tenants it is
    # scoped to the caller's tenant (gateway/tenants.py)
    cache_salt: Annotated[str, Field(max_length=1024)] | None = None
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs (one at most)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: Annotated[str, Field(max_length=65536)] | None = None
    guided_choice: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)] | None
    ) = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsBody | None = None

    def structured(self) -> dict | None:
        """The structured output asked for, as pb.StructuredOutputs' fields; ValueError naming the field when
        more than one way is given or response_format's type is not one this server takes."""
        asked: dict[str, dict] = {}
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":
                asked["response_format"] = {"json_object": True}
            elif rf.type == "json_schema":
                schema = (rf.json_schema or {}).get("schema") if isinstance(rf.json_schema, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError(
                        "response_format json_schema needs json_schema.schema, a JSON schema object"
                    )
                asked["response_format"] = {"json": json.dumps(schema)}
            else:
                raise ValueError(
                    f"response_format {rf.type!r} is not supported: text, json_object or json_schema"
                )
        if self.guided_json is not None:
            g = self.guided_json
            asked["guided_json"] = {"json": g if isinstance(g, str) else json.dumps(g)}
        if self.guided_regex is not None:
            asked["guided_regex"] = {"regex": self.guided_regex}
        if self.guided_choice is not None:
            asked["guided_choice"] = {"choice": list(self.guided_choice)}
        if self.guided_grammar is not None:
            asked["guided_grammar"] = {"grammar": self.guided_grammar}
        if self.structured_outputs is not None:
            asked["structured_outputs"] = self.structured_outputs.fields()
        if len(asked) > 1:
            raise ValueError(f"structured output is asked for more than once: {', '.join(asked)}")
        return next(iter(asked.values()), None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous usage stats: every chunk carries the usage of its choice so far."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def token_bias(self) -> dict[int, float]:
        """logit_bias with integer keys; a key that is not a token id is a ValueError naming it."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token <= INT32:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            bias[token] = value
        return bias

    def conflict(self) -> tuple[str, str] | None:
        """(field, message) of a field that makes no sense without another (OpenAI refuses these), or None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options can only be set when stream is true"
        if (
            self.stream_options is not None
            and self.stream_options.continuous_usage_stats
            and not self.include_usage
        ):
            return (
                "stream_options",
                "stream_options.continuous_usage_stats needs stream_options.include_usage",
            )
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) of the first field set that this server would otherwise ignore, or None."""
        for name, value in (self.model_extra or {}).items():
            if name in _REFUSED:
                reason, default = _REFUSED[name]
                if value != default and value not in (None, [], {}, ""):
                    return name, reason if name in reason else f"{name}: {reason}"
        modalities = (self.model_extra or {}).get("modalities")
        if isinstance(modalities, list) and any(m != "text" for m in modalities):
            return "modalities", "modalities other than text are not supported: this model writes text only"
        return None


class ContentPart(_Body):
    type: str  # "text" only: other kinds (images, audio) are refused by name (ChatCompletionRequest.unsupported)
    text: str = ""


class FunctionDefinition(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments' object
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class CalledFunction(_Body):
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict:
        """As chat templates take a call: its arguments a JSON object where they parse as one (vLLM's way)."""
        try:
            args: Any = json.loads(self.function.arguments)
        except (ValueError, RecursionError):
            args = self.function.arguments
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": args}}


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's
    tool_call_id: str | None = None  # a tool turn's: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def other_parts(self) -> list[str]:
        """The types of content parts other than text."""
        parts = self.content if isinstance(self.content, list) else []
        return [part.type for part in parts if part.type != "text"]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True  # vLLM's extra
    tools: Annotated[list[ToolDefinition], Field(max_length=1024)] | None = None
    # "auto" where tools are given (gateway/tools.py), else "none"
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: one call at most
    # vLLM's: more variables for the chat template (say enable_thinking); the router renders with them
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning (--reasoning-parser) out
    # the API's deprecated function calling, read only to refuse it (left out of the OpenAPI schema)
    functions: SkipJsonSchema[list[Any] | None] = None
    function_call: SkipJsonSchema[Any] = None

    def conflict(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs set to true"
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            return "tool_choice", f"tool_choice {self.choice_name()!r} needs tools"
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.function_names():
            return (
                "tool_choice",
                f"tool_choice names function {choice.function.name!r}, which is not among tools",
            )
        names = self.function_names()
        if len(set(names)) < len(names):
            return "tools", "tools name a function more than once"
        return super().conflict()

    def function_names(self) -> list[str]:
        return [t.function.name for t in self.tools or ()]

    def choice_name(self) -> str:
        """tool_choice as a word: none / auto / required / function (named), "auto" where tools are given
        without one, as OpenAI takes them."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        return "function" if isinstance(choice, NamedToolChoice) else choice

    def unsupported(self) -> tuple[str, str] | None:
        other = [kind for m in self.messages for kind in m.other_parts()]
        if other:
            return (
                "messages",
                f"messages hold a content part of type {other[0]!r}: this model reads text only",
            )
        if self.functions or self.function_call not in (None, "none"):
            return "functions", "functions and function_call are deprecated and not supported: use tools"
        return super().unsupported()

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


NonEmptyIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | NonEmptyIds
        | Annotated[list[NonEmptyIds], Field(min_length=1)]
    )
    # 0 only with echo: the prompt alone (lm-eval's loglikelihood), as OpenAI's legacy API took it
    max_tokens: Annotated[int, Field(ge=0, le=INT32)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens) before each choice's own
    # read only to refuse them (`unsupported`; left out of the OpenAPI schema)
    suffix: SkipJsonSchema[str | None] = None
    best_of: SkipJsonSchema[Annotated[int, Field(ge=1, le=128)] | None] = None

    def conflict(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens must be at least 1; 0 is taken only with echo (the prompt alone)"
        return super().conflict()

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of other than n is not supported (best_of {self.best_of}, n {self.n})"
        return super().unsupported()

    def token_limit(self) -> int:
        """Tokens the engine is asked for: OpenAI's default 16, and one (dropped) for echo's max_tokens 0."""
        return 16 if self.max_tokens is None else max(self.max_tokens, 1)

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """What the engine computes for the prompt: echo with logprobs needs them for the prompt's tokens
        (vLLM's default), an explicit prompt_logprobs wins."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TokenizeCompletionRequest(_Body):
    """vLLM's /tokenize of a prompt: its token ids as /v1/completions would encode it."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # completions encode with them: another value is refused
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """vLLM's /tokenize of chat messages: their token ids as /v1/chat/completions would encode them. vLLM's
    fields that change the rendering (a template of the request's own, ...) are refused by name, since
    the count would otherwise be of another prompt than the one asked about."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template writes them: another value is refused
    return_token_strs: bool = False

    # rendered as chat renders them
    tools: Annotated[list[ToolDefinition], Field(max_length=1024)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        extra = self.model_extra or {}
        for name in (
            "continue_final_message",
            "chat_template",
            "mm_processor_kwargs",
        ):
            if extra.get(name) not in (None, False, {}, ""):
                reason = _REFUSED.get(name, (f"{name} is not supported by this server", None))[0]
                return name, reason
        return None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
