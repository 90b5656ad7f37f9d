"""Decode steps at static shapes through the compiled forward (depthserve/engine/static_decode.py):
equal to the eager engine (greedy tokens identical, logprobs within 1e-4) on a mixed batch with
chunked prefill and preemption, compiled with fullgraph=True once at start-up and never again
while serving, padding rows writing nothing to the cache, and the enforce_eager switch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthserve import SamplingParams
from depthserve.engine.static_decode import DecodeRow, decode_buckets
from depthserve.tiny import make_tiny, synthetic_streams
from tests.depth_helpers import assert_same_generations, tiny_llm

LENGTHS = [3, 17, 9, 30, 5, 12, 41]


@pytest.fixture(scope="module")
def path(tmp_path_factory, smollm_tokenizer):
    return make_tiny("llama", tmp_path_factory.mktemp("static") / "llama", seed=3, tokenizer=smollm_tokenizer)


@pytest.fixture(scope="module")
def compiled(path):
    return tiny_llm(path, max_model_len=128, max_num_seqs=8, enforce_eager=False)


def _prompts() -> list[list[int]]:
    stream = synthetic_streams(49152, 1, 400, seed=1)[0].tolist()
    return [stream[i * 9 : i * 9 + n] for i, n in enumerate(LENGTHS)]


def test_buckets_cover_every_batch_size():
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(200) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 200)
    assert decode_buckets(3) == (1, 2, 3) and decode_buckets(1) == (1,)


@pytest.mark.slow
def test_compiled_decode_equals_eager_on_a_mixed_batch_with_preemption(path, compiled):
    """Seven requests over a budget of pages that forces preemption, prompts prefilled in chunks:
    the compiled engine's tokens and logprobs are the eager engine's; nothing compiles after start-up."""
    from torch._dynamo.utils import counters

    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2) for _ in LENGTHS]
    eager = tiny_llm(path, pages=96, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16,
                     enforce_eager=True)
    assert eager.engine.runner.static is None
    expected = eager.generate(_prompts(), params)
    llm = tiny_llm(path, pages=96, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16,
                   enforce_eager=False)
    graphs = counters["stats"]["unique_graphs"]
    got = llm.generate(_prompts(), params)
    assert llm.engine.scheduler.num_preemptions > 0, "the page budget was meant to force preemption"
    assert counters["stats"]["unique_graphs"] == graphs, "a decode step compiled after start-up"
    assert_same_generations(expected, got)
    assert llm.engine.block_manager.num_used_pages == 0


def test_padding_rows_write_nothing_and_leave_real_rows_alone(compiled):
    """Three rows padded to a bucket of four: the step writes exactly the three rows' cache slots,
    and each real row's hidden state is the one it gets alone (bucket 1)."""
    static, pool = compiled.engine.runner.static, compiled.engine.runner.pool
    assert static.bucket(3) == 4
    width = static.width
    tables = [np.arange(b * width, (b + 2) * width, dtype=np.int64).reshape(2, width) + 1 for b in range(0, 6, 2)]
    rows = [DecodeRow(token, position, table) for token, position, table in zip([5, 17, 99], [3, 9, 12], tables)]
    before = pool.k_pages.clone()
    batched = static.run(rows)
    changed = (pool.k_pages != before).any(-1).nonzero().tolist()  # (page, offset) pairs written
    bs = static.block_size
    written = sorted([int(p), row.position % bs] for row in rows for p in row.table[row.position // bs])
    assert sorted(changed) == written
    for i, row in enumerate(rows):
        torch.testing.assert_close(static.run([row])[0], batched[i], atol=1e-5, rtol=0)


def test_enforce_eager_and_the_default_on_cpu(path):
    assert tiny_llm(path, max_model_len=64).engine.runner.static is None  # CPU default: eager
    assert tiny_llm(path, max_model_len=64, enforce_eager=True).engine.runner.static is None
