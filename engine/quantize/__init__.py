"""Making int4 checkpoints here: round-to-nearest, AWQ and GPTQ over calibration text the project ships
(data/calibration.txt; data/heldout.txt is for perplexity), written in the AWQ or GPTQ layout that
vLLM's and transformers' loaders read (`pdserve quantize`, engine/quantize/pipeline.py)."""

from engine.quantize.pipeline import FORMATS, METHODS, QuantizeConfig, quantize

__all__ = ["FORMATS", "METHODS", "QuantizeConfig", "quantize"]
