"""Per-token depth in the engine (docs/depth-semantics.md section 6), ITT: a request whose
`thinking_steps` is a range runs each step's tokens with the first `level` thinking steps on (the
depth policy's level); a token whose step is off gets no update and enters no routed slot. Random
levels in mixed batches (fixed and range requests, chunked prefill, preemption) equal the reference
run on the schedule the engine reports, routing decisions teacher-forced as for fixed knobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthserve import DepthParams, SamplingParams, reference
from depthserve.archs.itt.format import routed_slot_name
from depthserve.oracles.itt import itt_ratios, load_itt
from depthserve.errors import InvalidDepthError
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import (assert_runs_like_the_fixed_knob, check_logprobs, costliest_pages, stream_prompts,
                                  tiny_llm)
from tests.test_depth_elastic import RandomLevels
from tests.test_sgt_itt_engine import DELTA, NEAR_TIE, TOL

MAX_LEN = 64
LENGTHS = [5, 17, 30, 9, 40, 12, 33, 24]
DEPTHS = [{"thinking_steps": {"min": 0, "max": 2}}, {"selection_ratios": [0.7, 0.3]}, {"thinking_steps": "auto"},
          {"thinking_steps": {"min": 1, "max": 2}, "selection_ratios": [1.0, 0.7]}, {"thinking_steps": 1},
          {"thinking_steps": {"min": 0, "max": 1}, "selection_ratios": [0.3, 1.0]}, None,
          {"thinking_steps": "auto", "selection_ratios": [0.7, 0.7]}]


@pytest.fixture(scope="module")
def path(tmp_path_factory, smollm_tokenizer):
    return make_tiny("itt", tmp_path_factory.mktemp("elastic-itt") / "itt", seed=11, num_kv_heads=2,
                     tokenizer=smollm_tokenizer)


def _prompts() -> list[list[int]]:
    return stream_prompts(LENGTHS, seed=41)


def _schedule(depth: DepthParams, per_token: list[int]) -> list[dict]:
    ratios = {} if depth.get("selection_ratios") is None else {"selection_ratios": depth["selection_ratios"]}
    return [{"thinking_steps": level, **ratios} for level in per_token]


def _step_on(path, depth: DepthParams, per_token: list[int] | None, n: int, t: int) -> np.ndarray:
    """Where step t is on: its ratio is positive and the token's thinking steps reach it."""
    knobs = depth if per_token is None else DepthParams(selection_ratios=depth.get("selection_ratios"))
    ratio = itt_ratios(load_itt(path, torch.float32).spec, knobs)[t - 1]
    levels = np.full(n, t) if per_token is None else np.asarray(per_token[:n])
    return (levels >= t) & (ratio > 0)


def check_against_reference(path, prompts, depths, outputs) -> dict:
    """Each request against the reference on the schedule it reports: a decision is recorded exactly
    where the token's level has the step on, equal to the reference's where the margin exceeds
    DELTA; logprobs on the engine's decisions."""
    stats = {"tokens": 0, "decisions": 0, "within_delta": 0, "max_err": 0.0}
    for prompt, depth, out in zip(prompts, depths, outputs):
        tokens = prompt + out.token_ids[:-1]
        n = len(tokens)
        per_token = out.depth.per_token
        schedule = None if per_token is None else _schedule(depth, per_token)
        _, decisions = reference.forward(path, tokens, depth, return_decisions=True, schedule=schedule)
        force = {}
        for key, ref in decisions.items():
            mine = out.depth.decisions[key][:n]
            on = _step_on(path, depth, per_token, n, key[1])
            assert ((mine >= 0) == on).all(), f"{key}: decisions recorded where the step is off, or missing"
            confident = on & (ref["margin"] > DELTA)
            stats["decisions"] += int(on.sum())
            stats["within_delta"] += int((on & ~confident).sum())
            bad = np.flatnonzero(((mine == 1) != ref["selected"]) & confident)
            assert not len(bad), f"{key}: decisions differ at {bad}"
            force[key] = mine == 1
        logprobs = torch.log_softmax(reference.forward(path, tokens, depth, force=force, schedule=schedule), dim=-1)
        check_logprobs(logprobs, len(prompt), out.outputs[0], stats, tol=TOL, near_tie=NEAR_TIE)
    return stats


@pytest.mark.slow
def test_random_levels_in_a_mixed_batch_equal_the_reference(path):
    prompts = _prompts()
    depths = [DepthParams.from_dict(d) for d in DEPTHS]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2) for _ in prompts]
    llm = tiny_llm(path, pages=costliest_pages(path, depths, MAX_LEN) + 4, max_model_len=MAX_LEN,
                   max_num_batched_tokens=16)
    llm.engine.depth_policy = RandomLevels(1)
    outputs = llm.generate(prompts, params, depths)
    stats = check_against_reference(path, prompts, depths, outputs)
    assert stats["tokens"] > 0 and stats["within_delta"] <= 0.01 * stats["decisions"]
    ranged = [out.depth.per_token for out in outputs if out.depth.per_token is not None]
    assert len(ranged) == 5 and {level for levels in ranged for level in levels} == {0, 1, 2}
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_used_pages == 0


def test_a_range_at_its_maximum_is_the_fixed_knob(path):
    prompts = _prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    llm = tiny_llm(path, max_num_batched_tokens=16)
    ranged = llm.generate(prompts, params, DepthParams(thinking_steps={"min": 0, "max": 1}))  # fixed policy: 1
    fixed = llm.generate(prompts, params, DepthParams(thinking_steps=1))
    assert_runs_like_the_fixed_knob(ranged, fixed, 1)

def test_a_routed_slot_holds_only_tokens_whose_level_ran_its_step(path):
    """The step-2 routed slots grow only with tokens that had step 2 on and were selected; pages held
    are the dense slots plus the routed slots' stored tokens after every step."""
    llm = tiny_llm(path, max_num_batched_tokens=8)
    engine = llm.engine
    engine.depth_policy = RandomLevels(5)
    engine.add_request("r", _prompts()[4], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                       DepthParams(thinking_steps="auto", selection_ratios=[1.0, 1.0]))
    seq = engine._requests["r"].seqs[0]
    bm, bs, checked = engine.block_manager, engine.args.block_size, 0
    layers = engine.model.spec.layers
    while engine.has_unfinished_requests():
        engine.step()
        if seq.finished:
            break
        levels = np.array(seq.levels[: seq.num_computed_tokens])
        routed = 0
        for layer in layers:
            for t in (1, 2):  # ratio 1: every token whose level has step t on is selected
                pages, length = bm.routed_table(seq, routed_slot_name(layer, t))
                assert length == np.count_nonzero(levels >= t)
                assert len(pages) == -(-length // bs)
                routed += len(pages) * engine.model.config.num_kv_heads
        dense = -(-seq.num_computed_tokens // bs) * engine.model.config.num_layers * engine.model.config.num_kv_heads
        assert bm.pages_held(seq) == dense + routed
        checked += 1
    assert checked >= 5 and bm.num_used_pages == 0


def test_thinking_step_ranges_are_checked(path):
    llm = tiny_llm(path)
    params = SamplingParams(max_tokens=2)
    for bad, message in (({"min": 2, "max": 1}, "above its max"), ({"min": 0, "max": 3}, "must lie in 0..2"),
                         ({"max": 1}, "a range is")):
        with pytest.raises(InvalidDepthError, match=message):
            llm.generate([[5, 6, 7]], params, DepthParams(thinking_steps=bad))
    with pytest.raises(InvalidDepthError, match="does not run per-token depth ranges"):
        llm.generate([[5, 6, 7]], params, DepthParams(selection_ratios={"min": 0, "max": 1}))
    assert llm.engine.block_manager.num_used_pages == 0
