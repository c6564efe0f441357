"""Which quantization a checkpoint uses: vLLM's `quantization` option checked against what the files say.

`quantization=None` detects it: a `.gguf` file is "gguf"; a model directory whose config.json has a
`quantization_config` (or that holds AutoGPTQ's quantize_config.json / AutoAWQ's quant_config.json) is
what it names; anything else is dense. Every refusal is a ValueError that names the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUANTIZATION_METHODS = ("awq", "gptq", "gguf")
_GPTQ_FORMATS = {"gptq": True, "gptq_v2": False}  # checkpoint_format -> zero points stored minus one


@dataclass(frozen=True)
class QuantConfig:
    """An AWQ or GPTQ checkpoint's quantization_config (GGUF files describe themselves per tensor)."""

    method: str  # awq | gptq
    bits: int = 4
    group_size: int = 128  # -1: one group over all input features
    desc_act: bool = False  # gptq: act order (g_idx permutes the input rows)
    sym: bool = True  # gptq: zero points fixed at 8 (informational: they are stored either way)
    zeros_minus_one: bool = True  # gptq: the classic format stores zero points minus one
    modules_to_not_convert: tuple[str, ...] = ()  # awq: module names left dense
    lm_head: bool = False  # gptq: the LM head is quantized too (GPTQModel's lm_head=true, as vLLM reads it)

    def __post_init__(self) -> None:
        if self.method not in ("awq", "gptq"):
            raise ValueError(f"unsupported quantization method {self.method!r}; supported: awq, gptq")
        if self.bits != 4:
            raise ValueError(
                f"unsupported quantization_config: bits={self.bits} ({self.method}: only 4-bit is served)"
            )
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % 8):
            raise ValueError(
                f"unsupported quantization_config: group_size={self.group_size} (a positive multiple of 8, or -1)"
            )

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str) -> QuantConfig:
        """Parse transformers' / vLLM's quantization_config keys (and AutoAWQ's / AutoGPTQ's own files)."""
        method = str(d.get("quant_method", "")).lower()
        if method not in ("awq", "gptq"):
            raise ValueError(
                f"{where}: unsupported quantization method {d.get('quant_method')!r} (quant_method); "
                f"supported: awq, gptq"
            )
        try:
            bits = int(d.get("bits", d.get("w_bit", 4)))
            group = int(d.get("group_size", d.get("q_group_size", 128)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: unreadable bits or group_size: {e}") from e
        if bits != 4:
            raise ValueError(
                f"{where}: unsupported quantization_config: bits={bits} ({method}: only 4-bit is served)"
            )
        if method == "awq":
            return cls._awq(d, bits, group, where)
        return cls._gptq(d, bits, group, where)

    @classmethod
    def _awq(cls, d: dict[str, Any], bits: int, group: int, where: str) -> QuantConfig:
        version = str(d.get("version", d.get("format", "gemm"))).lower()
        if version != "gemm":
            raise ValueError(f"{where}: unsupported AWQ version {version!r} (only the GEMM layout is served)")
        if not d.get("zero_point", True):
            raise ValueError(f"{where}: unsupported AWQ quantization_config: zero_point=false")
        skip = tuple(d.get("modules_to_not_convert") or ())
        return cls("awq", bits, group, modules_to_not_convert=skip)

    @classmethod
    def _gptq(cls, d: dict[str, Any], bits: int, group: int, where: str) -> QuantConfig:
        fmt = str(d.get("checkpoint_format", "gptq")).lower()
        if fmt not in _GPTQ_FORMATS:
            raise ValueError(f"{where}: unsupported GPTQ checkpoint_format {fmt!r}; supported: gptq, gptq_v2")
        desc_act = bool(d.get("desc_act", False)) and group != -1  # one group: act order changes nothing
        return cls(
            "gptq", bits, group, desc_act, bool(d.get("sym", True)), _GPTQ_FORMATS[fmt],
            lm_head=bool(d.get("lm_head", False)),
        )  # fmt: skip


def checkpoint_quant_config(model_dir: Path) -> QuantConfig | None:
    """The quantization a model directory declares, or None for a dense checkpoint."""
    config = model_dir / "config.json"
    if config.is_file():
        try:
            declared = json.loads(config.read_text()).get("quantization_config")
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {config}: {e}") from e
        if declared is not None:
            if not isinstance(declared, dict):
                raise ValueError(f"{config}: quantization_config must be an object, got {declared!r}")
            return QuantConfig.from_hf(declared, f"{config} quantization_config")
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        path = model_dir / name
        if path.is_file():
            try:
                return QuantConfig.from_hf(
                    {"quant_method": method, **json.loads(path.read_text())}, str(path)
                )
            except (OSError, ValueError) as e:
                raise ValueError(f"{path}: {e}") from e
    return None


def resolve_quantization(path: Path, requested: str | None, load_format: str) -> QuantConfig | str | None:
    """What `path` is served as: a QuantConfig (awq, gptq), "gguf" (kept quantized per tensor) or None
    (dense). `requested` (the quantization option) must agree with the files."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown quantization {requested!r}; expected one of {', '.join(QUANTIZATION_METHODS)}"
        )
    is_gguf = load_format == "gguf" or path.is_file() or (path.suffix == ".gguf")
    # dummy: random weights in a named shape, or in a directory's config.json (and its quantization)
    if load_format == "dummy":
        if requested == "gguf":
            raise ValueError("quantization='gguf' needs a GGUF file, not dummy weights (use awq or gptq)")
        declared = checkpoint_quant_config(path) if path.is_dir() else None
        if declared is not None and requested not in (None, declared.method):
            raise ValueError(f"quantization={requested!r}, but {path} declares {declared.method.upper()}")
        return declared or (QuantConfig(requested) if requested else None)
    if is_gguf:
        if requested not in (None, "gguf"):
            raise ValueError(
                f"quantization={requested!r} cannot load the GGUF file {path} (use gguf or leave it unset)"
            )
        return "gguf"
    declared = checkpoint_quant_config(path)
    if requested == "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf file; {path} is a model directory")
    if requested is not None and declared is None:
        raise ValueError(
            f"quantization={requested!r}, but {path} is a dense checkpoint (its config.json has no "
            f"quantization_config): pass an {requested.upper()} checkpoint or leave quantization unset"
        )
    if requested is not None and declared is not None and declared.method != requested:
        raise ValueError(
            f"quantization={requested!r}, but {path} holds a {declared.method.upper()} checkpoint"
        )
    return declared
