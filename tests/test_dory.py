"""Dory (docs/depth-semantics.md, "Public looped models: Dory"): the config and weights read as
transformers reads them, and the engine against transformers' DoryForCausalLM in fp32 (with
`n_recurrent_loops` = the request's `loops`): greedy tokens identical, logprobs within 1e-4, in
mixed batches of loop counts, with chunked prefill, preemption, prefix-cache hits and a sliding
window shorter than the prompts. The checkpoints are tiny ones saved by transformers itself."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from depthserve import DepthParams, SamplingParams
from depthserve.archs import read_depth_spec
from depthserve.archs.dory import format as dory_format
from depthserve.oracles import dory as dory_reference
from depthserve.lab.tiny.dory import make_tiny
from depthserve.errors import CheckpointFormatError, InvalidDepthError
from tests.depth_helpers import cache_layout, check_logprobs, tiny_llm
from tests.looped_serving import check_loops_served_with_the_openai_sdk

TOL = 1e-4
NEAR_TIE = 0.0  # greedy tokens must be the reference's argmax
WINDOW = 8  # the tiny checkpoints' sliding window: every prompt below is longer
VOCAB = 257  # the byte tokenizer's


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dory")
    per_loop = make_tiny(root / "per-loop", seed=3, loops=2, sliding_window=WINDOW)
    return {"per_loop": per_loop, "released": _released_copy(per_loop, root / "released")}


def _released_copy(path, out):
    """The same checkpoint in the layout released Dory checkpoints use: each decoder layer as an
    attention block `layers.{2i}.mixer` and an MLP block `layers.{2i+1}.mixer`, the rates as
    `attn_alpha` / `mlp_alpha` (transformers reads it through its conversion mapping)."""
    shutil.copytree(path, out)
    renamed = {}
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        parts = name.split(".")
        if parts[:2] == ["backbone", "layers"]:
            i, rest = int(parts[2]), parts[3:]
            if rest[0] in ("lambda_1", "lambda_2"):
                block, rest = (2 * i, ["attn_alpha"]) if rest[0] == "lambda_1" else (2 * i + 1, ["mlp_alpha"])
            else:
                block, rest = (2 * i if rest[0] == "self_attn" else 2 * i + 1), ["mixer", *rest[1:]]
            name = ".".join(["backbone", "layers", str(block), *rest])
        renamed[name] = tensor
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(path, prompt, depth, completion, stats, **reference_options):
    logits = dory_reference.forward(path, prompt + completion.token_ids[:-1], depth, prompt_len=len(prompt),
                                    **reference_options)
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


# ---- the config and the weights ----------------------------------------------------------------------
def _transformers_config(hf: dict):
    from transformers import DoryConfig

    return DoryConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "transformers_version")})


@pytest.mark.parametrize("layout", ["released", "per_layer"])
def test_config_reads_as_transformers_reads_it(ckpts, layout):
    hf = json.loads((ckpts["per_loop"] / "config.json").read_text())
    assert "mlp" in hf["layer_types"] and hf["num_hidden_layers"] == 12  # transformers saves the released layout
    if layout == "per_layer":  # one entry per decoder layer, as DoryConfig holds it in memory
        hf = {**hf, "layer_types": hf["layer_types"][::2], "num_hidden_layers": 6, "n_input_layers": 2,
              "n_recurrent_layers": 2, "n_output_layers": 2}
    ours, theirs = read_depth_spec(hf), _transformers_config(hf)
    assert ours.layer_types == tuple(theirs.layer_types) and ours.num_layers == theirs.num_hidden_layers == 6
    assert (ours.n_input_layers, ours.n_recurrent_layers, ours.n_output_layers) == (
        theirs.n_input_layers, theirs.n_recurrent_layers, theirs.n_output_layers) == (2, 2, 2)
    assert ours.rope_thetas == {t: p["rope_theta"] for t, p in theirs.rope_parameters.items()}
    assert (ours.sliding_window, ours.n_recurrent_loops, ours.recurrent_kv_cache_mode) == (WINDOW, 2, "per_loop")
    assert ours.max_loops == dory_format.MAX_LOOPS_FACTOR * 2


def test_defaults_are_transformers_defaults():
    """A config naming only what it must gets DoryConfig's defaults (layer types, rope thetas, counts)."""
    hf = {"model_type": "dory", "num_hidden_layers": 20}
    ours, theirs = read_depth_spec(hf), _transformers_config(hf)
    assert ours.layer_types == tuple(theirs.layer_types)
    assert ours.n_recurrent_layers == theirs.n_recurrent_layers == 4
    assert ours.rope_thetas == {t: p["rope_theta"] for t, p in theirs.rope_parameters.items()}
    assert (ours.head_dim, ours.sliding_window, ours.n_recurrent_loops) == (theirs.head_dim, theirs.sliding_window, 2)


@pytest.mark.parametrize("change, match", [
    ({"n_recurrent_layers": 20}, "must equal num_hidden_layers"),
    ({"recurrent_kv_cache_mode": "every_loop"}, "recurrent_kv_cache_mode"),
    ({"n_recurrent_loops": 0}, "n_recurrent_loops"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": ["full_attention", "mlp", "mlp"]}, "alternates"),
    ({"layer_types": ["local"] * 6, "num_hidden_layers": 6, "n_recurrent_layers": 2}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4}}}, "rope"),
    ({"depth": {"architecture": "dory"}}, "carries no `depth` section"),
])
def test_malformed_configs_are_refused(ckpts, change, match):
    hf = {**json.loads((ckpts["per_loop"] / "config.json").read_text()), **change}
    if "depth" in change:
        with pytest.raises(CheckpointFormatError, match=match):
            dory_format.read_spec(change["depth"], hf)
        return
    with pytest.raises(CheckpointFormatError, match=match):
        read_depth_spec(hf)


def test_weight_names_in_every_spelling():
    name = dory_format.parameter_name
    assert name("backbone.embeddings.weight") == name("model.embed_tokens.weight") == "embed_tokens.weight"
    assert name("backbone.layers.6.mixer.g_proj.weight") == "layers.3.self_attn.gate_proj.weight"
    assert name("backbone.layers.3.self_attn.g_proj.weight") == "layers.3.self_attn.gate_proj.weight"
    assert name("backbone.layers.7.mixer.suv_up") == name("model.layers.3.mlp.suv_up") == "layers.3.mlp.suv_up"
    assert name("backbone.layers.6.attn_alpha") == "layers.3.lambda_1"
    assert name("backbone.layers.7.mlp_alpha") == "layers.3.lambda_2"
    assert name("lm_head.logit_scale") == "lm_head.logit_scale"


def _dense_window_attention(q, keys, values, positions, window, scale):
    """Each query (at `positions`) over the keys at positions in (p - window, p], GQA by repetition."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    key_pos = torch.arange(keys.shape[0])
    out = []
    for query, p in zip(q, positions):
        visible = (key_pos <= p) & (key_pos > p - window)
        weights = torch.softmax(torch.einsum("hd,khd->hk", query, keys[visible]) * scale, dim=-1)
        out.append(torch.einsum("hk,khd->hd", weights, values[visible]))
    return torch.stack(out)


@pytest.mark.parametrize("window", [1, 5, 64])
def test_windowed_paged_attention_sees_the_last_window_keys(window):
    """The torch paged ops with a window, prefill chunks (at position 0 and later) and decode rows,
    against dense attention over the keys at positions p - window + 1 .. p."""
    from depthserve.kernels import paged

    gen = torch.Generator().manual_seed(window)
    block, kv_heads, heads, dim, length = 4, 2, 4, 8, 23
    blocks = -(-length // block)
    k_pages = torch.randn(kv_heads * blocks + 3, block, dim, generator=gen)
    v_pages = torch.randn(k_pages.shape, generator=gen)
    table = torch.randperm(k_pages.shape[0], generator=gen)[: kv_heads * blocks].view(kv_heads, blocks)
    keys = k_pages[table].permute(1, 2, 0, 3).reshape(blocks * block, kv_heads, dim)[:length]
    values = v_pages[table].permute(1, 2, 0, 3).reshape(blocks * block, kv_heads, dim)[:length]
    scale = dim**-0.5
    for start, end in ((0, 9), (9, 23)):
        q = torch.randn(end - start, heads, dim, generator=gen)
        got = paged.paged_prefill_attention_varlen(q, k_pages, v_pages, table[None], torch.tensor([0, end - start]),
                                                   torch.tensor([end]), scale, window)
        torch.testing.assert_close(got, _dense_window_attention(q, keys, values, range(start, end), window, scale))
    q = torch.randn(3, heads, dim, generator=gen)
    lens = torch.tensor([23, 7, 1])
    got = paged.paged_decode_attention(q, k_pages, v_pages, table[None].expand(3, -1, -1), lens, scale, window)
    expected = torch.cat([_dense_window_attention(q[i : i + 1], keys, values, [int(lens[i]) - 1], window, scale)
                          for i in range(3)])
    torch.testing.assert_close(got, expected)


def test_reference_is_peaked_and_loops_change_it(ckpts):
    path, ids = ckpts["per_loop"], _ids(40, seed=1)
    logits = {L: dory_reference.forward(path, ids, {"loops": L}) for L in (1, 2, 4)}
    torch.testing.assert_close(dory_reference.forward(path, ids), logits[2], rtol=0, atol=0)  # default: trained
    for lg in logits.values():
        top2 = lg.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).median()) > 0.5
    for a, b in ((1, 2), (2, 4)):
        assert (logits[a].argmax(-1) != logits[b].argmax(-1)).any()


# ---- the engine, per_loop ----------------------------------------------------------------------------
LENGTHS = [9, 23, 40, 17, 31, 12, 55, 26]
LOOPS = [1, 2, 4, None, 4, 1, 2, 4]


def test_mixed_loops_batch_equals_transformers_with_chunks_and_preemption(ckpts):
    path = ckpts["per_loop"]
    prompts = [_ids(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    depths = [DepthParams() if n is None else DepthParams(loops=n) for n in LOOPS]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    probe = tiny_llm(path)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = [bm.pages_for(cache_layout(model, d), len(p) + params.max_tokens) for p, d in zip(prompts, depths)]
    pages = max(need) + 6
    assert sum(need) > 2 * pages
    # A step budget of 13 tokens: prompts cut into uneven chunks across steps.
    engine = tiny_llm(path, pages=pages, max_model_len=80, max_num_batched_tokens=13).engine
    final = _run(engine, [(f"r{i}", p, params, d) for i, (p, d) in enumerate(zip(prompts, depths))])
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    stats = {"tokens": 0, "max_err": 0.0}
    for i, (prompt, depth) in enumerate(zip(prompts, depths)):
        out = final[f"r{i}"]
        _check(path, prompt, depth, out.outputs[0], stats)
        report = out.depth
        assert report.settings["loops"] == (LOOPS[i] or 2) and report.settings["trained_loops"] == 2
        assert report.counters["recurrent_layer_passes"] == report.tokens * report.settings["loops"] * 2
    print("dory per_loop mixed batch:", engine.scheduler.num_preemptions, "preemptions", stats)
    assert engine.block_manager.num_used_pages == 0


def test_cache_slots_grow_with_loops_in_per_loop_mode(ckpts):
    model = tiny_llm(ckpts["per_loop"]).engine.model
    for loops in (1, 2, 4):
        layout = cache_layout(model, DepthParams(loops=loops))
        assert len(layout.slots) == 4 + 2 * loops  # prelude and coda layers once, the recurrent ones per pass
        assert layout.base_width == 6 * model.config.num_kv_heads


def test_prefix_cache_hits_are_exact_and_keyed_by_loops(ckpts):
    path = ckpts["per_loop"]
    llm = tiny_llm(path)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    shared = _ids(33, seed=4)
    first = llm.generate([shared], params, DepthParams(loops=4))[0]
    hit = llm.generate([shared + _ids(5, seed=5)], params, DepthParams(loops=4))[0]
    other_loops = llm.generate([shared + _ids(5, seed=5)], params, DepthParams(loops=1))[0]
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens == 32 and other_loops.num_cached_tokens == 0
    stats = {"tokens": 0, "max_err": 0.0}
    _check(path, shared + _ids(5, seed=5), {"loops": 4}, hit.outputs[0], stats)
    _check(path, shared + _ids(5, seed=5), {"loops": 1}, other_loops.outputs[0], stats)
    assert llm.engine.block_manager.num_used_pages == 0


def test_released_layout_checkpoint_serves_the_same(ckpts):
    path = ckpts["released"]
    prompt = _ids(29, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    out = tiny_llm(path, max_num_batched_tokens=11).generate([prompt], params, DepthParams(loops=3))[0]
    stats = {"tokens": 0, "max_err": 0.0}
    _check(path, prompt, {"loops": 3}, out.outputs[0], stats)  # transformers reads the released names itself
    _check(ckpts["per_loop"], prompt, {"loops": 3}, out.outputs[0], stats)


def _with_biases(path, out):
    """The checkpoint with `attention_bias` and `mlp_bias` set and random biases on W_Q, W_K, W_V, W_O
    and the MLP's three projections (transformers' output gate W_G has none)."""
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "attention_bias": True, "mlp_bias": True}))
    weights = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(8)
    for name, tensor in list(weights.items()):
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "up_proj.weight",
                          "down_proj.weight")) or name.endswith("mlp.gate_proj.weight"):
            weights[name.removesuffix("weight") + "bias"] = torch.randn(tensor.shape[0], generator=generator) * 0.3
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_biased_projections_serve_the_same(ckpts, tmp_path):
    """W_Q, W_K, W_V and W_G run as one packed product, W_gate and W_up as another: with biases the
    packed bias holds W_G's rows as zeros."""
    path = _with_biases(ckpts["per_loop"], tmp_path / "biased")
    prompts = [_ids(21, seed=11), _ids(9, seed=12)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    loops = [1, 4]
    outputs = tiny_llm(path).generate(prompts, params, [DepthParams(loops=n) for n in loops])
    stats = {"tokens": 0, "max_err": 0.0}
    for prompt, n, out in zip(prompts, loops, outputs, strict=True):
        _check(path, prompt, {"loops": n}, out.outputs[0], stats)
    unbiased = tiny_llm(ckpts["per_loop"]).generate(prompts[:1], params, DepthParams(loops=1))[0]
    assert unbiased.outputs[0].token_ids != outputs[0].outputs[0].token_ids  # the biases mattered


def test_a_packed_projection_missing_a_shard_is_refused(ckpts, tmp_path):
    out = shutil.copytree(ckpts["per_loop"], tmp_path / "no-k")
    weights = load_file(str(out / "model.safetensors"))
    del weights[next(name for name in weights if name.endswith("layers.2.self_attn.k_proj.weight"))]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match=r"layers\.2\.self_attn\.qkvg_proj\.weight .*shards \[1\] are missing"):
        tiny_llm(out)


@pytest.mark.parametrize("depth, match", [
    ({"loops": 0}, "1..8"),
    ({"loops": 9}, "1..8"),
    ({"loops": 1.5}, "integer"),
    ({"loops": {"min": 0, "max": 2}}, "1..8"),
    ({"loops": {"min": 2, "max": 9}}, "1..8"),
    ({"loops": {"min": 3, "max": 2}}, "above its max"),
    ({"depth": 2}, "not supported"),
])
def test_invalid_loops_raise_and_leave_no_pages(ckpts, depth, match):
    llm = tiny_llm(ckpts["per_loop"])
    with pytest.raises(InvalidDepthError, match=match):
        llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2),
                     [DepthParams(), DepthParams.from_dict(depth)])
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_used_pages == 0
    knob = llm.engine.model.depth_knobs()["loops"]
    assert (knob.minimum, knob.maximum, knob.default) == (1, 8, 2)


# ---- the engine, last_loop ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def last_loop(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("dory-last") / "last-loop", seed=7, loops=2, cache_mode="last_loop",
                     sliding_window=WINDOW)


def test_last_loop_prompts_run_in_fixed_chunks_then_one_token_per_forward(last_loop):
    plan = tiny_llm(last_loop).engine.model.plan(DepthParams(loops=3))
    chunk = dory_format.LAST_LOOP_PREFILL_CHUNK
    assert plan.prefill_chunk == chunk == plan.layout.prefix_chunk and plan.layout.uses_prefix_cache
    assert [plan.forward_tokens(c, 70) for c in (0, 5, chunk, 2 * chunk, 70, 75)] == [
        chunk, chunk - 5, chunk, 70 - 2 * chunk, 1, 1]


def test_last_loop_slots_do_not_grow_with_loops(last_loop):
    model = tiny_llm(last_loop).engine.model
    layouts = [cache_layout(model, DepthParams(loops=n)) for n in (1, 2, 4, 8)]
    assert all(layout == layouts[0] for layout in layouts) and len(layouts[0].slots) == 6


def test_last_loop_equals_transformers_fed_the_same_chunks(last_loop):
    """Mixed loops, prompts of several chunks, a step budget below the chunk (a fixed chunk is never
    cut) and preemption: transformers is fed each prompt in the same chunks, then one token at a time."""
    path = last_loop
    # short prompts admitted in the first steps whose decodes outgrow the pool (their sliding slots
    # give pages back, their full slots grow), then a prompt of three chunks
    lengths, loops = [8, 12, 4, 10, 6, 70], [1, 4, None, 2, 1, 3]
    prompts = [_ids(n, seed=40 + i) for i, n in enumerate(lengths)]
    depths = [DepthParams() if n is None else DepthParams(loops=n) for n in loops]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    probe = tiny_llm(path)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = [bm.pages_for(cache_layout(model, d), len(p) + params.max_tokens) for p, d in zip(prompts, depths)]
    pages = max(need)
    engine = tiny_llm(path, pages=pages, max_model_len=96, max_num_batched_tokens=24).engine
    final = _run(engine, [(f"r{i}", p, params, d) for i, (p, d) in enumerate(zip(prompts, depths))])
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    stats = {"tokens": 0, "max_err": 0.0}
    chunk = dory_format.LAST_LOOP_PREFILL_CHUNK
    for i, (prompt, depth) in enumerate(zip(prompts, depths)):
        _check(path, prompt, depth, final[f"r{i}"].outputs[0], stats, prefill_chunk=chunk)
    print("dory last_loop mixed batch:", engine.scheduler.num_preemptions, "preemptions", stats)
    assert engine.block_manager.num_used_pages == 0


def test_last_loop_without_chunked_prefill_runs_each_prompt_in_one_forward(last_loop):
    prompts = [_ids(n, seed=50 + n) for n in (45, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    llm = tiny_llm(last_loop, enable_chunked_prefill=False, max_model_len=64, max_num_batched_tokens=64)
    assert llm.engine.model.plan(DepthParams()).forward_tokens(0, 45, chunked=False) == 45
    stats = {"tokens": 0, "max_err": 0.0}
    for prompt, out in zip(prompts, llm.generate(prompts, params, DepthParams(loops=3))):
        _check(last_loop, prompt, {"loops": 3}, out.outputs[0], stats, prefill_chunk=len(prompt))
    assert llm.engine.block_manager.num_used_pages == 0


def test_last_loop_results_depend_on_the_split(last_loop):
    """The reason for the fixed chunks: the same tokens fed in other forwards give other logits."""
    ids = _ids(40, seed=8)
    whole = dory_reference.forward(last_loop, ids, {"loops": 3}, prompt_len=40, prefill_chunk=40)
    chunked = dory_reference.forward(last_loop, ids, {"loops": 3}, prompt_len=40, prefill_chunk=16)
    assert torch.equal(whole[:16], chunked[:16]) and float((whole[16:] - chunked[16:]).abs().max()) > 1e-3


def test_last_loop_prefix_hits_are_whole_prompt_chunks_and_exact(last_loop):
    """A hit reuses whole prompt chunks only: a follow-up turn (the first request's prompt, its output,
    more) finds the first prompt's two whole chunks, not its partial third chunk nor the tokens decoded
    one per forward (which fill four chunks' worth of blocks); the logprobs equal transformers fed
    the follow-up in chunks counted from its first token. Other loops, or chunked prefill off, hit nothing."""
    chunk = dory_format.LAST_LOOP_PREFILL_CHUNK
    llm = tiny_llm(last_loop)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    first_prompt = _ids(2 * chunk + 10, seed=60)
    first = llm.generate([first_prompt], params, DepthParams(loops=3))[0]
    follow_up = first_prompt + first.outputs[0].token_ids + _ids(7, seed=61)
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    hit = llm.generate([follow_up], short, DepthParams(loops=3))[0]
    other_loops = llm.generate([follow_up], short, DepthParams(loops=2))[0]
    assert first.num_cached_tokens == 0 and other_loops.num_cached_tokens == 0
    assert hit.num_cached_tokens == 2 * chunk
    stats = {"tokens": 0, "max_err": 0.0}
    _check(last_loop, first_prompt, {"loops": 3}, first.outputs[0], stats, prefill_chunk=chunk)
    _check(last_loop, follow_up, {"loops": 3}, hit.outputs[0], stats, prefill_chunk=chunk)
    _check(last_loop, follow_up, {"loops": 2}, other_loops.outputs[0], stats, prefill_chunk=chunk)
    assert llm.engine.block_manager.num_used_pages == 0

    one_forward = tiny_llm(last_loop, enable_chunked_prefill=False, max_model_len=128, max_num_batched_tokens=128)
    exact_chunk = one_forward.generate([first_prompt[:chunk]], short, DepthParams(loops=3))[0]
    longer = one_forward.generate([first_prompt], short, DepthParams(loops=3))[0]
    assert exact_chunk.num_cached_tokens == 0 and longer.num_cached_tokens == 0
    _check(last_loop, first_prompt, {"loops": 3}, longer.outputs[0], stats, prefill_chunk=len(first_prompt))
    print("dory last_loop prefix hits:", stats)


def _windowed_pages(engine, seq) -> int:
    """Pages the sequence holds in its sliding layers' slots."""
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


@pytest.mark.parametrize("mode", ["per_loop", "last_loop"])
def test_sliding_window_pages_go_back_during_long_generations(ckpts, last_loop, mode):
    """Two sequences decode 60 tokens side by side (window 8, block 8): each sliding slot holds at most
    ceil((window + block) / block) + 1 blocks while the full slots grow, the pages given back are
    taken by the other sequence at once, and the tokens and logprobs still equal transformers. per_loop
    runs with prefix caching off (its cached rows keep their pages); last_loop registers none of these
    rows (prompts shorter than a chunk, decoded tokens)."""
    path = ckpts["per_loop"] if mode == "per_loop" else last_loop
    engine = tiny_llm(path, enable_prefix_caching=mode == "last_loop").engine
    block = engine.block_manager.block_size
    prompts = [_ids(n, seed=70 + n) for n in (12, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w{i}", prompt, params, DepthParams(loops=3))
    sliding_slots = 3 if mode == "last_loop" else 3 + 2  # per_loop: the sliding recurrent layer per pass
    heads = engine.model.config.num_kv_heads
    bound = (-(-(WINDOW + block) // block) + 1) * sliding_slots * heads
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
    chunk = dory_format.LAST_LOOP_PREFILL_CHUNK if mode == "last_loop" else None
    for i, prompt in enumerate(prompts):
        _check(path, prompt, {"loops": 3}, final[f"w{i}"].outputs[0], stats, prefill_chunk=chunk)
    print(f"dory {mode} sliding pages: at most {most} of {bound}", stats)
    assert engine.block_manager.num_used_pages == 0


# ---- over HTTP -------------------------------------------------------------------------------------
@pytest.mark.slow  # ~35 s on the shared 2-core machine (a server, SmolLM2's 49152-token vocabulary)
def test_served_over_http_with_the_openai_sdk(tmp_path, smollm_tokenizer):
    """Completions, chat and streams equal offline generation at each `loops`; the knob changes the
    tokens and the bill (usage.depth); GET /v1/models lists its range and default; a value outside
    1..max_loops is a 400 naming the range."""
    path = make_tiny(tmp_path / "dory-chat", seed=2, loops=2, sliding_window=WINDOW, tokenizer=smollm_tokenizer)
    check_loops_served_with_the_openai_sdk(path, (1, 4), (1, 8), default=2)
