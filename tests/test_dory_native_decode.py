"""Dory decoder layers' decode step as one native call (depthserve/archs/dory/native_decode.py)
computes what the eager layers compute, bit for bit: the same engine (bf16 activations, int4 or
int8 weights on the native kernel) generates the same tokens with the same log-probabilities with
the native step and without it, in both cache modes, on mixed batches of requests at different
loop counts and per-token ranges (whole sections in one call where every row runs a pass, layer by
layer over a pass's subset of rows, the eager layer where a routed slot's sliding window needs the
keys' positions), with prompts longer than the sliding window."""

from __future__ import annotations

import pytest
import torch

from depthserve import LLM, SamplingParams
from depthserve.lab.tiny.dory import make_tiny
from depthserve.kernels import cpu_native
from tests.depth_helpers import BLOCK_SIZE, depth_params
from tests.test_depth_elastic import RandomLevels

if cpu_native.unavailable_reason() is not None:
    pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}", allow_module_level=True)

VOCAB = 257  # the byte tokenizer's
LENGTHS = [5, 19, 33, 12]
MAX_TOKENS = [7, 5, 6, 8]
KNOBS = [{"loops": 1}, {"loops": 3}, {"loops": {"min": 1, "max": 3}}, None]


pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(llm: LLM) -> list:
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    llm.engine.depth_policy = RandomLevels(1)
    outputs = llm.generate(prompts, params, depth=[depth_params(knobs) for knobs in KNOBS])
    assert llm.engine.block_manager.num_used_pages == 0
    return [(o.token_ids, [sorted(entry.items()) for entry in o.logprobs]) for o in outputs]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("cache_mode", ["per_loop", "last_loop"])
def test_native_dory_step_is_the_eager_step_bit_for_bit(cache_mode, bits, tmp_path, monkeypatch):
    path = make_tiny(tmp_path / cache_mode, seed=9, loops=2, cache_mode=cache_mode, sliding_window=8)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization=f"int{bits}", load_progress=False,
              max_model_len=64, block_size=BLOCK_SIZE, max_num_batched_tokens=24, enable_prefix_caching=False)
    model = llm.engine.model
    cfg = model.config
    sections = {tuple(range(cfg.n_input_layers)), tuple(cfg.recurrent_layers), tuple(cfg.output_layers)}
    assert sections | {(i,) for i in cfg.recurrent_layers} == set(model.native_runs)
    calls: list[tuple[int, int]] = []  # (rows, layers) of each native call
    native_step = cpu_native.dory_decode_layers

    def counted(x, *args):
        calls.append((x.shape[0], len(args[-1])))
        return native_step(x, *args)

    monkeypatch.setattr(cpu_native, "dory_decode_layers", counted)
    native = _generate(llm)
    assert max(rows for rows, _ in calls) > 1, "the native step never ran on a decode batch of several rows"
    assert {layers for _, layers in calls} == {1, 2}, "sections in one call, and a pass's subset layer by layer"
    runs = model.native_runs
    model.native_runs = {}
    count = len(calls)
    eager = _generate(llm)
    assert len(calls) == count
    model.native_runs = runs
    assert native == eager


def test_fp32_activations_keep_the_eager_layers(tmp_path):
    path = make_tiny(tmp_path / "dory", seed=9)
    fp32 = LLM(str(path), device="cpu", dtype="float32", quantization="int4", load_progress=False, max_model_len=64)
    assert fp32.engine.model.native_runs == {}
    dense = LLM(str(path), device="cpu", dtype="bfloat16", load_progress=False, max_model_len=64)
    assert dense.engine.model.native_runs == {}


def test_the_layers_call_refuses_cache_columns_outside_the_tables(tmp_path):
    path = make_tiny(tmp_path / "dory", seed=9)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization="int4", load_progress=False, max_model_len=64)
    model, pool = llm.engine.model, llm.engine.runner.pool
    cfg = model.config
    run = model.native_runs[tuple(cfg.recurrent_layers)]
    layers = len(cfg.recurrent_layers)
    width = run.kv_heads * layers
    table = (torch.ones(1, cfg.head_dim // 2), torch.zeros(1, cfg.head_dim // 2))
    args = dict(x=torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16), scales=run.scales, eps=run.eps,
                weights=run.projections.weights, bits=run.projections.bits,
                out_features=run.projections.out_features, cos=[table[0]] * layers, sin=[table[1]] * layers,
                windows=run.windows, num_heads=run.num_heads, kv_heads=run.kv_heads, k_pages=pool.k_pages,
                v_pages=pool.v_pages, slot_index=torch.zeros(1, width, dtype=torch.long),
                page_table=torch.zeros(1, 2, width, dtype=torch.int32), context_lens=torch.ones(1, dtype=torch.int32),
                scale=run.scale)
    with pytest.raises(RuntimeError, match="cache columns are outside the tables"):
        cpu_native.dory_decode_layers(**args, first_columns=[width - run.kv_heads + 1] * layers)
    with pytest.raises(RuntimeError, match="six scales, four projections"):
        cpu_native.dory_decode_layers(**args, first_columns=[0] * (layers + 1))
