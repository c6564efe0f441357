"""The sampler's device side: per-row knobs in, tokens out, as batched tensor ops.

Every function here takes device tensors of fixed shapes and never waits for the device (no `.item()`, no
data-dependent shapes), so a step's sampling can be queued ahead of the forward pass's end or captured in a
CUDA graph. Which optional stages run (filters, min-p) is decided on the host from the requests'
parameters (`Stages`), never from device data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sampling_noise import greedy_argmax, gumbel_argmax
from kernels.top_p_cutoff import top_k_top_p_cutoff

INT_KNOBS = ("seed", "position")
FLOAT_KNOBS = ("temperature", "top_k", "top_p", "min_p", "repetition", "frequency", "presence", "pad")


@dataclass(frozen=True)
class Stages:
    """What a step's rows need, known on the host from their parameters."""

    sample: bool  # some row samples (temperature > 0)
    sort: bool  # some sampling row has top-p: sort the rows
    max_k: int  # without top-p, the largest top-k of a sampling row (0: none): one topk, no sort
    min_p: bool  # some sampling row has min-p


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row knobs on the device; float knobs are (rows, 1) so they broadcast over the vocabulary."""

    seed: torch.Tensor  # (rows,) int64: a 64-bit word
    position: torch.Tensor  # (rows,) int64: position of the token being sampled
    temperature: torch.Tensor  # 0: greedy
    top_k: torch.Tensor  # the vocabulary size when off
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor

    @staticmethod
    def unpack(packed: torch.Tensor) -> SamplingTensors:
        """From (rows, 2 + 4) int64: INT_KNOBS, then FLOAT_KNOBS as float32 pairs sharing a word."""
        ints = packed[:, : len(INT_KNOBS)]
        floats = packed[:, len(INT_KNOBS) :].contiguous().view(torch.float32)  # (rows, 8)
        cols = {name: floats[:, j : j + 1] for j, name in enumerate(FLOAT_KNOBS) if name != "pad"}
        return SamplingTensors(seed=ints[:, 0], position=ints[:, 1], **cols)


def apply_penalties(
    logits: torch.Tensor,  # (rows, vocab)
    t: SamplingTensors,
    counts: torch.Tensor,  # (rows, vocab) float32: occurrences of each token in the row's output
    seen: torch.Tensor,  # (rows, vocab) bool: the token is in the row's prompt or output
) -> torch.Tensor:
    """Repetition (vLLM/HF): a seen token's logit is divided by the penalty when positive, multiplied when
    not. Then OpenAI's `logit -= frequency * count + presence * (count > 0)`. Neutral knobs (1, 0, 0)
    leave a row's logits bit-exact."""
    logits = logits.float()
    rep = t.repetition
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - (t.frequency * counts + t.presence * (counts > 0).float())


def history_counts(
    flat: torch.Tensor,  # (3, n) int64: row, token id, 1 if an output token else 0 (a prompt token)
    rows: int,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, seen), each (rows, vocab), from every row's history tokens in one scatter."""
    row, token, is_output = flat[0], flat[1], flat[2]
    index = row * (vocab + 1) + token.clamp(0, vocab)  # ids past the vocabulary land in a spare column
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=flat.device)
    counts.view(-1).index_add_(0, index, is_output.float())
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=flat.device)
    seen.view(-1).index_fill_(0, index, True)
    return counts[:, :vocab], seen[:, :vocab]


def top_k_cutoff(scaled: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """(rows, 1): the top_k-th largest of each row, from one topk of the largest k asked for (no sort);
    -inf for rows whose k is past max_k (top-k off)."""
    best = scaled.topk(max_k, dim=-1).values  # (rows, max_k), descending
    cut = best.gather(1, top_k.long().clamp(1, max_k) - 1)
    return cut.masked_fill(top_k > max_k, float("-inf"))


def filter_threshold(scaled: torch.Tensor, t: SamplingTensors, stages: Stages) -> torch.Tensor:
    """(rows, 1): the smallest logits / temperature that top-k, top-p and min-p keep."""
    threshold = torch.full_like(scaled[:, :1], float("-inf"))  # (rows, 1)
    if stages.sort:
        cut = top_k_top_p_cutoff(scaled, t.top_k, t.top_p)
        threshold = torch.maximum(threshold, cut)
    elif stages.max_k:
        threshold = torch.maximum(threshold, top_k_cutoff(scaled, t.top_k, stages.max_k))
    if stages.min_p:  # p >= min_p * p_max, in logits: scaled >= max + log(min_p)
        threshold = torch.maximum(threshold, scaled.amax(dim=-1, keepdim=True) + torch.log(t.min_p))
    return threshold


def filter_mask(scaled: torch.Tensor, t: SamplingTensors, stages: Stages) -> torch.Tensor:
    """(rows, vocab) bool: the tokens top-k, top-p and min-p leave to sample from."""
    return scaled >= filter_threshold(scaled, t, stages)


def scaled_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits / temperature; greedy rows (temperature 0) divided by 1."""
    return logits.float() / torch.where(t.temperature > 0, t.temperature, 1.0)


def sample_tokens(logits: torch.Tensor, t: SamplingTensors, stages: Stages) -> torch.Tensor:
    """(rows,) int64: greedy rows take the argmax of `logits`, the others the Gumbel-max of their filtered
    softmax(logits / temperature) with noise from (seed, position)."""
    if not stages.sample:
        return greedy_argmax(logits)
    if stages.sort or stages.max_k or stages.min_p:
        threshold = filter_threshold(scaled_logits(logits, t), t, stages)
    else:
        threshold = torch.full_like(t.temperature, float("-inf"))
    return gumbel_argmax(logits, t.temperature, threshold, t.seed, t.position)


def logprob_tensors(
    raw: torch.Tensor,  # (rows, vocab): the model's logits
    tokens: torch.Tensor,  # (rows,) int64
    top: int,  # how many top logprobs the most demanding row asked for
) -> list[torch.Tensor]:
    """The sampled token's logprob (rows,) and, when top > 0, the top-`top` values and ids (rows, top)."""
    logp = torch.log_softmax(raw.float(), dim=-1)  # (rows, vocab)
    out = [logp.gather(1, tokens.unsqueeze(1)).squeeze(1)]
    if top:
        best = logp.topk(top, dim=-1)
        out += [best.values, best.indices]
    return out
