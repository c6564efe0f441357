"""Quantized linear layers: AWQ, GPTQ and GGUF Q4_0 / Q4_1 / Q8_0 as linear methods set on the model's own
linear layers (engine/layers/linear.py), so the model file does not fork. engine/quant_weights.py decides
which method each layer gets and loads the checkpoint into them."""

from engine.layers.quant.awq import AWQLinearMethod
from engine.layers.quant.base import LinearMethod
from engine.layers.quant.config import QUANTIZATION_METHODS, QuantConfig, resolve_quantization
from engine.layers.quant.gguf import GGUFInt4Method, GGUFInt8Method
from engine.layers.quant.gptq import GPTQLinearMethod

__all__ = [
    "QUANTIZATION_METHODS",
    "AWQLinearMethod",
    "GGUFInt4Method",
    "GGUFInt8Method",
    "GPTQLinearMethod",
    "LinearMethod",
    "QuantConfig",
    "resolve_quantization",
]
