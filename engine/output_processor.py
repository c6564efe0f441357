"""Per-request detokenization and stop strings: sequences in, RequestOutputs out."""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import CompletionOutput, RequestOutput
from engine.sequence import Sequence, SequenceStatus
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Completion:
    seq: Sequence
    detok: IncrementalDetokenizer | None
    text: str = ""
    stop_hit: bool = False


class RequestState:
    """One user request: its prompt and its n completions (one Sequence each)."""

    def __init__(
        self, request_id: str, prompt: str | None, seqs: list[Sequence], tokenizer: Tokenizer | None
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = seqs[0].prompt_token_ids
        self.completions = [_Completion(s, _detokenizer(tokenizer, s)) for s in seqs]

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)

    def update(self, seq: Sequence) -> bool:
        """Detokenize the sequence's newest token; True if a stop string now ends it."""
        c = next(c for c in self.completions if c.seq is seq)
        if c.detok is None:
            return False
        c.text += c.detok.add(seq.output_token_ids[-1])
        stops = seq.params.stop_strings
        if not stops or c.stop_hit:
            return False
        window = len(c.text) - max(len(s) for s in stops) - 8  # only new text can complete a stop string
        for stop in stops:
            at = c.text.find(stop, max(0, window))
            if at >= 0:
                c.text = c.text[: at + len(stop)] if seq.params.include_stop_str_in_output else c.text[:at]
                seq.stop_reason = stop
                c.stop_hit = True
                return True
        return False

    def output(self) -> RequestOutput:
        outs = [self._completion_output(i, c) for i, c in enumerate(self.completions)]
        first = self.completions[0].seq
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            finished=self.finished,
        )

    @staticmethod
    def _completion_output(index: int, c: _Completion) -> CompletionOutput:
        seq = c.seq
        text = c.text
        if not seq.is_finished and seq.params.stop_strings:
            # hold back what could still grow into a stop string, so streamed text never takes it back
            text = text[: max(0, len(text) - max(len(s) for s in seq.params.stop_strings) + 1)]
        wants_logprobs = seq.params.logprobs is not None
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            logprobs=list(seq.logprobs) if wants_logprobs else None,
            finish_reason=seq.status.finish_reason if seq.status >= SequenceStatus.FINISHED_STOPPED else None,
            stop_reason=seq.stop_reason,
        )


def _detokenizer(tokenizer: Tokenizer | None, seq: Sequence) -> IncrementalDetokenizer | None:
    if tokenizer is None:
        return None  # token ids only
    return IncrementalDetokenizer(
        tokenizer, seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens
    )
