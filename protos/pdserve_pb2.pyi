from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "pooling", "truncate_prompt_tokens", "priority", "model", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    pooling: PoolingParams
    truncate_prompt_tokens: int
    priority: int
    model: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., pooling: _Optional[_Union[PoolingParams, _Mapping]] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., model: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PoolingParams(_message.Message):
    __slots__ = ("dimensions", "normalize")
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    dimensions: int
    normalize: bool
    def __init__(self, dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "embedding", "prompt_tokens", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embedding: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., embedding: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class WorkerEmbedRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "pooling", "priority", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pooling: PoolingParams
    priority: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., pooling: _Optional[_Union[PoolingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "return_token_strs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    prompt: GenerateRequest
    return_token_strs: bool
    def __init__(self, prompt: _Optional[_Union[GenerateRequest, _Mapping]] = ..., return_token_strs: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "max_model_len", "token_strs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model", "token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "token_ids", "sampling", "priority", "model", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    chat: ChatMessages
    token_ids: TokenIds
    sampling: SamplingParams
    priority: int
    model: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., model: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools_json", "template_kwargs_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools_json: str
    template_kwargs_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools_json: _Optional[str] = ..., template_kwargs_json: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "seed", "logprobs", "n", "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "allowed_token_ids", "skip_special_tokens", "prompt_logprobs", "truncate_prompt_tokens", "bad_words", "structured_outputs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    seed: int
    logprobs: int
    n: int
    include_stop_str_in_output: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    prompt_logprobs: int
    truncate_prompt_tokens: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    structured_outputs: StructuredOutputs
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., truncate_prompt_tokens: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "json_object", "grammar", "reasoning_start", "reasoning_end")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    REASONING_START_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    json_object: bool
    grammar: str
    reasoning_start: str
    reasoning_end: str
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., json_object: _Optional[bool] = ..., grammar: _Optional[str] = ..., reasoning_start: _Optional[str] = ..., reasoning_end: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "logprobs", "finish_reason", "stop_reason", "usage", "prompt_logprobs", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: str
    stop_reason: str
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "max_model_len", "vocab_size", "block_size", "max_token_chars", "think_tokens", "eos_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKEN_CHARS_FIELD_NUMBER: _ClassVar[int]
    THINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    max_token_chars: int
    think_tokens: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., max_token_chars: _Optional[int] = ..., think_tokens: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "cache_salt", "prefill_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    priority: int
    cache_salt: str
    prefill_address: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., prefill_address: _Optional[str] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "stop_reason", "num_cached_tokens", "prompt_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: str
    stop_reason: str
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "kv_descriptor", "dst_block_ids", "priority", "kv_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    kv_descriptor: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    kv_token: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., kv_descriptor: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., kv_token: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs", "num_cached_tokens", "kv_done", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_DONE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: TokenLogprobs
    num_cached_tokens: int
    kv_done: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., kv_done: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: str
    details: str
    def __init__(self, code: _Optional[str] = ..., details: _Optional[str] = ...) -> None: ...

class DecodeFrame(_message.Message):
    __slots__ = ("stream", "request", "cancel", "more")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    stream: int
    request: DecodeRequest
    cancel: bool
    more: bool
    def __init__(self, stream: _Optional[int] = ..., request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., more: _Optional[bool] = ...) -> None: ...

class DecodeReply(_message.Message):
    __slots__ = ("stream", "chunk", "error", "end")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream: int
    chunk: DecodeChunk
    error: CallStatus
    end: bool
    def __init__(self, stream: _Optional[int] = ..., chunk: _Optional[_Union[DecodeChunk, _Mapping]] = ..., error: _Optional[_Union[CallStatus, _Mapping]] = ..., end: _Optional[bool] = ...) -> None: ...

class PrefillFrame(_message.Message):
    __slots__ = ("stream", "request", "cancel", "more")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    stream: int
    request: PrefillRequest
    cancel: bool
    more: bool
    def __init__(self, stream: _Optional[int] = ..., request: _Optional[_Union[PrefillRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., more: _Optional[bool] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("stream", "response", "error", "end")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream: int
    response: PrefillResponse
    error: CallStatus
    end: bool
    def __init__(self, stream: _Optional[int] = ..., response: _Optional[_Union[PrefillResponse, _Mapping]] = ..., error: _Optional[_Union[CallStatus, _Mapping]] = ..., end: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "role", "num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "block_size", "model", "max_model_len", "vocab_size", "epoch", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    model: str
    max_model_len: int
    vocab_size: int
    epoch: int
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., epoch: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ("epoch", "after_seq")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    after_seq: int
    def __init__(self, epoch: _Optional[int] = ..., after_seq: _Optional[int] = ...) -> None: ...

class KVEventsResponse(_message.Message):
    __slots__ = ("epoch", "batches", "snapshot")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    batches: _containers.RepeatedScalarFieldContainer[bytes]
    snapshot: bytes
    def __init__(self, epoch: _Optional[int] = ..., batches: _Optional[_Iterable[bytes]] = ..., snapshot: _Optional[bytes] = ...) -> None: ...
