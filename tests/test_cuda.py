"""The GPU part of the suite (marker `cuda`; skipped, saying why, without a CUDA device): the Triton
kernels in bf16 against their torch fallbacks in fp32 (the fp32 comparisons are test_kernels.py
and test_saobp_kernels.py, which run natively wherever CUDA is), the engine on CUDA against the
CPU engine in fp32 for every architecture with a static decode step, and decode steps compiled and replayed as CUDA
graphs against the eager engine on CUDA, on mixed-depth batches with preemption.

Compiling is what takes the time on a GPU host (once per depth level of each engine), so each
architecture is compiled once: the engine test runs the eager CUDA engine against the CPU engine, and
the graphs test the compiled one against that eager engine. Engines take at most 8 sequences (buckets
2, 4 and 8) and a KV pool of a few hundred pages.

    pytest -m cuda            # on a GPU host (docs/gpu.md, bench/gpu/run.sh)
"""

from __future__ import annotations

import pytest
import torch

from depthserve import SamplingParams
from depthserve.kernels import flash
from depthserve.kernels.dispatch import Kernels
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import assert_same_generations, depth_params, tiny_llm
from tests.test_kernels import make_pool, random_tables
from tests.test_static_decode import (
    DEPTH_CASES,
    LENGTHS,
    _prompts,
    assert_same_report,
    case_arch,
    compiled_equals_eager,
)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the GPU tests run on a GPU host)")]

ARCHS = ["llama", *sorted(DEPTH_CASES)]
torch_ops, triton_ops = Kernels("torch"), Kernels("triton")


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.float() - reference.float()).norm() / reference.float().norm())


def _paged(batch, q_heads, kv_heads, head_dim, lens, block_size, dtype, seed):
    """Queries, a scrambled page pool and page tables laid out as test_kernels.py lays them, in `dtype`."""
    blocks = -(-max(lens) // block_size) + 1
    pages = batch * kv_heads * blocks + 3
    k, v = (pool.to(dtype) for pool in make_pool(pages, block_size, head_dim, seed))
    q = torch.randn(batch, q_heads, head_dim, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype)
    return q, k, v, random_tables(batch, kv_heads, blocks, pages, seed), torch.tensor(lens, device="cuda")


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, lens", [
    (9, 3, 64, [1, 100, 4096, 777]),  # SmolLM2's heads, ragged contexts
    (32, 8, 128, [2048, 33]),
    (4, 4, 64, [300, 5]),  # MHA, as SGT's head subsets reach the kernel (one table row per query head)
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_kernel_in_half_precision_matches_fp32(q_heads, kv_heads, head_dim, lens, dtype):
    q, k, v, table, context = _paged(len(lens), q_heads, kv_heads, head_dim, lens, 16, dtype, seed=len(lens))
    reference = torch_ops.paged_decode_attention(q.float(), k.float(), v.float(), table, context, 0.125)
    for tiles_per_split in (None, 1, 4):
        got = triton_ops.paged_decode_attention(q, k, v, table, context, 0.125, tiles_per_split)
        assert got.dtype == dtype and relative_error(got, reference) < 1e-2, tiles_per_split


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_prefill_and_saobp_kernels_in_half_precision_match_fp32(dtype):
    q, k, v, table, context = _paged(3, 6, 2, 64, [40, 130, 7], 16, dtype, seed=5)
    # 40, 30 and 7 queries: the second sequence's last 30 positions, a later chunk over cached keys
    starts = torch.tensor([0, 40, 70, 77], device="cuda")
    queries = torch.randn(77, 6, 64, device="cuda").to(dtype)
    reference = torch_ops.paged_prefill_attention_varlen(queries.float(), k.float(), v.float(), table, starts, context, 0.125)
    got = triton_ops.paged_prefill_attention_varlen(queries, k, v, table, starts, context, 0.125)
    assert relative_error(got, reference) < 1e-2

    bias = torch.randn(k.shape[0] * 3, 16, device="cuda") * 0.1
    bias_table = torch.randperm(bias.shape[0], device="cuda")[: 3 * 6 * table.shape[2]].view(3, 6, -1)
    for self_message in (False, True):
        expected, lse = torch_ops.saobp_decode_attention(q.float(), k.float(), v.float(), table, bias, bias_table,
                                                         context, 0.125, 0.5, self_message)
        out, got_lse = triton_ops.saobp_decode_attention(q, k, v, table, bias, bias_table, context, 0.125, 0.5,
                                                         self_message)
        assert relative_error(out, expected) < 1e-2 and relative_error(got_lse, lse) < 1e-2


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attends_chunks_that_start_their_sequences_in_half_precision(dtype, window):
    """The prefill op's CUDA form given the chunks' own keys (views of one fused QKV output, as a
    layer hands them over) runs torch's flash varlen kernel on this GPU and matches the fp32 torch
    reference over the pool that holds those keys; so does a sliding-window layer's (window 24)."""
    counts, q_heads, kv_heads, head_dim = [40, 130, 7], 9, 3, 64
    fused = torch.randn(sum(counts), q_heads + 2 * kv_heads, head_dim, device="cuda").to(dtype)
    q, k, v = fused.split([q_heads, kv_heads, kv_heads], dim=1)
    if not flash.torch_has_flash():
        pytest.skip(f"torch {torch.__version__} has no varlen_attn taking {sorted(flash.NEEDED_KEYWORDS)}: "
                    "every prefill chunk takes the Triton kernel")
    assert flash.runs(q, kv_heads), f"flash varlen attention does not run on {torch.cuda.get_device_name()}"
    table = random_tables(len(counts), kv_heads, -(-max(counts) // 16), 400, seed=2)
    k_pages, v_pages = (torch.zeros(400, 16, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    positions = torch.cat([torch.arange(n, device="cuda") for n in counts])
    owner = torch.cat([torch.full((n,), i, device="cuda") for i, n in enumerate(counts)])
    torch_ops.store_kv(k, v, k_pages, v_pages, table[owner, :, positions // 16] * 16 + (positions % 16)[:, None])
    starts = torch.tensor([0, 40, 170, 177], dtype=torch.int32, device="cuda")
    lens = torch.tensor(counts, dtype=torch.int32, device="cuda")
    windowed = () if window is None else (window,)
    reference = (torch_ops.paged_prefill_attention_varlen if window is None else
                 torch_ops.paged_window_prefill_attention)(q.float(), k_pages.float(), v_pages.float(), table, starts,
                                                           lens, 0.125, *windowed)
    got = (triton_ops.paged_prefill_attention_varlen if window is None else triton_ops.paged_window_prefill_attention)(
        q, k_pages, v_pages, table, starts, lens, 0.125, *windowed, max_queries=130, fresh_kv=(k, v))
    assert got.dtype == dtype and relative_error(got, reference) < 1e-2


def _mixed_batch(arch: str, tmp_path, tokenizer):
    options, depths, pages = DEPTH_CASES.get(arch, ({}, None, 96))
    path = make_tiny(case_arch(arch), tmp_path / arch, seed=11, tokenizer=tokenizer, **options)
    return path, depths, pages, _prompts()


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_on_cuda_generates_the_cpu_engines_tokens_in_fp32(arch, tmp_path, smollm_tokenizer):
    """Seven requests at mixed depths, prompts in chunks: the eager CUDA engine (Triton kernels) gives
    the CPU engine's greedy tokens and its logprobs within 1e-3 (the compiled engine with CUDA graphs
    equals the eager one: the next test)."""
    path, depths, pages, prompts = _mixed_batch(arch, tmp_path, smollm_tokenizer)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2) for _ in LENGTHS]
    depth = None if depths is None else [depth_params(d) for d in depths]
    # 400 pages, or the case's own budget where one request needs more (Inkling-2: 160 pages a block)
    engine_args = dict(pages=max(400, pages), max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16)
    expected = tiny_llm(path, **engine_args).generate(prompts, params, depth)
    llm = tiny_llm(path, device="cuda", enforce_eager=True, **engine_args)
    got = llm.generate(prompts, params, depth)
    assert_same_generations(expected, got, tol=1e-3)
    for e, g in zip(expected, got):
        assert_same_report(e.depth, g.depth)
    assert llm.engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graphs_equal_the_eager_engine_on_a_mixed_depth_batch_with_preemption(arch, tmp_path, smollm_tokenizer):
    """On CUDA the compiled decode step of every bucket is captured once and replayed: tokens,
    logprobs (1e-4) and depth reports equal the eager engine's, with preemption forcing recomputation."""
    path, depths, pages, prompts = _mixed_batch(arch, tmp_path, smollm_tokenizer)
    llm = compiled_equals_eager(path, pages=pages, depths=depths, device="cuda", prompts=prompts)
    static = llm.engine.runner.static
    assert static.cuda_graphs and set(static._graphs) == every_bucket_and_level(static)


def every_bucket_and_level(static) -> set[tuple[int, int | None]]:
    """The keys of the graphs that warm-up captures: one per (batch bucket, depth level cap)."""
    return {(size, level) for size in static.buckets for level in static.levels}
