"""`depthserve import-sgt`: an SGT training checkpoint (OLMo v1 layout) -> the native SGT format.

A small synthetic OLMo-layout checkpoint (3 blocks, 2 looped, one with fractional head decays; an
MHA and a GQA variant) is imported through the CLI. The test carries its own float64 forward
written straight from the OLMo equations on the *source* layout (fused att_proj split into
[q; k; v], fused ff_proj chunked value-first, every head of the loop computed and scaled by
head_decay, the loop between the attention residual and the MLP with the block's own attn_norm),
and the native reference forward of the imported directory must equal it (relative 1e-10 in
float64: both read the same stored values, so only float64 rounding separates them) with the
trained loop counts, with loops off and with more loops than trained. The engine must match the
reference on a few requests (logprobs within 1e-4, fp32 engine; greedy tokens = argmax).
Refusals raise the typed error with the offending key named, and the CLI exits 2.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import yaml
from safetensors.torch import save_file

from depthserve import LLM, DepthParams, SamplingParams, reference
from depthserve.errors import DepthServeError
from depthserve.loading.tokenizer import byte_tokenizer
from depthserve.tools.cli import main
from depthserve.lab.sgt_import import UnsupportedCheckpointError, import_sgt

D, H, L, FF = 64, 4, 3, 96  # d_model, heads, blocks, SwiGLU width (fused ff_proj: 2 * FF rows)
HD = D // H
THETA, EPS = 10000.0, 1e-5
REL_TOL = 1e-10  # float64 oracle vs float64 native reference
LOGPROB_TOL = 1e-4  # fp32 engine vs float64 reference
NEAR_TIE = 1e-4
# Loop state per block: (current_loop_depth, kept_head_indices, head_keep_mask, head_decay).
LOOP_STATE = {
    0: (0, [0, 1, 2, 3], [1, 1, 1, 1], [1.0, 1.0, 1.0, 1.0]),  # buffers present, K = 0: not looped
    1: (2, [3, 0], [1, 0, 0, 1], [1.0, 0.0, 0.0, 1.0]),  # heads 3, 0 in different KV groups under GQA
    2: (1, [2], [0, 0, 1, 0], [0.5, 0.0, 1.0, 0.25]),  # fractional: S = [2, 0, 3], scales [1, 0.5, 0.25]
}
EXPECTED_SGT = {"looped_layers": [1, 2], "head_sets": [[3, 0], [2, 0, 3]], "loop_counts": [2, 1],
                "head_scales": [None, [1.0, 0.5, 0.25]], "max_loops": 3}


def olmo_state(n_kv: int, rows: int, tied: bool, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in OLMo v1 names, scaled for peaked output distributions."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    sd = {"transformer.wte.weight": normal(rows, D, std=1.0), "transformer.ln_f.weight": 1 + normal(D, std=0.1)}
    if not tied:
        sd["transformer.ff_out.weight"] = normal(rows, D, std=4.0 / D**0.5)
    for i in range(L):
        p = f"transformer.blocks.{i}."
        qk = normal(D + n_kv * HD, D, std=1.5 / D**0.5)
        v = normal(n_kv * HD, D, std=1.0 / D**0.5)
        sd[p + "att_proj.weight"] = torch.cat([qk, v])
        sd[p + "attn_out.weight"] = normal(D, D, std=1.0 / D**0.5)
        sd[p + "ff_proj.weight"] = normal(2 * FF, D, std=1.0 / D**0.5)
        sd[p + "ff_out.weight"] = normal(D, FF, std=1.0 / FF**0.5)
        sd[p + "attn_norm.weight"] = 1 + normal(D, std=0.1)
        sd[p + "ff_norm.weight"] = 1 + normal(D, std=0.1)
        k, kept, mask, decay = LOOP_STATE[i]
        q = p + "loop_attention."
        sd[q + "current_loop_depth"] = torch.tensor(k, dtype=torch.int64)
        sd[q + "kept_head_indices"] = torch.tensor(kept, dtype=torch.int64)
        sd[q + "head_keep_mask"] = torch.tensor(mask, dtype=torch.bool)
        sd[q + "head_decay"] = torch.tensor(decay, dtype=torch.float32)
    return sd


# ---- the independent oracle: OLMo's equations on the source layout, float64 -------------------------
def olmo_forward(sd: dict[str, torch.Tensor], n_kv: int, ids: list[int], loops: int | None = None) -> torch.Tensor:
    """Logits [n, rows]. `loops`: None = each block's current_loop_depth; an int replaces it in every
    looped block (K > 0)."""
    w = {k: t.double() for k, t in sd.items()}
    n = len(ids)
    x = w["transformer.wte.weight"][torch.tensor(ids)]

    def rms(t, weight):
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS))

    inv_freq = 1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rotate_half(t):
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat([-t2, t1], dim=-1)

    future = torch.ones(n, n, dtype=torch.bool).triu(1)

    def attention(p, t, decay=None):
        q, k, v = (t @ w[p + "att_proj.weight"].T).split([D, n_kv * HD, n_kv * HD], dim=-1)
        q = q.view(n, H, HD).transpose(0, 1)
        k = k.view(n, n_kv, HD).transpose(0, 1)
        v = v.view(n, n_kv, HD).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // n_kv, dim=0), v.repeat_interleave(H // n_kv, dim=0)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(HD)
        y = torch.softmax(att.masked_fill(future, float("-inf")), dim=-1) @ v  # [H, n, HD]
        if decay is not None:
            y = y * decay[:, None, None]  # the training loop: every head, scaled by its head_decay
        return y.transpose(0, 1).reshape(n, D) @ w[p + "attn_out.weight"].T

    for i in range(L):
        p = f"transformer.blocks.{i}."
        h = x + attention(p, rms(x, w[p + "attn_norm.weight"]))
        k = int(sd[p + "loop_attention.current_loop_depth"])
        if k > 0 and loops is not None:
            k = loops
        for _ in range(k):
            h = h + attention(p, rms(h, w[p + "attn_norm.weight"]), w[p + "loop_attention.head_decay"])
        value, gate = (rms(h, w[p + "ff_norm.weight"]) @ w[p + "ff_proj.weight"].T).chunk(2, dim=-1)
        x = h + (torch.nn.functional.silu(gate) * value) @ w[p + "ff_out.weight"].T
    x = rms(x, w["transformer.ln_f.weight"])
    head = w.get("transformer.ff_out.weight", w["transformer.wte.weight"])
    return x @ head.T


# ---- the two source checkpoints ---------------------------------------------------------------------
def write_mha(root, tokenizer_len: int):
    """MHA, fp32, flat config.json (n_kv_heads null, mlp_hidden_size), model.safetensors, untied head,
    padded embedding rows; no tokenizer files: the default model's tokenizer is used."""
    src = root / "olmo-mha"
    src.mkdir()
    rows = tokenizer_len + 64
    sd = olmo_state(n_kv=H, rows=rows, tied=False, dtype=torch.float32, seed=1)
    cfg = {"d_model": D, "n_heads": H, "n_kv_heads": None, "n_layers": L, "mlp_hidden_size": 2 * FF,
           "rope": True, "rope_theta": THETA, "layer_norm_type": "rms", "layer_norm_eps": EPS,
           "vocab_size": tokenizer_len, "embedding_size": rows, "max_sequence_length": 256,
           "weight_tying": False, "include_bias": False, "clip_qkv": None, "attention_layer_norm": False,
           "block_type": "sequential", "activation_type": "swiglu", "eos_token_id": 0, "pad_token_id": 1}
    (src / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(src / "model.safetensors"))
    return src, sd, cfg


def write_gqa(root):
    """GQA (2 KV heads), bf16, OLMo training config.yaml (model keys under `model`, mlp_ratio),
    model.pt, tied embeddings, a byte-level tokenizer given with --tokenizer."""
    src = root / "olmo-gqa"
    src.mkdir()
    tok_dir = root / "byte-tokenizer"
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(str(tok_dir))
    rows = 320
    sd = olmo_state(n_kv=2, rows=rows, tied=True, dtype=torch.bfloat16, seed=2)
    cfg = {"d_model": D, "n_heads": H, "n_kv_heads": 2, "n_layers": L, "mlp_ratio": 2 * FF // D,
           "rope": True, "rope_theta": THETA, "layer_norm_type": "rms", "layer_norm_eps": EPS,
           "vocab_size": len(tokenizer), "embedding_size": rows, "max_sequence_length": 256,
           "weight_tying": True, "include_bias": False, "clip_qkv": None, "attention_layer_norm": False,
           "eos_token_id": 0, "pad_token_id": 0}
    (src / "config.yaml").write_text(yaml.safe_dump({"run_name": "sgt", "model": cfg, "seed": 6198}))
    torch.save(sd, src / "model.pt")
    return src, sd, cfg, tok_dir


@pytest.fixture(scope="module")
def imported(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("import-sgt")
    out = {}
    src, sd, cfg = write_mha(root, len(smollm_tokenizer))
    assert main(["import-sgt", str(src), "--out", str(root / "native-mha"), "--max-loops", "3"]) == 0
    out["mha"] = (root / "native-mha", sd, H)
    src, sd, cfg, tok_dir = write_gqa(root)
    assert main(["import-sgt", str(src), "--out", str(root / "native-gqa"), "--max-loops", "3",
                 "--tokenizer", str(tok_dir)]) == 0
    out["gqa"] = (root / "native-gqa", sd, 2)
    return out


def _ids(name: str, n: int, seed: int) -> list[int]:
    high = 49152 if name == "mha" else 257
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_config_and_depth_section(imported, name):
    path, sd, n_kv = imported[name]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["depth"]["architecture"] == "sgt"
    assert cfg["depth"]["sgt"] == EXPECTED_SGT
    assert cfg["vocab_size"] == sd["transformer.wte.weight"].shape[0]  # padded rows kept
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]) == (H, n_kv, FF)
    assert cfg["tie_word_embeddings"] == (name == "gqa")
    assert cfg["torch_dtype"] == ("float32" if name == "mha" else "bfloat16")
    assert (path / "tokenizer.json").is_file()


@pytest.mark.parametrize("name", ["mha", "gqa"])
@pytest.mark.parametrize("loops", [None, 0, 3])
def test_reference_equals_olmo_equations(imported, name, loops):
    path, sd, n_kv = imported[name]
    ids = _ids(name, 13, seed=5)
    expected = olmo_forward(sd, n_kv, ids, loops)
    got = reference.forward(path, ids, None if loops is None else {"loops": loops})
    assert got.dtype == torch.float64 and got.shape == expected.shape
    rel = float((got - expected).abs().max() / expected.abs().max())
    assert rel < REL_TOL, f"{name} loops={loops}: relative error {rel:.2e}"
    if loops == 3:  # the loops matter: a different count changes the logits
        assert float((got - olmo_forward(sd, n_kv, ids, None)).abs().max()) > 1e-3


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_engine_equals_reference(imported, name):
    path, _, _ = imported[name]
    llm = LLM(str(path), device="cpu", dtype="float32", load_progress=False, max_model_len=64, block_size=8,
              kv_cache_memory_gib=0.01)
    prompts = [_ids(name, 5, seed=7), _ids(name, 11, seed=8), _ids(name, 5, seed=7)]
    depths = [None, {"loops": 3}, {"loops": 0}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, [DepthParams.from_dict(d) if d else DepthParams() for d in depths])
    for prompt, depth, out in zip(prompts, depths, outputs):
        logprobs = torch.log_softmax(reference.forward(path, prompt + out.token_ids[:-1], depth), dim=-1)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = logprobs[len(prompt) - 1 + i]
            for alt, lp in entry.items():
                err = abs(float(row[alt]) - lp.logprob)
                assert err < LOGPROB_TOL, f"{name} depth={depth} token {i}: logprob of {alt} differs by {err:.2e}"
            if int(row.argmax()) != token:
                assert float(row.max() - row[token]) < NEAR_TIE, f"{name} depth={depth}: token {i} is not the argmax"


# ---- refusals -----------------------------------------------------------------------------------------------
def _cfg(**changes):
    return lambda cfg, sd: cfg.update(changes)


def _add(key, shape):
    return lambda cfg, sd: sd.__setitem__(key, torch.ones(*shape))


def _drop(*keys):
    return lambda cfg, sd: [sd.pop(k) for k in keys]


def _short_att_proj(cfg, sd):
    key = "transformer.blocks.1.att_proj.weight"
    sd[key] = sd[key][:-1]


LOOP1 = "transformer.blocks.1.loop_attention."
REFUSALS = [
    ("clip_qkv", _cfg(clip_qkv=8.0), "clip_qkv", []),
    ("attention_layer_norm", _cfg(attention_layer_norm=True), "attention_layer_norm", []),
    ("q_norm tensor", _add("transformer.blocks.1.q_norm.weight", (D,)), "transformer.blocks.1.q_norm.weight", []),
    ("layer_norm_type", _cfg(layer_norm_type="default"), "layer_norm_type", []),
    ("missing tensor", _drop("transformer.blocks.2.ff_out.weight"), "transformer.blocks.2.ff_out.weight", []),
    ("include_bias", _cfg(include_bias=True), "include_bias", []),
    ("bias tensor", _add("transformer.blocks.0.attn_out.bias", (D,)), "transformer.blocks.0.attn_out.bias", []),
    ("parallel block", _cfg(block_type="parallel"), "block_type", []),
    ("inconsistent shape", _short_att_proj, "transformer.blocks.1.att_proj.weight", []),
    ("config vs tensors", _cfg(n_kv_heads=1), "n_kv_heads", []),
    ("no head decays", _drop(LOOP1 + "head_decay", LOOP1 + "head_keep_mask", LOOP1 + "kept_head_indices"),
     LOOP1 + "head_decay", []),
    ("unknown tensor", _add("transformer.blocks.0.extra.weight", (D,)), "transformer.blocks.0.extra.weight", []),
    ("max_loops below trained", _cfg(), "--max-loops", ["--max-loops", "1"]),
]


@pytest.fixture(scope="module")
def base_source():
    cfg = {"d_model": D, "n_heads": H, "n_kv_heads": 2, "n_layers": L, "mlp_hidden_size": 2 * FF,
           "layer_norm_type": "rms", "vocab_size": 257, "embedding_size": 320, "weight_tying": False}
    return cfg, olmo_state(n_kv=2, rows=320, tied=False, dtype=torch.float32, seed=3)


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refusals_name_the_key(tmp_path, base_source, capsys, case):
    _, mutate, key, extra = case
    cfg, sd = copy.deepcopy(base_source[0]), dict(base_source[1])
    mutate(cfg, sd)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(src / "model.safetensors"))
    max_loops = int(extra[1]) if extra else None
    with pytest.raises(UnsupportedCheckpointError) as info:
        import_sgt(src, tmp_path / "out", max_loops=max_loops)
    assert isinstance(info.value, DepthServeError)
    assert info.value.key == key and key in str(info.value)
    assert main(["import-sgt", str(src), "--out", str(tmp_path / "out"), *extra]) == 2
    assert key in capsys.readouterr().err
    assert not (tmp_path / "out" / "config.json").exists()


def test_refuses_to_overwrite_the_source(tmp_path, base_source):
    cfg, sd = base_source
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / "model.safetensors"))
    assert main(["import-sgt", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert (tmp_path / "model.safetensors").is_file()
