"""One generated sequence: its tokens, progress and settings (no torch)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from depthserve.cache import CacheLayout
from depthserve.depth import DepthParams, DepthPlan
from depthserve.sampling_params import SamplingParams


class SequenceStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # choice index within the request (n > 1)
    prompt_token_ids: list[int]
    sampling: SamplingParams
    plan: DepthPlan  # the request's depth settings as its model runs them (made once per request)
    max_tokens: int  # resolved: never past the context
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at first admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # when it first left the waiting queue
    first_token_time: float | None = None
    # After a failed step: run alone (recomputed from scratch) until this many tokens are computed,
    # so that a fault which recurs is traced to this sequence alone (Scheduler.isolate).
    isolate_until: int | None = None
    # What the engine keeps per sequence beside the scheduler's fields (the scheduler never reads them).
    generator: Any = None  # torch.Generator of a seeded request (one per sequence), else None
    detokenizer: Any = None  # IncrementalDetokenizer
    logprobs: list | None = None  # one entry per output token when the request asks for logprobs
    cumulative_logprob: float = 0.0
    prompt_logprobs: list | None = None  # filled as the prompt is computed, when asked for
    depth_record: Any = None  # the model's per-position decisions (DepthModel.new_record)
    matcher: Any = None  # GrammarMatcher of a constrained request (structured outputs), else None
    output_levels: list[int] = field(default_factory=list)  # a range knob: each output token's level
    # A range knob: the level each computed position ran at. Kept through preemption: recomputed
    # positions run at their recorded level again (depth_policy.replay_recorded_levels).
    levels: list[int] = field(default_factory=list)

    @property
    def depth(self) -> DepthParams:
        return self.plan.depth

    @property
    def layout(self) -> CacheLayout:
        return self.plan.layout

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, stop: int) -> list[int]:
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        out_start = max(start - len(prompt), 0)
        return prompt[start:] + self.output_token_ids[out_start : stop - len(prompt)]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
