"""SGT and ITT in the engine: incremental = recompute against the reference forward.

Mixed batches (different prompt lengths and different depth settings in one batch) run with
chunked prefill, forced preemption and prefix caching on; every generated token's logprobs
(chosen + top alternatives) must match the reference forward within 1e-4 (fp32) and every greedy
token must be the reference's argmax. ITT routing decisions must equal the reference's wherever
the margin |s - tau| exceeds DELTA, and logits are compared with the reference run on the
engine's own decisions (teacher-forced), as the contract states.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthserve import LLM, DepthParams, SamplingParams, reference
from depthserve.engine.model_runner import ModelRunner
from depthserve.errors import InvalidDepthError
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import cache_layout, check_logprobs, depth_params, stream_prompts, tiny_llm

TOL = 1e-4  # logprobs, fp32 engine vs the float64 reference
DELTA = 1e-4  # routing margin below which a decision may differ (rounding)
NEAR_TIE = 1e-4
LENGTHS = [3, 9, 17, 24, 33, 40, 51, 64, 70, 85, 97, 120, 141]
SGT_DEPTHS = [{"loops": 0}, {"loops": 1}, {"loops": 2}, {"loops": 3}, None, {"loops": {1: 0, 2: 3}},
              {"loops": {3: 2}}, {"loops": 3}, {"loops": 0}, None, {"loops": 1}, {"loops": {2: 0}}, {"loops": 2}]
ITT_DEPTHS = [{"selection_ratios": [0.3, 0.7]}, {"selection_ratios": [1.0, 0.0]}, None,
              {"selection_ratios": [0.0, 0.3]}, {"selection_ratios": [0.7, 1.0]}, {"thinking_steps": 1},
              {"selection_ratios": [0.3, 0.3]}, {"thinking_steps": 0}, {"selection_ratios": [1.0, 1.0]},
              {"selection_ratios": [0.7, 0.3], "thinking_steps": 1}, None, {"selection_ratios": [0.0, 0.0]},
              {"selection_ratios": [0.3, 1.0]}]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ("sgt", "itt"):
        for kv, name in ((2, "gqa"), (4, "mha")):
            out[f"{arch}-{name}"] = make_tiny(arch, root / f"{arch}-{name}", seed=11, num_kv_heads=kv,
                                              tokenizer=smollm_tokenizer)
    return out


def _prompts() -> list[list[int]]:
    prompts = stream_prompts(LENGTHS, seed=21)
    prompts[4] = prompts[7][:33]  # shares a 2-block prefix with request 7 (same depth setting below)
    prompts[3] = prompts[7][:24]
    return prompts


def check_against_reference(path, prompts, depths, outputs, routed: bool) -> dict:
    stats = {"tokens": 0, "decisions": 0, "within_delta": 0, "max_err": 0.0}
    for prompt, depth, out in zip(prompts, depths, outputs):
        tokens = prompt + out.token_ids[:-1]  # every position the engine computed
        force = None
        if routed:
            engine_routing = out.depth.decisions
            _, decisions = reference.forward(path, tokens, depth, return_decisions=True)
            assert set(engine_routing) == set(decisions), (engine_routing.keys(), decisions.keys())
            force = {}
            for key, ref in decisions.items():
                mine = engine_routing[key][: len(tokens)]
                assert (mine >= 0).all(), f"{key}: a computed position has no recorded decision"
                mine = mine == 1
                confident = ref["margin"] > DELTA
                stats["decisions"] += len(mine)
                stats["within_delta"] += int((~confident).sum())
                bad = np.flatnonzero((mine != ref["selected"]) & confident)
                assert not len(bad), f"{key}: decisions differ at {bad} with margins {ref['margin'][bad]}"
                force[key] = mine
        logprobs = torch.log_softmax(reference.forward(path, tokens, depth, force=force), dim=-1)
        check_logprobs(logprobs, len(prompt), out.outputs[0], stats, tol=TOL, near_tie=NEAR_TIE,
                       prompt_logprobs=out.prompt_logprobs)
    return stats


def _run_mixed(path, depths, prefix_caching=True):
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    # Every third request also scores its prompt (prompt_logprobs: every prompt position is checked).
    per_request = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2,
                                  prompt_logprobs=1 if i % 3 == 2 else None) for i in range(len(prompts))]
    ds = [depth_params(d) for d in depths]
    # KV budget: a little more than the costliest request alone, far less than the batch needs.
    probe = tiny_llm(path, max_model_len=160)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = [bm.pages_for(cache_layout(model, d), len(p) + params.max_tokens) for p, d in zip(prompts, ds)]
    pages = max(need) + 4
    assert sum(need) > 3 * pages
    llm = tiny_llm(path, pages=pages, max_model_len=160, max_num_batched_tokens=32, enable_prefix_caching=prefix_caching)
    outputs = llm.generate(prompts, per_request, ds)
    return llm, prompts, ds, outputs


@pytest.mark.parametrize("name", ["sgt-gqa", "sgt-mha"])
@pytest.mark.slow
def test_sgt_mixed_batch_equals_reference(ckpts, name):
    llm, prompts, depths, outputs = _run_mixed(ckpts[name], SGT_DEPTHS)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert engine.block_manager.prefix_hits > 0, "requests 3, 4 and 7 share a prefix and depth"
    stats = check_against_reference(ckpts[name], prompts, depths, outputs, routed=False)
    print(name, "preemptions", engine.scheduler.num_preemptions, "prefix hits", engine.block_manager.prefix_hits, stats)
    assert engine.block_manager.num_used_pages == 0
    # The report: loop iterations, extrapolation beyond the trained counts, relative compute.
    by_loops = {str(d.get("loops")): o.depth.to_dict() for d, o in zip(depths, outputs)}
    assert set(by_loops["0"]["loop_iterations"].values()) == {0}
    assert by_loops["2"]["loop_iterations"] == {layer: 2 * by_loops["2"]["tokens"] for layer in (1, 2, 3)}
    assert by_loops["3"]["extrapolated"] == [1, 2, 3] and by_loops["2"]["extrapolated"] == [2, 3]
    # relative to the trained counts ({1: 2, 2: 1, 3: 1}), the defaults (docs/server.md, "Depth")
    assert by_loops["None"]["relative_compute"] == pytest.approx(1.0)
    assert by_loops["0"]["relative_compute"] < by_loops["1"]["relative_compute"] < 1.0 < by_loops["3"]["relative_compute"]


@pytest.mark.parametrize("name", ["itt-gqa", "itt-mha"])
@pytest.mark.slow
def test_itt_mixed_batch_equals_reference(ckpts, name):
    llm, prompts, depths, outputs = _run_mixed(ckpts[name], ITT_DEPTHS)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    stats = check_against_reference(ckpts[name], prompts, depths, outputs, routed=True)
    print(name, "preemptions", engine.scheduler.num_preemptions, stats)
    assert stats["within_delta"] <= 0.01 * stats["decisions"]
    assert engine.block_manager.num_used_pages == 0
    for depth, out in zip(depths, outputs):
        report = out.depth.to_dict()
        ratios = report["selection_ratios"]
        enabled = {f"{layer}:{t}" for layer in (1, 3) for t in (1, 2) if ratios[t - 1] > 0}
        assert set(report["selected_tokens"]) == enabled  # "layer:step" -> count, enabled steps only
        for key, count in report["selected_tokens"].items():
            if ratios[int(key[-1]) - 1] == 1.0:
                assert count == report["tokens"]
        if depth is None:  # the defaults (docs/server.md, "Depth")
            assert report["relative_compute"] == pytest.approx(1.0)
        if not enabled:
            assert report["relative_compute"] < 1.0


def test_sgt_outputs_are_the_same_alone_and_from_the_prefix_cache(ckpts):
    path = ckpts["sgt-gqa"]
    llm = tiny_llm(path)
    prompt = _prompts()[-1]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    first = llm.generate([prompt], params, DepthParams(loops=2))[0]
    again = llm.generate([prompt], params, DepthParams(loops=2))[0]
    other = llm.generate([prompt], params, DepthParams(loops=1))[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    assert other.num_cached_tokens == 0, "a prefix cached under other depth settings must not be reused"
    for a, b in zip(first.logprobs, again.logprobs):
        for token in a:
            assert abs(a[token].logprob - b[token].logprob) < TOL


@pytest.mark.parametrize("name", ["sgt-gqa", "sgt-mha"])
def test_loop_slot_bytes_grow_by_the_stored_heads(ckpts, name):
    from depthserve.archs import read_depth_spec

    llm = tiny_llm(ckpts[name])
    engine = llm.engine
    cfg = engine.model.config
    spec = read_depth_spec(engine.hf_config)
    page_bytes = ModelRunner.page_bytes(8, cfg.head_dim, torch.float32)
    prompt = _prompts()[5]  # 40 tokens: 5 blocks of 8
    blocks = -(-len(prompt) // 8)
    layer_bytes = blocks * cfg.num_kv_heads * page_bytes  # one dense layer's cache for this request

    def held(depth: DepthParams) -> tuple[int, int]:
        engine.add_request("probe", prompt, SamplingParams(max_tokens=4, ignore_eos=True), depth)
        engine.step()  # the prompt in one chunk; the request keeps its pages while it decodes
        seq = engine._requests["probe"].seqs[0]
        total = engine.block_manager.pages_held(seq) * page_bytes
        subset = engine.stats()["kv_bytes_used_by_kind"].get("head_subset", 0)
        engine.abort_request("probe")
        return total, subset

    base, base_subset = held(DepthParams(loops=0))
    assert base == cfg.num_layers * layer_bytes and base_subset == 0
    group = cfg.num_heads // cfg.num_kv_heads
    for s in spec.layers:
        stored = len({h // group for h in s.heads})
        previous = base
        for k in (1, 2, 3):
            total, subset = held(DepthParams(loops={s.layer: k, **{o.layer: 0 for o in spec.layers if o is not s}}))
            # Each iteration adds exactly (KV heads stored) / (KV heads of the layer) of a layer's cache.
            assert total - previous == layer_bytes * stored // cfg.num_kv_heads
            assert subset == k * layer_bytes * stored // cfg.num_kv_heads
            previous = total
    assert engine.block_manager.num_used_pages == 0


def test_costly_requests_are_admitted_first_come_first_served(ckpts):
    """A loops=3 request needs more pages; it waits for them without being overtaken by cheaper ones."""
    path = ckpts["sgt-gqa"]
    prompts = _prompts()
    cheap, costly = DepthParams(loops=0), DepthParams(loops=3)
    order = [("a", prompts[9], cheap), ("b", prompts[11], costly), ("c", prompts[1], cheap), ("d", prompts[2], cheap)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    probe = tiny_llm(path, max_model_len=160)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = {rid: bm.pages_for(cache_layout(model, d), len(p) + params.max_tokens) for rid, p, d in order}
    assert need["b"] > 3 * need["a"]  # the scheduler prices depth: loops=3 costs more pages
    pages = need["b"] + 16  # b fits alone, not beside a; c and d would fit beside a
    assert need["a"] + need["b"] > pages and need["a"] + need["c"] + need["d"] < pages
    engine = tiny_llm(path, pages=pages, max_model_len=160, max_num_batched_tokens=512).engine
    for rid, prompt, depth in order:
        engine.add_request(rid, prompt, params, depth)
    admitted: dict[str, int] = {}
    finished: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = step
        for seq in engine.scheduler.running:
            admitted.setdefault(seq.request_id, step)
    assert list(admitted) == ["a", "b", "c", "d"], admitted
    assert admitted["b"] > finished["a"]  # b waited for a's pages ...
    assert admitted["c"] >= admitted["b"] and admitted["d"] >= admitted["b"]  # ... and nobody overtook it
    assert engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize(
    "name, depth, match",
    [
        ("sgt-gqa", {"loops": 4}, "0..3"),
        ("sgt-gqa", {"loops": -1}, "0..3"),
        ("sgt-gqa", {"loops": {"7": 1}}, "not one of its layers"),
        ("sgt-gqa", {"loops": 1.5}, "integer"),
        ("sgt-gqa", {"loops": True}, "integer"),
        ("sgt-gqa", {"selection_ratios": [0.5, 0.5]}, "not supported"),
        ("itt-gqa", {"selection_ratios": [0.5]}, "exactly 2 values"),
        ("itt-gqa", {"selection_ratios": [1.2, 0.3]}, r"\[0, 1\]"),
        ("itt-gqa", {"selection_ratios": [-0.1, 0.3]}, r"\[0, 1\]"),
        ("itt-gqa", {"selection_ratios": "half"}, "list of numbers"),
        ("itt-gqa", {"thinking_steps": 3}, "parameters for 2, no more"),
        ("itt-gqa", {"loops": 1}, "not supported"),
        ("itt-gqa", {"depth": 2}, "not supported"),
    ],
)
def test_invalid_depth_settings_raise_and_leave_no_blocks(ckpts, name, depth, match):
    llm = _engines(ckpts, name)
    with pytest.raises(InvalidDepthError, match=match):
        llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2), [DepthParams(), DepthParams.from_dict(depth)])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_pages == 0


_ENGINES: dict[str, LLM] = {}


def _engines(ckpts, name) -> LLM:
    if name not in _ENGINES:
        _ENGINES[name] = tiny_llm(ckpts[name])
    return _ENGINES[name]


def test_itt_decisions_are_the_same_in_the_prompt_and_when_generated(ckpts):
    path = ckpts["itt-gqa"]
    llm = tiny_llm(path, max_num_batched_tokens=16)
    prompt = _prompts()[6]
    depth = DepthParams(selection_ratios=[0.7, 0.3])
    generated = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), depth)[0]
    tokens = prompt + generated.token_ids[:-1]
    as_prompt = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), depth)[0]
    _, decisions = reference.forward(path, tokens, depth, return_decisions=True)
    decode = generated.depth.decisions
    prefill = as_prompt.depth.decisions
    for key, ref in decisions.items():
        confident = ref["margin"] > DELTA
        assert np.array_equal(decode[key][: len(tokens)][confident], prefill[key][: len(tokens)][confident]), key
    fractions = generated.depth.fractions["decode_selected_fraction"]
    assert set(fractions) == {"1:1", "1:2", "3:1", "3:2"} and all(f is not None for f in fractions.values())
