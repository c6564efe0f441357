"""Per-request detokenization and stop strings: sequences in, RequestOutputs out."""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """One completion's text, built a token at a time, cut at the first stop string.

    A stop token (one of stop_token_ids, or EOS unless ignored) ends the completion in the engine; as in vLLM,
    its text is left out unless include_stop_str_in_output. Used by the offline engine and by the router,
    which sees only token ids from the decode workers."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens
        )
        self.stops = params.stop_strings
        self.keep_stop = params.include_stop_str_in_output
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.stop: str | None = None  # the stop string that ended the text
        # as vLLM: stop strings are looked for in the text of tokens past the first min_tokens only
        self.min_tokens = params.min_tokens
        self.num_tokens = 0
        eos = () if params.ignore_eos else tokenizer.eos_token_ids
        self.stop_ids = {*(params.stop_token_ids or ()), *eos}

    def add(self, token_id: int, last: bool = False) -> bool:
        """Add a token (last: the completion ends here); True if a stop string now ends the text."""
        if self.stop is not None:
            return False
        self.num_tokens += 1
        if (
            token_id in self.stop_ids and not self.keep_stop
        ):  # the completion's last token: no text of its own
            return self._extend(self.detok.flush())
        return self._extend(self.detok.add(token_id) + (self.detok.flush() if last else ""))

    def finish(self) -> bool:
        """The completion ended after its last token was added (without last=True): flush what the
        detokenizer held back; True if a stop string now ends the text."""
        if self.stop is not None:
            return False
        return self._extend(self.detok.flush())

    def _extend(self, delta: str) -> bool:
        start = max(0, len(self.text) - self.longest + 1)  # a stop string may straddle the old text
        self.text += delta
        if self.num_tokens <= self.min_tokens:
            return False
        hits = [(at, s) for s in self.stops if (at := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, self.stop = min(hits)
        self.text = self.text[: at + len(self.stop)] if self.keep_stop else self.text[:at]
        return True

    def visible(self, finished: bool) -> str:
        """The text safe to show: while running, hold back what could still grow into a stop string."""
        if finished or self.stop is not None or not self.longest:
            return self.text
        return self.text[: max(0, len(self.text) - self.longest + 1)]


class RequestState:
    """One user request: its prompt and its n completions (one Sequence each)."""

    def __init__(
        self, request_id: str, prompt: str | None, seqs: list[Sequence], tokenizer: Tokenizer | None
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = seqs[0].prompt_token_ids
        self.seqs = seqs
        self.texts = [
            TextStream(tokenizer, s.prompt_token_ids, s.params) if tokenizer else None for s in seqs
        ]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def update(self, seq: Sequence) -> bool:
        """Detokenize the sequence's new tokens (`seq.new_tokens`: several after a verified draft); True if
        a stop string now ends it, the tokens after the one that completed it dropped."""
        text = self.texts[self.seqs.index(seq)]
        if text is None:
            return False
        first = seq.num_output_tokens - seq.new_tokens
        new = seq.output_token_ids[first:]
        for j, token in enumerate(new):
            if text.add(token, last=seq.is_finished and j == len(new) - 1):
                seq.stop_reason = text.stop
                seq.truncate_output(first + j + 1)
                return True
        return False

    def output(self) -> RequestOutput:
        outs = [self._completion(i, s, t) for i, (s, t) in enumerate(zip(self.seqs, self.texts))]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            num_cached_tokens=max(self.seqs[0].num_cached_tokens, 0),
            prompt_logprobs=self.seqs[0].prompt_logprobs_out(),
            finished=self.finished,
            metrics=self._metrics(),
        )

    def _metrics(self) -> RequestMetrics:
        first = self.seqs[0]
        times = RequestMetrics(
            first.arrival_time, first.times.scheduled, first.times.first_token, first.times.last_token
        )
        stats = [s.spec_stats for s in self.seqs if s.spec_stats is not None]
        if not stats:
            return times
        per_pos = [0] * max(len(s.accepted_per_pos) for s in stats)
        for s in stats:
            for i, n in enumerate(s.accepted_per_pos):
                per_pos[i] += n
        return RequestMetrics(
            first.arrival_time,
            first.times.scheduled,
            first.times.first_token,
            first.times.last_token,
            spec_decode_num_drafts=sum(s.num_drafts for s in stats),
            spec_decode_num_draft_tokens=sum(s.num_draft_tokens for s in stats),
            spec_decode_num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
            spec_decode_num_accepted_tokens_per_pos=per_pos,
        )

    @staticmethod
    def _completion(index: int, seq: Sequence, text: TextStream | None) -> CompletionOutput:
        wants_logprobs = seq.params.logprobs is not None
        return CompletionOutput(
            index=index,
            text=text.visible(seq.is_finished) if text else "",
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            logprobs=list(seq.logprobs) if wants_logprobs else None,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
        )
