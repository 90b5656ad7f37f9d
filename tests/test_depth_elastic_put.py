"""Per-token depth in the engine (docs/depth-semantics.md section 6), PUT: a request whose `loops` is a
range runs each step's tokens at the level the depth policy picks; the core passes up to the
range's minimum have dense slots, each later pass a routed slot holding only the tokens that ran
it, and the pass-t conv state is that of the tokens that ran pass t. Incremental = recompute with
any schedule: random levels (going down and up) in mixed batches of fixed and range requests, with
chunked prefill and preemption, equal the reference run on the schedule the engine reports. PUT has
no prefix caching (its conv state lives outside the KV blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthserve import DepthParams, SamplingParams, reference
from depthserve.archs.put.format import core_slot_name
from depthserve.errors import InvalidDepthError
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import (assert_runs_like_the_fixed_knob, check_logprobs, costliest_pages, stream_prompts,
                                  tiny_llm)
from tests.test_depth_elastic import RandomLevels

TOL = 1e-4  # tests/test_put.py
NEAR_TIE = 1e-4
T = 3
MAX_LEN = 48
LENGTHS = [5, 17, 30, 9, 40, 12, 33, 24]
LOOPS = [{"loops": {"min": 1, "max": 3}}, {"loops": 2}, {"loops": "auto"}, {"loops": {"min": 2, "max": 3}},
         {"loops": 3}, {"loops": {"min": 1, "max": 2}}, {"loops": 1}, {"loops": {"min": 2, "max": 3}}]


class MixedLevels(RandomLevels):
    """RandomLevels that also counts the steps whose items run at different levels."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.mixed_steps = 0

    def assign(self, scheduled):
        out = super().assign(scheduled)
        levels = {item.level if item.level is not None else item.seq.plan.level for item in out}
        self.mixed_steps += len(levels) > 1
        return out


@pytest.fixture(scope="module", params=["k2", "k3"])
def path(request, tmp_path_factory, smollm_tokenizer):
    """Tiny PUT checkpoints (1 prefix, 2 core, 1 suffix layers, T = 3) with conv kernels 2 and 3 (a
    two-row state: its rows come from different steps when the levels change)."""
    kernel = {"k2": 2, "k3": 3}[request.param]
    return make_tiny("put", tmp_path_factory.mktemp("elastic-put") / request.param, seed=5, num_kv_heads=2,
                     tokenizer=smollm_tokenizer, conv_kernel=kernel)


def _prompts() -> list[list[int]]:
    return stream_prompts(LENGTHS, seed=31)


def _knob():
    from depthserve.depth import KnobSpec

    return KnobSpec("loops", "", 1, T, T, elastic=True)


def check_against_reference(path, prompts, depths, outputs) -> dict:
    """Each request against the float64 reference: at its knob, or with a range on the schedule it
    reports (section 6); every logprob within TOL, greedy tokens the reference's argmax."""
    stats = {"tokens": 0, "max_err": 0.0}
    for prompt, depth, out in zip(prompts, depths, outputs):
        tokens = prompt + out.token_ids[:-1]
        per_token = out.depth.per_token
        if per_token is None:
            logits = reference.forward(path, tokens, depth)
        else:
            assert len(per_token) == len(tokens)
            logits = reference.forward(path, tokens, schedule=[{"loops": n} for n in per_token])
        check_logprobs(torch.log_softmax(logits, dim=-1), len(prompt), out.outputs[0], stats, tol=TOL,
                       near_tie=NEAR_TIE, prompt_logprobs=out.prompt_logprobs)
    return stats


@pytest.mark.slow
def test_random_levels_in_a_mixed_batch_equal_the_reference(path):
    prompts = _prompts()
    depths = [DepthParams.from_dict(d) for d in LOOPS]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
              for _ in prompts]
    llm = tiny_llm(path, pages=costliest_pages(path, depths, MAX_LEN) + 40, max_model_len=MAX_LEN,
                   max_num_batched_tokens=16)
    policy = llm.engine.depth_policy = MixedLevels(0)
    preempted = []  # per preemption: (ranged, the levels its computed positions ran at)
    preempt = llm.engine.scheduler._preempt

    def spy(seq):
        preempted.append((seq.plan.elastic is not None, set(seq.levels[: seq.num_computed_tokens])))
        preempt(seq)

    llm.engine.scheduler._preempt = spy
    outputs = llm.generate(prompts, params, depths)
    stats = check_against_reference(path, prompts, depths, outputs)
    assert stats["tokens"] > 0 and stats["prompt_positions"] > 0
    turns = 0
    for depth, out in zip(depths, outputs):
        loops = depth.normalized({"loops": _knob()})["loops"]
        per_token = out.depth.per_token
        if per_token is None:
            assert out.outputs[0].token_depths is None
            continue
        assert all(loops.minimum <= n <= loops.maximum for n in per_token)
        n = len(out.prompt_token_ids)
        assert out.outputs[0].token_depths == per_token[n - 1 :]  # each sampled token: the forward it came from
        assert out.depth.settings["loops"] == loops.as_json()
        assert out.depth.settings["mean_depth"] == pytest.approx(np.mean(per_token), abs=1e-4)
        assert out.depth.counters["core_layer_passes"] == sum(per_token) * 2
        steps = np.diff(per_token)
        turns += bool((steps < 0).any() and (steps > 0).any())  # its depth went down and up again
    assert turns >= 3
    levels = {n for out in outputs for n in out.depth.per_token or []}
    assert levels == {1, 2, 3}
    print("put elastic: preemptions", preempted, "mixed steps", policy.mixed_steps, stats)
    assert policy.mixed_steps >= 5
    # a ranged sequence preempted after running several levels: its recomputed positions replay them
    assert any(ranged and len(levels) > 1 for ranged, levels in preempted), preempted
    assert llm.engine.block_manager.prefix_hits == 0 and all(o.num_cached_tokens == 0 for o in outputs)
    assert llm.engine.block_manager.num_used_pages == 0
    assert set(llm.engine.stats()["depth_levels_run"]) == {1, 2, 3}


def test_a_range_at_its_maximum_is_the_fixed_knob(path):
    prompts = _prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    llm = tiny_llm(path, max_num_batched_tokens=16)
    for top, low in ((3, 1), (2, 1), (3, 2)):
        ranged = llm.generate(prompts, params, DepthParams(loops={"min": low, "max": top}))  # fixed policy: top
        fixed = llm.generate(prompts, params, DepthParams(loops=top))
        assert_runs_like_the_fixed_knob(ranged, fixed, top)
        for a, b in zip(ranged, fixed):
            assert a.depth.settings["mean_depth"] == top and a.depth.settings["loops"] == {"min": low, "max": top}
            assert a.depth.flops == pytest.approx(b.depth.flops) and a.depth.counters == b.depth.counters
    assert llm.engine.stats()["depth_shed_tokens"] == 0 and llm.engine.block_manager.num_used_pages == 0


def test_the_plan_prices_the_maximum_with_routed_passes_past_the_minimum(path):
    llm = tiny_llm(path)
    bm, model = llm.engine.block_manager, llm.engine.model
    for low, high in ((1, 3), (2, 3), (1, 2)):
        plan = model.plan(DepthParams(loops={"min": low, "max": high}).normalized(model.depth_knobs()))
        fixed = model.plan(DepthParams(loops=high))
        dense = {slot.name for slot in plan.layout.slots}
        routed = {slot.name for slot in plan.layout.routed_slots}
        assert routed == {core_slot_name(j, t) for t in range(max(2, low + 1), high + 1) for j in (0, 1)}
        assert {core_slot_name(j, t) for t in range(1, low + 1) for j in (0, 1)} <= dense
        assert not dense & routed and plan.min_loops == low and plan.loops == plan.level == high
        assert plan.layout.state_bytes == fixed.layout.state_bytes  # every pass's state up to the maximum
        assert bm.pages_for(plan.layout, 40) == bm.pages_for(fixed.layout, 40)  # admission: the maximum
        assert plan.work_at(high) == fixed.work_at(high) == 1 + 1 + 2 * high  # layer applications
        assert [plan.work_at(n) for n in range(1, T + 1)] == [4.0, 6.0, 8.0]
        assert plan.cache_key != fixed.cache_key and not plan.layout.uses_prefix_cache
    assert model.plan(DepthParams(loops={"min": 2, "max": 2}).normalized(model.depth_knobs())).elastic is None
    assert model.depth_knobs()["loops"].elastic


def test_a_routed_pass_holds_exactly_the_tokens_that_ran_it(path):
    """Pages per slot against the schedule, after every step: dense slots cover every token, the
    routed slot of pass t holds the tokens with loops >= t, the conv state its pages, and nothing
    else stays reserved."""
    llm = tiny_llm(path, max_num_batched_tokens=8)
    engine = llm.engine
    engine.depth_policy = RandomLevels(3)
    prompt = _prompts()[4]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                       DepthParams(loops={"min": 1, "max": 3}))
    engine.add_request("s", prompt[:20], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                       DepthParams(loops={"min": 2, "max": 3}))
    seqs = {rid: engine._requests[rid].seqs[0] for rid in ("r", "s")}
    bm, bs, kv, checked = engine.block_manager, engine.args.block_size, 2, 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in seqs.values():
            if seq.finished or not seq.num_computed_tokens:
                continue
            low = seq.plan.elastic.minimum
            ran = np.asarray(seq.levels[: seq.num_computed_tokens])
            assert len(ran) == seq.num_computed_tokens and ran.min() >= low and ran.max() <= 3
            routed = 0
            for t in range(low + 1, T + 1):
                for j in (0, 1):
                    pages, length = bm.routed_table(seq, core_slot_name(j, t))
                    assert length == np.count_nonzero(ran >= t)
                    assert len(pages) == -(-length // bs)  # the step's reservation was given back
                    routed += len(pages) * kv
            # prefix, suffix and the core's dense passes (1..min), two KV heads each
            dense = -(-seq.num_computed_tokens // bs) * (1 + 1 + 2 * low) * kv
            assert bm.pages_held(seq) == dense + routed + bm.state_pages_for(seq.layout)
            checked += 1
    assert checked >= 10 and bm.num_used_pages == 0


@pytest.mark.parametrize("loops, match", [
    ({"min": 3, "max": 2}, "above its max"),
    ({"min": 0, "max": 2}, "must lie in 1..3"),
    ({"min": 1, "max": 4}, "must lie in 1..3"),
    ({"min": 1.5, "max": 2}, "integer"),
    ({"min": 1}, "a range is"),
    ({"min": 1, "max": 2, "step": 1}, "a range is"),
    ("deep", "integer"),
])
def test_invalid_ranges_raise_and_leave_no_blocks(path, loops, match):
    llm = _engine(path)
    with pytest.raises(InvalidDepthError, match=match):
        llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2),
                     [DepthParams(loops={"min": 1, "max": 2}), DepthParams(loops=loops)])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_pages == 0


_ENGINES: dict = {}


def _engine(path):
    if path not in _ENGINES:
        _ENGINES[path] = tiny_llm(path)
    return _ENGINES[path]
