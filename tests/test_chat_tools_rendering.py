"""Tool calling in the chat template: the router renders a request's tools, an assistant turn's tool calls and
a tool turn's result (router/prompts.py); `--chat-template` replaces the model's template in the router
(`pdserve router`, `up`, `serve`); `LLM.chat` takes `chat_template` and `tools` as vLLM's does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from protos import pdserve_pb2 as pb
from router.admission import admit, tokenize
from router.errors import Stop
from router.prompts import PromptEncoder
from router.server import RouterConfig, RouterServicer
from serving.chat_template import read_chat_template
from serving.cli import build_parser, main
from serving.grpc_common import params_to_proto
from serving.roles import cluster_children

NAME = "m"

# ChatML with tools, in the Hermes style; every newline is written out, so trim_blocks changes nothing.
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nYou may call these tools:\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant\\n' + m.content }}"
    "{% for call in m.tool_calls %}{{ '<tool_call>\\n{\"name\": ' + (call.function.name | tojson) }}"
    "{{ ', \"arguments\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif m.role == 'tool' %}{{ '<|im_start|>tool\\n<tool_response id=\"' + m.tool_call_id + '\">\\n' }}"
    "{{ m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
}
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1", "name": "get_weather"},
]
EXPECTED = (
    "<|im_start|>system\nYou may call these tools:\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n<|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius"}}\n</tool_call><|im_end|>\n'
    '<|im_start|>tool\n<tool_response id="call_1">\n{"temp": 21}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok(bundled_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(bundled_model_dir, chat_template=TEMPLATE)


@pytest.fixture
def encoder(tok: Tokenizer):
    enc = PromptEncoder(tok, threads=1)
    yield enc
    enc.close()


@pytest.fixture
def template_file(tmp_path: Path) -> Path:
    path = tmp_path / "tools.jinja"
    path.write_text(TEMPLATE)
    return path


def chat(tools_json: str = json.dumps([TOOL]), calls_json: str = json.dumps([CALL])) -> pb.ChatMessages:
    return pb.ChatMessages(
        messages=[
            pb.ChatMessage(role="user", content="Weather in Paris?"),
            pb.ChatMessage(role="assistant", tool_calls_json=calls_json),
            pb.ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1", name="get_weather"),
        ],
        add_generation_prompt=True,
        tools_json=tools_json,
    )


def info(tok: Tokenizer) -> pb.ModelInfo:
    return pb.ModelInfo(model=NAME, max_model_len=512, vocab_size=tok.vocab_size, block_size=16)


def test_the_router_renders_tools_tool_calls_and_tool_results(tok, encoder) -> None:
    assert tok.apply_chat_template(MESSAGES, tools=[TOOL]) == EXPECTED
    want = tok.encode(EXPECTED, add_special_tokens=False)
    ids = asyncio.run(encoder.encode(pb.GenerateRequest(chat=chat())))
    assert ids == want
    assert tok.decode(ids, skip_special_tokens=False) == EXPECTED
    counted = asyncio.run(
        tokenize(pb.TokenizeRequest(prompt=pb.GenerateRequest(chat=chat())), info(tok), NAME, encoder)
    )
    assert list(counted.token_ids) == want  # /tokenize counts the prompt Generate sends


def test_a_request_without_tools_renders_none(tok, encoder) -> None:
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]))
    ids = asyncio.run(encoder.encode(request))
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize(
    ("tools_json", "calls_json", "words"),
    [
        ("[{", json.dumps([CALL]), "tools_json is not valid JSON"),
        ('{"type": "function"}', json.dumps([CALL]), "tools_json must be a JSON array of objects"),
        (json.dumps([TOOL]), "not json", "messages[1].tool_calls_json is not valid JSON"),
        (json.dumps([TOOL]), "[1, 2]", "messages[1].tool_calls_json must be a JSON array of objects"),
        (json.dumps([TOOL]), "[" * 100_000, "messages[1].tool_calls_json is not valid JSON"),
        (json.dumps([TOOL]), '[{"id": "call_1"}]', "chat template error"),  # no function: no arguments
    ],
)
def test_bad_tool_fields_are_invalid_argument_naming_the_field(tok, encoder, tools_json, calls_json, words):
    bad = pb.GenerateRequest(model=NAME, chat=chat(tools_json, calls_json))
    bad.sampling.CopyFrom(params_to_proto(SamplingParams(max_tokens=1)))
    for call in (
        admit(bad, info(tok), NAME, encoder),
        tokenize(pb.TokenizeRequest(prompt=bad), info(tok), NAME, encoder),
    ):
        with pytest.raises(Stop) as stop:
            asyncio.run(call)
        assert stop.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in stop.value.details


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ('{"tools": []}', "chat_template_kwargs may not set tools"),
        ('["x"]', "chat_template_kwargs must be a JSON object"),
        ("{", "chat_template_kwargs is not valid JSON"),
    ],
)
def test_chat_template_kwargs_are_the_templates_variables(bundled_model_dir, kwargs, words) -> None:
    """vLLM's chat_template_kwargs: a template variable the request sets (say Qwen3's enable_thinking); one
    that the request's own fields set, or a body that is not a JSON object, is INVALID_ARGUMENT naming it."""
    template = "{{ '<|im_start|>' + (greeting or 'none') + '<|im_end|>' }}"
    tok = Tokenizer.from_dir(bundled_model_dir, chat_template=template)
    enc = PromptEncoder(tok, threads=1)
    try:
        for given, text in (("", "none"), ('{"greeting": "bonjour"}', "bonjour")):
            messages = pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content="hi")], template_kwargs_json=given
            )
            ids = asyncio.run(enc.encode(pb.GenerateRequest(chat=messages)))
            assert tok.decode(ids, skip_special_tokens=False) == f"<|im_start|>{text}<|im_end|>"
        bad = pb.GenerateRequest(
            model=NAME,
            chat=pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content="hi")], template_kwargs_json=kwargs
            ),
        )
        with pytest.raises(Stop) as stop:
            asyncio.run(tokenize(pb.TokenizeRequest(prompt=bad), info(tok), NAME, enc))
        assert stop.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in stop.value.details
    finally:
        enc.close()


def test_chat_template_flag_replaces_the_routers_template(bundled_model_dir, template_file) -> None:
    args = build_parser().parse_args(
        ["router", "--prefill", "p:1", "--decode", "d:1", "--chat-template", str(template_file)]
    )
    text, file = read_chat_template(args.chat_template)
    assert (text, file) == (TEMPLATE, template_file.resolve())
    assert read_chat_template(TEMPLATE) == (TEMPLATE, None)  # the template text itself

    async def tokenizer_template() -> str | None:
        config = RouterConfig(("p:1",), ("d:1",), str(bundled_model_dir), NAME, chat_template=text)
        servicer = RouterServicer(config)  # its channels want a running loop
        await servicer.close()
        return servicer.tokenizer.chat_template if servicer.tokenizer else None

    assert asyncio.run(tokenizer_template()) == TEMPLATE
    with pytest.raises(ValueError, match="chat template does not parse"):
        RouterConfig(("p:1",), ("d:1",), str(bundled_model_dir), NAME, chat_template="{% for %}")


def test_up_hands_the_template_file_to_its_router_and_serve_takes_the_flag(template_file) -> None:
    parser = build_parser()
    up = parser.parse_args(["up", "--chat-template", str(template_file)])
    router_cmd = cluster_children(up, [])[-1].cmd
    assert f"--chat-template={template_file.resolve()}" in router_cmd
    router = parser.parse_args(router_cmd[router_cmd.index("router") :])
    assert read_chat_template(router.chat_template)[0] == TEMPLATE
    inline = parser.parse_args(["up", "--chat-template", TEMPLATE])
    assert f"--chat-template={TEMPLATE}" in cluster_children(inline, [])[-1].cmd
    assert parser.parse_args(["serve", "--chat-template", str(template_file)]).chat_template == str(
        template_file
    )


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("missing.jinja", "--chat-template: no such file: "),
        (".", "--chat-template: cannot read .: Is a directory"),
        ("{% for %}", "--chat-template: chat template does not parse"),
    ],
)
def test_a_bad_chat_template_stops_the_command_at_start_up(tmp_path, capsys, value, words) -> None:
    value = str(tmp_path / value) if value == "missing.jinja" else value
    for command in (["router", "--prefill", "p:1", "--decode", "d:1"], ["up"]):
        assert main([*command, "--chat-template", value]) == 2
        assert words in capsys.readouterr().err


def test_up_s_router_renders_tools_with_the_template_of_its_flag(tok, template_file) -> None:
    """Through `pdserve up --chat-template FILE` (aggregated: one decode worker): Tokenize and Generate count
    the same prompt, and a bad field is INVALID_ARGUMENT over gRPC."""
    from tests.cluster import collect, start_cluster

    cluster = start_cluster(0, 1, "tcp", "--chat-template", str(template_file))
    try:
        stub = cluster.stub()
        want = tok.encode(EXPECTED, add_special_tokens=False)
        counted = stub.Tokenize(pb.TokenizeRequest(prompt=pb.GenerateRequest(chat=chat())), timeout=60)
        assert list(counted.token_ids) == want
        one = pb.SamplingParams(temperature=0, max_tokens=1)
        _, _, usage = collect(stub.Generate(pb.GenerateRequest(chat=chat(), sampling=one), timeout=60))
        assert usage is not None and usage.prompt_tokens == len(want)
        with pytest.raises(grpc.RpcError) as refused:
            collect(stub.Generate(pb.GenerateRequest(chat=chat(tools_json="[{"), sampling=one), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tools_json is not valid JSON" in (refused.value.details() or "")
    finally:
        cluster.stop()


def test_llm_chat_takes_a_chat_template_and_tools() -> None:
    from engine.llm import LLM

    llm = LLM(dtype="float32", device="cpu", cpu_kv_cache_space=0.1, max_model_len=512)
    assert llm.tokenizer is not None
    out = llm.chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=1), chat_template=TEMPLATE, tools=[TOOL]
    )
    assert out[0].prompt_token_ids == llm.tokenizer.encode(EXPECTED, add_special_tokens=False)
    assert len(out[0].outputs[0].token_ids) == 1
