"""What the model looks like: the few fields of a Hugging Face `config.json` the engine needs.

Reads both spellings transformers has used: v4 (`rope_theta`, `rope_scaling`, `torch_dtype`)
and v5 (`rope_parameters`, `dtype`). `to_hf_dict()` writes the v4 spelling, which both read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
)  # fmt: skip
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# base models (no LM head: embedding models such as e5-mistral are saved so) load as their causal LM
_BASE_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "MixtralModel": "MixtralForCausalLM",
    "Qwen2MoeModel": "Qwen2MoeForCausalLM",
    "Qwen3MoeModel": "Qwen3MoeForCausalLM",
}
# an RMSNorm over each q and k head before RoPE
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# sparse mixture-of-experts MLPs (engine/layers/moe.py)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# q, k and v with a bias, o_proj without
_QKV_BIAS_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
_MODEL_TYPE_BY_ARCH = {arch: model_type for model_type, arch in _ARCH_BY_MODEL_TYPE.items()}


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    rope_type: ClassVar[str] = "llama3"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (`rope_type: linear`): every frequency divided by `factor`."""

    rope_type: ClassVar[str] = "linear"
    factor: float


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (`rope_type: yarn`; Qwen2.5 / Qwen3 past 32k): low frequencies interpolated, high ones kept, a linear
    ramp between (beta_fast .. beta_slow rotations), and cos / sin scaled by the attention factor."""

    rope_type: ClassVar[str] = "yarn"
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = (
        None  # None: from factor (and mscale / mscale_all_dim when both are given)
    )
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always; Llama and Qwen3 when their config says so)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"
    # mixture of experts (MOE_ARCHITECTURES): routed experts a MoE layer has, each token's top k of them, an
    # expert's intermediate features, whether the top k's router weights are renormalised to sum to 1; a
    # layer is a MoE one unless listed in mlp_only_layers, every decoder_sparse_step-th (Qwen-MoE's keys); a
    # shared expert of shared_expert_intermediate_size features every token takes, gated (Qwen2-MoE; 0: none)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for name in (*sizes, "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.architecture in MOE_ARCHITECTURES:
            for name in (
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "decoder_sparse_step",
            ):
                if getattr(self, name) <= 0:
                    raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"model config: num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                    f"({self.num_experts})"
                )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a mixture-of-experts MLP (else a dense one of intermediate_size)."""
        return (
            self.architecture in MOE_ARCHITECTURES
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def is_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def qk_norm(self) -> bool:
        """Whether each q and k head goes through an RMSNorm of its own (weights q_norm, k_norm) before RoPE."""
        return self.architecture in QK_NORM_ARCHITECTURES

    @property
    def o_proj_bias(self) -> bool:
        """Llama's `attention_bias` also covers o_proj; Qwen2's q/k/v bias does not."""
        return self.attention_bias and self.architecture not in _QKV_BIAS_ARCHITECTURES

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"no config.json in model directory {path}")
        try:
            data = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {config_path}: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(d)
        _check_supported_features(d)
        try:
            rope_theta, rope_scaling = _rope(d)
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            return cls(
                architecture=architecture,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=_max_positions(d, rope_scaling),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=_attention_bias(architecture, d),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=_token_ids(d.get("eos_token_id")),
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
                **_moe(architecture, d),
            )
        except KeyError as e:
            raise ValueError(f"model config is missing {e.args[0]!r}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` that transformers (v4 and v5) loads into the same model."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPE_BY_ARCH[self.architecture],
            "hidden_act": "silu",
            **{k: getattr(self, k) for k in _PLAIN_FIELDS},
            "rope_scaling": None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _hf_token_ids(self.eos_token_id),
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": self.rope_scaling.rope_type, **vars(self.rope_scaling)}
        if self.architecture == "Qwen2MoeForCausalLM":
            d["qkv_bias"] = self.attention_bias
        elif self.architecture != "Qwen2ForCausalLM":
            d["attention_bias"] = self.attention_bias
        if self.architecture == "MixtralForCausalLM":
            d.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok)
        elif self.architecture in MOE_ARCHITECTURES:
            d.update(
                num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
            )  # fmt: skip
            if self.architecture == "Qwen2MoeForCausalLM":
                d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return d


_PLAIN_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
    "tie_word_embeddings", "torch_dtype",
)  # fmt: skip


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        arch = _BASE_ARCHITECTURES.get(archs[0], archs[0])
    elif d.get("model_type") in _ARCH_BY_MODEL_TYPE:
        arch = _ARCH_BY_MODEL_TYPE[d["model_type"]]
    else:
        arch = f"model_type={d.get('model_type')!r}"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _moe(architecture: str, d: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields: Mixtral's experts are intermediate_size wide and always renormalised;
    Qwen2-MoE and Qwen3-MoE name their own (transformers 5 saves num_experts as num_local_experts); Qwen2-MoE adds
    a shared expert."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    top_k = int(d.get("num_experts_per_tok") or 0)
    if architecture == "MixtralForCausalLM":
        return dict(
            num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(d["intermediate_size"])
        )
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0)
        if architecture == "Qwen2MoeForCausalLM"
        else 0,
    )


def _attention_bias(architecture: str, d: dict[str, Any]) -> bool:
    """Qwen2 always has a q/k/v bias, Qwen2-MoE unless `qkv_bias` says not; others where `attention_bias` says."""
    if architecture == "Qwen2ForCausalLM":
        return True
    if architecture == "Qwen2MoeForCausalLM":
        return bool(d.get("qkv_bias", True))
    return bool(d.get("attention_bias", False))


def _check_supported_features(d: dict[str, Any]) -> None:
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
    partial = d.get("partial_rotary_factor") or (d.get("rope_parameters") or {}).get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial} (RoPE over the whole head only)")
    if d.get("mlp_bias"):
        raise ValueError("unsupported: mlp_bias=true")


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    if kind == "linear":
        return theta, LinearRopeScaling(factor=float(scaling["factor"]))
    if kind == "yarn":
        factor = scaling.get("factor")
        original = int(scaling.get("original_max_position_embeddings") or d["max_position_embeddings"])
        return theta, YarnRopeScaling(
            factor=float(factor) if factor is not None else int(d["max_position_embeddings"]) / original,
            original_max_position_embeddings=original,
            beta_fast=float(scaling.get("beta_fast") or 32.0),
            beta_slow=float(scaling.get("beta_slow") or 1.0),
            attention_factor=_float_or_none(scaling.get("attention_factor")),
            mscale=_float_or_none(scaling.get("mscale")),
            mscale_all_dim=_float_or_none(scaling.get("mscale_all_dim")),
            truncate=bool(scaling.get("truncate", True)),
        )
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear, yarn)")


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _max_positions(d: dict[str, Any], rope_scaling: RopeScaling | None) -> int:
    """Context length; capped at a sliding window we do not implement (Mistral v0.1), so it stays exact. With YaRN
    it is the original context times the factor (as vLLM derives it: Qwen3 with factor 4 serves 131,072)."""
    limit = int(d.get("max_position_embeddings", 2048))
    if isinstance(rope_scaling, YarnRopeScaling):
        limit = int(rope_scaling.original_max_position_embeddings * rope_scaling.factor)
    window = d.get("sliding_window")
    uses_window = d.get(
        "use_sliding_window", d.get("model_type") not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    )
    if window and uses_window and window < limit:
        return int(window)
    return limit


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _hf_token_ids(ids: tuple[int, ...]) -> int | list[int] | None:
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def _dummy(arch: str, **kw: Any) -> ModelConfig:
    return ModelConfig(architecture=arch, **kw)


# Real shapes, for `--load-format dummy` speed work (weight values do not change speed).
DUMMY_SHAPES: dict[str, ModelConfig] = {
    "SmolLM2-135M": _dummy(
        "LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,),
        torch_dtype="bfloat16",
    ),
    "Llama-3-8B": _dummy(
        "LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=(128001,),
        torch_dtype="bfloat16",
    ),
    "Qwen2.5-7B": _dummy(
        "Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=True, bos_token_id=151643,
        eos_token_id=(151643,), torch_dtype="bfloat16",
    ),
    "Phi-4": _dummy(
        "Phi3ForCausalLM", vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=10, head_dim=128, rms_norm_eps=1e-5, rope_theta=250000.0,
        max_position_embeddings=16384, tie_word_embeddings=False, bos_token_id=100257, eos_token_id=(100265,),
        torch_dtype="bfloat16",
    ),
    "Qwen3-8B": _dummy(
        "Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=(151645,),
        torch_dtype="bfloat16",
    ),
    "Qwen3-30B-A3B": _dummy(
        "Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=(151645,),
        torch_dtype="bfloat16", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    "Mixtral-8x7B": _dummy(
        "MixtralForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=1, eos_token_id=(2,),
        torch_dtype="bfloat16", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
    ),
}  # fmt: skip


def dummy_config(name: str) -> ModelConfig:
    if name not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy model shape {name!r}; known: {', '.join(DUMMY_SHAPES)}")
    return DUMMY_SHAPES[name]
