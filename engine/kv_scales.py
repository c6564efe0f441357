"""The KV cache's dtype and, for fp8 (e4m3, kernels/kv_quant.py), each layer's K and V scales.

Scales are 1.0 unless `calculate_kv_scales`, as in vLLM without scales in the checkpoint (a log line says
so: K and V values past +-448 then saturate). With it, one calibration pass over a fixed text (random
token ids for a model without a tokenizer) writes K and V unquantized into a scratch cache, and each
layer's scale maps twice its largest |K| (|V|) to 448, leaving room for larger values than the text had.
The scales live on the attention modules (PagedAttention.kv_scale) and are set in place, so the captured
CUDA graphs read them. A prefill and a decode worker started with the same flags compute the same scales.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.attention import PagedAttention
from engine.attention_metadata import AttentionMetadata
from kernels.kv_quant import FP8_DTYPE, FP8_MAX

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

HEADROOM = 2.0  # the calibration's largest |K| and |V| land at 448 / HEADROOM
CALIBRATION_TOKENS = 512
CALIBRATION_TEXT = (
    "The history of science is the study of how people came to understand the natural world. Early "
    "astronomers tracked the planets and the seasons; physicians described diseases and their cures; "
    "engineers built bridges, clocks and engines. In the modern era, chemistry explained the elements, "
    "biology the cell and evolution, and physics the atom, light and gravity. Computers then changed how "
    "every field works: programs simulate weather, fold proteins, translate languages and answer "
    "questions. Here is a short dialogue. User: What is the capital of France? Assistant: Paris. User: "
    "Write a Python function that adds two numbers. Assistant: def add(a, b): return a + b. User: List "
    'three colors. Assistant: red, green and blue. 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. {"key": [1, 2.5, null]}'
)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """CacheConfig.kv_cache_dtype ("auto", "fp8", "fp8_e4m3") as the cache tensor's dtype."""
    return FP8_DTYPE if name in ("fp8", "fp8_e4m3") else model_dtype


def attention_layers(model: torch.nn.Module) -> list[PagedAttention]:
    return [m for m in model.modules() if isinstance(m, PagedAttention)]


def set_kv_scales(model: torch.nn.Module, scales: torch.Tensor) -> None:
    """scales (num_layers, 2) fp32: [k_scale, v_scale] per layer, copied into each layer's in place."""
    layers = attention_layers(model)
    assert scales.shape == (len(layers), 2), f"scales {tuple(scales.shape)} for {len(layers)} layers"
    for layer, row in zip(layers, scales):
        layer.kv_scale.copy_(row)


def setup_kv_scales(runner: ModelRunner, calculate: bool, token_ids: list[int] | None) -> torch.Tensor | None:
    """The fp8 cache's scales, set on the model and returned as (num_layers, 2); None for another cache.
    `token_ids`: the calibration text's (None: random ids of the model's vocabulary)."""
    if runner.kv_cache.dtype != FP8_DTYPE:
        return None
    layers = attention_layers(runner.model)
    if not calculate:
        logger.info(
            "fp8 KV cache: K and V scales 1.0 in all %d layers (values past +-%g saturate); "
            "calculate_kv_scales=True computes them from a calibration pass",
            len(layers), FP8_MAX,
        )  # fmt: skip
        return torch.ones(len(layers), 2)
    if token_ids is None:
        g = torch.Generator().manual_seed(0)
        token_ids = torch.randint(
            0, runner.model_config.vocab_size, (CALIBRATION_TOKENS,), generator=g
        ).tolist()
    scales = calibrate(runner, token_ids[: min(CALIBRATION_TOKENS, runner.max_model_len)])
    set_kv_scales(runner.model, scales)
    logger.info(
        "fp8 KV cache: scales from a calibration pass of %d tokens: K %.3g..%.3g, V %.3g..%.3g over %d layers",
        min(len(token_ids), CALIBRATION_TOKENS), scales[:, 0].min(), scales[:, 0].max(), scales[:, 1].min(),
        scales[:, 1].max(), len(layers),
    )  # fmt: skip
    return scales.cpu()


@torch.inference_mode()
def calibrate(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """(num_layers, 2) fp32 scales: HEADROOM x each layer's largest |K| and |V| over the tokens / 448."""
    n, bs = len(token_ids), runner.block_size
    num_blocks = -(-n // bs)
    # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim) in the model's dtype: unquantized
    scratch = torch.zeros(
        runner.num_layers, 2, num_blocks, *runner.kv_shape_tail, dtype=runner.dtype, device=runner.device
    )
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], bs, runner.device)
    ids = torch.tensor(token_ids, dtype=torch.long, device=runner.device)
    runner.model(ids, torch.arange(n, device=runner.device), meta, scratch)
    amax = scratch.abs().amax(dim=(2, 3, 4, 5)).float()  # (num_layers, 2): the unused tail is zeros
    return (amax * HEADROOM / FP8_MAX).clamp(min=1e-8)
