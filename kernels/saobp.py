"""SAOBP attention with a running per-key bias (docs/depth-semantics.md section 5). The torch
implementations; Triton kernels (decode and bias update) in `triton/saobp.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from depthserve.kernels.paged import gather_kv, masked_index_copy_

# ---- SAOBP: attention with a running per-key bias (docs/depth-semantics.md section 5) -----------------------
# The bias lives in `bias_pages` [num_rows, block_size] fp32; `bias_table[..., h, block]` is the row
# holding (that head, that token block). log(M_ik / m_0) = log1p(A_ik * coef), coef = 1/m_0 - 1.


def pool_bias_rows(k_pages: torch.Tensor) -> torch.Tensor:
    """[num_pages * R, block_size] fp32: the K pool's storage as bias rows, R = head_dim * itemsize / 4
    per page (where the engine keeps SAOBP's bias: archs/saobp/format.py)."""
    num_pages, block_size = k_pages.shape[0], k_pages.shape[1]
    return k_pages.view(num_pages, -1).view(torch.float32).view(-1, block_size)


def gather_bias(bias_pages: torch.Tensor, bias_table: torch.Tensor) -> torch.Tensor:
    """[batch, heads, num_blocks * block_size] bias in token order (bias_table [batch, heads, blocks])."""
    batch, heads, blocks = bias_table.shape
    return bias_pages.index_select(0, bias_table.reshape(-1)).view(batch, heads, blocks * bias_pages.shape[1])


def _scatter_bias(bias_pages, bias_table, values, keep) -> None:
    """bias[b, h, pos] = values[b, h, pos] where keep[b, pos] (values [batch, heads, len])."""
    batch, heads, length = values.shape
    bs = bias_pages.shape[1]
    pos = torch.arange(length, device=values.device)
    index = bias_table[:, :, pos // bs] * bs + pos % bs  # [batch, heads, len]
    mask = keep[:, None, :].expand(batch, heads, length)
    masked_index_copy_(bias_pages.view(-1), index.reshape(-1), values.reshape(-1).to(bias_pages.dtype),
                       mask.reshape(-1))


def _saobp_scores(q, k_pages, page_table, scale):
    """Raw scaled scores [batch, num_q_heads, max_len] fp32 of one query per sequence."""
    batch, num_q_heads, head_dim = q.shape
    keys = gather_kv(k_pages, page_table)
    num_kv_heads, max_len = keys.shape[1], keys.shape[2]
    query = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim).to(keys.dtype)
    scores = torch.matmul(query, keys.transpose(-1, -2)).float().mul_(scale)
    return scores.view(batch, num_q_heads, max_len)


def saobp_decode_attention(
    q: torch.Tensor,  # [batch, num_q_heads, head_dim], one query per sequence (at position context_len - 1)
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,  # [batch, num_kv_heads, num_blocks]
    bias_pages: torch.Tensor,  # [num_rows, block_size] fp32
    bias_table: torch.Tensor,  # [batch, num_q_heads, num_blocks] bias row ids
    context_lens: torch.Tensor,  # [batch] keys visible (the query's own, newest key included)
    scale: float,
    coef: float,
    self_message: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(s + c) V with the cached bias c of keys < context_len - 1 (the newest key has none yet;
    with `self_message` the row's own log1p(A * coef) is added). Returns (out [batch, H, d],
    lse [batch, H] fp32: the log-sum-exp of the raw scores, for `saobp_bias_update`)."""
    batch, num_q_heads, head_dim = q.shape
    scores = _saobp_scores(q, k_pages, page_table, scale)
    max_len = scores.shape[-1]
    pos = torch.arange(max_len, device=q.device)
    ctx = context_lens.to(pos.dtype)[:, None]
    scores.masked_fill_((pos[None, :] >= ctx)[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    cached = pos[None, :] < ctx - 1
    bias = torch.where(cached[:, None, :], gather_bias(bias_pages, bias_table)[..., :max_len], 0.0)
    if self_message:
        bias = bias + torch.log1p(torch.exp(scores - lse[..., None]) * coef)
    probs = torch.softmax(scores + bias, dim=-1)
    values = gather_kv(v_pages, page_table)  # [batch, kv_heads, max_len, d]
    num_kv_heads = values.shape[1]
    probs = probs.view(batch, num_kv_heads, num_q_heads // num_kv_heads, max_len).to(values.dtype)
    out = torch.matmul(probs, values).view(batch, num_q_heads, head_dim).to(q.dtype)
    return out, lse


def saobp_bias_update(
    q: torch.Tensor,  # [batch, num_q_heads, head_dim] the rows just computed
    k_pages: torch.Tensor,
    page_table: torch.Tensor,  # [batch, num_kv_heads, num_blocks]
    bias_pages: torch.Tensor,  # [num_rows, block_size] fp32, updated in place
    bias_table: torch.Tensor,  # [batch, num_q_heads, num_blocks]
    context_lens: torch.Tensor,  # [batch]
    lse: torch.Tensor,  # [batch, num_q_heads] from saobp_decode_attention
    scale: float,
    coef: float,
) -> None:
    """After row j = context_len - 1: c_k += log1p(A_jk * coef) for k < j, and c_j = log1p(A_jj * coef)."""
    scores = _saobp_scores(q, k_pages, page_table, scale)
    max_len = scores.shape[-1]
    pos = torch.arange(max_len, device=q.device)
    ctx = context_lens.to(pos.dtype)[:, None]
    term = torch.log1p(torch.exp(scores - lse[..., None].float()) * coef)
    old = torch.where((pos[None, :] < ctx - 1)[:, None, :], gather_bias(bias_pages, bias_table)[..., :max_len], 0.0)
    _scatter_bias(bias_pages, bias_table, old + term, pos[None, :] < ctx)


def saobp_prefill_attention(
    q: torch.Tensor,  # [total_queries, num_q_heads, head_dim], packed by sequence
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_tables: torch.Tensor,  # [num_seqs, num_kv_heads, num_blocks]
    bias_pages: torch.Tensor,  # [num_rows, block_size] fp32, updated in place
    bias_tables: torch.Tensor,  # [num_seqs, num_q_heads, num_bias_blocks]
    query_starts: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs] keys visible to each chunk's last query
    scale: float,
    coef: float,
    self_message: bool,
) -> torch.Tensor:
    """SAOBP attention of packed prompt chunks: row j of a chunk [start, end) sees the cached bias of
    keys < start plus the terms of the chunk's rows i < j (i <= j with the self message); afterwards
    every key's bias holds the terms of all rows < end. Materialises [heads, chunk, context]."""
    out = torch.empty_like(q)
    starts = query_starts.tolist()
    num_q_heads = q.shape[1]
    bs = bias_pages.shape[1]
    for i, context_len in enumerate(context_lens.tolist()):
        rows = slice(starts[i], starts[i + 1])
        n = rows.stop - rows.start
        if n == 0:
            continue
        start = context_len - n
        keys = gather_kv(k_pages, page_tables[i][None])[0, :, :context_len]  # [kv, ctx, d]
        values = gather_kv(v_pages, page_tables[i][None])[0, :, :context_len]
        group = num_q_heads // keys.shape[0]
        query = q[rows].transpose(0, 1).float()  # [H, n, d]
        scores = torch.matmul(query, keys.float().repeat_interleave(group, 0).transpose(-1, -2)) * scale
        key_pos = torch.arange(context_len, device=q.device)
        query_pos = torch.arange(start, context_len, device=q.device)
        scores.masked_fill_((key_pos[None, :] > query_pos[:, None])[None], float("-inf"))
        terms = torch.log1p(torch.softmax(scores, dim=-1) * coef)  # [H, n, ctx]; 0 where masked
        running = torch.cumsum(terms, dim=1)  # inclusive over the chunk's rows
        table = bias_tables[i][None, :, : -(-context_len // bs)]
        cached = torch.where(key_pos < start, gather_bias(bias_pages, table)[0, :, :context_len], 0.0)  # [H, ctx]
        within = running if self_message else running - terms
        probs = torch.softmax(scores + cached[:, None, :] + within, dim=-1)
        out[rows] = torch.matmul(probs.to(values.dtype), values.repeat_interleave(group, 0)).transpose(0, 1).to(q.dtype)
        _scatter_bias(bias_pages, table, (cached + running[:, -1])[None], torch.ones(1, context_len, dtype=torch.bool,
                                                                                         device=q.device))
    return out
