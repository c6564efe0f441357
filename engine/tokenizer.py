"""Tokenizer + chat template over a model directory, needing only `tokenizers` and `jinja2` at runtime.

Reads tokenizer.json, tokenizer_config.json (special tokens, chat template; or chat_template.jinja,
as transformers v5 saves it) and generation_config.json (EOS ids).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class Tokenizer:
    def __init__(
        self, backend: tokenizers.Tokenizer, config: dict[str, Any], generation_config: dict[str, Any]
    ) -> None:
        self.backend = backend
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template: str | None = _pick_template(config.get("chat_template"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        bos_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        self.bos_token_id: int | None = (
            bos_id if bos_id is not None else generation_config.get("bos_token_id")
        )
        self.eos_token_ids: set[int] = _eos_ids(
            backend, self.eos_token, generation_config.get("eos_token_id")
        )
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """`chat_template`: template text that replaces the model's (vLLM's --chat-template)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"no tokenizer.json in {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:
            raise ValueError(f"{file}: cannot load tokenizer: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        if "chat_template" not in config and (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text()
        elif "chat_template" not in config:
            config["chat_template"] = _read_json(path / "chat_template.json").get("chat_template")
        if chat_template is not None:
            config["chat_template"] = chat_template
        return cls(backend, config, _read_json(path / "generation_config.json"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)  # tokenizer.json's post-processor did not add it
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages with the model's chat template, or `chat_template` (text) in its place; kwargs
        (`tools`, ...) are the template's variables. Encode the result with add_special_tokens=False."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this model has no chat template")
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        try:
            return compile_chat_template(template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except (jinja2.exceptions.TemplateError, TypeError) as e:  # TypeError: tojson of a missing field
            raise ValueError(f"chat template error: {e}") from e


@lru_cache(maxsize=8)
def compile_chat_template(text: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it (ValueError if it does not parse)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template does not parse: {e}") from e


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (take "default")."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _eos_ids(backend: tokenizers.Tokenizer, eos_token: str | None, generation_eos: Any) -> set[int]:
    ids: set[int] = set()
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif isinstance(generation_eos, list):
        ids.update(int(i) for i in generation_eos)
    token_id = backend.token_to_id(eos_token) if eos_token else None
    if token_id is not None:
        ids.add(token_id)
    return ids


class IncrementalDetokenizer:
    """Text deltas for a growing output, never splitting a UTF-8 character (vLLM-style offsets).

    Each step decodes two short windows that share a few tokens of left context: ids[prefix:read]
    (already emitted) and ids[prefix:] (with the new token); the delta is what the second adds.
    While the text ends in U+FFFD (bytes of an unfinished character) nothing is emitted.
    The concatenated deltas, plus `flush()` at the end, equal decode(output ids).
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - self.CONTEXT_TOKENS, 0)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text, new_text = self._windows()
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character at the end), as decode would show it."""
        prefix_text, new_text = self._windows()
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def _windows(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        return prefix, decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
