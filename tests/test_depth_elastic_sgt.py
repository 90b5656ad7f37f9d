"""Per-token depth in the engine (docs/depth-semantics.md section 6), SGT: a request whose `loops` is a
range runs each step's tokens with the depth policy's level as the loop count of every looped layer.
Slot (l, k) holds the tokens with loops >= k: iterations up to the range's minimum are head-subset
slots as for a fixed knob, the deeper ones routed slots that grow only with the tokens that ran
them. Incremental = recompute with any schedule: random levels in mixed batches (fixed and range
requests, chunked prefill, preemption, prefix hits of the fixed ones) equal the reference run on
the schedule the engine reports. The tiny GQA checkpoint's looped layer 2 has a head subset whose
query heads split unevenly over its KV groups (attended through HeadSubsetAttention.read_heads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthserve import DepthParams, SamplingParams, reference
from depthserve.archs.sgt.format import kv_heads_of, loop_slot_name
from depthserve.errors import InvalidDepthError
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import assert_runs_like_the_fixed_knob, cache_layout, check_logprobs, stream_prompts, tiny_llm
from tests.test_depth_elastic import RandomLevels
from tests.test_sgt_itt_engine import NEAR_TIE, TOL

MAX_LEN = 48
LENGTHS = [5, 17, 30, 9, 40, 12, 33, 24]
# max_loops of the tiny checkpoint is 3: "auto" is 0..3.
DEPTHS = [{"loops": {"min": 0, "max": 3}}, {"loops": 1}, {"loops": "auto"}, {"loops": {"min": 1, "max": 2}},
          {"loops": 2}, {"loops": {"min": 2, "max": 3}}, {"loops": 2}, {"loops": {1: 0, 2: 3}}]


@pytest.fixture(scope="module")
def path(tmp_path_factory, smollm_tokenizer):
    # Looped layers 1..3 with head sets [3, 0] (one query head per KV group), [1, 2, 3] (uneven over
    # the two KV groups) and [1, 0] (two heads of one group).
    return make_tiny("sgt", tmp_path_factory.mktemp("elastic-sgt") / "sgt", seed=11, num_kv_heads=2,
                     tokenizer=smollm_tokenizer)


def _prompts() -> list[list[int]]:
    prompts = stream_prompts(LENGTHS, seed=51)
    prompts[6] = prompts[4][:33]  # fixed loops=2 requests sharing a prefix: prefix-cache hits
    return prompts


def check_against_reference(path, prompts, depths, outputs) -> dict:
    """Each request against the reference: at its knob, or with a range on the schedule it reports
    (one loop count per token for every looped layer)."""
    stats = {"tokens": 0, "max_err": 0.0}
    for prompt, depth, out in zip(prompts, depths, outputs):
        tokens = prompt + out.token_ids[:-1]
        per_token = out.depth.per_token
        schedule = None
        if per_token is not None:
            assert len(per_token) == len(tokens)
            schedule = [{"loops": level} for level in per_token]
            # Each output token was sampled at the level of the position that produced it.
            assert out.outputs[0].token_depths == per_token[len(prompt) - 1:]
        logprobs = torch.log_softmax(reference.forward(path, tokens, depth, schedule=schedule), dim=-1)
        check_logprobs(logprobs, len(prompt), out.outputs[0], stats, tol=TOL, near_tie=NEAR_TIE,
                       prompt_logprobs=out.prompt_logprobs)
    return stats


def _check_report(depth: DepthParams, out) -> None:
    """usage.depth of a range request: the range, the mean level, iterations and FLOPs from its schedule."""
    report = out.depth.to_dict()
    levels = np.array(out.depth.per_token)
    assert report["loops"] == depth["loops"].as_json()
    assert report["mean_depth"] == pytest.approx(levels.mean(), abs=1e-4)
    assert set(report["loop_iterations"].values()) == {int(levels.sum())}
    assert report["extrapolated"] == ([2, 3] if levels.max() == 2 else [1, 2, 3] if levels.max() == 3 else [])
    # relative to the trained counts (at most 2 per layer), the defaults (docs/server.md, "Depth")
    if levels.max() == 0:
        assert report["relative_compute"] < 1.0
    if levels.min() >= 2:
        assert report["relative_compute"] > 1.0


@pytest.mark.slow
def test_random_levels_in_a_mixed_batch_equal_the_reference(path):
    prompts = _prompts()
    depths = [DepthParams.from_dict(d) for d in DEPTHS]
    # Every third request also scores its prompt (its positions run at random levels too).
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1 if i % 3 == 2 else None) for i in range(len(prompts))]
    probe = tiny_llm(path, max_model_len=MAX_LEN)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = [bm.pages_for(cache_layout(model, d), MAX_LEN) for d in depths]
    llm = tiny_llm(path, pages=max(need) + 6, max_model_len=MAX_LEN, max_num_batched_tokens=16)
    assert sum(need) > 3 * (max(need) + 6)
    llm.engine.depth_policy = RandomLevels(0)
    outputs = llm.generate(prompts, params, depths)
    stats = check_against_reference(path, prompts, depths, outputs)
    assert stats["tokens"] > 0 and stats["prompt_positions"] > 0
    ranged = 0
    for depth, out in zip(depths, outputs):
        span = depth.normalized(model.depth_knobs())["loops"]
        if out.depth.per_token is not None:
            ranged += 1
            assert all(span.minimum <= level <= span.maximum for level in out.depth.per_token)
            _check_report(depth.normalized(model.depth_knobs()), out)
    assert ranged == 4
    levels = {level for out in outputs for level in out.depth.per_token or []}
    assert levels == {0, 1, 2, 3}
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_hits > 0
    assert llm.engine.block_manager.num_used_pages == 0
    assert set(llm.engine.stats()["depth_levels_run"]) == {0, 1, 2, 3}


@pytest.mark.parametrize("low, high", [(0, 2), (1, 3)])
def test_a_range_at_its_maximum_is_the_fixed_knob(path, low, high):
    """The fixed policy runs a range at its maximum: the same tokens, logprobs and FLOPs as the fixed
    knob (its iterations past the minimum read routed slots instead of head-subset columns)."""
    prompts = _prompts()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    llm = tiny_llm(path, max_num_batched_tokens=16)
    ranged = llm.generate(prompts, params, DepthParams(loops={"min": low, "max": high}))
    fixed = llm.generate(prompts, params, DepthParams(loops=high))
    assert_runs_like_the_fixed_knob(ranged, fixed, high)
    for a, b in zip(ranged, fixed):
        mine, theirs = a.depth.to_dict(), b.depth.to_dict()
        assert mine["flops"] == pytest.approx(theirs["flops"], rel=1e-12)
        assert mine["loop_iterations"] == theirs["loop_iterations"]
        assert mine["extrapolated"] == theirs["extrapolated"] and mine["mean_depth"] == high
    assert llm.engine.stats()["depth_shed_tokens"] == 0
    assert llm.engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("loops", [{"min": 1, "max": 3}, "auto"])
def test_a_slot_holds_exactly_the_tokens_that_ran_its_iteration(path, loops):
    """Pages per slot against the schedule, after every step: the dense and head-subset slots (up to
    the range's minimum) cover every token, the routed slot of iteration k holds the tokens that ran
    k, and nothing else stays reserved. The request then equals the reference on its schedule."""
    llm = tiny_llm(path, max_num_batched_tokens=8)
    engine = llm.engine
    engine.depth_policy = RandomLevels(3)
    prompt = _prompts()[4]
    depth = DepthParams(loops=loops)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
                       depth)
    seq = engine._requests["r"].seqs[0]
    span = seq.plan.elastic
    cfg, spec = engine.model.config, engine.model.spec
    bm, bs, checked, final = engine.block_manager, engine.args.block_size, 0, None
    stored = {s.layer: len(kv_heads_of(cfg, s)) for s in spec.layers}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
        if seq.finished:
            break
        levels = np.array(seq.levels[: seq.num_computed_tokens])
        assert len(levels) == seq.num_computed_tokens
        assert levels.min() >= span.minimum and levels.max() <= span.maximum
        blocks = -(-seq.num_computed_tokens // bs)
        subset = routed = 0
        for s in spec.layers:
            subset += span.minimum * blocks * stored[s.layer]
            for k in range(span.minimum + 1, span.maximum + 1):
                pages, length = bm.routed_table(seq, loop_slot_name(s.layer, k))
                assert length == np.count_nonzero(levels >= k)
                assert len(pages) == -(-length // bs)  # the step's reservation was given back
                routed += len(pages) * stored[s.layer]
        dense = blocks * cfg.num_layers * cfg.num_kv_heads
        assert bm.pages_held(seq) == dense + subset + routed
        checked += 1
    assert checked >= 5 and bm.num_used_pages == 0
    assert len(set(seq.levels)) > 1  # the policy drew more than one level
    stats = check_against_reference(path, [prompt], [depth], [final])
    assert stats["tokens"] == 10


def test_loop_ranges_are_checked(path):
    llm = tiny_llm(path)
    knob = llm.engine.model.depth_knobs()["loops"]
    assert knob.elastic and knob.check("auto").as_json() == {"min": 0, "max": 3}
    plan = llm.engine.model.plan(DepthParams(loops={"min": 1, "max": 3}).normalized({"loops": knob}))
    assert plan.level == 3 and plan.elastic.as_json() == {"min": 1, "max": 3}
    assert len(plan.level_work) == 4 and plan.level_work[0] == 1.0
    assert all(a < b for a, b in zip(plan.level_work, plan.level_work[1:]))
    params = SamplingParams(max_tokens=2)
    for bad, message in (({"min": 2, "max": 1}, "above its max"), ({"min": 0, "max": 4}, "must lie in 0..3"),
                         ({"min": 1}, "a range is"), ({"min": 1, "max": 2, "step": 1}, "a range is"),
                         ({1: {"min": 0, "max": 2}}, "must be an integer")):
        with pytest.raises(InvalidDepthError, match=message):
            llm.generate([[5, 6, 7]], params, DepthParams(loops=bad))
    assert llm.engine.block_manager.num_used_pages == 0
