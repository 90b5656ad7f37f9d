"""Per-token loops for Dory (docs/depth-semantics.md section 6 and "Public looped models: Dory"): a
request whose `loops` is a range runs each step's tokens at the depth policy's level. The schedule
reference (depthserve/oracles/dory.py, float64 from the checkpoint's weights) equals
transformers' DoryForCausalLM at every constant schedule, in both cache modes; the engine equals
that reference on the schedule it reports: random levels going down and up in mixed batches of
fixed and range requests, with chunked prefill (last_loop: the fixed prompt chunks), preemption
and sliding windows shorter than the prompts (per_loop: routed pass slots whose keys' positions
have holes). Tiny checkpoints saved by transformers itself."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from depthserve import DepthParams, SamplingParams
from depthserve.archs.dory import format as dory_format
from depthserve.oracles import dory as dory_reference
from depthserve.lab.tiny.dory import make_tiny
from tests.depth_helpers import assert_runs_like_the_fixed_knob, check_logprobs, costliest_pages, tiny_llm
from tests.test_depth_elastic import RandomLevels

TOL = 1e-4  # tests/test_dory.py
NEAR_TIE = 0.0  # greedy tokens must be the reference's argmax
WINDOW = 8  # every prompt below is longer
VOCAB = 257  # the byte tokenizer's
MAX_LEN = 40  # the longest prompt and its 8 tokens
LENGTHS = [21, 9, 30, 14, 26, 11]
KNOBS = [{"loops": {"min": 1, "max": 3}}, {"loops": 2}, {"loops": {"min": 2, "max": 4}}, {"loops": {"min": 1, "max": 4}},
         {"loops": 1}, {"loops": {"min": 1, "max": 2}}]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny Dory (2 prelude, 2 recurrent, 2 coda layers, sliding and full in each; trained loops 2,
    max_loops 8) in each cache mode."""
    root = tmp_path_factory.mktemp("dory-schedules")
    return {mode: make_tiny(root / mode, seed=11, loops=2, cache_mode=mode, sliding_window=WINDOW)
            for mode in ("per_loop", "last_loop")}


@pytest.fixture(params=["per_loop", "last_loop"])
def path(request, ckpts):
    return ckpts[request.param]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chunk(path) -> int | None:
    """The prompt chunk the engine runs last_loop prompts in (None: per_loop, any split)."""
    cfg = dory_reference.load_weights(str(path)).cfg
    return dory_format.LAST_LOOP_PREFILL_CHUNK if cfg.recurrent_kv_cache_mode == "last_loop" else None


# ---- the reference -------------------------------------------------------------------------------------
def test_a_constant_schedule_equals_transformers(path):
    ids = _ids(45, seed=0)
    options = dict(prompt_len=40, prefill_chunk=16)  # last_loop: three prompt forwards, then one token each
    for loops in (1, 2, 4):
        hf = dory_reference.forward(path, ids, {"loops": loops}, **options)
        ours = dory_reference.forward(path, ids, schedule=[{"loops": loops}] * len(ids), **options)
        torch.testing.assert_close(ours, hf, rtol=0, atol=1e-4)


def test_a_token_depends_only_on_its_prefix_and_their_loops(path):
    ids = _ids(30, seed=1)
    rng = random.Random(2)
    schedule = [{"loops": rng.randint(1, 4)} for _ in ids]
    full = dory_reference.forward(path, ids, schedule=schedule, prompt_len=20, prefill_chunk=8)
    prefix = dory_reference.forward(path, ids[:24], schedule=schedule[:24], prompt_len=20, prefill_chunk=8)
    torch.testing.assert_close(prefix, full[:24], rtol=0, atol=1e-10)
    other = list(schedule)
    other[25] = {"loops": 1 if schedule[25]["loops"] != 1 else 3}
    changed = dory_reference.forward(path, ids, schedule=other, prompt_len=20, prefill_chunk=8)
    torch.testing.assert_close(changed[:25], full[:25], rtol=0, atol=1e-10)
    assert (changed[25] - full[25]).abs().max() > 1e-6


def test_a_shallow_token_changes_what_later_tokens_read(path):
    """Token 12 (a decode forward) runs one pass where the others run three. per_loop: it is
    missing from the pass-2 and pass-3 slots; last_loop: the later tokens read its pass-1 keys. Either
    way nothing before it changes, and the later tokens within the window change."""
    ids = _ids(20, seed=3)
    deep = [{"loops": 3}] * len(ids)
    shallow = list(deep)
    shallow[12] = {"loops": 1}
    base = dory_reference.forward(path, ids, schedule=deep, prompt_len=10, prefill_chunk=8)
    changed = dory_reference.forward(path, ids, schedule=shallow, prompt_len=10, prefill_chunk=8)
    torch.testing.assert_close(changed[:12], base[:12], rtol=0, atol=1e-10)
    assert (changed[13:13 + WINDOW - 1] - base[13:13 + WINDOW - 1]).abs().max(dim=-1).values.min() > 1e-8


# ---- the engine ----------------------------------------------------------------------------------------
def _check_against_reference(path, prompts, knobs, outputs) -> dict:
    stats = {"tokens": 0, "max_err": 0.0}
    for prompt, knob, out in zip(prompts, knobs, outputs):
        tokens = prompt + out.token_ids[:-1]
        per_token = out.depth.per_token
        if per_token is None:
            schedule = [{"loops": knob["loops"]}] * len(tokens)
        else:
            assert len(per_token) == len(tokens)
            schedule = [{"loops": n} for n in per_token]
        logits = dory_reference.forward(path, tokens, schedule=schedule, prompt_len=len(prompt),
                                        prefill_chunk=_chunk(path))
        check_logprobs(torch.log_softmax(logits, dim=-1), len(prompt), out.outputs[0], stats, tol=TOL,
                       near_tie=NEAR_TIE, prompt_logprobs=out.prompt_logprobs)
    return stats


def test_random_levels_in_a_mixed_batch_equal_the_reference(path):
    prompts = [_ids(n, seed=40 + i) for i, n in enumerate(LENGTHS)]
    depths = [DepthParams.from_dict(k) for k in KNOBS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    # pages for one sequence of MAX_LEN tokens at the costliest knob, and a few: the
    # six sequences are preempted in turn and recompute their recorded levels
    llm = tiny_llm(path, pages=costliest_pages(path, depths, MAX_LEN) + 4, max_model_len=MAX_LEN,
                   max_num_batched_tokens=16)
    llm.engine.depth_policy = RandomLevels(0)
    preempted = []
    preempt = llm.engine.scheduler._preempt

    def spy(seq):
        preempted.append((seq.plan.elastic is not None, set(seq.levels[: seq.num_computed_tokens])))
        preempt(seq)

    llm.engine.scheduler._preempt = spy
    outputs = llm.generate(prompts, params, depths)
    stats = _check_against_reference(path, prompts, KNOBS, outputs)
    assert stats["tokens"] == 8 * len(prompts) and stats["prompt_positions"] > 0
    turns = 0
    knob = llm.engine.model.depth_knobs()["loops"]
    for depth, out in zip(depths, outputs):
        loops = knob.check(depth["loops"])
        per_token = out.depth.per_token
        if per_token is None:
            assert isinstance(loops, int) and out.depth.settings["loops"] == loops
            continue
        assert all(loops.minimum <= n <= loops.maximum for n in per_token)
        assert out.outputs[0].token_depths == per_token[len(out.prompt_token_ids) - 1:]
        assert out.depth.settings["loops"] == loops.as_json()
        assert out.depth.settings["mean_depth"] == pytest.approx(np.mean(per_token), abs=1e-4)
        assert out.depth.counters["recurrent_layer_passes"] == sum(per_token) * 2
        steps = np.diff(per_token)
        turns += bool((steps < 0).any() and (steps > 0).any())
    assert turns >= 2
    print("dory schedules: preemptions", preempted, stats)
    assert any(ranged and len(levels) > 1 for ranged, levels in preempted), preempted
    assert llm.engine.block_manager.num_used_pages == 0


def _mode(path) -> str:
    return dory_reference.load_weights(str(path)).cfg.recurrent_kv_cache_mode


def _plan(model, knob):
    return model.plan(DepthParams(loops=knob).normalized(model.depth_knobs()))


def test_the_plan_prices_the_maximum(path):
    """per_loop: passes up to the range's minimum have dense slots, the later ones routed (so no
    prefix cache); last_loop: the fixed knob's slots, and a key of its own (the blocks depend on the
    schedule). Either way admission prices the range's maximum."""
    llm = tiny_llm(path)
    bm, model = llm.engine.block_manager, llm.engine.model
    assert model.depth_knobs()["loops"].elastic
    for low, high in ((1, 3), (2, 4), (1, 2)):
        plan, fixed = _plan(model, {"min": low, "max": high}), _plan(model, high)
        assert plan.elastic.as_json() == {"min": low, "max": high} and plan.loops == plan.level == high
        assert bm.pages_for(plan.layout, 40) == bm.pages_for(fixed.layout, 40)
        assert [plan.work_at(n) for n in (1, 2, 3)] == [6.0, 8.0, 10.0]  # 2 + 2 layers, 2 per pass
        assert plan.cache_key != fixed.cache_key
        routed = {slot.name for slot in plan.layout.routed_slots}
        if _mode(path) == "per_loop":
            dense = {slot.name for slot in plan.layout.slots}
            assert routed == {dory_format.recurrent_slot_name(model.config, i, t)
                              for t in range(max(2, low + 1), high + 1) for i in (2, 3)}
            assert {f"layer{i}.pass{t}" for t in range(1, low + 1) for i in (2, 3)} <= dense
            assert not plan.layout.uses_prefix_cache
        else:
            assert not routed and plan.layout == fixed.layout
            assert plan.cache_key != _plan(model, {"min": low, "max": high}).cache_key  # one per request
    assert _plan(model, {"min": 2, "max": 2}).elastic is None


def test_a_range_at_its_maximum_is_the_fixed_knob(path):
    """The fixed policy runs a range at its maximum: the same tokens as the fixed knob, every token
    reported at it, the same FLOPs and counters, and the same logprobs: within 1e-6 in last_loop mode
    (the same slots), within the engine's tolerance in per_loop mode, whose passes past the range's
    minimum attend through routed slots (the same keys, summed in another order in fp32)."""
    prompts = [_ids(n, seed=60 + i) for i, n in enumerate((19, 11, 35))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    llm = tiny_llm(path, max_num_batched_tokens=16)
    for low, high in ((1, 3), (2, 4)):
        ranged = llm.generate(prompts, params, DepthParams(loops={"min": low, "max": high}))
        fixed = llm.generate(prompts, params, DepthParams(loops=high))
        if _mode(path) == "last_loop":
            assert_runs_like_the_fixed_knob(ranged, fixed, high)
        for a, b in zip(ranged, fixed, strict=True):
            assert a.token_ids == b.token_ids and a.depth.per_token == [high] * a.depth.tokens
            assert a.outputs[0].token_depths == [high] * len(a.token_ids)
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert {t: v.logprob for t, v in x.items()} == pytest.approx({t: v.logprob for t, v in y.items()},
                                                                            abs=TOL)
            assert a.depth.settings["mean_depth"] == high
            assert a.depth.flops == pytest.approx(b.depth.flops) and a.depth.counters == b.depth.counters
    assert llm.engine.block_manager.num_used_pages == 0


def test_a_routed_pass_holds_exactly_the_tokens_that_ran_it(ckpts):
    """per_loop, after every step: the routed slots of pass t hold the tokens with loops >= t and
    nothing stays reserved, a sliding layer's routed slot without the pages of its leading blocks
    behind the window; the dense slots (every layer's first pass, and the passes up to the range's
    minimum) cover every token."""
    llm = tiny_llm(ckpts["per_loop"], max_num_batched_tokens=8)
    engine = llm.engine
    engine.depth_policy = RandomLevels(3)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("r", _ids(26, seed=5), params, DepthParams(loops={"min": 1, "max": 3}))
    engine.add_request("s", _ids(17, seed=6), params, DepthParams(loops={"min": 2, "max": 4}))
    seqs = {rid: engine._requests[rid].seqs[0] for rid in ("r", "s")}
    cfg, bm, bs, kv, checked = engine.model.config, engine.block_manager, engine.args.block_size, 2, 0
    released_routed = 0
    while engine.has_unfinished_requests():
        starts = {rid: seq.num_computed_tokens for rid, seq in seqs.items()}  # the pages go back before a step
        engine.step()
        for rid, seq in seqs.items():
            if seq.finished or not seq.num_computed_tokens:
                continue
            low, high = seq.plan.elastic.minimum, seq.plan.elastic.maximum
            ran = np.asarray(seq.levels[: seq.num_computed_tokens])
            assert ran.min() >= low and ran.max() <= high
            routed = 0
            for t in range(low + 1, high + 1):
                for i in cfg.recurrent_layers:
                    name = dory_format.recurrent_slot_name(cfg, i, t)
                    pages, length = bm.routed_table(seq, name)
                    assert length == np.count_nonzero(ran >= t)
                    assert len(pages) == -(-length // bs)
                    window = cfg.window(i)
                    behind = 0 if window is None else np.count_nonzero(ran[: max(starts[rid] - window + 1, 0)] >= t)
                    held = bm._seqs[seq.seq_id].routed[name].pages_held()
                    assert held == (len(pages) - behind // bs) * kv, (name, held, len(pages), behind)
                    released_routed += behind // bs
                    routed += held
            dense_slots = cfg.num_layers + (low - 1) * cfg.n_recurrent_layers
            blocks = -(-seq.num_computed_tokens // bs)
            # the sliding-window dense slots give back the pages of blocks behind the window
            assert bm.pages_held(seq) - routed <= blocks * dense_slots * kv
            assert bm.pages_held(seq) - routed >= blocks * (dense_slots // 2) * kv
            checked += 1
    assert checked >= 10 and released_routed > 0 and bm.num_used_pages == 0


def test_pages_behind_the_window_are_never_read(path):
    """Two range requests decode 40 tokens each (window 8, block 8) at random levels while every page
    no sequence holds is filled with NaN after each step: the pages the sliding slots gave back (dense
    and, per_loop, routed) are never read again, so the tokens and logprobs still equal the reference
    on the reported schedule; per_loop gives routed pages back."""
    llm = tiny_llm(path, enable_prefix_caching=False, max_num_batched_tokens=8)  # no cached rows: refs 0 = free
    engine = llm.engine
    engine.depth_policy = RandomLevels(5)
    bm, pool = engine.block_manager, engine.runner.pool
    prompts, knobs = [_ids(19, seed=81), _ids(12, seed=82)], [{"loops": {"min": 1, "max": 3}}, {"loops": {"min": 2, "max": 4}}]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    for i, (prompt, knob) in enumerate(zip(prompts, knobs)):
        engine.add_request(f"n{i}", prompt, params, DepthParams.from_dict(knob))
    final, routed_given_back = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        free = torch.from_numpy(np.flatnonzero(bm._refs == 0))
        pool.k_pages[free] = float("nan")
        pool.v_pages[free] = float("nan")
        routed_given_back = max([routed_given_back] + [r.released for entry in bm._seqs.values()
                                                       for r in entry.routed.values()])
    outputs = [final[f"n{i}"] for i in range(len(prompts))]
    stats = _check_against_reference(path, prompts, knobs, outputs)
    assert stats["tokens"] == 40 * len(prompts)
    assert (routed_given_back > 0) == (_mode(path) == "per_loop")
    print(f"dory {_mode(path)} NaN-poisoned free pages:", stats, "routed rows given back", routed_given_back)


def test_last_loop_ranges_never_share_prefix_blocks(ckpts):
    """Two equal prompts with the same range: the second computes its own blocks (what they hold
    depends on the schedule run); with a fixed knob the second hits the first's whole chunks."""
    path = ckpts["last_loop"]
    prompt = _ids(2 * dory_format.LAST_LOOP_PREFILL_CHUNK + 5, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm = tiny_llm(path, enable_prefix_caching=True)
    for knob, hits in (({"min": 1, "max": 3}, False), (3, True)):
        first = llm.generate([prompt], params, DepthParams(loops=knob))[0]
        second = llm.generate([prompt], params, DepthParams(loops=knob))[0]
        assert (second.num_cached_tokens > 0) == hits and first.token_ids == second.token_ids


def test_slo_policy_and_ranges_over_http(ckpts):
    """`--depth-policy slo` with a range: the prompt runs deep, the decode steps at the cap the time
    target allows (the range's minimum for a target no step meets); choices and usage report the
    depths, /v1/models marks `loops` elastic, and a range outside 1..max_loops is a 400 naming it.
    The schedule offline under the same policy equals the reference."""
    import httpx

    from depthserve import LLM
    from depthserve.config import EngineArgs
    from depthserve.engine.async_llm import AsyncLLM
    from depthserve.engine.llm_engine import LLMEngine
    from depthserve.server.app import build_app
    from tests.live_server import live_server, wait_idle

    path = ckpts["per_loop"]
    args = dict(device="cpu", dtype="float32", load_progress=False, max_model_len=MAX_LEN, block_size=8,
                depth_policy="slo", tpot_slo_ms=0.001)
    prompt = _ids(20, seed=8)
    body = {"model": str(path), "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "depth": {"loops": {"min": 1, "max": 4}}}
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(path), **args)))
    with live_server(build_app(llm)) as base:
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["depth_knobs"]["loops"]["elastic"] is True
        reply = httpx.post(f"{base}/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        depths, usage = reply.json()["choices"][0]["token_depths"], reply.json()["usage"]["depth"]
        assert depths == [4] + [1] * 5  # the prompt's step deep; every decode step over the target
        assert usage["loops"] == {"min": 1, "max": 4} and usage["mean_depth"] == pytest.approx((20 * 4 + 5) / 25)
        for bad, message in (({"min": 0, "max": 2}, "1..8"), ({"min": 2, "max": 9}, "1..8"),
                             ({"min": 3, "max": 1}, "above its max")):
            response = httpx.post(f"{base}/v1/completions", json={**body, "depth": {"loops": bad}})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and message in error["message"], error
        wait_idle(llm)
        assert llm.engine.block_manager.num_used_pages == 0
    offline = LLM(str(path), **args)
    out = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
                           DepthParams(loops={"min": 1, "max": 4}))[0]
    assert out.depth.per_token == [4] * 20 + [1] * 5 and out.text == reply.json()["choices"][0]["text"]
    stats = _check_against_reference(path, [prompt], [body["depth"]], [out])
    assert stats["tokens"] == 6


def test_the_confidence_exit_is_refused(ckpts):
    """The coda attends over the earlier tokens' coda states: a pass's output is no readout."""
    from depthserve.config import EngineArgs
    from depthserve.engine.llm_engine import LLMEngine
    from depthserve.errors import ConfigurationError

    assert not tiny_llm(ckpts["per_loop"]).engine.model.readout_every_level
    with pytest.raises(ConfigurationError, match="readout at every depth level"):
        LLMEngine(EngineArgs(model=str(ckpts["last_loop"]), device="cpu", dtype="float32", load_progress=False,
                             max_model_len=MAX_LEN, block_size=8, depth_policy="confidence",
                             confidence_threshold=0.9))
