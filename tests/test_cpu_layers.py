"""The CPU path's own layouts against plain formulas: column-blocked linears and paged prefill
attention (which must give the same numbers whichever SDPA kernel torch picks for it)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from depthserve.kernels import paged
from depthserve.layers.linear import CpuLinear, column_splits


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("out_features, bias", [(96, False), (96, True), (7, False), (8192, False)])
def test_cpu_linear_equals_linear(threads, out_features, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, out_features, bias=bias)
    cpu = CpuLinear(linear, threads=threads)
    assert out_features % cpu.splits == 0 and cpu.splits <= threads
    # Row counts on both sides of the oneDNN range of wide layers, and a 3-d input.
    for shape in [(1, 48), (4, 48), (5, 48), (33, 48), (49, 48), (300, 48), (2, 3, 48)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(cpu(x), linear(x), rtol=1e-5, atol=1e-5)


def test_column_splits_divide_the_output():
    assert column_splits(3072, 2) == 2
    assert column_splits(576, 16) == 16
    assert column_splits(7, 2) == 1
    assert column_splits(9, 4) == 3
    assert column_splits(10, 0) == 1


def _naive_causal_attention(q, keys, values, start, scale):
    """q [n, H, d] at positions start.., keys/values [H_kv, L, d]: softmax over keys at or before each query."""
    group = q.shape[1] // keys.shape[0]
    k = keys.repeat_interleave(group, 0).double()
    v = values.repeat_interleave(group, 0).double()
    scores = torch.einsum("nhd,hld->hnl", q.double(), k) * scale
    query_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(keys.shape[1])[None, :] > query_pos, -math.inf)
    return torch.einsum("hnl,hld->nhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("start, num_queries", [(0, 21), (13, 8), (16, 1)])
def test_paged_prefill_attention_is_causal_attention(q_heads, kv_heads, start, num_queries):
    gen = torch.Generator().manual_seed(start + num_queries)
    block_size, head_dim, num_pages = 4, 16, 40
    context_len = start + num_queries
    blocks = -(-context_len // block_size)
    k_pages = torch.randn(num_pages, block_size, head_dim, generator=gen)
    v_pages = torch.randn(num_pages, block_size, head_dim, generator=gen)
    table = torch.randperm(num_pages, generator=gen)[: kv_heads * blocks].view(kv_heads, blocks)
    q = torch.randn(num_queries, q_heads, head_dim, generator=gen)
    scale = head_dim**-0.5

    out = paged.paged_prefill_attention(q, k_pages, v_pages, table, context_len, scale)

    keys = k_pages[table].reshape(kv_heads, blocks * block_size, head_dim)[:, :context_len]
    values = v_pages[table].reshape(kv_heads, blocks * block_size, head_dim)[:, :context_len]
    torch.testing.assert_close(out, _naive_causal_attention(q, keys, values, start, scale), rtol=1e-5, atol=1e-5)
