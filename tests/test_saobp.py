"""SAOBP (docs/depth-semantics.md section 5): the format, the reference and the engine = reference.

The reference (depthserve.oracles.saobp.forward) computes the refined attention from each
head's materialised [n, n] attention matrix in float64; here it is itself checked against a literal
double loop over rows and keys. The engine keeps the running per-key bias in the paged cache and
must give the same logprobs (1e-4, fp32) and greedy tokens for mixed batches of 13 requests with
chunked prefill of uneven chunk sizes and forced preemption, for both variants with and without
the self message, and for n > 1 forks; at 4096 tokens with lambda = 1 within 1e-3.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from depthserve import DepthParams, SamplingParams, reference
from depthserve.archs import read_depth_spec
from depthserve.oracles.llama import logits_of, norm, rope
from depthserve.archs.saobp import format as saobp_format
from depthserve.oracles import saobp as saobp_reference
from depthserve.lab.tiny.saobp import make_tiny as make_tiny_saobp
from depthserve.cache import SlotKind
from depthserve.engine.model_runner import ModelRunner
from depthserve.errors import CheckpointFormatError, InvalidDepthError
from depthserve.lab.make_tiny import make_tiny, synthetic_streams
from tests.depth_helpers import cache_layout, check_logprobs, stream_prompts, tiny_llm

TOL = 1e-4  # logprobs, fp32 engine vs the float64 reference
LONG_TOL = 1e-3  # at 4096 tokens
NEAR_TIE = 1e-4
LENGTHS = [3, 9, 17, 24, 33, 40, 51, 64, 70, 85, 97, 120, 141]
VARIANTS = {  # name -> make_tiny options
    "high": dict(variant="high"),
    "low": dict(variant="low"),
    "high-self": dict(variant="high", self_message=True),
    "low-self": dict(variant="low", self_message=True),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("saobp")
    out = {name: make_tiny_saobp(root / name, 5, None, None, smollm_tokenizer, lam=1.0, **opts)
           for name, opts in VARIANTS.items()}
    # MHA, SAOBP on layers 1 and 2 only.
    out["mha-layers"] = make_tiny_saobp(root / "mha-layers", 6, None, 4, smollm_tokenizer, lam=1.0, layers=[1, 2])
    out["llama-same"] = make_tiny("llama", root / "llama-same", seed=5, tokenizer=smollm_tokenizer)
    return out


def _prompts() -> list[list[int]]:
    return stream_prompts(LENGTHS, seed=23)


def check_against_reference(path, prompts, outputs, tol=TOL, greedy=True) -> dict:
    """Every sampled token's logprobs (chosen + top) and every scored prompt position vs the reference."""
    stats = {"tokens": 0, "prompt_positions": 0, "max_err": 0.0}
    for prompt, out in zip(prompts, outputs):
        for index, completion in enumerate(out.outputs):
            logprobs = torch.log_softmax(reference.forward(path, prompt + completion.token_ids[:-1]), dim=-1)
            check_logprobs(logprobs, len(prompt), completion, stats, tol=tol, near_tie=NEAR_TIE, greedy=greedy,
                           prompt_logprobs=out.prompt_logprobs if index == 0 else None)
    return stats


# ---- the format ------------------------------------------------------------------------------------------
def test_depth_section_round_trip_and_checks(ckpts):
    cfg = json.loads((ckpts["high-self"] / "config.json").read_text())
    assert cfg["depth"] == {"format_version": 1, "architecture": "saobp",
                            "saobp": {"lambda": 1.0, "variant": "high", "self_message": True, "layers": None}}
    spec = read_depth_spec(cfg)
    assert isinstance(spec, saobp_format.SAOBPSpec) and saobp_format.to_section(spec) == cfg["depth"]
    assert read_depth_spec(json.loads((ckpts["mha-layers"] / "config.json").read_text())).layers == (1, 2)
    # Defaults: variant "high", self_message false, every layer.
    minimal = dict(cfg, depth={"format_version": 1, "architecture": "saobp", "saobp": {"lambda": 0.2}})
    assert read_depth_spec(minimal) == saobp_format.SAOBPSpec(0.2, "high", False, None)
    bad = [({}, "depth.saobp is missing"), ({"saobp": {"variant": "high"}}, "lambda"),
           ({"saobp": {"lambda": -1}}, "lambda"), ({"saobp": {"lambda": 1, "variant": "mid"}}, "variant"),
           ({"saobp": {"lambda": 1, "self_message": 1}}, "self_message"),
           ({"saobp": {"lambda": 1, "layers": [4]}}, "layers"), ({"saobp": {"lambda": 1, "layers": [1, 1]}}, "layers"),
           ({"saobp": {"lambda": 1, "beta": 2}}, "unknown")]
    for body, match in bad:
        with pytest.raises(CheckpointFormatError, match=match):
            read_depth_spec(dict(cfg, depth={"format_version": 1, "architecture": "saobp", **body}))


def test_make_tiny_command_line(tmp_path, smollm_tokenizer, monkeypatch):
    from depthserve import tiny
    from depthserve.tools import cli

    monkeypatch.setattr(tiny, "load_default_tokenizer", lambda: smollm_tokenizer)
    assert cli.main(["make-tiny", "--arch", "saobp", "--out", str(tmp_path / "m"), "--num-kv-heads", "4"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["depth"]["architecture"] == "saobp" and cfg["num_key_value_heads"] == 4
    assert cfg["max_position_embeddings"] >= 4096 + 64  # long-context tests
    assert cfg["architectures"] == ["LlamaForCausalLM"]  # the base is a plain Llama; no extra tensors
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert all(not k.startswith("model.layers.") or ".self_attn." in k or ".mlp." in k or "layernorm" in k
                   for k in f.keys())


# ---- the reference -------------------------------------------------------------------------------------
def _literal_attention(ref, layer, x, spec):
    """Section 5 with explicit loops over rows j, keys k and sending rows i (tiny n only)."""
    cfg, w = ref.cfg, ref.w
    H, H_kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    p = f"model.layers.{layer}.self_attn."
    n = x.shape[0]
    pos = torch.arange(n)
    m0 = math.exp(spec.lam if spec.variant == "high" else -spec.lam)
    out = torch.zeros_like(x)
    for h in range(H):
        g = h // (H // H_kv)
        q = rope(x @ w[p + "q_proj.weight"][h * hd : (h + 1) * hd].T, pos, 10000.0)
        k = rope(x @ w[p + "k_proj.weight"][g * hd : (g + 1) * hd].T, pos, 10000.0)
        v = x @ w[p + "v_proj.weight"][g * hd : (g + 1) * hd].T
        s = (q @ k.T) / math.sqrt(hd)
        A = torch.zeros(n, n, dtype=x.dtype)
        for i in range(n):
            A[i, : i + 1] = torch.softmax(s[i, : i + 1], dim=0)
        rows = []
        for j in range(n):
            logits = []
            for kk in range(j + 1):
                c = 0.0
                senders = range(j + 1) if spec.self_message else range(j)
                for i in senders:  # every row i < j (or <= j) sends a message; masked ones send m_0
                    M = A[i, kk] + m0 * (1 - A[i, kk])
                    c += math.log(float(M) / m0)
                logits.append(float(s[j, kk]) + c)
            probs = torch.softmax(torch.tensor(logits, dtype=x.dtype), dim=0)
            rows.append(probs @ v[: j + 1])
        out = out + torch.stack(rows) @ w[p + "o_proj.weight"][:, h * hd : (h + 1) * hd].T
    return out


@pytest.mark.parametrize("name", ["high", "low-self"])
def test_reference_attention_is_the_literal_equations(ckpts, name):
    ref = saobp_reference.load_saobp(ckpts[name])
    ids = torch.tensor(_prompts()[2][:12])
    x = norm(ref, 0, "a", ref.w["model.embed_tokens.weight"][ids])
    got = saobp_reference.saobp_attention(ref, 0, x, ref.spec)
    torch.testing.assert_close(got, _literal_attention(ref, 0, x, ref.spec), rtol=0, atol=1e-10)


def test_reference_bias_matters_and_is_causal(ckpts, tmp_path, smollm_tokenizer):
    ids = _prompts()[6]
    base = reference.forward(ckpts["llama-same"], ids)
    zero = make_tiny_saobp(tmp_path / "zero", 5, None, None, smollm_tokenizer, lam=0.0)
    torch.testing.assert_close(reference.forward(zero, ids), base, rtol=0, atol=1e-9)  # lambda = 0: plain Llama
    outs = {name: reference.forward(ckpts[name], ids) for name in VARIANTS}
    for name, logits in outs.items():
        assert (logits - base).abs().max() > 0.5, f"{name}: the bias should change the logits visibly"
    assert (outs["high"] - outs["low"]).abs().max() > 0.5
    assert (outs["high"] - outs["high-self"]).abs().max() > 0.05
    prefix = reference.forward(ckpts["high-self"], ids[:30])
    torch.testing.assert_close(outs["high-self"][:30], prefix, rtol=0, atol=1e-9)  # no row sees later rows


# ---- the engine --------------------------------------------------------------------------------------------
def _run_mixed(path, max_num_batched_tokens=29):
    prompts = _prompts()
    per_request = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2,
                                  prompt_logprobs=1 if i % 3 == 2 else None) for i in range(len(prompts))]
    probe = tiny_llm(path, max_model_len=160)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = [bm.pages_for(cache_layout(model, DepthParams()), len(p) + 12) for p in prompts]
    pages = max(need) + 4
    assert sum(need) > 3 * pages
    # A per-step budget of 29 tokens: prompt chunks of uneven sizes (29, or what is left beside decodes).
    llm = tiny_llm(path, pages=pages, max_model_len=160, max_num_batched_tokens=max_num_batched_tokens)
    outputs = llm.generate(prompts, per_request)
    return llm, prompts, outputs


@pytest.mark.parametrize("name", list(VARIANTS) + ["mha-layers"])
@pytest.mark.slow
def test_mixed_batch_equals_reference(ckpts, name):
    t0 = time.perf_counter()
    llm, prompts, outputs = _run_mixed(ckpts[name])
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    stats = check_against_reference(ckpts[name], prompts, outputs)
    print(name, "preemptions", engine.scheduler.num_preemptions, stats, f"{time.perf_counter() - t0:.1f}s")
    assert stats["prompt_positions"] > 100
    assert engine.block_manager.num_used_pages == 0
    assert engine.block_manager.prefix_queries == 0  # prefix caching is off for SAOBP


def test_forks_have_their_own_bias(ckpts):
    """n > 1: each fork's bias is its own (no shared prefix rows); sampled forks diverge and each
    one matches the reference of its own tokens."""
    path = ckpts["high-self"]
    llm = tiny_llm(path, max_num_batched_tokens=16)
    prompts = _prompts()[4:7]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params)
    for out in outputs:
        assert len(out.outputs) == 3
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "sampled forks should diverge"
    stats = check_against_reference(path, prompts, outputs, greedy=False)
    assert stats["tokens"] == 3 * 3 * 10
    bm = llm.engine.block_manager
    assert bm.prefix_hits == 0 and bm.num_used_pages == 0


def test_bias_slot_is_accounted_in_bytes(ckpts):
    llm = tiny_llm(ckpts["high"])
    engine = llm.engine
    model, cfg = engine.model, engine.model.config
    layout = cache_layout(model, DepthParams())
    bias = [s for s in layout.slots if s.kind is SlotKind.PER_KEY_BIAS]
    assert len(bias) == 1 and not layout.uses_prefix_cache
    page_bytes = ModelRunner.page_bytes(8, cfg.head_dim, torch.float32)
    # fp32 bias of L layers x H heads per token: R = head_dim rows of block_size floats per page (its K half).
    rows_per_page = cfg.head_dim * 4 // 4
    assert bias[0].num_heads == -(-cfg.num_layers * cfg.num_heads // rows_per_page)
    prompt = _prompts()[5]  # 40 tokens: 5 blocks of 8
    engine.add_request("probe", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    used = engine.stats()["kv_bytes_used_by_kind"]
    blocks = -(-len(prompt) // 8)
    assert used["per_key_bias"] == blocks * bias[0].num_heads * page_bytes
    assert used["dense"] == blocks * cfg.num_layers * cfg.num_kv_heads * page_bytes
    # the bias needs L * H * 4 bytes per token; what is held is at most one page per block more
    assert cfg.num_layers * cfg.num_heads * 4 * blocks * 8 <= used["per_key_bias"]
    engine.abort_request("probe")
    assert engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("depth", [{"loops": 1}, {"depth": 2}, {"selection_ratios": [0.5]}, {"thinking_steps": 0}])
def test_any_depth_knob_is_an_error_and_leaves_no_blocks(ckpts, depth):
    llm = tiny_llm(ckpts["low"])
    with pytest.raises(InvalidDepthError, match="not supported"):
        llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2), [DepthParams(), DepthParams.from_dict(depth)])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_pages == 0
    assert llm.engine.model.depth_knobs() == {}
    with pytest.raises(InvalidDepthError, match="no depth knobs"):
        reference.forward(ckpts["low"], [1, 2, 3], depth)


@pytest.mark.slow
def test_4096_tokens_lambda_1_matches_float64_reference(ckpts):
    """A 4090-token prompt (chunks of 512) and 6 generated tokens: every prompt position's logprob
    and every generated token's within 1e-3 of the float64 reference."""
    path = ckpts["high"]
    stream = synthetic_streams(49152, 1, 4090, seed=31)[0].tolist()
    t0 = time.perf_counter()
    llm = tiny_llm(path, max_model_len=4096 + 16, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    out = llm.generate([stream], params)[0]
    t1 = time.perf_counter()
    tokens = stream + out.token_ids[:-1]
    # float64 logits a block of 256 positions at a time (all 4096 at once would hold 1.6 GB)
    ref, states = saobp_reference.final_states(path, tokens)
    expected: dict[int, torch.Tensor] = {}  # position -> its logprobs, for the positions the engine reports
    generated_rows = range(len(stream) - 1, len(tokens))
    for start in range(0, len(tokens), 256):
        rows = torch.log_softmax(logits_of(ref, states[start: start + 256]), dim=-1)
        for position in range(start, min(start + 256, len(tokens))):
            entry = out.prompt_logprobs[position + 1] if position + 1 < len(stream) else None
            if entry is not None:
                expected[position] = rows[position - start, list(entry)].clone()
            if position in generated_rows:
                expected[position] = rows[position - start].clone()
    t2 = time.perf_counter()
    err = 0.0
    for position, entry in enumerate(out.prompt_logprobs):
        if entry is None:
            continue
        for j, lp in enumerate(entry.values()):
            err = max(err, abs(float(expected[position - 1][j]) - lp.logprob))
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = expected[len(stream) - 1 + i]
        for alt, lp in entry.items():
            err = max(err, abs(float(row[alt]) - lp.logprob))
        assert int(row.argmax()) == token or float(row.max() - row[token]) < NEAR_TIE
    print(f"4096 tokens: max logprob error {err:.2e}; engine {t1 - t0:.1f}s, reference {t2 - t1:.1f}s")
    assert err < LONG_TOL
    assert len(out.prompt_logprobs) == len(stream)
