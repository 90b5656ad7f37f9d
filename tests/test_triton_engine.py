"""The engine with every Triton kernel forced on (interpreted on CPU) against the torch path:
the same greedy tokens and logprobs for a mixed batch with chunked prefill and prefix hits."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from depthserve import LLM, SamplingParams  # noqa: E402
from depthserve.kernels.dispatch import force_triton  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    # A small token budget: prompts are prefilled in chunks over earlier chunks' cache.
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_num_batched_tokens=16,
               kv_cache_memory_gib=0.05, max_model_len=128, block_size=8, load_progress=False)


def run(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True)
    return llm.generate(prompts, params)


def test_triton_path_matches_torch_path(llm):
    shared = "The history of the city of"
    prompts = [shared + " Rome", "Hi", shared + " Paris began when the first settlers arrived"]
    expected = run(llm, prompts)
    with force_triton():
        got = run(llm, prompts)  # the second run also hits the prefix cache of the first
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        for e_step, g_step, token in zip(e.logprobs, g.logprobs, g.token_ids):
            assert abs(g_step[token].logprob - e_step[token].logprob) < 1e-4
    assert llm.engine.block_manager.num_free_pages == llm.engine.block_manager.num_pages
