"""Small frozen configs, one per role, each checked when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec_decode import SpeculativeConfig

_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("auto", "swap", "recompute")
# every `dtype` name and the torch dtype it means (engine_core resolves them)
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8: e4m3 with per-layer K and V scales


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    # how a preempted request gives its blocks back: its KV copied to the CPU swap space and back later, or
    # freed and recomputed; auto: per request, whichever costs less (engine/preemption.py)
    preemption_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(f"scheduling_policy must be one of {_POLICIES}, got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least max_model_len ({self.max_model_len}) so that every prompt fits in one step"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space: float = 1.0  # GiB of KV cache when running on the CPU
    num_gpu_blocks_override: int | None = None
    swap_space: float = 0.0  # GiB of pinned CPU memory for preempted requests' KV blocks (0: none)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8 (e4m3): half the bytes per block
    calculate_kv_scales: bool = False  # fp8: K and V scales per layer from a calibration pass (else 1.0)

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_space <= 0:
            raise ValueError(f"cpu_kv_cache_space must be positive, got {self.cpu_kv_cache_space}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}"
            )
        if not self.swap_space >= 0:  # NaN too
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (fp8 is e4m3), got {self.kv_cache_dtype!r}"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales needs an fp8 KV cache (kv_cache_dtype='fp8')")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF model dir, GGUF file, or a dummy shape name; None: the bundled model
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    load_format: str = "auto"
    # awq | gptq | gguf; None: what the checkpoint says (a .gguf file: gguf) (engine/quant_weights.py)
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None  # None: the model's own
    served_model_name: str | None = None  # None: the model directory's name
    enforce_eager: bool = False  # True: never capture CUDA graphs (the CPU never does)
    # plan and queue each step while the device runs the one before (LLMEngine.step, decode workers)
    async_scheduling: bool = True
    # vLLM's speculative_config, as a dict or a SpeculativeConfig; None: one token a step (engine/spec_decode.py)
    speculative_config: SpeculativeConfig | dict | None = None
    # ranks (processes, one GPU each) that split every layer's heads and weights (engine/tp/)
    tensor_parallel_size: int = 1
    # vLLM's: a MoE layer's experts spread whole over the tensor-parallel ranks (E / N each) instead of each
    # expert's intermediate features split over them (engine/layers/moe.py)
    enable_expert_parallel: bool = False
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors, gguf or dummy, got {self.load_format!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.quantization not in (None, "awq", "gptq", "gguf"):
            raise ValueError(f"quantization must be awq, gptq or gguf, got {self.quantization!r}")
        if self.scheduler.preemption_mode == "swap" and self.cache.swap_space == 0:
            raise ValueError("preemption_mode='swap' needs swap space: set swap_space (GiB of CPU memory)")
        if self.tensor_parallel_size > 1 and (
            self.cache.swap_space > 0 or self.cache.kv_cache_dtype != "auto"
        ):
            raise ValueError(
                "swap_space and an fp8 kv_cache_dtype with tensor_parallel_size > 1 are not supported yet"
            )
        if isinstance(self.speculative_config, dict):
            object.__setattr__(
                self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config)
            )
