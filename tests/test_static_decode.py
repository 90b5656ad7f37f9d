"""Decode steps at static shapes through the compiled forward (depthserve/engine/static_decode.py):
equal to the eager engine (greedy tokens identical, logprobs within 1e-4, the same depth reports)
on mixed batches with mixed depth, chunked prefill and preemption, for every architecture with a
static decode spec; compiled with fullgraph=True once at start-up and never again while serving;
padding rows writing nothing to the cache; and the enforce_eager switch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from depthserve import SamplingParams
from depthserve.engine.static_decode import DecodeRow, decode_buckets
from depthserve.tiny import make_tiny
from tests.depth_helpers import assert_same_generations, depth_params, stream_prompts, tiny_llm

LENGTHS = [3, 17, 9, 30, 5, 12, 41]
# Architectures with a static decode step beyond Llama: make_tiny options, the depth of each request of
# the mixed batch (GQA SGT with an uneven head subset; ITT steps on and off; Dreamer with attention
# experts; SAOBP has no knobs) and a page budget that forces preemption.
DEPTH_CASES = {
    "sgt": (dict(num_kv_heads=2), [{"loops": 0}, {"loops": 2}, None, {"loops": {1: 0, 2: 3}}, {"loops": 3},
                                   {"loops": 1}, {"loops": {3: 2}}], 120),
    "put": ({}, [{"loops": 1}, {"loops": 3}, None, {"loops": 2}, {"loops": 1}, {"loops": 2}, {"loops": 3}], 150),
    "itt": (dict(num_kv_heads=2), [{"selection_ratios": [0.3, 0.7]}, {"selection_ratios": [1.0, 0.0]}, None,
                                   {"thinking_steps": 0}, {"selection_ratios": [0.7, 1.0]}, {"thinking_steps": 1},
                                   {"selection_ratios": [0.0, 0.5]}], 150),
    "saobp": (dict(num_kv_heads=2, variant="low", self_message=True), [None] * len(LENGTHS), 90),
    "dreamer": (dict(attn_experts=3, da_rope="reversed_half"),
                [{"depth": 1}, {"depth": 4}, None, {"depth": 2}, {"depth": 3}, {"depth": 1}, {"depth": 2}], 90),
}


@pytest.fixture(scope="module")
def path(tmp_path_factory, smollm_tokenizer):
    return make_tiny("llama", tmp_path_factory.mktemp("static") / "llama", seed=3, tokenizer=smollm_tokenizer)


@pytest.fixture(scope="module")
def compiled(path):
    return tiny_llm(path, max_model_len=128, max_num_seqs=8, enforce_eager=False)


def _prompts(vocab_size: int = 49152) -> list[list[int]]:
    return stream_prompts(LENGTHS, seed=1, stride=9, vocab_size=vocab_size)


def test_buckets_cover_every_batch_size():
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(200) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 200)
    assert decode_buckets(3) == (1, 2, 3) and decode_buckets(1) == (1,)


def assert_same_report(expected, got) -> None:
    """Equal depth reports; routing decisions (arrays) compared element by element."""
    if expected is None:
        assert got is None
        return
    assert dataclasses.replace(got, decisions=None) == dataclasses.replace(expected, decisions=None)
    for name, value in (expected.decisions or {}).items():
        np.testing.assert_array_equal(got.decisions[name], value, err_msg=name)


def compiled_equals_eager(path, pages: int, depths=None, device: str = "cpu", prompts=None):
    """Seven requests over a budget of pages that forces preemption, prompts prefilled in chunks:
    the compiled engine's tokens, logprobs and depth reports are the eager engine's, its decode
    steps ran at static shapes, and nothing compiled after start-up. Returns the compiled engine."""
    from torch._dynamo.utils import counters

    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2) for _ in LENGTHS]
    depth = None if depths is None else [depth_params(d) for d in depths]
    engines = {}
    for enforce_eager in (True, False):
        engines[enforce_eager] = tiny_llm(path, pages=pages, max_model_len=64, max_num_seqs=8, device=device,
                                          max_num_batched_tokens=16, enforce_eager=enforce_eager)
    eager, llm = engines[True], engines[False]
    assert eager.engine.runner.static is None
    prompts = prompts or _prompts()
    expected = eager.generate(prompts, params, depth)
    graphs, warm_up_steps = counters["stats"]["unique_graphs"], llm.engine.runner.static.steps
    got = llm.generate(prompts, params, depth)
    assert llm.engine.runner.static.steps > warm_up_steps + 10, "decode steps were meant to run at static shapes"
    assert llm.engine.scheduler.num_preemptions > 0, "the page budget was meant to force preemption"
    assert counters["stats"]["unique_graphs"] == graphs, "a decode step compiled after start-up"
    assert_same_generations(expected, got)
    for e, g in zip(expected, got):
        assert_same_report(e.depth, g.depth)
    assert llm.engine.block_manager.num_used_pages == 0
    return llm


@pytest.mark.slow
def test_compiled_decode_equals_eager_on_a_mixed_batch_with_preemption(path):
    compiled_equals_eager(path, pages=96)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(DEPTH_CASES))
def test_compiled_depth_decode_equals_eager_on_a_mixed_depth_batch(arch, tmp_path, smollm_tokenizer):
    """The same for the depth architectures, every request of the batch at its own depth."""
    options, depths, pages = DEPTH_CASES[arch]
    path = make_tiny(arch, tmp_path / arch, seed=11, tokenizer=smollm_tokenizer, **options)
    compiled_equals_eager(path, pages=pages, depths=depths)


# Batches shallower than the model's deepest setting (the DEPTH_CASES checkpoints).
SHALLOW = {
    "sgt": [{"loops": 0}, {"loops": 1}, {"loops": {1: 0, 2: 1}}, {"loops": 0}, {"loops": 1}, {"loops": 0}, {"loops": 1}],
    "itt": [{"thinking_steps": 0}, {"selection_ratios": [0.6, 0.0]}, {"thinking_steps": 1}, {"thinking_steps": 0},
            {"selection_ratios": [1.0, 0.0]}, {"thinking_steps": 0}, {"thinking_steps": 1}],
    "put": [{"loops": 1}, {"loops": 2}, {"loops": 1}, {"loops": 2}, {"loops": 1}, {"loops": 1}, {"loops": 2}],
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(SHALLOW))
def test_a_shallow_batch_runs_capped_below_the_deepest_level_and_equals_eager(arch, tmp_path, smollm_tokenizer):
    """Every request below the model's deepest setting: the compiled steps run capped at the batch's
    deepest level (iterations past it are not computed), with the eager engine's results."""
    options, _, pages = DEPTH_CASES[arch]
    path = make_tiny(arch, tmp_path / arch, seed=11, tokenizer=smollm_tokenizer, **options)
    static = compiled_equals_eager(path, pages=pages, depths=SHALLOW[arch]).engine.runner.static
    assert static.level_steps and max(static.level_steps) < static.spec.levels[-1], (static.level_steps,
                                                                                     static.spec.levels)


def test_padding_rows_write_nothing_and_leave_real_rows_alone(compiled):
    """Three rows padded to a bucket of four: the step writes exactly the three rows' cache slots,
    and each real row's hidden state is the one it gets alone (bucket 1)."""
    static, pool = compiled.engine.runner.static, compiled.engine.runner.pool
    assert static.bucket(3) == 4
    width = static.width
    tables = [np.arange(b * width, (b + 2) * width, dtype=np.int64).reshape(2, width) + 1 for b in range(0, 6, 2)]
    bs = static.block_size
    rows = [DecodeRow(token, position, table, table[position // bs] * bs + position % bs, np.zeros(0, np.float32),
                      np.zeros(0, np.int64), np.zeros(0, np.int64))
            for token, position, table in zip([5, 17, 99], [3, 9, 12], tables)]
    before = pool.k_pages.clone()
    batched = static.run(rows)
    changed = (pool.k_pages != before).any(-1).nonzero().tolist()  # (page, offset) pairs written
    written = sorted([int(p), row.position % bs] for row in rows for p in row.table[row.position // bs])
    assert sorted(changed) == written
    for i, row in enumerate(rows):
        torch.testing.assert_close(static.run([row])[0], batched[i], atol=1e-5, rtol=0)


def test_enforce_eager_and_the_default_on_cpu(path):
    assert tiny_llm(path, max_model_len=64).engine.runner.static is None  # CPU default: eager
    assert tiny_llm(path, max_model_len=64, enforce_eager=True).engine.runner.static is None
