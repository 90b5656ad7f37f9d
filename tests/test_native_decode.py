"""Llama decoder layers' decode step as one native call (depthserve/archs/llama/native_decode.py)
computes what the eager layers compute, bit for bit: the same engine generates the same tokens with
the same log-probabilities with the native step and without it, on mixed batches (prefill chunks
and decode rows in one step, decode-only steps of several rows) of the plain model (all its layers
in one call) and of the depth models whose plain layers are Llama layers (a call per layer), at
mixed depth."""

from __future__ import annotations

import pytest

from depthserve import LLM, SamplingParams
from depthserve.archs.llama.native_decode import NativeDecodeLayers
from depthserve.kernels import cpu_native
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import depth_params, stream_prompts

if cpu_native.unavailable_reason() is not None:
    pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}", allow_module_level=True)

LENGTHS = [3, 17, 33, 51]
MAX_TOKENS = [9, 4, 7, 6]
CASES = {
    "llama": ("llama", {}, [None] * 4),
    "sgt": ("sgt", dict(num_kv_heads=2), [{"loops": {1: 0, 2: 3}}, {"loops": 1}, None, {"loops": 3}]),
    "itt": ("itt", dict(num_kv_heads=2), [{"selection_ratios": [0.3, 0.7]}, {"selection_ratios": [1.0, 0.0]}, None,
                                          {"selection_ratios": [0.7, 0.3], "thinking_steps": 1}]),
}


def _generate(llm: LLM, depths: list[dict | None]) -> list:
    prompts = stream_prompts(LENGTHS, seed=43)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    return llm.generate(prompts, params, depth=[depth_params(d) for d in depths])


def _trace(outputs) -> list:
    return [(o.token_ids, [sorted(entry.items()) for entry in o.logprobs]) for o in outputs]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_native_decode_layer_is_the_eager_layer_bit_for_bit(name, bits, tmp_path, smollm_tokenizer, monkeypatch):
    arch, options, depths = CASES[name]
    path = make_tiny(arch, tmp_path / name, seed=3, tokenizer=smollm_tokenizer, **options)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization=f"int{bits}", load_progress=False,
              max_model_len=96, block_size=8, max_num_batched_tokens=24, enable_prefix_caching=False)
    model = llm.engine.model
    layers = [m for m in model.modules() if isinstance(getattr(m, "native_decode", None), NativeDecodeLayers)]
    assert layers, "no layer took the native decode step"
    whole_model = name == "llama"  # the plain model's layers in one call; the depth models' a call per layer
    assert (model.native_layers is not None) == whole_model
    rows_seen: list[int] = []
    layers_per_call: list[int] = []
    native_step = cpu_native.llama_decode_layers

    def counted(x, *args):
        rows_seen.append(x.shape[0])
        layers_per_call.append(len(args[-1]))
        return native_step(x, *args)

    monkeypatch.setattr(cpu_native, "llama_decode_layers", counted)
    native = _trace(_generate(llm, depths))
    assert rows_seen and max(rows_seen) > 1, "the native step never ran on a decode batch of several rows"
    assert set(layers_per_call) == ({len(model.layers)} if whole_model else {1})
    for layer in layers:
        layer.native_decode = None
    model.native_layers = None
    calls = len(rows_seen)
    eager = _trace(_generate(llm, depths))
    assert len(rows_seen) == calls
    assert native == eager
    assert llm.engine.block_manager.num_used_pages == 0


def test_only_plain_layers_on_native_weights_take_it(tmp_path, smollm_tokenizer):
    path = make_tiny("llama", tmp_path / "llama", seed=3, tokenizer=smollm_tokenizer)
    fp32 = LLM(str(path), device="cpu", dtype="float32", quantization="int4", load_progress=False, max_model_len=64)
    assert all(layer.native_decode is None for layer in fp32.engine.model.layers)  # fp32 activations: torch's kernels
    assert fp32.engine.model.native_layers is None
    dense = LLM(str(path), device="cpu", dtype="bfloat16", quantization="none", load_progress=False, max_model_len=64)
    assert all(layer.native_decode is None for layer in dense.engine.model.layers)
    assert dense.engine.model.native_layers is None


def test_the_layers_call_refuses_cache_columns_outside_the_tables(tmp_path, smollm_tokenizer):
    import torch

    path = make_tiny("llama", tmp_path / "llama", seed=3, tokenizer=smollm_tokenizer)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization="int4", load_progress=False, max_model_len=64)
    stack, pool = llm.engine.model.native_layers, llm.engine.runner.pool
    hidden = llm.engine.model.config.hidden_size
    layers = len(llm.engine.model.layers)
    width = stack.kv_heads * layers
    args = dict(x=torch.zeros(1, hidden, dtype=torch.bfloat16), norms=stack.norms, eps=stack.eps,
                weights=stack.projections.weights, bits=stack.projections.bits,
                out_features=stack.projections.out_features,
                cos=torch.ones(1, llm.engine.model.head_dim // 2), sin=torch.zeros(1, llm.engine.model.head_dim // 2),
                num_heads=stack.num_heads, kv_heads=stack.kv_heads, k_pages=pool.k_pages, v_pages=pool.v_pages,
                slot_index=torch.zeros(1, width, dtype=torch.long), page_table=torch.zeros(1, 2, width, dtype=torch.int32),
                context_lens=torch.ones(1, dtype=torch.int32), scale=stack.scale)
    with pytest.raises(RuntimeError, match="cache columns are outside the tables"):
        cpu_native.llama_decode_layers(**args, first_columns=[width - stack.kv_heads + 1] * layers)
    with pytest.raises(RuntimeError, match="two norms and four projections"):
        cpu_native.llama_decode_layers(**args, first_columns=[0] * (layers + 1))
