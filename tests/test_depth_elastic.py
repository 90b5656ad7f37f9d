"""Per-token depth in the engine (docs/depth-semantics.md section 6), Dreamer: a request whose `depth`
is a range runs each step's tokens at the level the depth policy picks, its slots past the range's
minimum holding only the tokens that ran them. Incremental = recompute with any schedule: random
levels in mixed batches (fixed and range requests, chunked prefill, preemption, prefix hits of the
fixed ones) equal the reference run on the schedule the engine reports."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from depthserve import DepthParams, SamplingParams
from depthserve.archs.dreamer.format import ran_depths, slot_name
from depthserve.errors import InvalidDepthError
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import assert_runs_like_the_fixed_knob, costliest_pages, stream_prompts, tiny_llm
from tests.test_dreamer import check_against_reference

MAX_LEN = 48
LENGTHS = [5, 17, 30, 9, 40, 12, 33, 24]
DEPTHS = [{"depth": {"min": 1, "max": 4}}, {"depth": 3}, {"depth": "auto"}, {"depth": {"min": 2, "max": 3}},
          {"depth": 4}, {"depth": {"min": 1, "max": 2}}, {"depth": 4}, {"depth": {"min": 3, "max": 4}}]


class RandomLevels:
    """A test policy: every elastic sequence at a random level of its range, every step."""

    name = "random"
    target = None

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def assign(self, scheduled):
        return [replace(item, level=self.rng.randint(item.seq.plan.elastic.minimum, item.seq.plan.elastic.maximum))
                if item.seq.plan.elastic is not None else item for item in scheduled]

    def observe(self, scheduled, seconds):
        return None


@pytest.fixture(scope="module", params=["dense", "attention-experts"])
def path(request, tmp_path_factory, smollm_tokenizer):
    options = dict(attn_experts=0, da_rope="depth") if request.param == "dense" else dict(attn_experts=2)
    return make_tiny("dreamer", tmp_path_factory.mktemp("elastic") / request.param, seed=5, num_kv_heads=2,
                     tokenizer=smollm_tokenizer, **options)


def _prompts() -> list[list[int]]:
    prompts = stream_prompts(LENGTHS, seed=31)
    prompts[6] = prompts[4][:33]  # fixed depth-4 requests sharing a prefix: prefix-cache hits
    return prompts


def _knob():
    from depthserve.depth import KnobSpec

    return KnobSpec("depth", "", 1, 4, 4, elastic=True)


@pytest.mark.slow
def test_random_levels_in_a_mixed_batch_equal_the_reference(path):
    prompts = _prompts()
    depths = [DepthParams.from_dict(d) for d in DEPTHS]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2) for _ in prompts]
    llm = tiny_llm(path, pages=costliest_pages(path, depths, MAX_LEN) + 6, max_model_len=MAX_LEN,
                   max_num_batched_tokens=16)
    llm.engine.depth_policy = RandomLevels(0)
    outputs = llm.generate(prompts, params, depths)
    stats = check_against_reference(path, prompts, depths, outputs)
    assert stats["tokens"] > 0
    for depth, out in zip(depths, outputs):
        span = depth.normalized({"depth": _knob()})["depth"]
        if out.depth.per_token is not None:
            assert all(span.minimum <= d <= span.maximum for d in out.depth.per_token)
    levels = {d for out in outputs for d in out.depth.per_token or []}
    assert levels == {1, 2, 3, 4}
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_hits > 0
    assert llm.engine.block_manager.num_used_pages == 0
    levels_run = llm.engine.stats()["depth_levels_run"]
    assert levels_run and set(levels_run) == {1, 2, 3, 4}


def test_a_range_at_its_maximum_is_the_fixed_knob(path):
    prompts = _prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    llm = tiny_llm(path, max_num_batched_tokens=16)
    ranged = llm.generate(prompts, params, DepthParams(depth={"min": 1, "max": 3}))  # fixed policy: 3
    fixed = llm.generate(prompts, params, DepthParams(depth=3))
    assert_runs_like_the_fixed_knob(ranged, fixed, 3)
    assert llm.engine.stats()["depth_shed_tokens"] == 0


def test_a_slot_holds_exactly_the_tokens_that_ran_its_depth(path):
    """Pages per slot against the schedule, after every step: dense slots cover every token, the
    routed slot of depth j holds the tokens that ran depth j, and nothing else stays reserved."""
    llm = tiny_llm(path, max_num_batched_tokens=8)
    engine = llm.engine
    engine.depth_policy = RandomLevels(3)
    prompt = _prompts()[4]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                       DepthParams(depth={"min": 2, "max": 4}))
    seq = engine._requests["r"].seqs[0]
    bm, bs, checked = engine.block_manager, engine.args.block_size, 0
    while engine.has_unfinished_requests():
        engine.step()
        if seq.finished:
            break
        ran = ran_depths(seq.depth_record, seq.num_computed_tokens)
        assert ran.min() >= 2 and ran.max() <= 4
        for j in (2, 3):
            pages, length = bm.routed_table(seq, slot_name(j))
            assert length == np.count_nonzero(ran > j)
            assert len(pages) == -(-length // bs)  # the step's reservation was given back
        dense = -(-seq.num_computed_tokens // bs) * 2 * 2  # two dense depths x two KV heads
        routed = sum(-(-np.count_nonzero(ran > j) // bs) * 2 for j in (2, 3))
        assert bm.pages_held(seq) == dense + routed
        checked += 1
    assert checked >= 5 and bm.num_used_pages == 0


def test_range_values_are_checked():
    knob = _knob()
    assert knob.check("auto").as_json() == {"min": 1, "max": 4}
    for bad, message in (({"min": 3, "max": 2}, "above its max"), ({"min": 0, "max": 2}, "must lie in 1..4"),
                         ({"min": 1}, "a range is"), ({"min": 1, "max": 2, "step": 1}, "a range is")):
        with pytest.raises(InvalidDepthError, match=message):
            knob.check(bad)
    with pytest.raises(InvalidDepthError, match="does not run per-token depth ranges"):
        replace(knob, elastic=False).check({"min": 1, "max": 2})


def test_ranges_over_http_report_every_token_depth(path):
    """A range over HTTP: each choice and each streamed chunk says the depth its tokens ran at,
    usage.depth the range and the mean; /v1/models marks the knob elastic; /metrics counts the
    levels; a range on a knob without per-token depth is a 400 in the engine's words."""
    import httpx

    from depthserve.config import EngineArgs
    from depthserve.engine.async_llm import AsyncLLM
    from depthserve.engine.llm_engine import LLMEngine
    from depthserve.server.app import build_app
    from tests.live_server import live_server, metric_value

    engine = LLMEngine(EngineArgs(model=str(path), device="cpu", dtype="float32", load_progress=False,
                                  max_model_len=MAX_LEN, block_size=8, kv_cache_memory_gib=0.02))
    body = {"model": str(path), "prompt": [5, 6, 7, 8, 9], "max_tokens": 5, "temperature": 0.0,
            "ignore_eos": True, "depth": {"depth": {"min": 1, "max": 3}}}
    with live_server(build_app(AsyncLLM(engine))) as base:
        knob = httpx.get(f"{base}/v1/models").json()["data"][0]["depth_knobs"]["depth"]
        assert knob["elastic"] is True
        whole = httpx.post(f"{base}/v1/completions", json=body).json()
        choice = whole["choices"][0]
        assert choice["token_depths"] == [3] * 5  # the fixed policy runs a range at its maximum
        assert whole["usage"]["depth"]["depth"] == {"min": 1, "max": 3}
        assert whole["usage"]["depth"]["mean_depth"] == 3
        fixed = httpx.post(f"{base}/v1/completions", json={**body, "depth": {"depth": 2}}).json()
        assert "token_depths" not in fixed["choices"][0]
        depths = []
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    import json

                    depths += json.loads(line[6:])["choices"][0].get("token_depths") or []
        assert depths == [3] * 5
        assert metric_value(base, "depthserve_depth_token_level_count") >= 10
        assert metric_value(base, "depthserve_depth_policy_target", policy="fixed") == 3
        bad = httpx.post(f"{base}/v1/completions", json={**body, "depth": {"depth": {"min": 3, "max": 1}}})
        assert bad.status_code == 400 and "above its max" in bad.json()["error"]["message"]
