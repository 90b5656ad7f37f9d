"""The torch fallbacks of the ops a compiled decode step calls run inside a CUDA-graph capture on
CUDA with kernel_backend="torch", so they must never synchronise with the host (a data-dependent
branch, `.item()`, `.tolist()`, a boolean-mask index): capture fails with "operation not permitted
when stream is capturing". The portable proof, on CPU: each traces whole under
torch.compile(fullgraph=True) (a data-dependent branch or `.item()` is a graph break, which fails)
into a graph where no tensor has a data-dependent shape (what a boolean-mask index or `nonzero`
traces to: an unbacked size, which the device can only report by synchronising), and the traced op
gives the eager op's results (padding rows included)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from depthserve.kernels import depth, paged, saobp
from depthserve.kernels.library import SCHEMAS


def no_data_dependent_shapes(graph: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """A torch.compile backend that runs the traced graph as is, after checking that no value in it
    has a size only the data decides."""
    for node in graph.graph.nodes:
        unbacked = free_unbacked_symbols(node.meta.get("example_value"))
        assert not unbacked, f"{node.format_node()} has a data-dependent size {unbacked}: a host synchronisation"
    return graph


def traced(op):
    """`op` traced whole by dynamo, shapes dynamic, with no data-dependent size (module docstring)."""
    torch._dynamo.reset()
    return torch.compile(op, fullgraph=True, dynamic=True, backend=no_data_dependent_shapes)


def paged_case(seed: int = 0, padding_rows: int = 1):
    """Three sequences over a pool of 12 pages (block size 4, 2 KV heads, 4 query heads), the last
    `padding_rows` of them padding (write index -1)."""
    gen = torch.Generator().manual_seed(seed)
    k_pages, v_pages = torch.randn(2, 12, 4, 8, generator=gen)
    table = torch.randperm(12, generator=gen)[:12].view(3, 2, 2).to(torch.int32)  # [batch, kv heads, blocks]
    lens = torch.tensor([5, 8, 1])
    q = torch.randn(3, 4, 8, generator=gen)
    write = table[:, :, 0].long() * 4 + 1
    write[len(write) - padding_rows:] = -1
    return q, k_pages, v_pages, table, lens, write


@pytest.mark.parametrize("padding_rows", [0, 1, 3])
def test_store_kv_traces_whole_and_skips_padding_rows(padding_rows):
    q, k_pages, v_pages, table, _, write = paged_case(padding_rows=padding_rows)
    k, v = torch.randn(2, 3, 2, 8)
    expected_k, expected_v = k_pages.clone(), v_pages.clone()
    for row, index in zip(range(3), write):
        for head in range(2):
            if index[head] >= 0:
                expected_k.view(-1, 8)[index[head]] = k[row, head]
                expected_v.view(-1, 8)[index[head]] = v[row, head]
    traced(paged.store_kv)(k, v, k_pages, v_pages, write)
    assert torch.equal(k_pages, expected_k) and torch.equal(v_pages, expected_v)


def test_masked_index_copy_leaves_rows_not_kept_alone():
    dest = torch.arange(10.0)
    index = torch.tensor([3, 7, 0, 7])
    source = torch.tensor([30.0, 70.0, 100.0, 77.0])
    keep = torch.tensor([True, False, False, False])
    traced(paged.masked_index_copy_)(dest, index, source, keep)
    assert dest.tolist() == [0.0, 1.0, 2.0, 30.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    traced(paged.masked_index_copy_)(dest, index, source, torch.zeros(4, dtype=torch.bool))
    assert dest.tolist() == [0.0, 1.0, 2.0, 30.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]


def test_paged_decode_attention_traces_whole():
    q, k_pages, v_pages, table, lens, _ = paged_case()
    expected = paged.paged_decode_attention(q, k_pages, v_pages, table, lens, 0.3)
    torch.testing.assert_close(traced(paged.paged_decode_attention)(q, k_pages, v_pages, table, lens, 0.3), expected)


def test_depth_attention_traces_whole():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, 8, generator=gen)
    k, v = torch.randn(2, 3, 4, 2, 8, generator=gen)
    valid = torch.tensor([1, 4, 2])
    expected = depth.depth_attention(q, k, v, valid, 0.5)
    torch.testing.assert_close(traced(depth.depth_attention)(q, k, v, valid, 0.5), expected)


@pytest.mark.parametrize("self_message", [False, True])
def test_saobp_decode_and_bias_update_trace_whole(self_message):
    q, k_pages, v_pages, table, lens, _ = paged_case(seed=3)
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(30, 4, generator=gen)
    bias_table = torch.randperm(30, generator=gen)[:24].view(3, 4, 2)  # [batch, q heads, blocks]
    coef = math.expm1(1.0)
    args = (q, k_pages, v_pages, table, bias, bias_table, lens, 0.3, coef, self_message)
    expected, expected_lse = saobp.saobp_decode_attention(*args)
    out, lse = traced(saobp.saobp_decode_attention)(*args)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)
    expected_bias, got_bias = bias.clone(), bias.clone()
    saobp.saobp_bias_update(q, k_pages, table, expected_bias, bias_table, lens, lse, 0.3, coef)
    traced(saobp.saobp_bias_update)(q, k_pages, table, got_bias, bias_table, lens, lse, 0.3, coef)
    torch.testing.assert_close(got_bias, expected_bias)
    # Keys at or beyond each context were left alone (rows 2's context is its one new key).
    untouched = torch.ones_like(bias, dtype=torch.bool)
    for b, length in enumerate(lens.tolist()):
        for pos in range(length):
            untouched[bias_table[b, :, pos // 4], pos % 4] = False
    assert torch.equal(got_bias[untouched], bias[untouched])


def test_every_decode_op_is_covered():
    """The ops a compiled decode step calls (kernels/library.py) are the ones traced above."""
    assert set(SCHEMAS) == {"store_kv", "paged_decode_attention", "depth_attention", "saobp_decode_attention",
                            "saobp_bias_update"}
