"""SGT loop slots (uneven GQA head subsets read through one table row per query head), ITT
routed slots, Dreamer's per-token depth attention and PUT's per-pass slots through the Triton
kernels (interpreted on CPU) against the torch path."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from depthserve import LLM, DepthParams, SamplingParams  # noqa: E402
from depthserve.kernels.dispatch import force_triton  # noqa: E402
from depthserve.tiny import make_tiny, synthetic_streams  # noqa: E402


@pytest.mark.parametrize("arch, depths", [
    ("sgt", [DepthParams(loops=3), DepthParams(loops={2: 2, 3: 0}), DepthParams(loops=0)]),
    ("itt", [DepthParams(selection_ratios=[0.7, 0.3]), DepthParams(selection_ratios=[1.0, 0.5]), DepthParams()]),
    ("dreamer", [DepthParams(depth=1), DepthParams(depth=3), DepthParams()]),  # the depth-attention kernel
    ("put", [DepthParams(loops=1), DepthParams(loops=3), DepthParams(loops=2)]),
])
def test_triton_path_matches_torch_path(tmp_path, smollm_tokenizer, arch, depths):
    path = make_tiny(arch, tmp_path / arch, seed=2, tokenizer=smollm_tokenizer)
    llm = LLM(str(path), device="cpu", dtype="float32", load_progress=False, max_model_len=64, block_size=8,
              max_num_batched_tokens=12)
    stream = synthetic_streams(49152, 1, 64, seed=4)[0].tolist()
    prompts = [stream[:13], stream[20:23], stream[30:50]]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True)
    expected = llm.generate(prompts, params, depths)
    with force_triton():
        got = llm.generate(prompts, params, depths)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        for e_step, g_step, token in zip(e.logprobs, g.logprobs, g.token_ids):
            assert abs(g_step[token].logprob - e_step[token].logprob) < 1e-4
    assert llm.engine.block_manager.num_used_pages == 0
