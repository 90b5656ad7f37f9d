"""HRM-Text (docs/depth-semantics.md, "Public looped models: HRM-Text"): the config and weights read
as transformers reads them, and the engine against transformers' HrmTextForCausalLM in fp32 (with
`H_cycles`, `L_cycles` = the request's `h_cycles`, `l_cycles`, and with prefix-LM the prompt marked
as the bidirectional block): greedy tokens identical, logprobs within 1e-4, in mixed batches of
cycle settings and attention modes, with chunked prefill, preemption and prefix caching where it is
exact. The checkpoints are tiny ones saved by transformers itself."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from depthserve import DepthParams, SamplingParams
from depthserve.archs import read_depth_spec
from depthserve.archs.hrm_text import format as hrm_format
from depthserve.oracles import hrm_text as hrm_reference
from depthserve.lab.tiny.hrm_text import LAYERS_PER_STACK, make_tiny
from depthserve.errors import CheckpointFormatError, InvalidDepthError
from tests.depth_helpers import cache_layout, check_logprobs, tiny_llm

TOL = 1e-4
NEAR_TIE = 0.0  # greedy tokens must be the reference's argmax
VOCAB = 257  # the byte tokenizer's


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("hrm") / "hrm", seed=3, h_cycles=2, l_cycles=2)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(path, prompt, depth, completion, stats):
    logits = hrm_reference.forward(path, prompt + completion.token_ids[:-1], depth, prompt_len=len(prompt))
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
    from transformers import HrmTextConfig

    return HrmTextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "transformers_version")})


def test_config_reads_as_transformers_reads_it(ckpt):
    hf = json.loads((ckpt / "config.json").read_text())
    assert hf["num_hidden_layers"] == LAYERS_PER_STACK * 2 * 3  # saved inflated: one per attention invocation
    ours, theirs = read_depth_spec(hf), _transformers_config(hf)
    assert ours.layers_per_stack == theirs.num_layers_per_stack == LAYERS_PER_STACK
    assert (ours.h_cycles, ours.l_cycles) == (theirs.H_cycles, theirs.L_cycles) == (2, 2)
    assert ours.embedding_scale == theirs.embedding_scale == 1 / theirs.initializer_range
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.prefix_lm is theirs.prefix_lm is True
    assert (ours.max_h_cycles, ours.max_l_cycles) == (2 * hrm_format.MAX_CYCLES_FACTOR, 2 * hrm_format.MAX_CYCLES_FACTOR)


def test_a_config_without_the_per_stack_count_carries_it_in_num_hidden_layers():
    """As transformers' __post_init__ reads a config naming only num_hidden_layers (the defaults of
    HrmTextConfig for everything else)."""
    hf = {"model_type": "hrm_text", "num_hidden_layers": 4, "H_cycles": 3, "L_cycles": 1}
    ours, theirs = read_depth_spec(hf), _transformers_config(hf)
    assert ours.layers_per_stack == theirs.num_layers_per_stack == 4
    assert (ours.hidden_size, ours.num_heads, ours.head_dim) == (theirs.hidden_size, theirs.num_attention_heads,
                                                                 theirs.head_dim)
    assert ours.embedding_scale == theirs.embedding_scale and ours.prefix_lm is theirs.prefix_lm


@pytest.mark.parametrize("change, match", [
    ({"H_cycles": 0}, "H_cycles"),
    ({"L_cycles": "3"}, "L_cycles"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_size": 66}, "multiple"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
    ({"prefix_lm": 1}, "prefix_lm"),
    ({"depth": {"architecture": "hrm_text"}}, "carries no `depth` section"),
])
def test_malformed_configs_are_refused(ckpt, change, match):
    hf = {**json.loads((ckpt / "config.json").read_text()), **change}
    with pytest.raises(CheckpointFormatError, match=match):
        if "depth" in change:
            hrm_format.read_spec(change["depth"], hf)
        else:
            read_depth_spec(hf)


def test_weight_names_in_both_spellings():
    name, part = hrm_format.parameter_name, hrm_format.split_part
    assert name("model.L_module.layers.1.attn.gqkv_proj.weight") == "L_module.layers.1.attn.gqkv_proj.weight"
    assert name("model.H_module.layers.0.self_attn.k_proj.weight") == "H_module.layers.0.attn.gqkv_proj.weight"
    assert [part(f"model.L_module.layers.0.self_attn.{p}_proj.weight") for p in ("gate", "q", "k", "v")] == [0, 1, 2, 3]
    assert name("model.L_module.layers.0.mlp.up_proj.weight") == "L_module.layers.0.mlp.gate_up_proj.weight"
    assert part("model.L_module.layers.0.mlp.up_proj.weight") == 1
    assert name("model.H_module.layers.0.self_attn.o_proj.weight") == "H_module.layers.0.attn.o_proj.weight"
    assert part("model.z_L_init") is None and name("model.z_L_init") == "z_L_init"


def _split_copy(path, out):
    """The same checkpoint with every fused projection saved as transformers' modules hold it."""
    shutil.copytree(path, out)
    tensors = {}
    for key, tensor in load_file(str(path / "model.safetensors")).items():
        for fused, parts in hrm_format.FUSED_PARTS.items():
            if f".{fused}." in key:
                for piece, split in zip(tensor.chunk(len(parts)), parts):
                    tensors[key.replace(fused, split)] = piece.contiguous()
                break
        else:
            tensors[key] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_split_projections_load_as_the_fused_ones(ckpt, tmp_path):
    prompt = _ids(21, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    fused = tiny_llm(ckpt).generate([prompt], params)[0]
    split = tiny_llm(_split_copy(ckpt, tmp_path / "split")).generate([prompt], params)[0]
    assert split.outputs[0].token_ids == fused.outputs[0].token_ids
    _check(ckpt, prompt, None, split.outputs[0], {})


def test_reference_is_peaked_and_every_knob_changes_it(ckpt):
    ids = _ids(30, seed=1)
    settings = [(2, 2, 1), (1, 2, 1), (2, 4, 1), (3, 1, 1), (2, 2, 0)]
    logits = {s: hrm_reference.forward(ckpt, ids, {"h_cycles": s[0], "l_cycles": s[1], "prefix_lm": s[2]},
                                       prompt_len=20) for s in settings}
    torch.testing.assert_close(hrm_reference.forward(ckpt, ids, prompt_len=20), logits[(2, 2, 1)], rtol=0, atol=0)
    for lg in logits.values():
        top2 = lg.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).median()) > 0.5
    for other in settings[1:]:
        assert (logits[(2, 2, 1)].argmax(-1) != logits[other].argmax(-1)).any(), other
    # prefix-LM reaches the prompt's rows only: the causal rows after it differ through their keys
    assert float((logits[(2, 2, 1)][:20] - logits[(2, 2, 0)][:20]).abs().max()) > 1e-2


# ---- the engine -----------------------------------------------------------------------------------------
LENGTHS = [9, 23, 40, 17, 31, 12, 55, 26]
SETTINGS = [None, {"h_cycles": 1, "l_cycles": 3}, {"h_cycles": 3, "l_cycles": 1}, {"prefix_lm": 0},
            {"h_cycles": 3, "l_cycles": 1, "prefix_lm": 0}, {"h_cycles": 1, "l_cycles": 1}, None,
            {"h_cycles": 1, "l_cycles": 3, "prefix_lm": 0}]


@pytest.mark.parametrize("chunked", [True, False])
def test_mixed_settings_batch_equals_transformers_with_chunks_and_preemption(ckpt, chunked):
    """Cycle settings and both attention modes in one batch, a step budget of 13 tokens (causal
    prompts cut into uneven chunks; a bidirectional prompt is one forward however long) and a KV
    budget that forces preemption (a preempted bidirectional request resumes from its own cached
    blocks: the prompt tokens they leave run in one forward over the cached keys)."""
    prompts = [_ids(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    depths = [DepthParams.from_dict(s) for s in SETTINGS]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    probe = tiny_llm(ckpt)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = [bm.pages_for(cache_layout(model, d), len(p) + params.max_tokens) for p, d in zip(prompts, depths)]
    pages = max(need) + 6
    assert sum(need) > 2 * pages
    engine = tiny_llm(ckpt, pages=pages, max_model_len=72, max_num_batched_tokens=13 if chunked else 72,
                      enable_chunked_prefill=chunked).engine
    final = _run(engine, [(f"r{i}", p, params, d) for i, (p, d) in enumerate(zip(prompts, depths))])
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    stats = {"tokens": 0, "max_err": 0.0}
    for i, (prompt, setting) in enumerate(zip(prompts, SETTINGS)):
        out = final[f"r{i}"]
        _check(ckpt, prompt, setting, out.outputs[0], stats)
        report, setting = out.depth, {"h_cycles": 2, "l_cycles": 2, "prefix_lm": 1, **(setting or {})}
        assert {k: report.settings[k] for k in setting} == setting
        assert report.counters["stack_invocations"] == report.tokens * setting["h_cycles"] * (setting["l_cycles"] + 1)
    print("hrm_text mixed batch:", engine.scheduler.num_preemptions, "preemptions", stats)
    assert engine.block_manager.num_used_pages == 0


def test_one_slot_per_attention_invocation(ckpt):
    model = tiny_llm(ckpt).engine.model
    for h, l in ((1, 1), (2, 2), (3, 1), (1, 4)):
        layout = cache_layout(model, DepthParams(h_cycles=h, l_cycles=l))
        assert len(layout.slots) == LAYERS_PER_STACK * h * (l + 1) == len({s.name for s in layout.slots})
        assert layout.base_width == 2 * LAYERS_PER_STACK * model.config.num_heads  # one high cycle, one low cycle


def test_a_bidirectional_prompt_is_one_forward(ckpt):
    model = tiny_llm(ckpt).engine.model
    bidirectional, causal = model.plan(DepthParams()), model.plan(DepthParams(prefix_lm=0))
    assert [bidirectional.forward_tokens(c, 70) for c in (0, 70, 75)] == [70, 1, 1]
    assert causal.forward_tokens(0, 70) is None and causal.layout.prefix_chunk is None


def test_prefix_cache_hits_are_exact_in_both_attention_modes(ckpt):
    """A causal request reuses the blocks of an earlier one with the same settings. A bidirectional
    prompt's keys depend on every prompt token, so its blocks are reused only by the same prompt
    (its last tokens then run in one forward over the cached keys and their own); a prompt that
    shares the cached blocks' tokens but not the whole prompt takes nothing. Every result equals
    transformers."""
    llm = tiny_llm(ckpt)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    shared, tail = _ids(33, seed=4), _ids(6, seed=5)
    causal = {"prefix_lm": 0, "h_cycles": 3}
    first = llm.generate([shared], params, DepthParams.from_dict(causal))[0]
    hit = llm.generate([shared + tail], params, DepthParams.from_dict(causal))[0]
    other_cycles = llm.generate([shared + tail], params, DepthParams(prefix_lm=0, h_cycles=2))[0]
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens == 32 and other_cycles.num_cached_tokens == 0
    bidirectional = {"h_cycles": 3, "l_cycles": 1}
    prompts = [shared + tail, shared + tail, shared + tail[:-1] + [tail[-1] % 200 + 1], shared]
    outs = [llm.generate([p], params, DepthParams.from_dict(bidirectional))[0] for p in prompts]
    assert [out.num_cached_tokens for out in outs] == [0, 32, 0, 0]  # the hit computes the last 7 prompt tokens
    stats = {"tokens": 0, "max_err": 0.0}
    _check(ckpt, shared + tail, causal, hit.outputs[0], stats)
    _check(ckpt, shared + tail, {"prefix_lm": 0, "h_cycles": 2}, other_cycles.outputs[0], stats)
    for prompt, out in zip(prompts, outs):
        _check(ckpt, prompt, bidirectional, out.outputs[0], stats)
    assert llm.engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("depth, match", [
    ({"h_cycles": 0}, "1..8"),
    ({"h_cycles": 9}, "1..8"),
    ({"l_cycles": 9}, "1..8"),
    ({"prefix_lm": 2}, "0..1"),
    ({"l_cycles": 1.5}, "integer"),
    ({"h_cycles": {"min": 1, "max": 2}}, "per-token depth ranges"),
    ({"loops": 2}, "not supported"),
])
def test_invalid_knobs_raise_and_leave_no_pages(ckpt, depth, match):
    llm = tiny_llm(ckpt)
    with pytest.raises(InvalidDepthError, match=match):
        llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2), [DepthParams(), DepthParams.from_dict(depth)])
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_used_pages == 0
    knobs = llm.engine.model.depth_knobs()
    assert [(k.minimum, k.maximum, k.default) for k in knobs.values()] == [(1, 8, 2), (1, 8, 2), (0, 1, 1)]


def test_parallel_samples_of_a_bidirectional_prompt_are_exact(ckpt):
    """n samples of one bidirectional prompt (a step budget below the prompt): every sample's
    logprobs equal transformers with that prompt as the instruction block."""
    prompt = _ids(20, seed=7)
    llm = tiny_llm(ckpt, max_num_batched_tokens=7)
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], params, DepthParams(h_cycles=3))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for completion in out.outputs:
        logits = hrm_reference.forward(ckpt, prompt + completion.token_ids[:-1], {"h_cycles": 3}, prompt_len=len(prompt))
        check_logprobs(torch.log_softmax(logits, dim=-1), len(prompt), completion, {}, tol=TOL, near_tie=NEAR_TIE,
                       greedy=False)
    assert llm.engine.block_manager.num_used_pages == 0


def test_a_checkpoint_without_prefix_lm_is_causal(tmp_path):
    """transformers ignores an instruction block when the config's prefix_lm is false: the knob's
    range is 0..0 and the default request equals the causal reference."""
    path = make_tiny(tmp_path / "causal", seed=5, h_cycles=1, l_cycles=3, prefix_lm=False)
    llm = tiny_llm(path, max_num_batched_tokens=7)
    knob = llm.engine.model.depth_knobs()["prefix_lm"]
    assert (knob.minimum, knob.maximum, knob.default) == (0, 0, 0)
    with pytest.raises(InvalidDepthError, match="0..0"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), DepthParams(prefix_lm=1))
    prompt = _ids(19, seed=6)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))[0]
    _check(path, prompt, None, out.outputs[0], {})
    _check(path, prompt, {"prefix_lm": 0}, out.outputs[0], {})


def test_admission_prices_the_cycles(ckpt):
    """A request's pages grow with its slots: h_cycles x (l_cycles + 1) stack invocations."""
    llm = tiny_llm(ckpt)
    bm, model = llm.engine.block_manager, llm.engine.model
    pages = {(h, l): bm.pages_for(cache_layout(model, DepthParams(h_cycles=h, l_cycles=l)), 40)
             for h, l in ((1, 1), (2, 2), (4, 3))}
    per_invocation = pages[(1, 1)] // 2
    assert pages == {(1, 1): 2 * per_invocation, (2, 2): 6 * per_invocation, (4, 3): 16 * per_invocation}


# ---- over HTTP -------------------------------------------------------------------------------------
@pytest.mark.slow  # a server and SmolLM2's 49152-token vocabulary on the shared 2-core machine
def test_served_over_http_with_the_openai_sdk(tmp_path, smollm_tokenizer):
    """Completions, chat and streams equal offline generation at each cycle setting; the knobs change
    the tokens and the bill (usage.depth); GET /v1/models lists their ranges and defaults; a value
    outside a range is a 400 naming it."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import httpx

    from depthserve import LLM
    from depthserve.config import EngineArgs
    from depthserve.engine.async_llm import AsyncLLM
    from depthserve.engine.llm_engine import LLMEngine
    from depthserve.server.app import build_app
    from tests.live_server import live_server, wait_idle

    path = make_tiny(tmp_path / "hrm-chat", seed=2, h_cycles=2, l_cycles=2, tokenizer=smollm_tokenizer)
    engine_args = dict(device="cpu", dtype="float32", load_progress=False, max_model_len=256, block_size=8)
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(path), **engine_args)))
    offline = LLM(str(path), **engine_args)
    model, prompts = llm.engine.model_name, ["The meaning of depth is", "Once upon a time there was a loop"]
    settings = [{"h_cycles": 1, "l_cycles": 1}, {"h_cycles": 3, "l_cycles": 2}, {"h_cycles": 2, "prefix_lm": 0}]
    with live_server(build_app(llm)) as base:
        listed = httpx.get(f"{base}/v1/models").json()["data"][0]["depth_knobs"]
        assert {name: (k["minimum"], k["maximum"], k["default"]) for name, k in listed.items()} == {
            "h_cycles": (1, 8, 2), "l_cycles": (1, 8, 2), "prefix_lm": (0, 1, 1)}
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        texts, flops = [], []
        for knobs in settings:
            depth = DepthParams.from_dict(knobs)
            expected = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), depth)
            got = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0.0,
                                            extra_body={"depth": knobs, "ignore_eos": True})
            texts.append([c.text for c in sorted(got.choices, key=lambda c: c.index)])
            assert texts[-1] == [e.text for e in expected]
            usage = got.usage.model_extra["depth"]
            assert all({k: p[k] for k in knobs} == knobs for p in usage["per_prompt"])
            flops.append(usage["flops"])
            assert usage["flops"] == pytest.approx(sum(e.depth.flops for e in expected))
            streamed = client.completions.create(model=model, prompt=prompts[1], max_tokens=8, temperature=0.0,
                                                 stream=True, extra_body={"depth": knobs, "ignore_eos": True})
            assert "".join(c.choices[0].text for c in streamed if c.choices) == expected[1].text
            messages = [{"role": "user", "content": "Cycle again."}]
            chat_expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=6), depth)
            chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0.0,
                                                  extra_body={"depth": knobs})
            assert chat.choices[0].message.content == chat_expected.text
            # the instruction of a chat is the whole rendered conversation: greedy tokens of transformers
            prompt, reply = offline.apply_chat_template(messages), chat_expected.outputs[0].token_ids
            logits = hrm_reference.forward(path, prompt + reply[:-1], knobs, prompt_len=len(prompt))
            assert logits[len(prompt) - 1:].argmax(-1).tolist() == reply
        assert texts[0] != texts[1] and flops[1] > flops[2] > flops[0]
        for bad, named in (({"h_cycles": 0}, "1..8"), ({"l_cycles": 9}, "1..8"), ({"prefix_lm": 2}, "0..1")):
            response = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "x", "depth": bad})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and named in error["message"], error
        wait_idle(llm)
        assert llm.engine.block_manager.num_used_pages == 0
