"""Turn the last position's logits into tokens: greedy, or temperature / top-k / top-p / min-p sampling.

The host packs every row's knobs into one small tensor and uploads it once (queued, `engine/uploads.py`);
everything after runs on the device as batched tensor ops (`engine/sampling_ops.py`) and the tokens and
logprobs come back in one queued copy. Sampling is the Gumbel-max trick over noise that is a hash of
(seed, position being sampled, vocab index) (`kernels/sampling_noise.py`): a request with a seed draws
the same tokens whatever else shares the batch, alone or batched, on CPU or GPU. A request without a seed
gets a fresh seed from the sampler's generator at each step. Logprobs are those of the raw model
distribution (before penalties, temperature and filters). Penalties (repetition, then frequency and
presence) adjust the logits first, greedy rows too; then each row's logit_bias is added and the stops its
min_tokens holds back go to -inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.sampling_ops import (
    SamplingTensors,
    Stages,
    history_counts,
    logprob_tensors,
    sample_tokens,
    scaled_logits,
)
from engine.sampling_ops import apply_penalties as penalize
from engine.sampling_ops import filter_mask as _filter_mask
from engine.sampling_params import SamplingParams
from engine.uploads import upload
from kernels.sampling_noise import greedy_argmax

History = tuple[list[int], list[int]]  # (prompt ids, output ids)
_WORD = (1 << 64) - 1
MAX_TOPK = 1024  # top-k without top-p up to this k takes torch.topk, beyond it a sort


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: the sampled token's logprob plus the top-k asked for


@dataclass
class PendingSample:
    """A step's sampling, queued on the device: its tokens there (a later step's inputs can read them
    before the host knows them) and their copy to the host, read by `result()`."""

    tokens: torch.Tensor  # (rows,) int64 on the logits' device
    packed: torch.Tensor  # on the host once `ready` has passed: tokens, then logprobs where asked for
    ready: torch.cuda.Event | None
    params: list[SamplingParams]
    top: int  # the most top logprobs a row asked for; < 0: no row asked for logprobs

    def result(self) -> SamplerOutput:
        """The tokens and logprobs on the host (waits for the device)."""
        if self.ready is not None:
            self.ready.synchronize()
        token_ids = self.packed[: len(self.params)].long().tolist()
        return SamplerOutput(token_ids, Sampler._logprobs(self.params, token_ids, self.top, self.packed))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # seeds of the requests that bring none

    def __call__(
        self,
        logits: torch.Tensor,  # (num_seqs, vocab) float32
        params: list[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[History | None] | None = None,
        before_read: Callable[[], None] | None = None,
        positions: Sequence[int] | None = None,
        banned: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        """`before_read()` runs once every result is queued on the device (tokens, logprobs, and their
        copies to the host), before the host waits for them: work it queues on this stream runs after
        them and does not delay them (the prefill worker queues its KV copy there)."""
        pending = self.queue(logits, params, generators, histories, positions, banned)
        if before_read is not None:
            before_read()
        return pending.result()

    def queue(
        self,
        logits: torch.Tensor,  # (num_seqs, vocab) float32
        params: list[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[History | None] | None = None,
        positions: Sequence[int] | None = None,
        banned: Sequence[Sequence[int]] | None = None,
        masks: Sequence[np.ndarray | None] | None = None,
    ) -> PendingSample:
        """Queue the sampling of every row and the copy of its results to the host; nothing waits.

        The position a row samples is `positions[i]`, else len(prompt) + len(output) of its history (0
        without one); its seed is `params.seed`, else its generator's initial seed, else one drawn from
        this sampler. `banned[i]`: token ids row i may not take (a request's stops before its min_tokens).
        `masks[i]`: the only tokens row i may take, as int32 words of bits (structured output), or None.
        Logprobs are the model's own, before penalties, bias and bans (vLLM's raw logprobs)."""
        raw = logits
        logits = adjust_logits(logits, params, banned)
        if masks is not None and any(m is not None for m in masks):
            logits = apply_masks(logits, masks)
        stages = stages_of(params, logits.shape[1])
        penalized = histories is not None and any(p.has_penalties for p in params)
        if stages.sample or penalized:
            seeds = self._seeds(params, generators)
            where = list(positions) if positions is not None else _positions(histories, len(params))
            t = sampling_tensors(params, seeds, where, logits.shape[1], logits.device)
            if penalized:
                assert histories is not None
                logits = apply_penalties_with(logits, t, params, histories)
            tokens = sample_tokens(logits, t, stages)  # (num_seqs,)
        else:  # every row greedy, nothing to adjust: no knobs to upload
            tokens = greedy_argmax(logits)
        top = max((p.logprobs or 0 for p in params if p.logprobs is not None), default=-1)
        packed = tokens if top < 0 else _pack([tokens, *logprob_tensors(raw, tokens, top)])
        ready = None
        if packed.is_cuda:
            packed = packed.to("cpu", non_blocking=True)  # into pinned memory
            ready = torch.cuda.Event()
            ready.record()
        return PendingSample(tokens, packed, ready, params, top)

    def _seeds(self, params: list[SamplingParams], generators: Sequence[torch.Generator | None]) -> list[int]:
        seeds: list[int | None] = [
            0 if p.greedy else p.seed if p.seed is not None else g.initial_seed() if g is not None else None
            for p, g in zip(params, generators)
        ]
        missing = [i for i, s in enumerate(seeds) if s is None]
        if missing:
            drawn = torch.randint(-(2**63), 2**63 - 1, (len(missing),), generator=self.generator)
            for i, s in zip(missing, drawn.tolist()):
                seeds[i] = s
        return [_as_int64(s) for s in seeds if s is not None]

    @staticmethod
    def _logprobs(
        params: list[SamplingParams], token_ids: list[int], top: int, packed: torch.Tensor
    ) -> list[dict[int, float] | None]:
        """The packed results on the host as one dict per row (None where not asked for): the sampled
        token's logprob, then the top ones the row asked for. `top` < 0: no row asked."""
        n = len(params)
        if top < 0:
            return [None] * n
        chosen = packed[n : 2 * n].tolist()
        values = packed[2 * n : 2 * n + n * top].view(n, top).tolist() if top else [[]] * n
        ids = packed[2 * n + n * top :].view(n, top).long().tolist() if top else [[]] * n
        out: list[dict[int, float] | None] = [None] * n
        for i, p in enumerate(params):
            if p.logprobs is None:
                continue
            entry = {token_ids[i]: chosen[i]}
            entry.update(zip(ids[i][: p.logprobs], values[i][: p.logprobs]))
            out[i] = entry
        return out


def _as_int64(seed: int) -> int:
    """Any Python int as the int64 with its low 64 bits."""
    word = seed & _WORD
    return word - (1 << 64) if word >> 63 else word


def _positions(histories: Sequence[History | None] | None, rows: int) -> list[int]:
    if histories is None:
        return [0] * rows
    return [0 if h is None else len(h[0]) + len(h[1]) for h in histories]


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tokens and logprobs as one float64 vector (ids are exact there), so one copy brings them back."""
    return torch.cat([x.double().flatten() for x in tensors])


def stages_of(params: list[SamplingParams], vocab: int) -> Stages:
    sampling = [p for p in params if not p.greedy]
    sort = any(p.top_p < 1.0 for p in sampling)
    max_k = max((min(p.top_k, vocab) for p in sampling if p.top_k > 0), default=0)
    if max_k > MAX_TOPK:  # a large k: one sort is cheaper than topk
        sort, max_k = True, 0
    return Stages(
        sample=bool(sampling),
        sort=sort,
        max_k=0 if sort else max_k,
        min_p=any(p.min_p > 0.0 for p in sampling),
    )


def sampling_tensors(
    params: list[SamplingParams], seeds: list[int], positions: list[int], vocab: int, device: torch.device
) -> SamplingTensors:
    """Every row's knobs on `device` in one upload."""
    floats = [
        [
            0.0 if p.greedy else p.temperature,
            float(p.top_k if 0 < p.top_k < vocab else vocab),
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
            0.0,  # FLOAT_KNOBS' pad: the knobs fill whole int64 words
        ]
        for p in params
    ]
    words = torch.tensor(floats, dtype=torch.float32).view(torch.int64)  # (rows, 4)
    ints = torch.tensor([seeds, positions], dtype=torch.int64).T  # (rows, 2)
    packed = torch.cat([ints, words.reshape(len(params), -1)], dim=1)  # (rows, 6)
    return SamplingTensors.unpack(upload(packed, device))


def apply_masks(logits: torch.Tensor, masks: Sequence[np.ndarray | None]) -> torch.Tensor:
    """The logits with every token a row's mask leaves out at -inf (rows without a mask keep all): one
    upload of the rows' bit words, unpacked on the device."""
    rows, vocab = logits.shape
    words = -(-vocab // 32)
    packed = np.full((rows, words), -1, dtype=np.int32)  # all bits set: every token allowed
    for r, m in enumerate(masks):
        if m is not None:
            packed[r, : min(words, m.size)] = m[:words]
            packed[r, m.size :] = 0
    bits = upload(torch.from_numpy(packed), logits.device).unsqueeze(-1)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits >> shifts) & 1).bool().reshape(rows, words * 32)[:, :vocab]
    return logits.float().masked_fill(~allowed, -math.inf)


def adjust_logits(
    logits: torch.Tensor,  # (rows, vocab)
    params: list[SamplingParams],
    banned: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The logits with each row's logit_bias added, its banned tokens at -inf, and, for a row with
    allowed_token_ids, every other token at -inf: one upload of (flat index, value) pairs, an out-of-place
    scatter-add and, where rows restrict their tokens, one masked fill. The logits themselves when no row has
    any of them."""
    rows, vocab = logits.shape
    index: list[int] = []
    values: list[float] = []
    restricted = any(p.allowed_token_ids is not None for p in params)
    for r, p in enumerate(params):
        for token in p.allowed_token_ids or ():  # value nan: marks an allowed token (the fill below)
            if token < vocab:
                index.append(r * vocab + token)
                values.append(math.nan)
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab:  # checked against the model's vocabulary when the request came in
                index.append(r * vocab + token)
                values.append(bias)
        for token in banned[r] if banned is not None else ():
            if 0 <= token < vocab:  # a stop token id past the vocabulary is never sampled anyway
                index.append(r * vocab + token)
                values.append(-math.inf)
    if not index:
        return logits
    pairs = upload(torch.tensor([index, values], dtype=torch.float64), logits.device)  # ids exact in float64
    where, add = pairs[0].long(), pairs[1].float()
    allowed = add.isnan()
    flat = torch.index_add(logits.float().reshape(-1), 0, where, add.masked_fill(allowed, 0.0))
    if restricted:  # -inf off each restricting row's allowed tokens; fixed shapes: no wait for the device
        spare = torch.full_like(where, rows * vocab)  # the other pairs mark a spare slot past the end
        keep = torch.zeros(rows * vocab + 1, dtype=torch.bool, device=logits.device)
        keep = keep.index_fill_(0, torch.where(allowed, where, spare), True)[:-1].view(rows, vocab)
        marked = torch.zeros(rows + 1, dtype=torch.bool, device=logits.device)
        marked = marked.index_fill_(0, torch.where(allowed, where // vocab, spare // vocab), True)[:-1]
        return flat.view(rows, vocab).masked_fill(~keep & marked[:, None], -math.inf)
    return flat.view(rows, vocab)


def apply_penalties_with(
    logits: torch.Tensor,
    t: SamplingTensors,
    params: list[SamplingParams],
    histories: Sequence[History | None],
) -> torch.Tensor:
    """Penalized logits: each penalized row's history tokens go up in one upload and are counted on the
    device (a row's prompt only where it has a repetition penalty)."""
    tokens: list[int] = []
    segments: list[int] = []  # per penalized row: its prompt's length, then its output's
    rows: list[int] = []
    for i, (p, h) in enumerate(zip(params, histories)):
        if not p.has_penalties or h is None:
            continue
        prompt = h[0] if p.repetition_penalty != 1.0 else []
        tokens += prompt
        tokens += h[1]
        segments += (len(prompt), len(h[1]))
        rows += (i, i)
    if not rows:
        return logits
    lengths = torch.tensor(segments, dtype=torch.int64)
    row_ids = torch.tensor(rows, dtype=torch.int64).repeat_interleave(lengths)
    is_output = torch.tensor([0, 1] * (len(rows) // 2), dtype=torch.int64).repeat_interleave(lengths)
    flat = torch.stack([row_ids, torch.tensor(tokens, dtype=torch.int64), is_output])  # (3, n)
    counts, seen = history_counts(upload(flat, logits.device), logits.shape[0], logits.shape[1])
    return penalize(logits, t, counts, seen)


def apply_penalties(
    logits: torch.Tensor,  # (rows, vocab)
    params: list[SamplingParams],
    histories: Sequence[History | None],
) -> torch.Tensor:
    """A penalized copy of the logits (see `engine.sampling_ops.apply_penalties`)."""
    t = sampling_tensors(params, [0] * len(params), [0] * len(params), logits.shape[1], logits.device)
    return apply_penalties_with(logits, t, params, histories).clone()


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature after top-k, top-p and min-p filtering; (rows, vocab)."""
    t = sampling_tensors(params, [0] * len(params), [0] * len(params), logits.shape[1], logits.device)
    scaled = scaled_logits(logits, t)
    keep = _filter_mask(scaled, t, Stages(sample=True, sort=True, max_k=0, min_p=True))
    return scaled.masked_fill(~keep, float("-inf")).softmax(dim=-1)
