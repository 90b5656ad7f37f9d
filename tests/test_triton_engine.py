"""The engine on the Triton kernel backend against the torch backend: the same greedy tokens and
logprobs for a mixed batch with chunked prefill and prefix hits. On CUDA it runs a Llama of
SmolLM2's shapes (random weights) natively; on CPU (the Triton interpreter, ~100x slower) a tiny
Llama of the same family."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from depthserve import LLM, SamplingParams  # noqa: E402
from depthserve.lab.make_tiny import make_tiny  # noqa: E402
from tests.depth_helpers import assert_same_generations, kernel_test_device  # noqa: E402

pytestmark = pytest.mark.slow  # part of make test, left out of make test-fast


def test_triton_path_matches_torch_path(tmp_path, smollm_tokenizer):
    shared = "The history of the city of Rome is long, and the"
    prompts = [shared + " Colosseum", "Hi", shared + " Tiber river"]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True)
    device = kernel_test_device()
    like = "smollm2-135m-instruct" if device == "cuda" else None
    model = str(make_tiny("llama", tmp_path / "llama", seed=6, like=like, tokenizer=smollm_tokenizer))
    runs = {}
    for backend in ("torch", "triton"):
        # A small token budget: prompts are prefilled in chunks over earlier chunks' cache.
        llm = LLM(model, dtype="float32", device=device, max_num_batched_tokens=16,
                  kv_cache_memory_gib=0.05, max_model_len=128, block_size=8, load_progress=False,
                  kernel_backend=backend)
        first = llm.generate(prompts[:1], params)
        runs[backend] = first + llm.generate(prompts[1:], params)  # the last prompt hits the first's blocks
        assert llm.engine.block_manager.prefix_hits > 0
        assert llm.engine.block_manager.num_free_pages == llm.engine.block_manager.num_pages
    assert_same_generations(runs["torch"], runs["triton"])
