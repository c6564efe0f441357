"""Embeddings from the generative model, as vLLM's pooling runner gives them: the final norm's hidden state at a
prompt's last token (LAST pooling, what decoder embedding models such as e5-mistral, gte-Qwen2 and
Qwen3-Embedding use), cut to `dimensions` for Matryoshka models and L2-normalized unless asked not to.

An embedding request is a prompt-only request: it is scheduled, chunked and prefix-cached as a prompt is, and
the step that runs its last chunk reads the pooled row instead of a sampled token (engine/model_runner.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where vectors are pooled: the servers' front ends read PoolingParams alone
    import torch


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams for embeddings: `dimensions` keeps the first that many values (Matryoshka models
    only), `normalize` divides by the L2 norm (True unless the model's pooler says otherwise)."""

    dimensions: int | None = None
    normalize: bool | None = None  # None: the model's pooler config (normalized when it says nothing)

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions!r}")


@dataclass(frozen=True)
class PoolerConfig:
    """How the model pools: from sentence-transformers' modules.json (a Pooling module's config and a Normalize
    module) when the model directory has them; LAST, normalized otherwise. `matryoshka`: the model was
    trained so that its first values alone are an embedding (config.json's is_matryoshka or
    matryoshka_dimensions), so requests may ask for fewer dimensions."""

    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path | None) -> PoolerConfig:
        if path is None or not Path(path).is_dir():
            return cls()
        root = Path(path)
        config = _json(root / "config.json")
        dims = tuple(int(d) for d in (config.get("matryoshka_dimensions") or ()))
        matryoshka = bool(config.get("is_matryoshka")) or bool(dims)
        modules = _json(root / "modules.json")
        if not isinstance(modules, list):
            return cls(matryoshka=matryoshka, matryoshka_dimensions=dims)
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        pooling_type = "LAST"
        if "Pooling" in kinds:
            pooled = _json(root / str(kinds["Pooling"].get("path", "")) / "config.json")
            modes = {
                "pooling_mode_lasttoken": "LAST",
                "pooling_mode_mean_tokens": "MEAN",
                "pooling_mode_cls_token": "CLS",
                "pooling_mode_max_tokens": "MAX",
            }
            chosen = [kind for key, kind in modes.items() if pooled.get(key)]
            pooling_type = chosen[0] if len(chosen) == 1 else "+".join(chosen) or "LAST"
        return cls(pooling_type, "Normalize" in kinds, matryoshka, dims)

    def check(self, params: PoolingParams, hidden_size: int) -> None:
        """ValueError unless this model can pool as `params` asks."""
        if self.pooling_type != "LAST":
            raise ValueError(
                f"this model pools by {self.pooling_type} (its sentence-transformers Pooling module); only LAST "
                "(the last token's hidden state) is supported"
            )
        d = params.dimensions
        if d is None:
            return
        if not self.matryoshka:
            raise ValueError(
                "this model does not support Matryoshka representation (config.json has no is_matryoshka or "
                "matryoshka_dimensions), so it cannot give fewer dimensions"
            )
        if d > hidden_size or (self.matryoshka_dimensions and d not in self.matryoshka_dimensions):
            allowed = list(self.matryoshka_dimensions) or f"1 to {hidden_size}"
            raise ValueError(f"dimensions {d} is not one this model gives: {allowed}")


def pool(rows: torch.Tensor, params: list[PoolingParams], config: PoolerConfig) -> list[torch.Tensor]:
    """Each pooled hidden row (n, hidden) cut to its request's dimensions and normalized in fp32 as asked."""
    import torch

    out = []
    for row, p in zip(rows.float(), params):
        if p.dimensions is not None:
            row = row[: p.dimensions]
        if config.normalize if p.normalize is None else p.normalize:
            row = torch.nn.functional.normalize(row, p=2, dim=-1)
        out.append(row)
    return out


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
