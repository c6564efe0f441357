"""pdserve's engine: model, paged KV cache, scheduler, sampler and the offline LLM API."""

from engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch models and loaders: import it only when asked for
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = [
    "LLM", "LLMEngine", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
    "EmbeddingRequestOutput", "EmbeddingOutput", "ScoringRequestOutput", "ScoringOutput",
]  # fmt: skip
