"""What the engine's requests spent on depth: the engine-wide counters of a range knob's tokens (by
the level they ran, and those the policy held below their range's maximum), each sequence's levels,
and a request's `DepthReport` when it finishes (the one place the engine asks the model for it).
The levels and the report follow docs/depth-semantics.md."""

from __future__ import annotations

from typing import Any

from depthserve.archs.base import DepthModel
from depthserve.depth import DepthPlan, DepthReport
from depthserve.engine.depth_policy import token_levels
from depthserve.engine.model_runner import SeqStepOutput, request_state
from depthserve.engine.requests import Request
from depthserve.engine.scheduler import ScheduledSeq


class DepthAccounting:
    def __init__(self, model: DepthModel, step_cache_reserved_bytes: int) -> None:
        self.model = model
        self.step_cache_reserved_bytes = step_cache_reserved_bytes
        self.levels_run: dict[int, int] = {}  # range-knob tokens computed, by the level they ran
        self.shed_tokens = 0  # range-knob tokens run below their range's maximum

    def new_record(self, plan: DepthPlan) -> Any:
        """The model's per-position decisions for a new sequence (DepthModel.new_record)."""
        return self.model.new_record(plan)

    def count_step(self, assigned: list[ScheduledSeq], ran: list[ScheduledSeq]) -> None:
        """Tokens per level run, and tokens shed: held below their range's maximum by the policy's
        cap (a confident token that stopped below its cap was not shed)."""
        for item in ran:
            for level in token_levels(item) or ():
                self.levels_run[level] = self.levels_run.get(level, 0) + 1
        for item in assigned:
            if item.level is not None:
                self.shed_tokens += item.num_tokens * (item.level < item.seq.plan.elastic.maximum)

    @staticmethod
    def record_levels(result: SeqStepOutput) -> None:
        """A range knob: the level each position of the step ran at, kept on its sequence (replayed
        after a preemption), and the level of a sampled token (that of the position it was read from)."""
        item = result.scheduled
        levels = token_levels(item)
        if levels is None:
            return
        item.seq.levels[item.start:item.end] = levels
        if result.sampled is not None:
            item.seq.output_levels.append(levels[-1])

    def final_report(self, request: Request) -> DepthReport | None:
        """What the request spent on depth, once it finished without error (not every step)."""
        if not request.finished or request.error is not None:
            return None
        return self.model.report(request_state(request.seqs[0]))

    def reset(self) -> None:
        self.levels_run = {}
        self.shed_tokens = 0

    def stats(self) -> dict:
        stats: dict = {"depth_levels_run": dict(self.levels_run), "depth_shed_tokens": self.shed_tokens}
        if self.step_cache_reserved_bytes:
            # Caches that live only during one step, outside the page pool (Dreamer's per-token
            # depth cache, SlotKind.TOKEN_DEPTH): held now (0 between steps) and the last step's peak.
            now, last = self.model.step_cache_bytes()
            stats["step_cache_bytes_by_kind"] = {kind.value: n for kind, n in now.items()}
            stats["last_step_cache_bytes_by_kind"] = {kind.value: n for kind, n in last.items()}
            stats["step_cache_reserved_bytes"] = self.step_cache_reserved_bytes
        return stats
