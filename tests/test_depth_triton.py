"""SGT loop slots (uneven GQA head subsets read through one table row per query head), ITT
routed slots, Dreamer's per-token depth attention and PUT's per-pass slots through the Triton
kernels (interpreted on CPU) against the torch kernels: the engine on each kernel backend."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from depthserve import DepthParams, SamplingParams  # noqa: E402
from depthserve.lab.make_tiny import make_tiny, synthetic_streams  # noqa: E402
from tests.depth_helpers import assert_same_generations, generate_on_both_backends  # noqa: E402

pytestmark = pytest.mark.slow  # part of make test, left out of make test-fast


@pytest.mark.parametrize("arch, depths", [
    ("sgt", [DepthParams(loops=3), DepthParams(loops={2: 2, 3: 0}), DepthParams(loops=0)]),
    ("itt", [DepthParams(selection_ratios=[0.7, 0.3]), DepthParams(selection_ratios=[1.0, 0.5]), DepthParams()]),
    ("dreamer", [DepthParams(depth=1), DepthParams(depth=3), DepthParams()]),  # the depth-attention kernel
    ("put", [DepthParams(loops=1), DepthParams(loops=3), DepthParams(loops=2)]),
])
def test_triton_path_matches_torch_path(tmp_path, smollm_tokenizer, arch, depths):
    path = make_tiny(arch, tmp_path / arch, seed=2, tokenizer=smollm_tokenizer)
    stream = synthetic_streams(49152, 1, 64, seed=4)[0].tolist()
    prompts = [stream[:13], stream[20:23], stream[30:50]]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True)
    expected, got, llm = generate_on_both_backends(str(path), prompts, params, depths, max_model_len=64,
                                                   block_size=8, max_num_batched_tokens=12)
    assert_same_generations(expected, got)
    assert llm.engine.block_manager.num_used_pages == 0
