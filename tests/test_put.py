"""PUT (docs/depth-semantics.md section 4): the native format, make-tiny, the reference forward, and the
engine against it (incremental = recompute).

The engine runs mixed batches (loops 1..T in one batch of 13 requests) with chunked prefill of
uneven chunk sizes and forced preemption (a tiny KV pool); every generated token's logprobs must
match the float64 reference within 1e-4 and every greedy token must be the reference's argmax.
The conv state is a per-sequence state held in pages of the KV pool: it must be freed with the
sequence on every path (finish, abort, preemption, invalid request).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from depthserve import LLM, DepthParams, SamplingParams, reference
from depthserve.archs import read_depth_spec
from depthserve.archs.put import format as put_format
from depthserve.oracles import put as put_reference
from depthserve.lab.tiny.put import make_tiny as make_tiny_put
from depthserve.cache import SlotKind
from depthserve.engine.model_runner import ModelRunner
from depthserve.errors import CheckpointFormatError, InvalidDepthError
from depthserve.lab.make_tiny import make_tiny, synthetic_streams
from tests.depth_helpers import cache_layout, check_logprobs, depth_params, tiny_llm

TOL = 1e-4
NEAR_TIE = 1e-4
LENGTHS = [3, 9, 17, 24, 33, 40, 51, 64, 70, 85, 97, 120, 141]
DEPTHS = [{"loops": 1}, {"loops": 2}, None, {"loops": 3}, {"loops": 1}, {"loops": 2}, {"loops": 3}, None,
          {"loops": 1}, {"loops": 3}, {"loops": 2}, {"loops": 1}, None]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("put")
    return {
        "gqa": make_tiny("put", root / "put-gqa", seed=5, tokenizer=smollm_tokenizer),
        # conv kernel 3: a state of two rows, longer than a decode chunk
        "k3": make_tiny_put(root / "put-k3", 6, None, 4, smollm_tokenizer,
                            n_prefix=1, n_core=1, n_suffix=1, steps=2, conv_kernel=3),
    }


def _ids(n: int, seed: int = 0) -> list[int]:
    return synthetic_streams(49152, 1, n, seed)[0].tolist()


def _prompts() -> list[list[int]]:
    stream = _ids(400, seed=21)
    prompts = [stream[i * 7 : i * 7 + n] for i, n in enumerate(LENGTHS)]
    prompts[3] = prompts[7][:24]  # a shared prefix: PUT must not use the prefix cache anyway
    return prompts


def _check(path, prompt, depth, out, stats):
    logprobs = torch.log_softmax(reference.forward(path, prompt + out.token_ids[:-1], depth), dim=-1)
    check_logprobs(logprobs, len(prompt), out, stats, tol=TOL, near_tie=NEAR_TIE)


def _run(engine, requests):
    """Step the engine to the end; returns ({id: final output}, the largest seq_state bytes seen)."""
    for rid, prompt, params, depth in requests:
        engine.add_request(rid, prompt, params, depth)
    final, state_bytes = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        state_bytes = max(state_bytes, engine.stats()["kv_bytes_used_by_kind"].get("seq_state", 0))
    return final, state_bytes


# ---- format, make-tiny, reference ------------------------------------------------------------------
def test_make_tiny_writes_the_put_format(ckpts):
    path = ckpts["gqa"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["depth"] == {"format_version": 1, "architecture": "put",
                            "put": {"n_prefix": 1, "n_core": 2, "n_suffix": 1, "T": 3, "conv_kernel": 2}}
    spec = read_depth_spec(cfg)
    assert spec == put_format.PUTSpec(1, 2, 1, 3, 2) and put_format.to_section(spec) == cfg["depth"]
    assert cfg["num_hidden_layers"] == 4 and (path / "tokenizer.json").is_file()
    w = load_file(str(path / "model.safetensors"))
    ffn, d = cfg["intermediate_size"], cfg["hidden_size"]
    for j in range(2):
        assert w[f"model.core_layers.{j}.mlp.step_embedding"].shape == (3, ffn)
        assert w[f"model.core_layers.{j}.mlp.conv.weight"].shape == (2, ffn)
    assert w["model.prefix_layers.0.self_attn.q_proj.weight"].shape == (4 * 16, d)
    assert w["model.suffix_layers.0.mlp.down_proj.weight"].shape == (d, ffn)
    assert not any(name.startswith("model.layers.") for name in w)
    k3 = read_depth_spec(json.loads((ckpts["k3"] / "config.json").read_text()))
    assert (k3.n_core, k3.steps, k3.conv_kernel) == (1, 2, 3)


@pytest.mark.parametrize("change, match", [
    (lambda s: s.pop("put"), "depth.put is missing"),
    (lambda s: s["put"].update(n_core=5), "must equal num_hidden_layers"),
    (lambda s: s["put"].update(T=0), "depth.put.T"),
    (lambda s: s["put"].update(conv_kernel=0), "depth.put.conv_kernel"),
    (lambda s: s["put"].update(n_prefix=True), "depth.put.n_prefix"),
])
def test_malformed_put_sections_are_refused(ckpts, change, match):
    cfg = json.loads((ckpts["gqa"] / "config.json").read_text())
    change(cfg["depth"])
    with pytest.raises(CheckpointFormatError, match=match):
        read_depth_spec(cfg)


def test_reference_is_peaked_and_loops_change_the_logits(ckpts):
    path, ids = ckpts["gqa"], _ids(48, seed=5)
    logits = {L: reference.forward(path, ids, {"loops": L}) for L in (1, 2, 3)}
    torch.testing.assert_close(reference.forward(path, ids), logits[3], rtol=0, atol=0)  # default: T
    for L, lg in logits.items():
        top2 = lg.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).median()) > 0.2 and float(torch.softmax(lg, -1).max(-1).values.mean()) > 0.1
    for a, b in ((1, 2), (2, 3), (1, 3)):
        assert float((logits[a] - logits[b]).abs().max()) > 1.0
        assert (logits[a].argmax(-1) != logits[b].argmax(-1)).any()
    with pytest.raises(ValueError, match="1..3"):
        reference.forward(path, ids, {"loops": 4})


@pytest.mark.parametrize("name", ["gqa", "k3"])
def test_changing_a_later_token_never_changes_earlier_logits(ckpts, name):
    path, ids = ckpts[name], _ids(30, seed=7)
    for L in (1, 2):
        base = reference.forward(path, ids, {"loops": L})
        for n in (0, 1, 17, 29):
            other = list(ids)
            other[n] = (other[n] + 1234) % 49152
            changed = reference.forward(path, other, {"loops": L})
            assert torch.equal(changed[:n], base[:n]), f"position {n} changed earlier logits"
            assert float((changed[n] - base[n]).abs().max()) > 1e-3


def test_dwconv_is_causal_with_zeros_before_the_first_token():
    z = torch.arange(1.0, 13.0, dtype=torch.float64).view(4, 3)
    w = torch.tensor([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [100.0, 200.0, 300.0]], dtype=torch.float64)
    out = put_reference.dwconv(z, w)
    expected = torch.stack([sum(w[j] * (z[n - j] if n - j >= 0 else 0) for j in range(3)) for n in range(4)])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ---- the engine ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_mixed_loops_batch_equals_reference_with_chunks_and_preemption(ckpts):
    path = ckpts["gqa"]
    prompts, depths = _prompts(), [depth_params(d) for d in DEPTHS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    probe = tiny_llm(path)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = [bm.pages_for(cache_layout(model, d), len(p) + params.max_tokens) for p, d in zip(prompts, depths)]
    pages = max(need) + 4
    assert sum(need) > 3 * pages
    # A budget of 29 tokens shared by the running sequences: prefill chunks of uneven sizes.
    engine = tiny_llm(path, pages=pages, max_model_len=160, max_num_batched_tokens=29).engine
    final, state_bytes = _run(engine, [(f"r{i}", p, params, d) for i, (p, d) in enumerate(zip(prompts, depths))])
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert engine.block_manager.prefix_hits == 0 and all(o.num_cached_tokens == 0 for o in final.values())
    assert state_bytes > 0, "the conv state is accounted as seq_state bytes while requests run"
    stats = {"tokens": 0, "max_err": 0.0}
    for i, (prompt, depth) in enumerate(zip(prompts, depths)):
        out = final[f"r{i}"]
        _check(path, prompt, depth, out.outputs[0], stats)
        report = out.depth
        assert report.settings["loops"] == depth.get("loops", 3) and report.settings["trained_loops"] == 3
        assert report.tokens == len(prompt) + params.max_tokens - 1
        assert report.counters["core_layer_passes"] == report.tokens * report.settings["loops"] * 2
    print("put mixed batch: preemptions", engine.scheduler.num_preemptions, stats)
    assert engine.block_manager.num_used_pages == 0 and engine.block_manager.num_free_pages == pages
    by_loops = {o.depth.settings["loops"]: o.depth.relative_compute for o in final.values()}
    assert by_loops[1] < by_loops[2] < by_loops[3] == pytest.approx(1.0)  # the default: T = 3 passes


def test_conv_state_across_tiny_chunks_and_decode_with_kernel_3(ckpts):
    path = ckpts["k3"]
    prompts = [_ids(n, seed=30 + n) for n in (11, 7, 2, 1, 5)]
    depths = [DepthParams(loops=2), DepthParams(loops=1), DepthParams(), DepthParams(loops=1), DepthParams(loops=2)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    # A budget of 3 tokens: chunks of 1..3 tokens, shorter than the two-row state.
    engine = tiny_llm(path, max_num_batched_tokens=3).engine
    final, state_bytes = _run(engine, [(f"r{i}", p, params, d) for i, (p, d) in enumerate(zip(prompts, depths))])
    cfg = engine.model.config
    assert state_bytes >= 2 * 2 * cfg.intermediate_size * 4  # loops 2 x (k-1) rows x d_ff x fp32
    stats = {"tokens": 0, "max_err": 0.0}
    for i, (prompt, depth) in enumerate(zip(prompts, depths)):
        _check(path, prompt, depth, final[f"r{i}"].outputs[0], stats)
    assert engine.block_manager.num_used_pages == 0


def test_state_is_accounted_in_bytes_and_freed_on_every_path(ckpts):
    path = ckpts["gqa"]
    engine = tiny_llm(path, max_num_batched_tokens=16).engine
    bm, model = engine.block_manager, engine.model
    page_bytes = ModelRunner.page_bytes(8, 16, torch.float32)
    prompt = _ids(40, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for loops in (1, 2, 3):
        layout = cache_layout(model, DepthParams(loops=loops))
        state = loops * 2 * 1 * model.config.intermediate_size * 4  # loops x n_core x (k-1) x d_ff x fp32
        assert layout.state_bytes == state
        # one dense slot per prefix layer, per (step, core layer), per suffix layer
        assert len(layout.slots) == 1 + 2 * loops + 1 and layout.base_width == 4 * model.config.num_kv_heads
        engine.add_request("probe", prompt, params, DepthParams(loops=loops))
        engine.step()  # a first chunk of 16 tokens
        seq = engine._requests["probe"].seqs[0]
        state_pages = -(-state // page_bytes)
        assert bm.pages_held(seq) == 2 * layout.row_width + state_pages
        assert engine.stats()["kv_bytes_used_by_kind"]["seq_state"] == state_pages * page_bytes
        engine.abort_request("probe")  # aborted mid-prefill
        assert bm.num_used_pages == 0 and SlotKind.SEQ_STATE not in bm.used_pages_by_kind()
    # aborted while decoding
    engine.add_request("decode", prompt, params, DepthParams(loops=2))
    for _ in range(5):
        engine.step()
    assert len(engine._requests["decode"].seqs[0].output_token_ids) >= 2
    engine.abort_request("decode")
    assert bm.num_used_pages == 0 and not engine.has_unfinished_requests()
    # the same prompt twice: no prefix-cache reuse (the state lives outside the KV blocks)
    llm = tiny_llm(path)
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), DepthParams())[0]
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), DepthParams())[0]
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids
    assert llm.engine.block_manager.prefix_queries == 0 and llm.engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("depth, match", [
    ({"loops": 0}, "1..3"),
    ({"loops": 4}, "1..3"),
    ({"loops": 1.5}, "integer"),
    ({"loops": True}, "integer"),
    ({"loops": {"1": 2}}, "integer"),
    ({"depth": 2}, "not supported"),
    ({"selection_ratios": [0.5]}, "not supported"),
])
def test_invalid_loops_raise_and_leave_no_blocks(ckpts, depth, match):
    llm = _engine(ckpts)
    with pytest.raises(InvalidDepthError, match=match):
        llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2), [DepthParams(), DepthParams.from_dict(depth)])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_pages == 0
    knob = llm.engine.model.depth_knobs()["loops"]
    assert (knob.minimum, knob.maximum, knob.default) == (1, 3, 3)


_ENGINE: list[LLM] = []


def _engine(ckpts) -> LLM:
    if not _ENGINE:
        _ENGINE.append(tiny_llm(ckpts["gqa"]))
    return _ENGINE[0]
