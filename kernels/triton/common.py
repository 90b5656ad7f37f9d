"""Pieces the Triton kernels share: block sizes, paged key/value offsets, grouped scores and the
online softmax.

Kernels read keys through the page table one key at a time (`page = table[pos // block_size]`),
so any power-of-two block size works with tiles of any width. On CPU they run only under
`TRITON_INTERPRET=1` (the tests); fp32 inputs use IEEE fp32 dot products (no TF32), so results
match the torch ops to float rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl


DECODE_TILE = 32  # keys per tile of the decode kernels


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(int(n)))


@triton.jit
def paged_kv_offsets(table_row, table_stride_blk, max_blocks, pos, n_mask, d,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[N, D] element offsets into the K/V page pools of positions `pos`, through one page-table row."""
    block = pos // BLOCK_SIZE
    page = tl.load(table_row + block * table_stride_blk, mask=n_mask & (block < max_blocks), other=0)
    return (page.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * HEAD_DIM + d[None, :]


@triton.jit
def group_scores(q, k, n_mask, scale):
    """Scores [G, N] of a query-head group against a key tile, -inf beyond the keys."""
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
    return tl.where(n_mask[None, :], s, float("-inf"))


@triton.jit
def running_logsumexp(m_i, l_i, z):
    """One key tile of a running log-sum-exp (max and rescaled sum), with no value accumulator."""
    m_new = tl.maximum(m_i, tl.max(z, axis=1))
    return m_new, l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)


@triton.jit
def online_softmax(m_i, l_i, acc, z, v):
    """One key tile of the online softmax: running max, sum and weighted value sum."""
    m_new = tl.maximum(m_i, tl.max(z, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(z - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
