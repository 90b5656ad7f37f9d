"""The depth policies (depthserve/engine/depth_policy.py), without torch: which level each elastic
request's tokens run at, the online step-cost model, and the fairness rule."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, replace

import pytest

from depthserve.cache import CacheLayout
from depthserve.depth import DepthParams, DepthPlan, DepthRange
from depthserve.engine.depth_policy import (AIM, EXIT_HISTORY, FORGET_STEPS, FixedPolicy, NeedPolicy, SLOPolicy,
                                            StepCostModel, level_tokens, make_policy, replay_recorded_levels)
from depthserve.engine.scheduler import ScheduledSeq
from depthserve.engine.sequence import Sequence
from depthserve.sampling_params import SamplingParams


@dataclass(frozen=True, kw_only=True)
class _Plan(DepthPlan):
    pass


def _item(tokens: int = 1, elastic: tuple[int, int] | None = None, level: int = 4, prompt: bool = False
          ) -> ScheduledSeq:
    """A scheduled sequence: decoding (past its 3-token prompt), or in its prompt."""
    span = DepthRange(*elastic) if elastic else None
    plan = _Plan(depth=DepthParams(), layout=CacheLayout(()), elastic=span, level=span.maximum if span else level)
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(), plan, max_tokens=4)
    return ScheduledSeq(seq, 0 if prompt else 3, tokens)


def test_fixed_runs_every_range_at_its_maximum_and_leaves_fixed_requests_alone():
    batch = [_item(elastic=(1, 4)), _item(level=2), _item(tokens=5, elastic=(2, 3))]
    out = FixedPolicy().assign(batch)
    assert [item.level for item in out] == [4, None, 3]
    assert level_tokens(out) == 4 + 2 + 5 * 3


def test_the_cost_model_recovers_a_linear_step_time():
    model = StepCostModel()
    for work in (10, 40, 80, 120, 200):
        model.add(work, 0.002 + 0.0005 * work)
    assert model.fixed == pytest.approx(0.002) and model.per_level_token == pytest.approx(0.0005)
    assert model.predict(100) == pytest.approx(0.052)
    one_load = StepCostModel()
    one_load.add(50, 0.1)  # one load seen: proportional until the loads differ
    assert one_load.fixed == 0 and one_load.predict(100) == pytest.approx(0.2)


def _slo(budget: float) -> SLOPolicy:
    """An SLO policy whose predictions aim at `budget` seconds (its target is budget / AIM)."""
    cost = StepCostModel()
    for work in (8, 32, 64, 128):
        cost.add(work, 0.001 * work)  # 1 ms per level-token, no fixed part
    return SLOPolicy(budget / AIM, cost)


def test_slo_picks_the_deepest_common_cap_that_meets_the_target():
    batch = [_item(elastic=(1, 4)) for _ in range(8)]  # 8 decodes: level L costs 8 L ms
    assert {item.level for item in _slo(0.040).assign(batch)} == {4}  # 32 ms fits
    policy = _slo(0.020)
    assert {item.level for item in policy.assign(batch)} == {2} and policy.target == 2  # 16 ms fits, 24 does not


def test_slo_never_goes_below_a_minimum_and_holds_every_request_to_one_cap():
    batch = [_item(elastic=(1, 4)), _item(elastic=(3, 4)), _item(elastic=(1, 2)), _item(level=4)]
    out = _slo(0.008).assign(batch)  # fixed 4 ms + elastic: only cap 1 fits (1 + 3 + 1 = 5 ms > 4 ms: overload)
    assert [item.level for item in out] == [1, 3, 1, None]
    out = _slo(0.011).assign(batch)  # cap 2: 2 + 3 + 2 + 4 = 11 ms (cap 3: 12 ms)
    assert [item.level for item in out] == [2, 3, 2, None]


def test_slo_sheds_under_load_and_restores_when_it_falls():
    policy = _slo(0.024)
    heavy = [_item(elastic=(1, 4)) for _ in range(12)]
    light = heavy[:3]
    assert policy.assign(heavy)[0].level == 2
    assert policy.assign(light)[0].level == 4


def test_slo_leaves_a_step_of_prompts_alone_deep():
    """No client waits for a next token in a step of prompt chunks only: the TPOT target does not bind."""
    prompts = [_item(tokens=64, elastic=(1, 4), prompt=True) for _ in range(4)]
    assert {item.level for item in _slo(0.010).assign(prompts)} == {4}
    assert {item.level for item in _slo(0.010).assign(prompts + [_item(elastic=(1, 4))])} == {1}


def test_slo_learns_from_the_steps_it_observes():
    policy = SLOPolicy(0.010 / AIM)
    batch = [_item(elastic=(1, 4)) for _ in range(4)]
    assert policy.assign(batch)[0].level == 4  # nothing measured yet: run deep, measure
    for work, seconds in ((16, 0.016), (8, 0.008), (12, 0.012)):  # prompt steps: no TPOT credit either way
        policy.observe([_item(tokens=work, level=1, prompt=True)], seconds)
    assert policy.credit == 0
    assert policy.assign(batch)[0].level == 2  # 1 ms per level-token: 4 x 2 = 8 ms <= 10 ms < 12 ms


def test_slo_lets_a_heavy_step_spend_what_light_decode_steps_saved():
    """A client's TPOT is the mean of its steps: time light decode steps saved lets a step with a
    prompt chunk run deeper, an overrun is paid back by the next steps, both bounded."""
    policy = _slo(0.010)  # aim 10 ms, 1 ms per level-token
    heavy = [_item(tokens=3, elastic=(1, 4), prompt=True), _item(elastic=(1, 4))]  # 4 level-tokens per level
    assert policy.assign(heavy)[0].level == 2  # 8 ms fits the aim, 12 does not
    light = [_item(level=2)]  # a fixed decode: 2 ms
    for _ in range(3):
        policy.observe(light, 0.002)  # 8 ms saved each, banked up to 2 aims
    assert policy.credit == pytest.approx(0.020)
    assert policy.assign(heavy)[0].level == 4  # 16 ms <= 10 + 20
    policy.observe(heavy, 0.045)  # a stall: 35 ms over, owed down to -2 aims
    assert policy.credit == pytest.approx(-0.015)
    assert policy.assign(heavy)[0].level == 1  # nothing fits 10 - 15 ms: the range's minimum


def _sampling(elastic: tuple[int, int] = (1, 4)) -> ScheduledSeq:
    """A decoding sequence's step: its one new token, whose readout is sampled after the step."""
    span = DepthRange(*elastic)
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(), _Plan(depth=DepthParams(), layout=CacheLayout(()),
                                                              elastic=span, level=span.maximum), max_tokens=64)
    seq.output_token_ids.append(7)
    return ScheduledSeq(seq, seq.num_tokens - 1, 1)


def _ran(policy, batch: list[ScheduledSeq], stopped: dict[int, int]) -> None:
    """One step of `batch` as `policy` assigns it; row i's sampled token stops at stopped[i] where
    given (below the assigned level), else runs its level. The step takes 1 ms per level-token run
    (the cost model's line) and banks no credit (slo's credit is tested above). Each sequence then
    has one more token."""
    assigned = policy.assign(batch)
    ran = [replace(item, ran_levels=(stopped[i],)) if i in stopped and stopped[i] < item.level else item
           for i, item in enumerate(assigned)]
    policy.observe(ran, 0.001 * level_tokens(ran))
    policy.credit = 0.0
    for item in batch:
        item.seq.output_token_ids.append(7)


def _need(budget: float, threshold: float = 0.9) -> NeedPolicy:
    cost = StepCostModel()
    for work in (8, 32, 64, 128):
        cost.add(work, 0.001 * work)
    return NeedPolicy(budget / AIM, threshold, cost)


def _advance(batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
    return [ScheduledSeq(item.seq, item.seq.num_tokens - 1, 1) for item in batch]


def test_need_gives_what_sure_tokens_leave_to_a_deeper_cap_for_the_rest():
    """Eight decoding sequences, 1 ms per level-token, 20 ms per step: slo caps every request at 2
    (8 x 2 = 16 ms; 8 x 3 = 24 would not fit). Under need, six of them have been stopping at level 1
    by their own readouts: at cap 4 they are expected to cost 6 x 1, the two unsure ones 2 x 4, 14 ms,
    so the cap rises to 4 for all, and only the unsure ones use it."""
    slo, need = _slo(0.020), _need(0.020)
    batch = [_sampling() for _ in range(8)]
    assert {item.level for item in slo.assign(batch)} == {2}
    assert all(item.exit_threshold is None for item in slo.assign(batch))
    for _ in range(3):
        _ran(need, batch, {i: 1 for i in range(6)})
        batch = _advance(batch)
    out = need.assign(batch)
    assert {item.level for item in out} == {4} and need.target == 4  # one cap for every elastic request
    assert all(item.exit_threshold == 0.9 for item in out)  # each token still stops only by its own readout
    assert need.expected_work(out) == pytest.approx(6 * 1 + 2 * 4)


def test_need_prices_a_token_that_ran_to_its_cap_at_the_whole_cap():
    """A token that ran to the level it was allowed may have needed more: at a deeper candidate cap it
    is priced at that cap, so tokens that are never sure get slo's cap, and a minimum still holds."""
    need = _need(0.020)
    batch = [_sampling() for _ in range(8)]
    for _ in range(3):
        _ran(need, batch, {})  # nobody stopped early
        batch = _advance(batch)
    assert {item.level for item in need.assign(batch)} == {2}  # as slo: 8 x 2 fits, 8 x 3 does not
    floor = [_sampling(elastic=(3, 4)) for _ in range(8)]
    assert {item.level for item in _need(0.010).assign(floor)} == {3}  # overload: the minimum, never below


def test_need_forgets_sequences_it_no_longer_sees_and_keeps_a_bounded_history():
    need = _need(0.020)
    batch = [_sampling()]
    for _ in range(EXIT_HISTORY + 4):
        _ran(need, batch, {0: 1})
        batch = _advance(batch)
    assert len(need.history._exits[batch[0].seq.seq_id]) == EXIT_HISTORY
    other = [_sampling()]
    for _ in range(2 * FORGET_STEPS):
        _ran(need, other, {})
        other = _advance(other)
    assert batch[0].seq.seq_id not in need.history._exits and len(need.history) == 1


def test_make_policy_checks_its_arguments():
    assert make_policy("fixed").name == "fixed"
    with pytest.raises(ValueError, match="tpot-slo-ms"):
        make_policy("slo")
    with pytest.raises(ValueError, match="confidence-threshold"):
        make_policy("need", tpot_slo_ms=20)
    assert make_policy("need", tpot_slo_ms=20, confidence_threshold=0.9).name == "need"
    with pytest.raises(ValueError, match="unknown depth policy"):
        make_policy("greedy")


def test_the_policy_module_imports_no_torch():
    code = "import sys, depthserve.engine.depth_policy; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_recomputed_positions_replay_the_levels_they_ran_at():
    """After a preemption a sequence recomputes its tokens: each position runs at its recorded level
    whatever the policy chose, a chunk stops where the recorded level changes, new positions are
    the policy's."""
    item = _item(tokens=4, elastic=(1, 4))
    item.seq.levels[:] = [3, 3, 3, 1, 1, 2]
    at = lambda start, tokens, level: replace(item, start=start, num_tokens=tokens, level=level)  # noqa: E731
    assert replay_recorded_levels([at(1, 4, 4)])[0] == at(1, 2, 3)
    assert replay_recorded_levels([at(3, 4, 4)])[0] == at(3, 2, 1)
    assert replay_recorded_levels([at(5, 4, 4)])[0] == at(5, 1, 2)
    assert replay_recorded_levels([at(6, 4, 4)])[0] == at(6, 4, 4)
    fixed = _item(tokens=4, level=2)
    fixed.seq.levels[:] = [1, 1]
    assert replay_recorded_levels([fixed]) == [fixed]
