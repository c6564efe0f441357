"""The engine process's loop (serving/engine_proc.py) with a stand-in core in a real child process: its load
reports show work an idle engine takes before the step that runs it, even when that one step ends it all."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from engine.sampling_params import SamplingParams
from serving.engine_proc import EngineProcess
from serving.messages.from_engine import Embedded, FromEngine
from serving.messages.to_engine import Embed, ToEngine

STEP_S = 1.0  # far longer than the loop's 0.1 s between load reports


class OneStepCore:
    """Every request it holds is answered by its next step, which takes STEP_S."""

    def __init__(self, config: object) -> None:
        self.held: list[str] = []

    def info(self) -> dict:
        return {"role": "test"}

    def handle(self, msg: ToEngine) -> None:
        assert isinstance(msg, Embed)
        self.held.append(msg.request_id)

    def has_work(self) -> bool:
        return bool(self.held)

    def load(self) -> dict:
        return {"num_running": 0, "num_waiting": len(self.held)}

    def counters(self) -> dict[str, float]:
        return {"held": float(len(self.held))}

    def step(self) -> list[FromEngine]:
        time.sleep(STEP_S)
        done, self.held = self.held, []
        return [Embedded(rid, (1.0,), 0) for rid in done]


async def _held_per_report() -> tuple[list[float], list[str]]:
    engine = EngineProcess(f"{__name__}.OneStepCore", None)
    await engine.start(timeout=120)
    try:
        deadline = time.monotonic() + 30
        while len(engine.history) < 3:  # idle reports: the loop is waiting for messages
            assert time.monotonic() < deadline, "no load reports from the idle engine"
            await asyncio.sleep(0.02)
        before = len(engine.history)
        rids = [f"e{i}" for i in range(4)]
        queues = [engine.open(rid) for rid in rids]
        ids = np.array([1, 2, 3], dtype=np.int64)
        for rid in rids:
            engine.send(Embed(rid, ids, SamplingParams(max_tokens=1)))
        answers = [await asyncio.wait_for(q.get(), 30) for q in queues]
        return [c["held"] for _, c in list(engine.history)[before:]], [a.request_id for a in answers]
    finally:
        await engine.shutdown()


def test_an_idle_engine_reports_new_work_before_the_step_that_ends_it():
    held, answered = asyncio.run(_held_per_report())
    assert answered == ["e0", "e1", "e2", "e3"]
    assert any(h > 0 for h in held), held
