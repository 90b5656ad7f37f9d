"""Triton kernels of the paged-attention family: KV store, split-K paged decode attention and
varlen causal prefill attention over the paged cache (torch versions: `kernels/paged.py`); the
prefill op's CUDA form hands chunks that start their sequences to torch's flash kernel
(kernels/flash.py)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from depthserve.kernels import flash
from depthserve.kernels import paged as torch_paged
from depthserve.kernels.paged import longest_chunk
from depthserve.kernels.triton.common import (DECODE_TILE, MIN_DOT, group_rows, group_scores, online_softmax,
                                              paged_kv_offsets, pow2)

# ---- KV store ---------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_pages_ptr, v_pages_ptr, index_ptr,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h, index_stride_t, index_stride_h,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)  # one (token, KV head)
    token = (row // NUM_HEADS).to(tl.int64)
    head = row % NUM_HEADS
    dst = tl.load(index_ptr + token * index_stride_t + head * index_stride_h).to(tl.int64)
    if dst >= 0:  # -1 marks a padding row
        d = tl.arange(0, BLOCK_D)
        mask = d < HEAD_DIM
        k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + d, mask=mask)
        v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + d, mask=mask)
        tl.store(k_pages_ptr + dst * HEAD_DIM + d, k.to(k_pages_ptr.dtype.element_ty), mask=mask)
        tl.store(v_pages_ptr + dst * HEAD_DIM + d, v.to(v_pages_ptr.dtype.element_ty), mask=mask)


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """`x` as [tokens, heads, head_dim] with unit stride along head_dim: a view where the strides
    allow one (the step's keys and values are views into the fused QKV output; copying them would
    be two more kernels per layer in a decode step), else a copy."""
    x = x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(k, v, k_pages, v_pages, slot_index) -> None:
    """Keys and values [tokens, KV heads, head_dim] (any token and head strides) into the pages at
    `slot_index` [tokens, KV heads] (any strides; -1: not stored)."""
    head_dim = k.shape[-1]
    keys, values = _rows_of_heads(k), _rows_of_heads(v)
    index = slot_index.reshape(keys.shape[0], keys.shape[1]) if slot_index.dim() != 2 else slot_index
    if index.numel() == 0:
        return
    _store_kv_kernel[(index.numel(),)](keys, values, k_pages, v_pages, index,
                                       keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
                                       index.stride(0), index.stride(1),
                                       NUM_HEADS=keys.shape[1], HEAD_DIM=head_dim, BLOCK_D=pow2(head_dim))


@triton.jit
def _longest_context(lens_ptr, batch, BLOCK_B: tl.constexpr):
    """The longest context of the batch (its lengths read BLOCK_B at a time)."""
    longest = tl.load(lens_ptr)
    for start in range(0, batch, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        longest = tl.maximum(longest, tl.max(tl.load(lens_ptr + rows, mask=rows < batch, other=0), axis=0))
    return longest


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, table_ptr, lens_ptr, part_acc_ptr, part_ml_ptr, out_ptr,
    scale, q_stride_b, q_stride_h, table_stride_b, table_stride_h, table_stride_blk, max_blocks, batch,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    """One (sequence, KV head, split): every query head of the group against the split's keys.
    With one split it writes the output; else its partial sum, max and normaliser. TILES_PER_SPLIT
    0: the NUM_SPLITS splits share the batch's longest context (splits past it find no key)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + b)
    if TILES_PER_SPLIT == 0:
        tiles_per_split = tl.cdiv(tl.cdiv(_longest_context(lens_ptr, batch, 128), BLOCK_N), NUM_SPLITS)
    else:
        tiles_per_split = TILES_PER_SPLIT
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_heads = kv_head * GROUP + g
    q_offs = (b.to(tl.int64) * q_stride_b + q_heads * q_stride_h)[:, None] + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    out_offs = (b * NUM_Q_HEADS + q_heads)[:, None] * HEAD_DIM + d[None, :]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = table_ptr + b * table_stride_b + kv_head * table_stride_h
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context)
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        n_mask = pos < end
        kv_offs = paged_kv_offsets(table_row, table_stride_blk, max_blocks, pos, n_mask, d, BLOCK_SIZE, HEAD_DIM)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_pages_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_pages_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = group_scores(q, k, n_mask, scale, IEEE)  # [G, N]
        m_i, l_i, acc = online_softmax(m_i, l_i, acc, s, v, IEEE)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:  # no reduction pass
        tl.store(out_ptr + out_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (b * NUM_Q_HEADS + q_heads) * NUM_SPLITS + split  # [G]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(part_acc_ptr, part_ml_ptr, out_ptr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)  # one (sequence, query head)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < NUM_SPLITS
    d_mask = d < HEAD_DIM
    base = row * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + base * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + base * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # empty splits weigh nothing
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


PROGRAMS_PER_SM = 4  # (sequence, KV head, split) programs per multiprocessor that split-K aims for


def decode_splits(batch: int, kv_heads: int, max_len: int, tile: int = DECODE_TILE, multiprocessors: int = 132) -> int:
    """Tiles per split: a context is split only when (sequence, KV head) pairs alone would leave the
    multiprocessors short of work, into as many splits as fill them (PROGRAMS_PER_SM each)."""
    tiles = max(1, triton.cdiv(max_len, tile))
    wanted = max(1, min(tiles, triton.cdiv(PROGRAMS_PER_SM * multiprocessors, max(1, batch * kv_heads))))
    return triton.cdiv(tiles, wanted)


def paged_decode_attention(q, k_pages, v_pages, page_table, context_lens, scale, tiles_per_split: int | None = None,
                           tile: int = DECODE_TILE, num_warps: int = 4, num_stages: int = 2):
    """Single-query paged attention (kernels/paged.py has the meaning). `tiles_per_split` (None:
    sized on the device, below), `tile` (keys per step of a program), `num_warps` and `num_stages`
    are the kernel's tuning knobs (bench/kernels.py sweeps them). `context_lens` int32 or int64, read
    as it is (the compiled step's lengths are int64: a conversion here was a copy kernel per layer).

    By default the grid has the splits `decode_splits` gives a context as long as the table (its
    most), and the kernel divides the batch's longest context among them: a table as wide as
    max_model_len (the CUDA-graph step's) with short contexts gets as many busy splits as a table
    as long as the contexts, and no host synchronisation reads the lengths."""
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return torch.empty_like(q)
    kv_heads, max_blocks = page_table.shape[1], page_table.shape[2]
    block_size = k_pages.shape[1]
    group = num_q_heads // kv_heads
    max_len = max_blocks * block_size
    tiles_at_width = tiles_per_split or decode_splits(batch, kv_heads, max_len, tile, _multiprocessors(q.device))
    num_splits = triton.cdiv(triton.cdiv(max_len, tile), tiles_at_width)
    if q.stride(-1) != 1:
        q = q.contiguous()  # (a view with unit head_dim stride is read in place: the rotary output's query part)
    out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_splits > 1:
        part_acc = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch, num_q_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:  # one split writes `out` itself
        part_acc = part_ml = torch.empty(1, dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(batch, kv_heads, num_splits)](
        q, k_pages, v_pages, page_table, context_lens, part_acc, part_ml, out,
        float(scale), q.stride(0), q.stride(1), page_table.stride(0), page_table.stride(1), page_table.stride(2),
        max_blocks, batch, NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_G=group_rows(group), HEAD_DIM=head_dim,
        BLOCK_D=pow2(head_dim, MIN_DOT), BLOCK_SIZE=block_size, BLOCK_N=tile,
        TILES_PER_SPLIT=tiles_per_split or 0, NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch * num_q_heads,)](
            part_acc, part_ml, out, HEAD_DIM=head_dim, BLOCK_D=pow2(head_dim),
            NUM_SPLITS=num_splits, BLOCK_S=pow2(num_splits),
        )
    return out


# ---- varlen causal prefill attention over the paged cache ------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, table_ptr, query_starts_ptr, lens_ptr, out_ptr,
    scale, table_stride_s, table_stride_h, table_stride_blk, max_blocks,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_starts_ptr + seq)
    num_queries = tl.load(query_starts_ptr + seq + 1) - q_start
    if m_block * BLOCK_M < num_queries:
        context = tl.load(lens_ptr + seq)
        first_pos = context - num_queries  # position of the sequence's first query
        m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        m_mask = m < num_queries
        d_mask = d < HEAD_DIM
        q_pos = first_pos + m
        q_offs = ((q_start + m) * NUM_Q_HEADS + head).to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table_row = table_ptr + seq * table_stride_s + (head // GROUP) * table_stride_h
        key_end = tl.minimum(first_pos + (m_block + 1) * BLOCK_M, context)  # causal: beyond the tile's last query
        n = tl.arange(0, BLOCK_N)
        for tile in range(0, key_end, BLOCK_N):
            pos = tile + n
            n_mask = pos < key_end
            kv_offs = paged_kv_offsets(table_row, table_stride_blk, max_blocks, pos, n_mask, d, BLOCK_SIZE, HEAD_DIM)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_pages_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_pages_ptr + kv_offs, mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # padded query rows see no key
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention_varlen(q, k_pages, v_pages, page_tables, query_starts, context_lens, scale, *,
                                   max_queries: int | None = None,
                                   fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
    """q [total_queries, num_q_heads, d] packed by sequence; page_tables [seqs, kv_heads, blocks];
    query_starts [seqs + 1]; context_lens [seqs] (keys visible to each sequence's last query);
    max_queries: the longest chunk's queries, which sizes the grid. The engine passes it from the
    host: reading it from the device would wait for the GPU to drain at every layer of a prefill
    step, exposing the host's launch time of the next layer.

    The op's CUDA form: `fresh_kv`, the chunks' own keys and values packed like q, is given when
    every chunk starts its sequence; then torch's flash varlen kernel attends over them where it
    runs (kernels/flash.py), and this kernel over the pool otherwise."""
    num_seqs = page_tables.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return torch.empty_like(q)
    if max_queries is None:
        max_queries = longest_chunk(query_starts)
    if (attended := flash.attend_fresh(q, fresh_kv, query_starts, max_queries, scale)) is not None:
        return attended
    out = torch.empty_like(q)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, max_blocks = page_tables.shape[1], page_tables.shape[2]
    block_m, block_n = 32, 32
    grid = (num_seqs, triton.cdiv(max_queries, block_m), num_q_heads)
    _prefill_kernel[grid](
        q.contiguous(), k_pages, v_pages, page_tables, query_starts, context_lens, out, float(scale),
        page_tables.stride(0), page_tables.stride(1), page_tables.stride(2), max_blocks,
        NUM_Q_HEADS=num_q_heads, GROUP=num_q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=pow2(head_dim, 16),
        BLOCK_SIZE=k_pages.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
    )
    return out


def paged_window_prefill_attention(q, k_pages, v_pages, page_tables, query_starts, context_lens, scale, window: int,
                                   *, max_queries: int | None = None,
                                   fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The windowed prefill op's CUDA form: chunks that start their sequences through flash with the
    window, others through the torch implementation (the varlen kernel above takes no window)."""
    if (attended := flash.attend_fresh(q, fresh_kv, query_starts, max_queries, scale, window)) is not None:
        return attended
    return torch_paged.paged_window_prefill_attention(q, k_pages, v_pages, page_tables, query_starts, context_lens,
                                                      scale, window)
