"""The engine on the Triton kernel backend (interpreted on CPU) against the torch backend: the
same greedy tokens and logprobs for a mixed batch with chunked prefill and prefix hits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from depthserve import LLM, SamplingParams  # noqa: E402
from tests.depth_helpers import assert_same_generations  # noqa: E402

pytestmark = pytest.mark.slow  # part of make test, left out of make test-fast


def test_triton_path_matches_torch_path():
    shared = "The history of the city of Rome is long, and the"
    prompts = [shared + " Colosseum", "Hi", shared + " Tiber river"]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        # A small token budget: prompts are prefilled in chunks over earlier chunks' cache.
        llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_num_batched_tokens=16,
                  kv_cache_memory_gib=0.05, max_model_len=128, block_size=8, load_progress=False,
                  kernel_backend=backend)
        first = llm.generate(prompts[:1], params)
        runs[backend] = first + llm.generate(prompts[1:], params)  # the last prompt hits the first's blocks
        assert llm.engine.block_manager.prefix_hits > 0
        assert llm.engine.block_manager.num_free_pages == llm.engine.block_manager.num_pages
    assert_same_generations(runs["torch"], runs["triton"])
