"""Pieces the Triton kernels share: block sizes, paged key/value offsets, grouped scores and the
online softmax.

Kernels read keys through the page table one key at a time (`page = table[pos // block_size]`),
so any power-of-two block size works with tiles of any width. The query heads of one KV head
(a GQA group) are the rows of one matrix product against each key tile (`tl.dot`, padded to
MIN_DOT rows: on a GPU the tensor cores take them, and the group's keys are read once). fp32
inputs use IEEE fp32 dot products (no TF32), so results match the torch ops to float rounding;
bf16 / fp16 inputs multiply in their own type and accumulate in fp32. On CPU the kernels run only
under `TRITON_INTERPRET=1` (the tests).
"""

from __future__ import annotations

import triton
import triton.language as tl


DECODE_TILE = 64  # keys per tile of the decode kernels
MIN_DOT = 16  # the smallest side of a tl.dot operand: query-head groups are padded to it


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(int(n)))


@triton.jit
def paged_kv_offsets(table_row, table_stride_blk, max_blocks, pos, n_mask, d,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[N, D] element offsets into the K/V page pools of positions `pos`, through one page-table row."""
    block = pos // BLOCK_SIZE
    page = tl.load(table_row + block * table_stride_blk, mask=n_mask & (block < max_blocks), other=0)
    return (page.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * HEAD_DIM + d[None, :]


def group_rows(group: int) -> int:
    """Rows of a query-head group's tile: a power of two, at least MIN_DOT."""
    return pow2(group, MIN_DOT)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32: IEEE fp32 for fp32 inputs, else in the inputs' own type."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b.to(a.dtype))


@triton.jit
def group_scores(q, k, n_mask, scale, IEEE: tl.constexpr):
    """Scores [G, N] (fp32) of a query-head group [G, D] against a key tile [N, D], -inf beyond the keys."""
    s = dot(q, tl.trans(k), IEEE) * scale
    return tl.where(n_mask[None, :], s, float("-inf"))


@triton.jit
def running_logsumexp(m_i, l_i, z):
    """One key tile of a running log-sum-exp (max and rescaled sum), with no value accumulator."""
    m_new = tl.maximum(m_i, tl.max(z, axis=1))
    return m_new, l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)


@triton.jit
def online_softmax(m_i, l_i, acc, z, v, IEEE: tl.constexpr):
    """One key tile of the online softmax: running max, sum and weighted value sum (fp32)."""
    m_new = tl.maximum(m_i, tl.max(z, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(z - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
