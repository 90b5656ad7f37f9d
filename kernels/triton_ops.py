"""Triton kernels for the engine's hot paths. Each op has a torch fallback of the same
signature and meaning in `torch_ops`; `dispatch` picks one per call by device.

Cache layout (see torch_ops): `k_pages`, `v_pages` are [num_pages, block_size, head_dim], one
page per (slot, KV head, token block). Kernels read keys through the page table one key at a
time (`page = table[pos // block_size]`), so any power-of-two block size works with tiles of
any width.

On CPU these kernels run only under `TRITON_INTERPRET=1` (the tests); fp32 inputs use IEEE
fp32 dot products (no TF32), so results match the torch ops to float rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(int(n)))


# ---- KV store ---------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_pages_ptr, v_pages_ptr, index_ptr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)  # one (token, KV head)
    dst = tl.load(index_ptr + row).to(tl.int64)
    if dst >= 0:  # -1 marks a padding row
        d = tl.arange(0, BLOCK_D)
        mask = d < HEAD_DIM
        src = row.to(tl.int64) * HEAD_DIM + d
        k = tl.load(k_ptr + src, mask=mask)
        v = tl.load(v_ptr + src, mask=mask)
        tl.store(k_pages_ptr + dst * HEAD_DIM + d, k.to(k_pages_ptr.dtype.element_ty), mask=mask)
        tl.store(v_pages_ptr + dst * HEAD_DIM + d, v.to(v_pages_ptr.dtype.element_ty), mask=mask)


def store_kv(k, v, k_pages, v_pages, slot_index) -> None:
    head_dim = k.shape[-1]
    keys = k.reshape(-1, head_dim).contiguous()
    values = v.reshape(-1, head_dim).contiguous()
    index = slot_index.reshape(-1).contiguous()
    if index.numel() == 0:
        return
    _store_kv_kernel[(index.numel(),)](keys, values, k_pages, v_pages, index,
                                       HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim))


# ---- paged decode attention (split-K, online softmax) -------------------------------------------


@triton.jit
def _paged_kv_offsets(table_row, table_stride_blk, max_blocks, pos, n_mask, d,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[N, D] element offsets into the K/V page pools of positions `pos`, through one page-table row."""
    block = pos // BLOCK_SIZE
    page = tl.load(table_row + block * table_stride_blk, mask=n_mask & (block < max_blocks), other=0)
    return (page.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * HEAD_DIM + d[None, :]


@triton.jit
def _group_scores(q, k, n_mask, scale):
    """Scores [G, N] of a query-head group against a key tile, -inf beyond the keys."""
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
    return tl.where(n_mask[None, :], s, float("-inf"))


@triton.jit
def _running_logsumexp(m_i, l_i, z):
    """One key tile of a running log-sum-exp (max and rescaled sum), with no value accumulator."""
    m_new = tl.maximum(m_i, tl.max(z, axis=1))
    return m_new, l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)


@triton.jit
def _online_softmax(m_i, l_i, acc, z, v):
    """One key tile of the online softmax: running max, sum and weighted value sum."""
    m_new = tl.maximum(m_i, tl.max(z, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(z - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, table_ptr, lens_ptr, part_acc_ptr, part_ml_ptr,
    scale, table_stride_b, table_stride_h, table_stride_blk, max_blocks,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_heads = kv_head * GROUP + g
    q_offs = (b * NUM_Q_HEADS + q_heads)[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = table_ptr + b * table_stride_b + kv_head * table_stride_h
    start = split * TILES_PER_SPLIT * BLOCK_N
    end = tl.minimum(start + TILES_PER_SPLIT * BLOCK_N, context)
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        n_mask = pos < end
        kv_offs = _paged_kv_offsets(table_row, table_stride_blk, max_blocks, pos, n_mask, d, BLOCK_SIZE, HEAD_DIM)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_pages_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_pages_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = _group_scores(q, k, n_mask, scale)  # [G, N]
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, s, v)

    part = (b * NUM_Q_HEADS + q_heads) * NUM_SPLITS + split  # [G]
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
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


_DECODE_TILE = 32
_TARGET_PROGRAMS = 512  # enough (sequence, KV head, split) programs to fill a large GPU


def decode_splits(batch: int, kv_heads: int, max_len: int, tile: int = _DECODE_TILE) -> int:
    """Tiles per split: split long contexts when there are too few (sequence, KV head) pairs."""
    tiles = max(1, triton.cdiv(max_len, tile))
    wanted = max(1, min(tiles, triton.cdiv(_TARGET_PROGRAMS, max(1, batch * kv_heads))))
    return triton.cdiv(tiles, wanted)


def paged_decode_attention(q, k_pages, v_pages, page_table, context_lens, scale, tiles_per_split: int | None = None):
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return torch.empty_like(q)
    kv_heads, max_blocks = page_table.shape[1], page_table.shape[2]
    block_size = k_pages.shape[1]
    group = num_q_heads // kv_heads
    max_len = max_blocks * block_size
    tiles_per_split = tiles_per_split or decode_splits(batch, kv_heads, max_len)
    num_splits = triton.cdiv(triton.cdiv(max_len, _DECODE_TILE), tiles_per_split)
    q = q.contiguous()
    part_acc = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch, num_q_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(batch, kv_heads, num_splits)](
        q, k_pages, v_pages, page_table, context_lens.to(torch.int32), part_acc, part_ml,
        float(scale), page_table.stride(0), page_table.stride(1), page_table.stride(2), max_blocks,
        NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_G=_pow2(group), HEAD_DIM=head_dim,
        BLOCK_D=_pow2(head_dim), BLOCK_SIZE=block_size, BLOCK_N=_DECODE_TILE,
        TILES_PER_SPLIT=tiles_per_split, NUM_SPLITS=num_splits,
    )
    out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    _decode_reduce_kernel[(batch * num_q_heads,)](
        part_acc, part_ml, out, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim),
        NUM_SPLITS=num_splits, BLOCK_S=_pow2(num_splits),
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
            kv_offs = _paged_kv_offsets(table_row, table_stride_blk, max_blocks, pos, n_mask, d, BLOCK_SIZE, HEAD_DIM)
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


def paged_prefill_attention_varlen(q, k_pages, v_pages, page_tables, query_starts, context_lens, scale):
    """q [total_queries, num_q_heads, d] packed by sequence; page_tables [seqs, kv_heads, blocks];
    query_starts [seqs + 1]; context_lens [seqs] (keys visible to each sequence's last query)."""
    num_seqs = page_tables.shape[0]
    out = torch.empty_like(q)
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, max_blocks = page_tables.shape[1], page_tables.shape[2]
    counts = query_starts[1:] - query_starts[:-1]
    block_m, block_n = 32, 32
    grid = (num_seqs, triton.cdiv(int(counts.max()), block_m), num_q_heads)
    _prefill_kernel[grid](
        q.contiguous(), k_pages, v_pages, page_tables, query_starts.to(torch.int32),
        context_lens.to(torch.int32), out, float(scale), page_tables.stride(0), page_tables.stride(1), page_tables.stride(2), max_blocks,
        NUM_Q_HEADS=num_q_heads, GROUP=num_q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim, 16),
        BLOCK_SIZE=k_pages.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
    )
    return out


# ---- ITT routed step ------------------------------------------------------------------------------


@triton.jit
def _itt_route_kernel(y_ptr, w_ptr, bias, thr_ptr, scores_ptr, slot_ptr, rows_ptr, count_ptr, num_rows,
                      DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: score every row, select by threshold, compact the selected rows in order."""
    offset = tl.program_id(0) * 0  # an int32 scalar carried through the loop
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    for start in range(0, num_rows, BLOCK_R):
        rows = start + r
        r_mask = rows < num_rows
        logit = tl.zeros([BLOCK_R], tl.float32)
        for k in range(0, DIM, BLOCK_D):
            cols = k + d
            c_mask = cols < DIM
            y = tl.load(y_ptr + rows.to(tl.int64)[:, None] * DIM + cols[None, :],
                        mask=r_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
            logit += tl.sum(y * w[None, :], axis=1)
        score = tl.sigmoid(logit + bias)
        thr = tl.load(thr_ptr + rows, mask=r_mask, other=float("inf"))
        enabled = thr < float("inf")  # +inf: the step is off for this row's request
        selected = (score >= thr) & enabled & r_mask
        rank = tl.cumsum(selected.to(tl.int32), axis=0)
        slot = tl.where(selected, offset + rank - 1, tl.where(enabled, -1, -2))
        tl.store(scores_ptr + rows, score, mask=r_mask)
        tl.store(slot_ptr + rows, slot, mask=r_mask)
        tl.store(rows_ptr + offset + rank - 1, rows, mask=selected)
        offset += tl.sum(selected.to(tl.int32), axis=0)
    tl.store(count_ptr, offset)


def itt_route(y, router_weight, router_bias: float, thresholds):
    num_rows, dim = y.shape
    scores = torch.empty(num_rows, dtype=torch.float32, device=y.device)
    slot_of_row = torch.empty(num_rows, dtype=torch.int32, device=y.device)
    rows = torch.empty(num_rows, dtype=torch.int32, device=y.device)
    count = torch.zeros(1, dtype=torch.int32, device=y.device)
    if num_rows:
        _itt_route_kernel[(1,)](y.contiguous(), router_weight.contiguous(), float(router_bias),
                                thresholds.to(torch.float32).contiguous(), scores, slot_of_row, rows, count, num_rows,
                                DIM=dim, BLOCK_R=128, BLOCK_D=min(_pow2(dim), 128))
    selected = int(count.item())
    return scores, slot_of_row, rows[:selected].long()


@triton.jit
def _itt_update_kernel(y_ptr, f_ptr, slot_ptr, scores_ptr, phi_ptr, alpha,
                       DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAPER_SKIP: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    d = tl.arange(0, BLOCK_D)
    offs = row.to(tl.int64) * DIM + d
    mask = d < DIM
    phi = tl.load(phi_ptr + d, mask=mask, other=0.0).to(tl.float32)
    if slot >= 0:  # selected: y += alpha * s * f_t(y) * phi_t
        y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
        f = tl.load(f_ptr + slot.to(tl.int64) * DIM + d, mask=mask).to(tl.float32)
        s = tl.load(scores_ptr + row)
        tl.store(y_ptr + offs, (y + alpha * s * f * phi).to(y_ptr.dtype.element_ty), mask=mask)
    elif slot == -1:
        if PAPER_SKIP:  # skipped: y += y * phi_t
            y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
            tl.store(y_ptr + offs, (y + y * phi).to(y_ptr.dtype.element_ty), mask=mask)


def itt_update(y, step_out, slot_of_row, scores, phi, alpha: float, skip_rule: str) -> None:
    num_rows, dim = y.shape
    if num_rows == 0:
        return
    _itt_update_kernel[(num_rows,)](y, step_out.contiguous(), slot_of_row.to(torch.int32), scores, phi.contiguous(),
                                    float(alpha), DIM=dim, BLOCK_D=_pow2(dim), PAPER_SKIP=skip_rule == "paper")


# ---- per-token depth attention (Dreamer DA) ----------------------------------------------------


@triton.jit
def _depth_attention_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, out_ptr, scale,
                            NUM_HEADS: tl.constexpr, MAX_DEPTH: tl.constexpr, BLOCK_T: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    valid = tl.load(valid_ptr + token)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_mask = t < valid
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (token * NUM_HEADS + head) * HEAD_DIM + d, mask=d_mask, other=0.0).to(tl.float32)
    kv_offs = ((token * MAX_DEPTH + t) * NUM_HEADS + head).to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
    s = tl.where(t_mask, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s, axis=0))
    out = tl.sum(p[:, None] * v, axis=0) / tl.sum(p, axis=0)
    tl.store(out_ptr + (token * NUM_HEADS + head) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def depth_attention(q, k_cache, v_cache, num_valid, scale):
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    max_depth = k_cache.shape[1]
    _depth_attention_kernel[(num_tokens, num_heads)](
        q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), num_valid.to(torch.int32), out, float(scale),
        NUM_HEADS=num_heads, MAX_DEPTH=max_depth, BLOCK_T=_pow2(max_depth), HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim),
    )
    return out


# ---- SAOBP: decode attention with a per-key bias, and the bias update (depth-semantics 5) ------------
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
    SELF_MESSAGE: tl.constexpr,
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
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    table_row = table_ptr + b * t_sb + kv_head * t_sh
    bias_rows = bias_table_ptr + b * bt_sb + q_heads[:, None] * bt_sh  # [G, 1]

    # Raw scores' running max / sum: their log-sum-exp normalises A_j (the self message and the update).
    m_raw = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_raw = tl.zeros([BLOCK_G], tl.float32)
    if SELF_MESSAGE:  # pass 1: A_j first
        for tile in range(0, context, BLOCK_N):
            pos = tile + n
            n_mask = pos < context
            kv_offs = _paged_kv_offsets(table_row, t_sblk, max_blocks, pos, n_mask, d, BLOCK_SIZE, HEAD_DIM)
            k = tl.load(k_pages_ptr + kv_offs, mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            s = _group_scores(q, k, n_mask, scale)
            m_raw, l_raw = _running_logsumexp(m_raw, l_raw, s)
        lse_known = m_raw + tl.log(l_raw)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(0, context, BLOCK_N):
        pos = tile + n
        n_mask = pos < context
        block = pos // BLOCK_SIZE
        kv_offs = _paged_kv_offsets(table_row, t_sblk, max_blocks, pos, n_mask, d, BLOCK_SIZE, HEAD_DIM)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_pages_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_pages_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = _group_scores(q, k, n_mask, scale)  # [G, N]
        # The cached bias of keys before the newest one (the newest has none yet).
        cached = g_mask[:, None] & (pos < context - 1)[None, :]
        row = tl.load(bias_rows + block[None, :] * bt_sblk, mask=cached, other=0)
        bias = tl.load(bias_ptr + row.to(tl.int64) * BLOCK_SIZE + (pos % BLOCK_SIZE)[None, :], mask=cached, other=0.0)
        if SELF_MESSAGE:
            bias += _log1p(tl.exp(s - lse_known[:, None]) * coef)
        else:
            m_raw, l_raw = _running_logsumexp(m_raw, l_raw, s)
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, s + bias, v)
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
        q.contiguous(), k_pages, v_pages, page_table, bias_pages, bias_table, context_lens.to(torch.int32), out, lse,
        float(scale), float(coef), page_table.stride(0), page_table.stride(1), page_table.stride(2),
        bias_table.stride(0), bias_table.stride(1), bias_table.stride(2), max_blocks,
        NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_G=_pow2(group), HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim),
        BLOCK_SIZE=k_pages.shape[1], BLOCK_N=_DECODE_TILE, SELF_MESSAGE=bool(self_message),
    )
    return out, lse


@triton.jit
def _saobp_bias_update_kernel(
    q_ptr, k_pages_ptr, table_ptr, bias_ptr, bias_table_ptr, lens_ptr, lse_ptr,
    scale, coef, t_sb, t_sh, t_sblk, bt_sb, bt_sh, bt_sblk, max_blocks,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
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
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + b * NUM_Q_HEADS + q_heads, mask=g_mask, other=0.0)
        block = pos // BLOCK_SIZE
        kv_offs = _paged_kv_offsets(table_ptr + b * t_sb + kv_head * t_sh, t_sblk, max_blocks, pos, n_mask, d,
                                    BLOCK_SIZE, HEAD_DIM)
        k = tl.load(k_pages_ptr + kv_offs, mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        s = _group_scores(q, k, n_mask, scale)  # [G, N]
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
    block_n = _DECODE_TILE
    tiles = triton.cdiv(max_blocks * k_pages.shape[1], block_n)
    _saobp_bias_update_kernel[(batch, kv_heads, tiles)](
        q.contiguous(), k_pages, page_table, bias_pages, bias_table, context_lens.to(torch.int32),
        lse.to(torch.float32).contiguous(), float(scale), float(coef),
        page_table.stride(0), page_table.stride(1), page_table.stride(2),
        bias_table.stride(0), bias_table.stride(1), bias_table.stride(2), max_blocks,
        NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_G=_pow2(group), HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim),
        BLOCK_SIZE=k_pages.shape[1], BLOCK_N=block_n,
    )
