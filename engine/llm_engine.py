"""The offline engine: requests in, a step at a time, vLLM-shaped outputs out (detokenized, stop strings)."""

from __future__ import annotations

import itertools

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.output_processor import RequestState
from engine.outputs import RequestOutput
from engine.prompt_checks import truncate_prompt
from engine.sampling_params import SamplingParams, completion_params
from engine.sequence import Sequence, SequenceStatus

__all__ = ["EngineConfig", "LLMEngine"]


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.requests: dict[str, RequestState] = {}
        self._counter = itertools.count()

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request (n completions); raise ValueError, adding nothing, if it is invalid."""
        params = params or SamplingParams()
        prompt_ids = truncate_prompt(
            self.encode_prompt(prompt), params.truncate_prompt_tokens, self.max_model_len
        )
        self.validate(prompt_ids, params)
        request_id = request_id or f"req-{next(self._counter)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs: list[Sequence] = []
        for i in range(params.n):
            child = completion_params(params, i)
            parent = seqs[0] if seqs else None
            seqs.append(
                self.make_sequence(f"{request_id}#{i}", prompt_ids, child, priority, cache_salt, parent)
            )
        self.requests[request_id] = RequestState(
            request_id, prompt if isinstance(prompt, str) else None, seqs, self.tokenizer
        )
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        for seq in state.seqs if state else []:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it advanced, or with `final_only` (vLLM's
        RequestOutputKind.FINAL_ONLY, as `LLM.generate` uses) of those it finished: an output copies every
        token so far, which at a few hundred rows is a visible share of the host's time per step."""
        updated, _ = self.run_step()
        touched: dict[str, RequestState] = {}
        for seq in updated:
            state = self.requests[seq.request_id.rsplit("#", 1)[0]]
            if state.update(seq) and not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            touched[state.request_id] = state
        states = [s for s in touched.values() if s.finished] if final_only else touched.values()
        outputs = [state.output() for state in states]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs
