"""Depth policies: how deep the tokens of requests with a range knob run, step by step
(docs/depth-semantics.md section 6). No torch: the policy sees the scheduler's view of a step.

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
  steps) predicts a step's time from its level-tokens (each scheduled token weighted by its cost
  at the level it runs at, DepthPlan.work_at: for Dreamer the level itself). In a step where some
  sequence is past its prompt (a client waits for its next token; a step of prompts alone runs at
  the ranges' maxima), the policy picks the deepest common cap whose prediction meets the step's
  budget: AIM = 90% of the target (the model predicts a step's mean time, and the tail must fit
  too) plus the credit of earlier decode steps (what they came in under the aim, or minus what
  they went over it, at most CREDIT_STEPS aims either way): a client's TPOT is the mean of the
  steps it waited for, so a step with a prompt chunk beside the decodes may run deep on what
  the light steps before it saved, and a step that overran is paid back by the next. Under
  overload it lowers elastic requests, never below their minimum, before anything else; when
  load falls the cap rises again. Fairness: every elastic request runs at the same cap, clipped
  to its own range (min(max_r, max(min_r, cap))), so no request is held at its minimum while
  another runs deeper than the cap, and a request is below another's level only when its own
  range says so.
- `confidence` (early exit, after CALM): the range's maximum, like `fixed`, but a token whose readout
  is sampled (each generated token, and the prompt's last) stops deepening at the first level of
  its range whose readout (the LM head over that level's state) gives its top-1 next token at
  least `--confidence-threshold` probability. Other prompt tokens run the policy's level: nobody
  reads their readouts, and every later token reads their deeper levels (a token that stopped
  early is absent from them). Only for models with a readout at every level (Dreamer; PUT without
  suffix layers, docs/depth-semantics.md "Readouts"). `slo`
  takes the threshold too: tokens then exit early within the slo cap. With prompt tokens by need
  (EngineArgs.prompt_exit), a prompt token whose next token is in the prompt stops too, teacher-
  forced: at the first level of its range whose readout gives that known next token at least the
  threshold's probability; later tokens read only the levels it ran (section 6).
- `need` (shedding by need): `slo` with the confidence exit, whose cap is chosen knowing which
  tokens will not need it. `slo` prices every elastic token of a candidate cap at that cap, so a
  step full of tokens that would exit early is priced as if none did and the cap drops for all;
  `need` prices each sampled token by its own sequence's recent exits (`ExitHistory`: a token that
  stopped at level l below its allowed level costs min(cap, l) at a candidate cap, one that ran to
  its allowed level costs the whole cap, since its need is unknown above it), so the budget that sure
  tokens leave goes to a deeper cap for the tokens that are not sure. Fairness is `slo`'s: one cap for
  every elastic request, clipped to its range; a token stops below it only by its own readout.
The exit decision depends only on the token, its prefix and the threshold (docs/depth-semantics.md
section 6), so a request under `confidence` alone is reproducible; under `slo` and `need` the cap
depends on the load, and what each token ran is reported per token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from depthserve.config import DEPTH_POLICIES
from depthserve.depth import DepthRange
from depthserve.engine.scheduler import ScheduledSeq

AIM = 0.9  # the slo policy aims its predicted step time at this share of the target
CREDIT_STEPS = 2.0  # the most time (in aims) decode steps may bank or owe (SLOPolicy.credit)
EXIT_HISTORY = 16  # sampled tokens per sequence whose exits the need policy remembers
FORGET_STEPS = 512  # steps after which the need policy forgets a sequence it has not seen


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


def replay_recorded_levels(scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """Positions computed before (a preempted sequence recomputing its tokens) run at the level they
    ran at then, whatever the policy chose: the tokens already emitted came from those states, and
    the schedule a request reports is the one that produced them. A chunk that reaches past a
    change of recorded level stops at the change (its rest runs next step)."""
    out = []
    for item in scheduled:
        recorded = item.seq.levels
        if item.level is not None and item.start < len(recorded):
            level, run = recorded[item.start], 1
            while run < item.num_tokens and item.start + run < len(recorded) and recorded[item.start + run] == level:
                run += 1
            item = replace(item, level=level, num_tokens=run, exit_threshold=None, exit_prompt=False, ran_levels=None)
        out.append(item)
    return out


def token_levels(item: ScheduledSeq) -> list[int] | None:
    """The level of each of the step's tokens of an elastic sequence (as ran, after the step), else None."""
    if item.ran_levels is not None:
        return list(item.ran_levels)
    return None if item.level is None else [item.level] * item.num_tokens


def level_tokens(scheduled: list[ScheduledSeq]) -> float:
    """A step's work: its tokens, each weighted by its cost at the level it runs at
    (DepthPlan.work_at; elastic ones as assigned or ran, fixed ones at their plan's level)."""
    work = 0.0
    for item in scheduled:
        plan = item.seq.plan
        levels = token_levels(item)
        work += (item.num_tokens * plan.work_at(plan.level) if levels is None
                 else sum(plan.work_at(level) for level in levels))
    return work


def with_exit(scheduled: list[ScheduledSeq], threshold: float | None, prompt: bool = False) -> list[ScheduledSeq]:
    """The elastic sequences' tokens may stop below their level once confident (`prompt`: their
    prompt tokens too, on the readout of the prompt's next token)."""
    if threshold is None:
        return scheduled
    return [replace(item, exit_threshold=threshold, exit_prompt=prompt) if elastic_range(item) is not None else item
            for item in scheduled]


class FixedPolicy:
    """Every elastic token at its range's maximum (`confidence`: generated ones may exit earlier)."""

    name = "fixed"

    def __init__(self, exit_threshold: float | None = None, prompt_exit: bool = False) -> None:
        self._target: float | None = None
        self.exit_threshold = exit_threshold
        self.prompt_exit = prompt_exit

    def assign(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        out = []
        for item in scheduled:
            span = elastic_range(item)
            if span is not None:
                item = replace(item, level=span.maximum)
                self._target = span.maximum
            out.append(item)
        return with_exit(out, self.exit_threshold, self.prompt_exit)

    def observe(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        return None

    @property
    def target(self) -> float | None:
        return self._target


class ConfidencePolicy(FixedPolicy):
    """Every elastic token at its range's maximum, generated ones stopping once confident."""

    name = "confidence"

    def __init__(self, exit_threshold: float, prompt_exit: bool = False) -> None:
        super().__init__(exit_threshold, prompt_exit)


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

    def __init__(self, target_seconds: float, cost: StepCostModel | None = None, exit_threshold: float | None = None,
                 prompt_exit: bool = False):
        if not target_seconds > 0:
            raise ValueError("the SLO policy needs a positive step time target")
        self.target_seconds = target_seconds
        self.exit_threshold = exit_threshold
        self.prompt_exit = prompt_exit
        self.cost = cost or StepCostModel()
        self._target: float | None = None
        # Seconds that decode steps came in under (> 0) or over (< 0) the aim, within
        # +-CREDIT_STEPS aims: a heavy step (a prompt chunk beside the decodes) may spend what
        # light steps saved, since a request's TPOT is the mean of its steps, not the worst.
        self.credit = 0.0

    def assign(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        elastic = [elastic_range(item) for item in scheduled]
        if not any(elastic):
            return scheduled
        deepest = max(span.maximum for span in elastic if span is not None)
        lowest = min(span.minimum for span in elastic if span is not None)
        cap = deepest
        # The target is a time per output token: it binds a step only when someone in it is waiting
        # for their next token (a step of prompts alone delays no output token: it runs deep).
        if _decoding(scheduled) and self.cost.ready:  # with no measurement yet, the first steps run deep and teach the model
            budget = AIM * self.target_seconds + self.credit
            cap = next((level for level in range(deepest, lowest - 1, -1)
                        if self.cost.predict(self.expected_work(self._at(scheduled, level))) <= budget), lowest)
        self._target = cap
        return with_exit(self._at(scheduled, cap), self.exit_threshold, self.prompt_exit)

    def expected_work(self, scheduled: list[ScheduledSeq]) -> float:
        """The level-tokens a step of `scheduled` (as assigned) is expected to run: each token at its level."""
        return level_tokens(scheduled)

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
        if _decoding(scheduled):
            aim = AIM * self.target_seconds
            self.credit = min(CREDIT_STEPS * aim, max(-CREDIT_STEPS * aim, self.credit + aim - seconds))

    @property
    def target(self) -> float | None:
        return self._target


class ExitHistory:
    """Where each sequence's recent sampled tokens stopped: (level ran, level allowed) of its last
    EXIT_HISTORY ones; a sequence unseen for FORGET_STEPS steps is forgotten (it finished or was
    aborted: the policy is not told)."""

    def __init__(self) -> None:
        self._exits: dict[int, deque[tuple[int, int]]] = {}
        self._seen: dict[int, int] = {}
        self._step = 0

    def record(self, scheduled: list[ScheduledSeq]) -> None:
        self._step += 1
        for item in scheduled:
            if item.level is None or item.exit_threshold is None or not item.samples:
                continue
            ran = item.ran_levels[-1] if item.ran_levels is not None else item.level
            seq_id = item.seq.seq_id
            self._exits.setdefault(seq_id, deque(maxlen=EXIT_HISTORY)).append((ran, item.level))
            self._seen[seq_id] = self._step
        if self._step % FORGET_STEPS == 0:
            for seq_id in [k for k, seen in self._seen.items() if self._step - seen > FORGET_STEPS]:
                del self._exits[seq_id], self._seen[seq_id]

    def expected_level_work(self, item: ScheduledSeq) -> float | None:
        """The expected work of `item`'s sampled token at its assigned level, from its sequence's
        exits (None: no history). A token that stopped below its allowed level needs no more than the
        level it stopped at; one that ran to its allowed level may need all of the assigned one."""
        exits = self._exits.get(item.seq.seq_id)
        if not exits:
            return None
        plan, level = item.seq.plan, item.level
        return sum(plan.work_at(min(level, ran) if ran < allowed else level) for ran, allowed in exits) / len(exits)

    def __len__(self) -> int:
        return len(self._exits)


class NeedPolicy(SLOPolicy):
    """`slo` with the confidence exit, each sampled token priced by its sequence's recent exits (module doc)."""

    name = "need"

    def __init__(self, target_seconds: float, exit_threshold: float, cost: StepCostModel | None = None,
                 prompt_exit: bool = False):
        super().__init__(target_seconds, cost=cost, exit_threshold=exit_threshold, prompt_exit=prompt_exit)
        self.history = ExitHistory()

    def expected_work(self, scheduled: list[ScheduledSeq]) -> float:
        work = 0.0
        for item in scheduled:
            expected = self.history.expected_level_work(item) if item.level is not None and item.samples else None
            if expected is None:
                work += level_tokens([item])
            else:  # the tokens before the sampled one run the assigned level (nobody reads their readouts)
                work += (item.num_tokens - 1) * item.seq.plan.work_at(item.level) + expected
        return work

    def observe(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        super().observe(scheduled, seconds)
        self.history.record(scheduled)


def _decoding(scheduled: list[ScheduledSeq]) -> bool:
    """Some sequence of the step is past its prompt: a client waits for its next token."""
    return any(item.start >= item.seq.num_prompt_tokens for item in scheduled)


def make_policy(name: str, tpot_slo_ms: float | None = None, confidence_threshold: float | None = None,
                prompt_exit: bool = False) -> DepthPolicy:
    if name == "fixed":
        return FixedPolicy()
    if name == "confidence":
        if confidence_threshold is None:
            raise ValueError("--depth-policy confidence needs --confidence-threshold (a top-1 probability)")
        return ConfidencePolicy(confidence_threshold, prompt_exit)
    if name == "slo":
        if tpot_slo_ms is None:
            raise ValueError("--depth-policy slo needs --tpot-slo-ms (the time per output token to keep within)")
        return SLOPolicy(tpot_slo_ms / 1000.0, exit_threshold=confidence_threshold, prompt_exit=prompt_exit)
    if name == "need":
        if tpot_slo_ms is None or confidence_threshold is None:
            raise ValueError("--depth-policy need needs --tpot-slo-ms (the time per output token to keep within) and "
                             "--confidence-threshold (the top-1 probability at which a token is sure)")
        return NeedPolicy(tpot_slo_ms / 1000.0, confidence_threshold, prompt_exit=prompt_exit)
    raise ValueError(f"unknown depth policy {name!r}; known: {', '.join(DEPTH_POLICIES)}")
