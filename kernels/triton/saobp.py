"""Triton kernels of SAOBP's bias-reading decode attention and bias update (torch versions:
`kernels/saobp.py`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from depthserve.kernels.triton.common import (DECODE_TILE, MIN_DOT, group_rows, group_scores, online_softmax,
                                              paged_kv_offsets, pow2, running_logsumexp)

# ---- SAOBP: decode attention with a per-key bias, and the bias update (docs/depth-semantics.md 5) ------------
# bias_pages [num_rows, block_size] fp32; bias_table [batch, num_q_heads, blocks] row ids (any strides).
# log(M_jk / m_0) = log1p(A_jk * coef) with coef = 1/m_0 - 1; A_jk = exp(s_jk - lse_j).


@triton.jit
def _log1p(x):
    # Accurate for tiny |x| (1 + x rounds to 1: the answer is x), where log(1 + x) would drop terms.
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _saobp_decode_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, table_ptr, bias_ptr, bias_table_ptr, lens_ptr, out_ptr, lse_ptr,
    scale, coef, t_sb, t_sh, t_sblk, bt_sb, bt_sh, bt_sblk, max_blocks,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SELF_MESSAGE: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    context = tl.load(lens_ptr + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_heads = kv_head * GROUP + g
    q_offs = (b * NUM_Q_HEADS + q_heads)[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    table_row = table_ptr + b * t_sb + kv_head * t_sh
    bias_rows = bias_table_ptr + b * bt_sb + q_heads[:, None] * bt_sh  # [G, 1]

    # Raw scores' running max / sum: their log-sum-exp normalises A_j (the self message and the update).
    m_raw = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_raw = tl.zeros([BLOCK_G], tl.float32)
    if SELF_MESSAGE:  # pass 1: A_j first
        for tile in range(0, context, BLOCK_N):
            pos = tile + n
            n_mask = pos < context
            kv_offs = paged_kv_offsets(table_row, t_sblk, max_blocks, pos, n_mask, d, BLOCK_SIZE, HEAD_DIM)
            k = tl.load(k_pages_ptr + kv_offs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            s = group_scores(q, k, n_mask, scale, IEEE)
            m_raw, l_raw = running_logsumexp(m_raw, l_raw, s)
        lse_known = m_raw + tl.log(l_raw)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(0, context, BLOCK_N):
        pos = tile + n
        n_mask = pos < context
        block = pos // BLOCK_SIZE
        kv_offs = paged_kv_offsets(table_row, t_sblk, max_blocks, pos, n_mask, d, BLOCK_SIZE, HEAD_DIM)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_pages_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_pages_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = group_scores(q, k, n_mask, scale, IEEE)  # [G, N]
        # The cached bias of keys before the newest one (the newest has none yet).
        cached = g_mask[:, None] & (pos < context - 1)[None, :]
        row = tl.load(bias_rows + block[None, :] * bt_sblk, mask=cached, other=0)
        bias = tl.load(bias_ptr + row.to(tl.int64) * BLOCK_SIZE + (pos % BLOCK_SIZE)[None, :], mask=cached, other=0.0)
        if SELF_MESSAGE:
            bias += _log1p(tl.exp(s - lse_known[:, None]) * coef)
        else:
            m_raw, l_raw = running_logsumexp(m_raw, l_raw, s)
        m_i, l_i, acc = online_softmax(m_i, l_i, acc, s + bias, v, IEEE)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + b * NUM_Q_HEADS + q_heads, m_raw + tl.log(l_raw), mask=g_mask)


def saobp_decode_attention(q, k_pages, v_pages, page_table, bias_pages, bias_table, context_lens, scale,
                           coef: float, self_message: bool):
    batch, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    kv_heads, max_blocks = page_table.shape[1], page_table.shape[2]
    group = num_q_heads // kv_heads
    _saobp_decode_kernel[(batch, kv_heads)](
        q.contiguous(), k_pages, v_pages, page_table, bias_pages, bias_table, context_lens, out, lse,
        float(scale), float(coef), page_table.stride(0), page_table.stride(1), page_table.stride(2),
        bias_table.stride(0), bias_table.stride(1), bias_table.stride(2), max_blocks,
        NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_G=group_rows(group), HEAD_DIM=head_dim,
        BLOCK_D=pow2(head_dim, MIN_DOT), BLOCK_SIZE=k_pages.shape[1], BLOCK_N=DECODE_TILE,
        SELF_MESSAGE=bool(self_message), IEEE=q.dtype == torch.float32,
    )
    return out, lse


@triton.jit
def _saobp_bias_update_kernel(
    q_ptr, k_pages_ptr, table_ptr, bias_ptr, bias_table_ptr, lens_ptr, lse_ptr,
    scale, coef, t_sb, t_sh, t_sblk, bt_sb, bt_sh, bt_sblk, max_blocks,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) * BLOCK_N
    context = tl.load(lens_ptr + b)
    if tile < context:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        pos = tile + tl.arange(0, BLOCK_N)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        n_mask = pos < context
        q_heads = kv_head * GROUP + g
        q = tl.load(q_ptr + (b * NUM_Q_HEADS + q_heads)[:, None] * HEAD_DIM + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        lse = tl.load(lse_ptr + b * NUM_Q_HEADS + q_heads, mask=g_mask, other=0.0)
        block = pos // BLOCK_SIZE
        kv_offs = paged_kv_offsets(table_ptr + b * t_sb + kv_head * t_sh, t_sblk, max_blocks, pos, n_mask, d,
                                    BLOCK_SIZE, HEAD_DIM)
        k = tl.load(k_pages_ptr + kv_offs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        s = group_scores(q, k, n_mask, scale, IEEE)  # [G, N]
        term = _log1p(tl.exp(s - lse[:, None]) * coef)
        write = g_mask[:, None] & n_mask[None, :]
        row = tl.load(bias_table_ptr + b * bt_sb + q_heads[:, None] * bt_sh + block[None, :] * bt_sblk,
                      mask=write, other=0)
        addr = row.to(tl.int64) * BLOCK_SIZE + (pos % BLOCK_SIZE)[None, :]
        old = tl.load(bias_ptr + addr, mask=write & (pos < context - 1)[None, :], other=0.0)  # the newest: set
        tl.store(bias_ptr + addr, old + term, mask=write)


def saobp_bias_update(q, k_pages, page_table, bias_pages, bias_table, context_lens, lse, scale, coef: float) -> None:
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return
    kv_heads, max_blocks = page_table.shape[1], page_table.shape[2]
    group = num_q_heads // kv_heads
    block_n = DECODE_TILE
    tiles = triton.cdiv(max_blocks * k_pages.shape[1], block_n)
    _saobp_bias_update_kernel[(batch, kv_heads, tiles)](
        q.contiguous(), k_pages, page_table, bias_pages, bias_table, context_lens,
        lse.to(torch.float32).contiguous(), float(scale), float(coef),
        page_table.stride(0), page_table.stride(1), page_table.stride(2),
        bias_table.stride(0), bias_table.stride(1), bias_table.stride(2), max_blocks,
        NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_G=group_rows(group), HEAD_DIM=head_dim,
        BLOCK_D=pow2(head_dim, MIN_DOT), BLOCK_SIZE=k_pages.shape[1], BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
    )
