"""Turn the last position's logits into tokens: greedy, or temperature / top-k / top-p / min-p sampling.

Sampling draws with the "exponential race" (argmax of p / q, q ~ Exp(1)), which equals sampling from p;
each request with a seed owns a torch.Generator, so the same seed gives the same output whatever else
shares the batch. Logprobs are those of the raw model distribution (before penalties, temperature and
filters). Penalties (repetition, then frequency and presence) adjust the logits first, greedy rows too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.uploads import upload


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: the sampled token's logprob plus the top-k asked for


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # (num_seqs, vocab) float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[tuple[list[int], list[int]] | None] | None = None,  # (prompt ids, output ids)
        before_read: Callable[[], None] | None = None,
    ) -> SamplerOutput:
        """`before_read()` runs once every result is queued on the device (tokens, logprobs, and their
        copies to the host), before the host waits for them: work it queues on this stream runs after
        them and does not delay them (the prefill worker queues its KV copy there)."""
        raw = logits
        if histories is not None and any(p.has_penalties for p in params):
            logits = apply_penalties(logits, params, histories)
        tokens = logits.argmax(dim=-1)  # (num_seqs,)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = upload(torch.tensor(rows), logits.device)
            probs = filtered_probs(logits[idx], [params[i] for i in rows])  # (len(rows), vocab)
            q = upload(
                torch.stack([self._exponential(probs.shape[1], generators[i]) for i in rows]), probs.device
            )
            tokens[idx] = (probs / q).argmax(dim=-1)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        results = [tokens, *self._logprob_tensors(raw, params, tokens, wanted)]
        ready = None
        if tokens.is_cuda:
            results = [t.to("cpu", non_blocking=True) for t in results]  # into pinned memory
            ready = torch.cuda.Event()
            ready.record()
        if before_read is not None:
            before_read()
        if ready is not None:
            ready.synchronize()
        token_ids = results[0].tolist()
        return SamplerOutput(token_ids, self._logprobs(params, token_ids, wanted, results[1:]))

    def _exponential(self, vocab: int, generator: torch.Generator | None) -> torch.Tensor:
        return torch.empty(vocab).exponential_(generator=generator or self.generator)

    @staticmethod
    def _logprob_tensors(
        logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor, wanted: list[int]
    ) -> list[torch.Tensor]:
        """For the rows in `wanted`: the sampled token's logprob, then each row's top-k (values, indices),
        all on the device."""
        if not wanted:
            return []
        idx = upload(torch.tensor(wanted), logits.device)
        logp = torch.log_softmax(logits[idx].float(), dim=-1)  # (len(wanted), vocab)
        out = [logp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1)]
        for row, i in enumerate(wanted):
            k = params[i].logprobs or 0
            if k:
                top = logp[row].topk(k)
                out += [top.values, top.indices]
        return out

    @staticmethod
    def _logprobs(
        params: list[SamplingParams], token_ids: list[int], wanted: list[int], tensors: list[torch.Tensor]
    ) -> list[dict[int, float] | None]:
        """_logprob_tensors' results, on the host, as one dict per row (None where not asked for)."""
        out: list[dict[int, float] | None] = [None] * len(params)
        if not wanted:
            return out
        chosen, tops = tensors[0].tolist(), iter(tensors[1:])
        for row, i in enumerate(wanted):
            entry = {token_ids[i]: chosen[row]}
            if params[i].logprobs:
                values, indices = next(tops), next(tops)
                entry.update(zip(indices.tolist(), values.tolist()))
            out[i] = entry
        return out


def apply_penalties(
    logits: torch.Tensor,  # (rows, vocab)
    params: list[SamplingParams],
    histories: list[tuple[list[int], list[int]] | None],
) -> torch.Tensor:
    """A penalized copy of the logits. Repetition (vLLM/HF): a logit of a token seen in the prompt or the
    output is divided by the penalty when positive, multiplied when negative. Then OpenAI's
    `logit -= frequency * count_in_output + presence * (count_in_output > 0)`."""
    logits = logits.float().clone()
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        history = histories[i]
        if not p.has_penalties or history is None:
            continue
        prompt, output = history
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab]
        counts = upload(counts.float(), logits.device)  # (vocab,)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen.index_fill_(0, upload(torch.tensor(prompt, dtype=torch.long), logits.device), True)
            row = logits[i]
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[i] = torch.where(seen, penalized, row)
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature after top-k, top-p and min-p filtering; (rows, vocab)."""
    dev = logits.device
    vocab = logits.shape[1]
    # one upload of every row's (temperature, top_k, top_p, min_p): see upload()
    knobs = upload(
        torch.tensor([[p.temperature, p.top_k if p.top_k > 0 else vocab, p.top_p, p.min_p] for p in params]),
        dev,
    )  # (rows, 4) float32
    temperature, top_k, top_p, min_p = (knobs[:, j : j + 1] for j in range(4))
    logits = logits.float() / temperature

    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (rows, vocab)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    drop = ranks >= top_k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p  # keeps at least the top token
    drop |= sorted_probs < min_p * sorted_probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return filtered.softmax(dim=-1)
