"""Hugging Face transformers as the reference: models, greedy generation, tiny random checkpoints.

Shared by the model tests and the end-to-end token-exactness tests. Everything runs fp32 on CPU.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 300
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TINY_WORDS = (
    " the and of to in is that it was for on are with as his they be at one have this from hello world"
)


@functools.cache
def _hf_model_cached(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def hf_model(model_dir: str | Path) -> Any:
    """transformers' AutoModelForCausalLM for `model_dir`, fp32 SDPA on CPU, loaded once per directory."""
    return _hf_model_cached(str(Path(model_dir).resolve()))


@torch.no_grad()
def hf_logits(model_dir: str | Path, token_ids: list[int]) -> torch.Tensor:  # (len, vocab) fp32
    out = hf_model(model_dir)(torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def hf_embedding(model_dir: str | Path, token_ids: list[int], normalize: bool = True) -> torch.Tensor:
    """sentence-transformers' last-token pooling over transformers: the final norm's output at the last
    token (fp32), L2-normalized unless asked not to."""
    out = hf_model(model_dir)(torch.tensor([token_ids]), use_cache=False, output_hidden_states=True)
    last = out.hidden_states[-1][0, -1].float()
    return torch.nn.functional.normalize(last, dim=-1) if normalize else last


def _eos_ids(model_dir: str | Path) -> list[int]:
    from engine.tokenizer import Tokenizer

    return sorted(Tokenizer.from_dir(model_dir).eos_token_ids)


@torch.no_grad()
def hf_greedy(
    model_dir: str | Path,
    prompt_ids_list: list[list[int]],
    max_new_tokens_list: list[int],
    extra: list[dict[str, Any]] | None = None,
) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time; each output stops after the first EOS
    (engine.tokenizer's eos_token_ids), which it includes, or after max_new_tokens. `extra[i]`: more
    GenerationConfig fields for prompt i (say sequence_bias, min_new_tokens, or eos_token_id with stop ids), and
    under "logits_processor" a LogitsProcessorList for generate."""
    from transformers import GenerationConfig

    model, eos = hf_model(model_dir), _eos_ids(model_dir)
    outputs = []
    for i, (prompt, max_new) in enumerate(zip(prompt_ids_list, max_new_tokens_list, strict=True)):
        fields = {"eos_token_id": eos or None, **(extra[i] if extra else {})}
        processors = fields.pop("logits_processor", None)
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new, pad_token_id=(eos or [0])[0], **fields
        )
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config, logits_processor=processors
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


class AllowOnly:
    """A transformers logits processor that leaves only `token_ids` possible (vLLM's allowed_token_ids)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.token_ids] = 0.0
        return scores + keep


class BanWords:
    """A transformers logits processor with vLLM's bad_words rule: a word's last token is banned where the
    tokens generated so far (not the prompt) end in the ones before it."""

    def __init__(self, words: tuple[tuple[int, ...], ...], prompt_len: int) -> None:
        self.words, self.prompt_len = words, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[0, self.prompt_len :].tolist()
        for w in self.words:
            n = len(w) - 1
            if n <= len(out) and out[len(out) - n :] == list(w[:n]):
                scores[:, w[-1]] = float("-inf")
        return scores


class GuideMask:
    """A transformers logits processor that holds generation to an outlines-core Guide (structured output):
    the guide takes each token generated since the last call, then every token it does not allow is -inf.
    `after`: a reasoning's end marker; until it is generated nothing is held, and the guide takes the tokens
    after it only."""

    def __init__(self, guide: Any, prompt_len: int, after: int | None = None) -> None:
        self.guide, self.prompt_len, self.seen, self.waiting = guide, prompt_len, 0, after

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        new = input_ids[0, self.prompt_len + self.seen :].tolist()
        self.seen += len(new)
        for token in new:
            if self.waiting is not None:
                self.waiting = None if token == self.waiting else self.waiting
            else:
                self.guide.advance(token, return_tokens=False)
        if self.waiting is not None:
            return scores
        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.guide.get_tokens()] = 0.0
        return scores + keep


# ---- tiny random checkpoints ---------------------------------------------------------------------


def tiny_random_model_dir(tmp_path: Path, arch: str = "llama", seed: int = 0, **sizes: int) -> Path:
    """A 2-layer random transformers checkpoint (+ tokenizer) in tmp_path / f"tiny-{arch}".

    llama: tied embeddings; qwen2: q/k/v bias, untied; qwen3: q and k normed per head, head_dim 32 (not
    hidden / heads), tied; phi3: fused qkv and gate_up tensors, untied; llama3_scaled: llama3 rope scaling,
    untied; mixtral: 4 experts, top 2 renormalised, untied; qwen3_moe: qwen3's attention, 4 experts of 48
    features, top 2 not renormalised, layer 0 a dense MLP, tied; qwen2_moe: q/k/v bias, the same experts and a
    shared expert of 96 features, layer 0 dense by decoder_sparse_step, untied.
    `sizes` override the config's (e.g. num_key_value_heads=8, or the MoEs' decoder_sparse_step=1 and
    mlp_only_layers=[]); they name the directory too.
    Weights are drawn wide enough (std 0.1, norms around 1, nonzero biases) that greedy choices
    are far from ties.
    """
    from transformers import AutoModelForCausalLM

    out = tmp_path / "-".join([f"tiny-{arch}", *(f"{k}{v}" for k, v in sorted(sizes.items()))])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(arch, **sizes), attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    model.save_pretrained(out)
    write_tiny_tokenizer(out)
    return out


def _tiny_config(arch: str, **sizes: int) -> Any:
    from transformers import (
        LlamaConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        bos_token_id=TINY_VOCAB - 2, eos_token_id=TINY_VOCAB - 1, dtype="float32",
    )  # fmt: skip
    common.update(sizes)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0)
    if arch == "phi3":  # q, k, v and gate, up fused in the checkpoint
        return Phi3Config(
            **common, tie_word_embeddings=False, rope_theta=10000.0, pad_token_id=TINY_VOCAB - 1
        )
    if arch == "qwen3":
        return Qwen3Config(**{"head_dim": 32, **common}, tie_word_embeddings=True, rope_theta=1000000.0)
    if arch == "mixtral":
        moe = dict(num_local_experts=4, num_experts_per_tok=2)
        return MixtralConfig(**{**moe, **common}, tie_word_embeddings=False, rope_theta=1000000.0)
    if arch == "qwen2_moe":  # q/k/v bias; layer 0 dense by decoder_sparse_step; a gated shared expert
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False)
        return Qwen2MoeConfig(
            **{**moe, "decoder_sparse_step": 2, "shared_expert_intermediate_size": 96, **common},
            tie_word_embeddings=False, rope_theta=1000000.0,
        )  # fmt: skip
    if arch == "qwen3_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False)
        return Qwen3MoeConfig(
            **{"head_dim": 32, **moe, "mlp_only_layers": [0], **common}, tie_word_embeddings=True,
            rope_theta=1000000.0,
        )  # fmt: skip
    if arch == "llama3_scaled":
        scaling = {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        }  # fmt: skip
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=scaling)
    raise ValueError(f"unknown tiny arch {arch!r}")


def write_tiny_tokenizer(out: Path) -> None:
    """A byte-level BPE of exactly TINY_VOCAB tokens: 256 bytes, a few merges, 3 ChatML specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: byte for byte, ch in bytes_to_unicode().items()}
    merges = _tiny_merges(vocab, TINY_VOCAB - len(TINY_SPECIAL_TOKENS))
    for token in TINY_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": None, "pad_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE,
        "add_bos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": 256,
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), 256),
    ]
    cs = list(bs)
    shifted = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + shifted)
            shifted += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _tiny_merges(vocab: dict[str, int], size: int) -> list[tuple[str, str]]:
    """Merges that spell the words of _TINY_WORDS (with their leading space), then letter pairs."""
    words = [("\u0120" + w) for w in _TINY_WORDS.split()] + [a + b for a in "etaoin" for b in "etaoinsrh"]
    merges: list[tuple[str, str]] = []
    for word in words:
        piece = word[0]
        for ch in word[1:]:
            if len(vocab) >= size:
                return merges
            if piece + ch not in vocab:
                merges.append((piece, ch))
                vocab[piece + ch] = len(vocab)
            piece += ch
    raise AssertionError("not enough merges for the tiny vocabulary")


def tiny_worker_config(tmp_path: Path, worker_id: str, **kwargs):
    """A worker config (serving/worker_config.py) over tiny_random_model_dir on CPU, fp32, a small pool:
    for driving a worker's engine-side core directly."""
    from engine.config import CacheConfig, EngineConfig
    from serving.worker_config import WorkerConfig

    engine = EngineConfig(
        model=str(tiny_random_model_dir(tmp_path)), device="cpu", dtype="float32", max_model_len=128,
        cache=CacheConfig(cpu_kv_cache_space=0.01),
    )  # fmt: skip
    return WorkerConfig(engine=engine, worker_id=worker_id, **kwargs)
