"""Bring up a tensor-parallel engine from rank 0: check that the model splits and the GPUs are there, start
ranks 1..N-1 (each loads its share while rank 0 loads its own), then join them in one process group.

Everything that can be checked before a process starts is (head counts, GPU count, features that do not
run sharded), so a bad setting costs a ValueError, not N model loads.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig, dummy_config
from engine.tp import group
from engine.tp.heads import check_model
from engine.tp.messages import Loaded, Start
from engine.tp.ranks import Ranks

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)


def check_devices(tp_size: int, device: torch.device, visible_gpus: int) -> None:
    """ValueError unless there is a GPU per rank (ranks use cuda:0 .. cuda:N-1 of the visible ones)."""
    if device.type != "cuda":
        return
    if device.index not in (None, 0):
        raise ValueError(f"a tensor-parallel engine computes on cuda:0 .. cuda:N-1, not on {device}")
    if tp_size > visible_gpus:
        where = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={where})" if where is not None else ""
        raise ValueError(
            f"tensor_parallel_size {tp_size} is larger than the {visible_gpus} visible GPU(s){shown}: "
            "each rank needs a GPU of its own"
        )


def check_config(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> None:
    tp = config.tensor_parallel_size
    check_model(model_config.num_attention_heads, model_config.num_key_value_heads,
                model_config.intermediate_size, tp)  # fmt: skip
    if model_config.is_moe and config.enable_expert_parallel and model_config.num_experts % tp:
        raise ValueError(
            f"num_experts ({model_config.num_experts}) is not divisible by tensor_parallel_size {tp} "
            "(enable_expert_parallel spreads whole experts over the ranks)"
        )
    if model_config.is_moe and not config.enable_expert_parallel and model_config.moe_intermediate_size % tp:
        raise ValueError(
            f"moe_intermediate_size ({model_config.moe_intermediate_size}) is not divisible by "
            f"tensor_parallel_size {tp}"
        )
    check_devices(tp, device, torch.cuda.device_count() if device.type == "cuda" else 0)
    spec = config.speculative_config
    if getattr(spec, "model", None):
        raise ValueError("speculative decoding with a draft model does not run with tensor_parallel_size > 1")


def read_config(model_path: str, load_format: str) -> ModelConfig:
    from engine.weights import gguf_file, gguf_model_config, open_gguf, resolve_format

    if load_format == "dummy" and not Path(model_path).is_dir():
        return dummy_config(model_path)
    if Path(model_path).exists() and resolve_format(Path(model_path), load_format) == "gguf":
        return gguf_model_config(open_gguf(gguf_file(Path(model_path))))
    return ModelConfig.from_dir(model_path)


def load_sharded(
    config: EngineConfig, model_path: str, dtype: torch.dtype, device: torch.device
) -> tuple[Ranks, LlamaForCausalLM, ModelConfig]:
    """Start the other ranks, load rank 0's share here meanwhile, and join them in the process group.
    Returns the ranks (close them to stop the processes), rank 0's model and the model's config."""
    from engine.weights import load_model

    tp = config.tensor_parallel_size
    check_config(config, read_config(model_path, config.load_format), device)
    backend = group.backend_for(device)
    store = dist.TCPStore("127.0.0.1", 0, tp, True, timeout=group.TIMEOUT, wait_for_workers=False)
    # on the CPU each other rank takes an equal share of this engine's threads (OMP_NUM_THREADS, else one per
    # core); rank 0 runs in the caller's process, whose threads stay as they are
    threads = max(1, torch.get_num_threads() // tp) if device.type == "cpu" else 0
    starts = [
        Start(
            r,
            tp,
            store.port,
            backend,
            "cpu" if device.type == "cpu" else f"cuda:{r}",
            model_path,
            str(dtype).removeprefix("torch."),
            config.load_format,
            config.seed,
            logging.getLogger().getEffectiveLevel(),
            threads,
            config.quantization,
            config.enable_expert_parallel,
        )  # fmt: skip
        for r in range(1, tp)
    ]
    ranks = Ranks(starts, on_failure=group.abort)
    try:
        model, model_config = load_model(
            model_path, dtype=dtype, load_format=config.load_format, device=device, tp_rank=0, tp_size=tp,
            quantization=config.quantization, expert_parallel=config.enable_expert_parallel,
        )  # fmt: skip
        ranks.collect(Loaded)
        group.join(backend, store, 0, tp)
    except BaseException:
        ranks.close()
        raise
    ranks.store = store  # type: ignore[attr-defined]  # the rendezvous lives as long as the group
    logger.info("tensor parallel: %d ranks over %s (pids %s)", tp, backend, ranks.pids)
    return ranks, model, model_config


def shutdown(ranks: Ranks) -> None:
    """Stop the ranks and leave the group (after this the process may start another engine)."""
    ranks.close()
    group.leave()
