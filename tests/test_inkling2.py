"""Inkling-2's looped text model (docs/depth-semantics.md, "Public looped models: Inkling-2"): the
config and weights read as transformers reads them, and the engine against transformers'
Inkling2LoopForCausalLM in fp32 (with `loop_num_passes` = the request's `loops`): greedy tokens
identical, logprobs within 1e-4, in mixed batches of loop counts, with chunked prefill, preemption,
prefix-cache hits and prompts longer than the sliding window, the relative-bias extent and the
log-scaling floor. Expert choices: every routing margin of the compared sequences in the reference
exceeds a small δ, so equal logits mean equal choices. The checkpoints are tiny ones saved by
transformers itself."""

from __future__ import annotations

import json

import pytest
import torch

from depthserve import DepthParams, SamplingParams
from depthserve.archs import read_depth_spec
from depthserve.archs.inkling2 import format as inkling2_format
from depthserve.oracles import inkling2 as inkling2_reference
from depthserve.lab.tiny.inkling2 import make_tiny
from depthserve.errors import CheckpointFormatError, InvalidDepthError
from tests.depth_helpers import cache_layout, check_logprobs, tiny_llm
from tests.looped_serving import check_loops_served_with_the_openai_sdk

TOL = 1e-4
NEAR_TIE = 0.0  # greedy tokens must be the reference's argmax
ROUTING_DELTA = 1e-5  # ten times the largest router-score disagreement measured with transformers (1.1e-6, loops 4)
WINDOW = 8  # the tiny checkpoint's sliding window: every prompt below is longer
VOCAB = 257  # the byte tokenizer's


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("inkling2") / "tiny", seed=3, loops=2, sliding_window=WINDOW)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(path, prompt, depth, completion, stats):
    ids = prompt + completion.token_ids[:-1]
    logits, margins = inkling2_reference.forward_with_margins(path, ids, depth)
    margin = float(margins.min())
    assert margin > ROUTING_DELTA, f"a routing decision within {margin} of flipping: pick another prompt"
    stats["min_routing_margin"] = min(stats.get("min_routing_margin", 1.0), margin)
    check_logprobs(torch.log_softmax(logits, dim=-1), len(prompt), completion, stats, tol=TOL, near_tie=NEAR_TIE)


def _run(engine, requests) -> dict:
    for rid, prompt, params, depth in requests:
        engine.add_request(rid, prompt, params, depth)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


# ---- the config --------------------------------------------------------------------------------------
def test_config_reads_as_transformers_reads_it(ckpt):
    from transformers import Inkling2LoopTextConfig

    hf = json.loads((ckpt / "config.json").read_text())
    ours = read_depth_spec(hf)
    theirs = Inkling2LoopTextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "transformers_version")})
    assert ours.layer_types == tuple(theirs.layer_types) and ours.num_layers == 8
    assert (ours.loop_start, ours.loop_end, ours.loop_passes) == (
        theirs.loop_layer_index_start, theirs.loop_layer_index_end, theirs.loop_num_passes) == (2, 6, 2)
    assert (ours.sliding_window, ours.rel_extent, ours.max_loops) == (WINDOW, theirs.rel_extent, 8)
    released = {k: v for k, v in hf.items() if not k.startswith("loop_")}
    released["loop_config"] = {"core_start": 2, "core_end": 4, "num_passes": 3, "gate_rank": 8}
    spec = read_depth_spec(released)
    assert (spec.loop_start, spec.loop_end, spec.loop_passes) == (2, 4, 3)


def test_defaults_are_transformers_defaults():
    from transformers import Inkling2LoopTextConfig

    ours, theirs = read_depth_spec({"model_type": "inkling2_loop_text"}), Inkling2LoopTextConfig()
    assert ours.layer_types == tuple(theirs.layer_types) and ours.num_layers == 24
    assert (ours.loop_start, ours.loop_end, ours.loop_passes, ours.num_experts, ours.experts_per_token) == (
        6, 18, 3, 128, 8)


@pytest.mark.parametrize("change, match", [
    ({"loop_layer_index_start": 3}, "whole attention-residual blocks"),
    ({"loop_num_passes": 0}, "loop_num_passes"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"swa_head_dim": 32}, "head_dim"),
    ({"layer_types": ["local"] * 8}, "layer_types"),
    ({"model_type": "inkling2_loop", "vision_config": {}}, "vision tower"),
])
def test_malformed_configs_are_refused(ckpt, change, match):
    hf = {**json.loads((ckpt / "config.json").read_text()), **change}
    with pytest.raises(CheckpointFormatError, match=match):
        inkling2_format.read_spec(None, hf)


def test_the_multimodal_checkpoint_is_refused_by_name():
    with pytest.raises(CheckpointFormatError, match="vision tower"):
        read_depth_spec({"model_type": "inkling2_loop", "text_config": {}, "vision_config": {}})


def test_reference_is_peaked_and_loops_change_it(ckpt):
    ids = _ids(40, seed=1)
    logits = {L: inkling2_reference.forward(ckpt, ids, {"loops": L}) for L in (1, 2, 4)}
    torch.testing.assert_close(inkling2_reference.forward(ckpt, ids), logits[2], rtol=0, atol=0)
    for lg in logits.values():
        top2 = lg.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).median()) > 0.5
    for a, b in ((1, 2), (2, 4)):
        assert (logits[a].argmax(-1) != logits[b].argmax(-1)).any()


# ---- the engine ----------------------------------------------------------------------------------------
LENGTHS = [9, 23, 40, 17, 31]
LOOPS = [1, 2, 4, None, 3]


def test_mixed_loops_batch_equals_transformers_with_chunks_and_preemption(ckpt):
    prompts = [_ids(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    depths = [DepthParams() if n is None else DepthParams(loops=n) for n in LOOPS]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    probe = tiny_llm(ckpt)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = [bm.pages_for(cache_layout(model, d), len(p) + params.max_tokens) for p, d in zip(prompts, depths)]
    pages = max(need) + 2
    assert sum(need) > 2 * pages
    # a step budget of 13 tokens: prompts cut into uneven chunks across steps
    engine = tiny_llm(ckpt, pages=pages, max_model_len=64, max_num_batched_tokens=13).engine
    final = _run(engine, [(f"r{i}", p, params, d) for i, (p, d) in enumerate(zip(prompts, depths))])
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    stats = {"tokens": 0, "max_err": 0.0}
    for i, (prompt, depth) in enumerate(zip(prompts, depths)):
        out = final[f"r{i}"]
        _check(ckpt, prompt, depth, out.outputs[0], stats)
        report = out.depth
        assert report.settings["loops"] == (LOOPS[i] or 2) and report.settings["trained_loops"] == 2
        assert report.counters["looped_layer_passes"] == report.tokens * report.settings["loops"] * 4
    print("inkling2 mixed batch:", engine.scheduler.num_preemptions, "preemptions", stats)
    assert engine.block_manager.num_used_pages == 0


def test_cache_slots_grow_with_loops_and_conv_slots_keep_a_window(ckpt):
    model = tiny_llm(ckpt).engine.model
    cfg = model.config
    for loops in (1, 2, 4):
        layout = cache_layout(model, DepthParams(loops=loops))
        assert len(layout.slots) == 3 * (4 + 4 * loops)  # keys/values and two conv slots per invocation
    slots = {slot.name: slot for slot in cache_layout(model, DepthParams(loops=3)).slots}
    assert slots["layer3.pass3"].window is None and slots["layer2.pass3"].window == WINDOW
    assert slots["layer3.pass2.conv_kv"].window == slots["layer7.conv_res"].window == cfg.conv_kernel_size
    assert slots["layer3.conv_res"].num_heads == cfg.hidden_size // cfg.head_dim
    one, four = (model.plan(DepthParams(loops=n)) for n in (1, 4))
    assert four.flops_per_token > one.flops_per_token


def test_prefix_cache_hits_are_exact_and_keyed_by_loops(ckpt):
    llm = tiny_llm(ckpt)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    shared = _ids(33, seed=14)
    first = llm.generate([shared], params, DepthParams(loops=3))[0]
    hit = llm.generate([shared + _ids(5, seed=15)], params, DepthParams(loops=3))[0]
    other_loops = llm.generate([shared + _ids(5, seed=15)], params, DepthParams(loops=1))[0]
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens == 32 and other_loops.num_cached_tokens == 0
    stats = {"tokens": 0, "max_err": 0.0}
    _check(ckpt, shared + _ids(5, seed=15), {"loops": 3}, hit.outputs[0], stats)
    _check(ckpt, shared + _ids(5, seed=15), {"loops": 1}, other_loops.outputs[0], stats)
    assert llm.engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("depth, match", [
    ({"loops": 0}, "1..8"),
    ({"loops": 9}, "1..8"),
    ({"loops": 1.5}, "integer"),
    ({"loops": {"min": 1, "max": 2}}, "per-token depth ranges"),
    ({"depth": 2}, "not supported"),
])
def test_invalid_loops_raise_and_leave_no_pages(ckpt, depth, match):
    llm = tiny_llm(ckpt)
    with pytest.raises(InvalidDepthError, match=match):
        llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2), [DepthParams(), DepthParams.from_dict(depth)])
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_used_pages == 0
    knob = llm.engine.model.depth_knobs()["loops"]
    assert (knob.minimum, knob.maximum, knob.default) == (1, 8, 2)


def _windowed_pages(engine, seq) -> int:
    """Pages the sequence holds in its windowed slots (sliding attention and convolution inputs)."""
    entry = engine.block_manager._seqs[seq.seq_id]
    return (entry.num_rows - entry.released_rows) * len(entry.layout.windowed_columns)


def _given_back_and_taken(engine) -> bool:
    """Whether a page one running sequence gave back (its table still names it) is another's now."""
    entries = [engine.block_manager._seqs[seq.seq_id] for seq in engine.scheduler.running]
    for entry in entries:
        given_back = entry.table()[entry.released_from:entry.released_to][:, list(entry.layout.windowed_columns)]
        for other in entries:
            if other is not entry and set(given_back.ravel().tolist()) & set(other.table()[other.released_to:].ravel().tolist()):
                return True
    return False


def test_windowed_slots_give_pages_back_during_long_generations(ckpt):
    """Two sequences decode 36 tokens side by side (block 8, windows of 8 and 4 tokens): each windowed
    slot holds at most ceil((8 + block) / block) + 1 blocks while the full layers' slots grow, the
    pages given back are taken by the other sequence, and the tokens still equal transformers
    (prefix caching off: cached rows keep their pages)."""
    engine = tiny_llm(ckpt, enable_prefix_caching=False).engine
    block = engine.block_manager.block_size
    prompts = [_ids(n, seed=70 + n) for n in (12, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w{i}", prompt, params, DepthParams(loops=2))
    layout = cache_layout(engine.model, DepthParams(loops=2))
    bound = (-(-(WINDOW + block) // block) + 1) * len(layout.windowed_columns)
    most, taken, final = 0, False, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        for seq in engine.scheduler.running:
            most = max(most, _windowed_pages(engine, seq))
        taken = taken or _given_back_and_taken(engine)
    assert 0 < most <= bound and taken
    stats = {"tokens": 0, "max_err": 0.0}
    for i, prompt in enumerate(prompts):
        _check(ckpt, prompt, {"loops": 2}, final[f"w{i}"].outputs[0], stats)
    print(f"inkling2 windowed pages: at most {most} of {bound}", stats)
    assert engine.block_manager.num_used_pages == 0


# ---- over HTTP -------------------------------------------------------------------------------------
@pytest.mark.slow  # a server and SmolLM2's 49152-token vocabulary on the shared 2-core machine
def test_served_over_http_with_the_openai_sdk(tmp_path, smollm_tokenizer):
    """Completions, chat and streams equal offline generation at each `loops`; the knob changes the
    tokens and the bill (usage.depth); GET /v1/models lists its range and default; a value outside
    1..max_loops is a 400 naming the range."""
    path = make_tiny(tmp_path / "inkling2-chat", seed=2, loops=2, sliding_window=WINDOW, tokenizer=smollm_tokenizer)
    check_loops_served_with_the_openai_sdk(path, (1, 3), (1, 8), default=2)
