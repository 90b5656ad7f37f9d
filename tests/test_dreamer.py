"""Dreamer (docs/depth-semantics.md section 3) in the engine and its reference.

Incremental = recompute: mixed batches (different prompt lengths and `depth` per request) run with
chunked prefill, forced preemption and prefix caching on; expert choices (EA top-k and the top-1
attention expert) must equal the float64 reference's wherever the margin exceeds DELTA, and every
generated token's logprobs must match the reference run on the engine's own choices within 1e-4
(fp32), greedy tokens being the reference's argmax. Also: the per-token depth cache's size and
lifetime, depth validation, and the format / make-tiny / reference basics.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from depthserve import LLM, DepthParams, SamplingParams, reference
from depthserve.cache import SlotKind
from depthserve.engine.model_runner import ModelRunner
from depthserve.archs import read_depth_spec
from depthserve.archs.dreamer import format as dreamer
from depthserve.errors import CacheCapacityError, CheckpointFormatError, InvalidDepthError
from depthserve.lab.make_tiny import make_tiny, synthetic_streams
from depthserve.layers import experts as experts_layer
from tests.depth_helpers import cache_layout, check_logprobs, depth_params, stream_prompts, tiny_llm

TOL = 1e-4
DELTA = 1e-4
NEAR_TIE = 1e-4
D = 4
LENGTHS = [3, 9, 17, 24, 33, 40, 51, 64, 70, 85, 97, 6, 20]
DEPTHS = [{"depth": 1}, {"depth": 2}, {"depth": 3}, {"depth": 4}, {"depth": 4}, None, {"depth": 2},
          {"depth": 4}, {"depth": 1}, {"depth": 3}, None, {"depth": 2}, {"depth": 1}]
VARIANTS = {  # name -> (make_tiny options, KV heads)
    "dense-depthrope": (dict(attn_experts=0, da_rope="depth"), 2),
    "experts-reversed": (dict(attn_experts=3, da_rope="reversed_half"), 2),
    "experts-depthrope-mha": (dict(attn_experts=2, da_rope="depth"), 4),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("dreamer")
    return {name: make_tiny("dreamer", root / name, seed=5, num_kv_heads=kv, tokenizer=smollm_tokenizer, **opts)
            for name, (opts, kv) in VARIANTS.items()}


def _prompts() -> list[list[int]]:
    prompts = stream_prompts(LENGTHS, seed=31)
    prompts[4] = prompts[7][:33]  # shares a 4-block prefix with request 7 (both at depth 4)
    prompts[3] = prompts[7][:24]
    return prompts


def check_against_reference(path, prompts, depths, outputs) -> dict:
    """Each request against the reference: at its knob, or with a depth range on the schedule it
    reports (section 6); expert choices equal where the margin exceeds DELTA, then logprobs
    teacher-forced on the engine's choices."""
    stats = {"tokens": 0, "decisions": 0, "within_delta": 0, "max_err": 0.0}
    for prompt, depth, out in zip(prompts, depths, outputs):
        tokens = prompt + out.token_ids[:-1]
        n = len(tokens)
        record = out.depth.decisions
        per_token = out.depth.per_token
        schedule = None if per_token is None else [{"depth": d} for d in per_token]
        used = out.depth.settings["depth"] if per_token is None else max(per_token)
        _, decisions = reference.forward(path, tokens, depth, return_decisions=True, schedule=schedule)
        assert {key[1] for key in decisions} == set(range(used))
        assert (record["ea"][:n, used:] == -1).all() and (record["attn"][:n, used:] == -1).all()
        force = {}
        for (kind, d), ref in decisions.items():
            mine = record[kind][:n, d]
            if kind == "ea":
                mine = np.sort(mine, axis=-1)
            # Positions served from the prefix cache were computed for another request: no record
            # (a position that did not run depth d has none either, nor does the reference).
            computed = ((mine >= 0) | (ref["choice"] < 0)).reshape(n, -1).all(-1)
            assert computed[out.num_cached_tokens:].all(), f"{kind}{d}: a computed position has no record"
            mine = np.where(computed.reshape((n,) + (1,) * (mine.ndim - 1)), mine, ref["choice"])
            same = (mine == ref["choice"]).reshape(n, -1).all(-1)
            confident = ref["margin"] > DELTA
            stats["decisions"] += n
            stats["within_delta"] += int((~confident).sum())
            bad = np.flatnonzero(~same & confident)
            assert not len(bad), f"{kind} at depth {d}: choices differ at {bad} (margins {ref['margin'][bad]})"
            force[(kind, d)] = mine
        logprobs = torch.log_softmax(reference.forward(path, tokens, depth, force=force, schedule=schedule), dim=-1)
        check_logprobs(logprobs, len(prompt), out.outputs[0], stats, tol=TOL, near_tie=NEAR_TIE,
                       prompt_logprobs=out.prompt_logprobs)
    return stats


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.slow
def test_mixed_depth_batch_equals_reference(ckpts, name):
    path = ckpts[name]
    prompts = _prompts()
    depths = [depth_params(d) for d in DEPTHS]
    per_request = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2,
                                  prompt_logprobs=1 if i % 4 == 2 else None) for i in range(len(prompts))]
    probe = tiny_llm(path)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = [bm.pages_for(cache_layout(model, d), len(p) + 10) for p, d in zip(prompts, depths)]
    pages = max(need) + 4
    assert sum(need) > 3 * pages
    # plus what the engine sets aside for a 32-token step's depth cache
    depth_cache_pages = -(-model.step_cache_bytes_bound(32) // ModelRunner.page_bytes(8, 16, torch.float32))
    llm = tiny_llm(path, pages=pages + depth_cache_pages, max_model_len=112, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, per_request, depths)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert engine.block_manager.prefix_hits > 0, "requests 3, 4 and 7 share a prefix and depth"
    stats = check_against_reference(path, prompts, depths, outputs)
    print(name, "preemptions", engine.scheduler.num_preemptions, "prefix hits", engine.block_manager.prefix_hits,
          stats)
    assert stats["within_delta"] <= 0.01 * stats["decisions"]
    assert engine.block_manager.num_used_pages == 0
    assert engine.model.token_depth_live_values == 0
    for d, out in zip(depths, outputs):
        report = out.depth.to_dict()
        assert report["depth"] == d.get("depth", D) and report["trained_depth"] == D
        assert report["tokens"] == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        assert (report["relative_compute"] == 1.0) == (report["depth"] == D)
        assert (report["relative_compute"] < 1.0) == (report["depth"] < D)
    model = engine.model
    flops = [dreamer.depth_flops(model.config, model.spec, 100, n, 10) for n in range(1, D + 1)]
    assert flops == sorted(flops) and len(set(flops)) == D


def test_depth_cache_is_per_token_constant_size_and_released(ckpts):
    path = ckpts["experts-reversed"]
    llm = tiny_llm(path, max_num_batched_tokens=24)
    engine, model = llm.engine, llm.engine.model
    spec = model.spec
    per_token = D * 2 * spec.da_dim  # the bound: tokens x D x 2 x d_DA values
    size = torch.empty((), dtype=torch.float32).element_size()
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(requests) -> list[tuple[int, int, int]]:
        model.token_depth_steps.clear()
        for rid, prompt, depth in requests:
            engine.add_request(rid, prompt, params, DepthParams(depth=depth))
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.stats()
            assert model.token_depth_live_values == 0  # released between steps
            assert stats["step_cache_bytes_by_kind"] == {"token_depth": 0}
            tokens, max_depth, peak = model.token_depth_steps[-1]
            assert stats["last_step_cache_bytes_by_kind"] == {"token_depth": peak * size}
        assert engine.block_manager.num_used_pages == 0 and model.token_depth_live_values == 0
        return list(model.token_depth_steps)

    steps = run([("a", prompts[10], 4), ("b", prompts[1], 2), ("c", prompts[8], 1)])
    assert any(tokens > 1 for tokens, _, _ in steps) and any(tokens == 3 for tokens, _, _ in steps)
    for tokens, max_depth, peak in steps:
        assert peak <= tokens * per_token  # never above tokens x D x 2 x d_DA
        assert peak == tokens * max_depth * 2 * spec.da_dim
        assert tokens <= 24  # a prefill chunk's cache is bounded by the chunk
    # Independent of the sequence length: one request decoding at position ~8 or ~97 holds the same.
    short = run([("s", prompts[1], 3)])
    long = run([("l", prompts[10], 3)])
    assert short[-5:] == long[-5:] == [(1, 3, 3 * 2 * spec.da_dim)] * 5  # the 5 decode steps
    # The paged cache, by contrast, holds `depth` dense slots per request.
    page_bytes = ModelRunner.page_bytes(8, 16, torch.float32)
    held = {}
    for depth in (1, 2, 4):
        engine.add_request("p", prompts[5], SamplingParams(max_tokens=3, ignore_eos=True), DepthParams(depth=depth))
        engine.step()
        seq = engine._requests["p"].seqs[0]
        held[depth] = engine.block_manager.pages_held(seq)
        assert engine.stats()["kv_bytes_used_by_kind"] == {"dense": held[depth] * page_bytes}
        engine.abort_request("p")
    blocks = -(-min(len(prompts[5]), 24) // 8)  # the first chunk: 24 tokens (the step budget)
    assert held == {n: n * blocks * model.config.num_kv_heads for n in (1, 2, 4)}
    assert engine.block_manager.num_used_pages == 0


def test_step_depth_cache_is_set_aside_from_the_cache_memory(ckpts):
    """The worst case of a full step's depth cache comes out of the cache memory before the
    page pool is sized, and every step's peak stays within it."""
    path = ckpts["dense-depthrope"]
    page_bytes = ModelRunner.page_bytes(8, 16, torch.float32)
    llm = tiny_llm(path, pages=400, max_num_batched_tokens=24)
    engine, model = llm.engine, llm.engine.model
    reserved = 24 * D * 2 * model.spec.da_dim * 4  # tokens x D x 2 x d_DA fp32 values
    assert engine.stats()["step_cache_reserved_bytes"] == reserved
    assert engine.block_manager.num_pages == (400 * page_bytes - reserved) // page_bytes
    llm.generate(_prompts()[:4], SamplingParams(max_tokens=4, ignore_eos=True))
    assert max(peak for _, _, peak in model.token_depth_steps) * 4 <= reserved
    with pytest.raises(CacheCapacityError, match="depth cache"):
        tiny_llm(path, pages=400, max_num_batched_tokens=100_000)


@pytest.mark.parametrize("depth, match", [
    ({"depth": 0}, "1..4"),
    ({"depth": 5}, "1..4"),
    ({"depth": 2.5}, "integer"),
    ({"depth": True}, "integer"),
    ({"depth": "2"}, "integer"),
    ({"loops": 1}, "not supported"),
    ({"thinking_steps": 1}, "not supported"),
])
def test_invalid_depth_raises_and_leaves_no_blocks(ckpts, depth, match):
    llm = _invalid_llm(ckpts)
    with pytest.raises(InvalidDepthError, match=match):
        llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2), [DepthParams(), DepthParams.from_dict(depth)])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_pages == 0
    knobs = llm.engine.model.depth_knobs()
    assert list(knobs) == ["depth"] and (knobs["depth"].minimum, knobs["depth"].maximum, knobs["depth"].default) == (1, D, D)


_LLMS: dict[str, LLM] = {}


def _invalid_llm(ckpts) -> LLM:
    if "x" not in _LLMS:
        _LLMS["x"] = tiny_llm(ckpts["dense-depthrope"])
    return _LLMS["x"]


def test_format_round_trip_and_make_tiny(ckpts, tmp_path, smollm_tokenizer):
    path = ckpts["experts-reversed"]
    cfg = json.loads((path / "config.json").read_text())
    spec = read_depth_spec(cfg)
    assert spec.architecture == "dreamer" and cfg["depth"]["architecture"] == "dreamer"
    assert (spec.depth, spec.attn_experts, spec.da_rope, spec.da_heads) == (D, 3, "reversed_half", 1)
    assert dreamer.to_section(spec) == cfg["depth"] and dreamer.read_spec(dreamer.to_section(spec), cfg) == spec
    # make-tiny's dispatch writes the default Dreamer checkpoint
    other = make_tiny("dreamer", tmp_path / "cli", seed=1, tokenizer=smollm_tokenizer)
    assert read_depth_spec(json.loads((other / "config.json").read_text())).architecture == "dreamer"
    assert (other / "tokenizer.json").is_file()
    # malformed sections and weights name the field
    for field, value, match in [("da_rope", "sideways", "da_rope"), ("top_k", 99, "top_k"), ("depth", 0, "depth"),
                                ("expert_rank", 7, "expert_rank"), ("attn_experts", -1, "attn_experts")]:
        bad = json.loads(json.dumps(cfg))
        bad["depth"]["dreamer"][field] = value
        with pytest.raises(CheckpointFormatError, match=match):
            read_depth_spec(bad)
    weights = {name: torch.zeros(shape) for name, shape in dreamer.tensor_shapes(cfg, spec).items()}
    dreamer.read_weights(cfg, spec, dict(weights))
    missing = dict(weights)
    missing.pop("model.block.ea.router.bias")
    with pytest.raises(CheckpointFormatError, match="ea.router.bias"):
        dreamer.read_weights(cfg, spec, missing)
    wrong = dict(weights, **{"model.block.da.q_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(CheckpointFormatError, match="da.q_proj"):
        dreamer.read_weights(cfg, spec, wrong)


def test_reference_basics(ckpts):
    ids = synthetic_streams(49152, 1, 48, seed=7)[0].tolist()
    for name, path in ckpts.items():
        logits = {n: reference.forward(path, ids, {"depth": n}) for n in range(1, D + 1)}
        torch.testing.assert_close(reference.forward(path, ids), logits[D], atol=0, rtol=0)  # default: D
        for a in range(1, D + 1):
            top2 = logits[a].topk(2, dim=-1).values
            assert float((top2[:, 0] - top2[:, 1]).median()) > 0.2  # peaked
            assert float(torch.softmax(logits[a], -1).max(-1).values.mean()) > 0.1
            for b in range(a + 1, D + 1):
                assert float((logits[a] - logits[b]).abs().max()) > 0.5, f"{name}: depth {a} == depth {b}"
        # causal: a prefix's logits do not depend on what follows
        torch.testing.assert_close(reference.forward(path, ids[:20], {"depth": 3}), logits[3][:20], atol=1e-9, rtol=0)
        # decisions carry margins; forcing the reference's own choices changes nothing
        _, decisions = reference.forward(path, ids, {"depth": 3}, return_decisions=True)
        kinds = {"ea"} | ({"attn"} if "experts" in name else set())
        assert set(decisions) == {(k, d) for k in kinds for d in range(3)}
        margins = np.concatenate([v["margin"] for v in decisions.values()])
        assert (margins >= 0).all() and float(np.median(margins)) > 0.05
        forced = reference.forward(path, ids, {"depth": 3}, force={k: v["choice"] for k, v in decisions.items()})
        torch.testing.assert_close(forced, logits[3], atol=0, rtol=0)
        # forcing other experts changes the logits
        experts = read_depth_spec(json.loads((path / "config.json").read_text())).num_experts
        shifted = (decisions[("ea", 1)]["choice"] + 1) % experts  # other (still distinct) experts
        changed = reference.forward(path, ids, {"depth": 3}, force={("ea", 1): shifted})
        assert float((changed - logits[3]).abs().max()) > 0.1


@pytest.mark.parametrize("form", ["looped", "padded", "static"])
def test_moe_never_loops_over_tokens(ckpts, monkeypatch, form):
    """Expert attention never loops over tokens: either one matmul per active expert on its tokens, or
    (decode-sized batches) all experts in one batched matmul on their tokens padded to the busiest
    expert's count, or at static shapes every expert on every token (no rows gathered). All equal each
    token run through its experts."""
    llm = _invalid_llm(ckpts)
    model = llm.engine.model
    h = torch.randn(37, model.config.hidden_size)
    padded = form == "padded"
    monkeypatch.setattr(experts_layer, "PADDED_EXPERTS_MAX_ROWS_PER_PAIR", 10**6 if form == "padded" else 0)
    monkeypatch.setattr(experts_layer, "PADDED_EXPERTS_MIN_ACTIVE_SHARE", 0.0)
    calls = []
    real = torch.Tensor.index_select

    def spy(self, dim, index):
        if self.shape[0] == 37 and dim == 0:
            calls.append(len(index))
        return real(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", spy)
    out, top = model.block.ea(h, 2, static_shapes=form == "static")
    monkeypatch.undo()
    active = torch.unique(top).numel()
    if form == "static":
        assert calls == []
    else:
        assert sum(calls) == 37 * model.spec.top_k and len(calls) == (1 if padded else active)
    # the same as every token run through its own experts
    hn = model.block.ea.norm(h)
    logits = model.block.ea.router(hn, 2)
    gates = torch.sigmoid(logits.gather(1, top))
    weights = gates / gates.sum(-1, keepdim=True)
    f = model.spec.expert_intermediate_size
    expected = torch.zeros_like(h)
    for i in range(37):
        for slot, e in enumerate(top[i].tolist()):
            gate, up = (hn[i] @ model.block.ea.gate_up[e].t()).split([f, f])
            expected[i] += weights[i, slot] * ((torch.nn.functional.silu(gate) * up) @ model.block.ea.down[e].t())
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert SlotKind.TOKEN_DEPTH.value == "token_depth"
