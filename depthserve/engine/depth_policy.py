"""Depth policies: how deep the tokens of requests with a range knob run, step by step
(depth-semantics.md section 6). No torch: the policy sees the scheduler's view of a step.

A request whose knob is a range (`"depth": {"min": 1, "max": 4}`, or `"auto"`: the knob's whole
range) is elastic: the server may run each of its tokens at any level of the range. After the
scheduler has picked a step, the engine asks the policy for a level per elastic sequence (one
level for all of that sequence's tokens in the step), runs the step, and reports how long it
took. Requests with a fixed knob always run it and are never touched.

- `fixed`: every elastic token runs at its range's maximum (a range then behaves like its maximum,
  priced and run the same).
- `slo`: keep each step within a time target (the TPOT target: while requests decode, every step
  is one output token for each of them). A cost model fitted online to the measured step times
  (`StepCostModel`: seconds = fixed + per level-token * level-tokens, least squares over recent
  steps) predicts a step's time from its level-tokens (each scheduled token times the level it
  runs at); the policy picks the deepest common cap whose prediction meets the target. Under
  overload it lowers elastic requests, never below their minimum, before anything else; when
  load falls the cap rises again. Fairness: every elastic request runs at the same cap, clipped
  to its own range (min(max_r, max(min_r, cap))), so no request is held at its minimum while
  another runs deeper than the cap, and a request is below another's level only when its own
  range says so.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from depthserve.depth import DepthRange
from depthserve.engine.scheduler import ScheduledSeq

POLICIES = ("fixed", "slo")


class DepthPolicy(Protocol):
    name: str

    def assign(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The step's sequences, each elastic one with the level its tokens run at."""
        ...

    def observe(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        """How long the step over `scheduled` (as assigned) took to run."""
        ...

    @property
    def target(self) -> float | None:
        """The level cap of the last step that had elastic requests (None: none yet)."""
        ...


def elastic_range(item: ScheduledSeq) -> DepthRange | None:
    return item.seq.plan.elastic


def level_tokens(scheduled: list[ScheduledSeq]) -> int:
    """Scheduled tokens times the level each runs at (elastic ones as assigned, fixed ones their plan's)."""
    return sum(item.num_tokens * (item.level if item.level is not None else item.seq.plan.level) for item in scheduled)


class FixedPolicy:
    """Every elastic token at its range's maximum."""

    name = "fixed"

    def __init__(self) -> None:
        self._target: float | None = None

    def assign(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        out = []
        for item in scheduled:
            span = elastic_range(item)
            if span is not None:
                item = replace(item, level=span.maximum)
                self._target = span.maximum
            out.append(item)
        return out

    def observe(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        return None

    @property
    def target(self) -> float | None:
        return self._target


@dataclass
class StepCostModel:
    """Step seconds against level-tokens, fitted by least squares over the last `window` steps:
    seconds = fixed + per_level_token * level_tokens, both kept >= 0. Until two distinct loads are
    seen it assumes no fixed part (seconds proportional to level-tokens)."""

    window: int = 256

    def __post_init__(self) -> None:
        self._work: deque[float] = deque(maxlen=self.window)
        self._seconds: deque[float] = deque(maxlen=self.window)
        self.fixed = 0.0
        self.per_level_token = 0.0

    @property
    def ready(self) -> bool:
        return len(self._work) > 0

    def add(self, work: float, seconds: float) -> None:
        if work <= 0 or seconds <= 0:
            return
        self._work.append(work)
        self._seconds.append(seconds)
        self._fit()

    def _fit(self) -> None:
        x, y = np.asarray(self._work), np.asarray(self._seconds)
        if np.ptp(x) > 0:
            slope, intercept = np.polyfit(x, y, 1)
            if slope > 0 and intercept >= 0:
                self.fixed, self.per_level_token = float(intercept), float(slope)
                return
            if slope > 0:  # a negative intercept: refit through the origin
                intercept = 0.0
        self.fixed = 0.0
        self.per_level_token = float((x * y).sum() / (x * x).sum())

    def predict(self, work: float) -> float:
        return self.fixed + self.per_level_token * work


class SLOPolicy:
    """The deepest common level cap whose predicted step time meets `target_seconds` (module doc)."""

    name = "slo"

    def __init__(self, target_seconds: float, cost: StepCostModel | None = None):
        if not target_seconds > 0:
            raise ValueError("the SLO policy needs a positive step time target")
        self.target_seconds = target_seconds
        self.cost = cost or StepCostModel()
        self._target: float | None = None

    def assign(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        elastic = [elastic_range(item) for item in scheduled]
        if not any(elastic):
            return scheduled
        deepest = max(span.maximum for span in elastic if span is not None)
        cap = deepest
        if self.cost.ready:  # with no measurement yet, the first steps run deep and teach the model
            cap = next((level for level in range(deepest, 0, -1)
                        if self.cost.predict(level_tokens(self._at(scheduled, level))) <= self.target_seconds), 1)
        self._target = cap
        return self._at(scheduled, cap)

    @staticmethod
    def _at(scheduled: list[ScheduledSeq], cap: int) -> list[ScheduledSeq]:
        out = []
        for item in scheduled:
            span = elastic_range(item)
            if span is not None:
                item = replace(item, level=min(span.maximum, max(span.minimum, cap)))
            out.append(item)
        return out

    def observe(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        self.cost.add(level_tokens(scheduled), seconds)

    @property
    def target(self) -> float | None:
        return self._target


def make_policy(name: str, tpot_slo_ms: float | None = None) -> DepthPolicy:
    if name == "fixed":
        return FixedPolicy()
    if name == "slo":
        if tpot_slo_ms is None:
            raise ValueError("--depth-policy slo needs --tpot-slo-ms (the time per output token to keep within)")
        return SLOPolicy(tpot_slo_ms / 1000.0)
    raise ValueError(f"unknown depth policy {name!r}; known: {', '.join(POLICIES)}")
