"""A request's greedy output must not depend on what else is in the batch.

Runs the 16 mixed-length requests of tests/batch_workload.py alone (the `alone_outputs` fixture),
then together with chunked prefill (a small per-step token budget) and a KV cache small enough to
force preemption; differences only at near-ties (batch_workload.compare).
"""

from __future__ import annotations

import pytest

from depthserve import LLM
from tests.batch_workload import MAX_TOKENS, PARAMS, compare, prompts

pytestmark = pytest.mark.slow  # part of make test, left out of make test-fast


def test_batch_with_chunked_prefill(alone_outputs, smollm_tokenizer):
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", load_progress=False,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    batched = llm.generate(prompts(smollm_tokenizer), PARAMS)
    compare(alone_outputs, batched)
    assert llm.engine.block_manager.num_used_pages == 0


def test_batch_with_forced_preemption(alone_outputs, smollm_tokenizer):
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", load_progress=False,
              max_num_batched_tokens=96, max_model_len=512, kv_cache_memory_gib=0.03,
              enable_prefix_caching=False)
    batched = llm.generate(prompts(smollm_tokenizer), PARAMS)
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for all 16"
    print("preemptions:", llm.engine.scheduler.num_preemptions)
    compare(alone_outputs, batched)
    assert llm.engine.block_manager.num_used_pages == 0
    assert all(len(out.token_ids) == MAX_TOKENS for out in batched)
