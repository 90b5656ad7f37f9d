"""Torch reference implementations of the paged-cache ops (the CPU path).

Cache layout: `k_pages`, `v_pages` are [num_pages, block_size, head_dim]; a page holds one
KV head of one slot for `block_size` consecutive tokens. A page table row lists, per token
block, the pages of the slot's heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_pages: torch.Tensor,  # [num_pages, block_size, head_dim]
    v_pages: torch.Tensor,
    slot_index: torch.Tensor,  # [num_tokens, num_kv_heads] flat index page * block_size + offset
) -> None:
    """Write each token's keys/values at its (page, offset). Rows with index -1 are padding."""
    head_dim = k.shape[-1]
    index = slot_index.reshape(-1)
    keys = k.reshape(-1, head_dim)
    values = v.reshape(-1, head_dim)
    if bool((index < 0).any()):
        keep = index >= 0
        index, keys, values = index[keep], keys[keep], values[keep]
    k_pages.view(-1, head_dim).index_copy_(0, index, keys.to(k_pages.dtype))
    v_pages.view(-1, head_dim).index_copy_(0, index, values.to(v_pages.dtype))


def gather_kv(
    pages: torch.Tensor,  # [num_pages, block_size, head_dim]
    page_table: torch.Tensor,  # [batch, num_kv_heads, num_blocks]
) -> torch.Tensor:
    """[batch, num_kv_heads, num_blocks * block_size, head_dim], in token order."""
    batch, heads, blocks = page_table.shape
    _, block_size, head_dim = pages.shape
    gathered = pages.index_select(0, page_table.reshape(-1))
    return gathered.view(batch, heads, blocks * block_size, head_dim)


def paged_decode_attention(
    q: torch.Tensor,  # [batch, num_q_heads, head_dim], one query per sequence
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,  # [batch, num_kv_heads, num_blocks]; padding blocks may hold any page
    context_lens: torch.Tensor,  # [batch] keys visible to each query (its own included)
    scale: float,
) -> torch.Tensor:
    """Single-query attention over each sequence's paged keys. Returns [batch, num_q_heads, head_dim].

    GQA by grouping the query heads of each KV head into one small matmul ([group, d] x [d, len]);
    on CPU this beats SDPA with a mask and enable_gqa by about 20% at decode shapes.
    """
    batch, num_q_heads, head_dim = q.shape
    keys = gather_kv(k_pages, page_table)  # [batch, kv_heads, max_len, d]
    values = gather_kv(v_pages, page_table)
    num_kv_heads, max_len = keys.shape[1], keys.shape[2]
    query = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim).to(keys.dtype)
    scores = torch.matmul(query, keys.transpose(-1, -2)).float().mul_(scale)  # [batch, kv_heads, group, max_len]
    beyond = torch.arange(max_len, device=q.device)[None, :] >= context_lens[:, None]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, num_q_heads, head_dim)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_queries, num_q_heads, head_dim], positions start..start+n-1 of one sequence
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,  # [num_kv_heads, num_blocks] of this sequence
    context_len: int,  # keys visible to the last query (start + num_queries)
    scale: float,
) -> torch.Tensor:
    """Causal attention of a prompt chunk over its sequence's cache (earlier chunks and prefix hits included)."""
    num_queries = q.shape[0]
    keys = gather_kv(k_pages, page_table[None])[0, :, :context_len]
    values = gather_kv(v_pages, page_table[None])[0, :, :context_len]
    start = context_len - num_queries
    # 4-d inputs (a batch of one): on CPU only those reach SDPA's flash kernel; 3-d ones take
    # the unfused math path, 1.5-2x slower at prompt-chunk sizes.
    query = q.transpose(0, 1).to(keys.dtype)[None]  # [1, heads, n, d]
    keys, values = keys[None], values[None]
    gqa = q.shape[1] != keys.shape[1]
    if start == 0:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        key_pos = torch.arange(context_len, device=q.device)
        query_pos = torch.arange(start, context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def paged_prefill_attention_varlen(
    q: torch.Tensor,  # [total_queries, num_q_heads, head_dim], packed by sequence
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_tables: torch.Tensor,  # [num_seqs, num_kv_heads, num_blocks]
    query_starts: torch.Tensor,  # [num_seqs + 1] row of each sequence's first query
    context_lens: torch.Tensor,  # [num_seqs] keys visible to each sequence's last query
    scale: float,
) -> torch.Tensor:
    """Causal attention of several packed prompt chunks, each over its own sequence's cache."""
    out = torch.empty_like(q)
    starts = query_starts.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        rows = slice(starts[i], starts[i + 1])
        if rows.start < rows.stop:
            out[rows] = paged_prefill_attention(q[rows], k_pages, v_pages, page_tables[i], context_len, scale)
    return out


def itt_route(
    y: torch.Tensor,  # [rows, d] states entering an ITT step
    router_weight: torch.Tensor,  # [d]
    router_bias: float,
    thresholds: torch.Tensor,  # [rows] fp32; +inf where the row's request has the step off
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router score s = sigmoid(r·y + b) in fp32 and causal threshold selection (s >= tau).

    Returns (scores [rows] fp32, slot_of_row [rows] int32: the row's index among the selected
    rows, -1 if skipped, -2 if the step is off for it, selected_rows [selected] int64 in order).
    """
    scores = torch.sigmoid(y.float() @ router_weight.float() + router_bias)
    enabled = thresholds < float("inf")
    selected = (scores >= thresholds) & enabled
    rank = torch.cumsum(selected.to(torch.int32), dim=0) - 1
    off = torch.full_like(rank, -2, dtype=torch.int32)
    slot_of_row = torch.where(selected, rank.to(torch.int32), torch.where(enabled, off + 1, off))
    return scores, slot_of_row, selected.nonzero().squeeze(1)


def itt_update(
    y: torch.Tensor,  # [rows, d], updated in place
    step_out: torch.Tensor,  # [selected, d] f_t(y) of the selected rows, in selection order
    slot_of_row: torch.Tensor,  # [rows] from itt_route
    scores: torch.Tensor,  # [rows] fp32
    phi: torch.Tensor,  # [d] step encoding phi_t
    alpha: float,
    skip_rule: str,  # "paper": y += y * phi_t for skipped rows; "identity": unchanged
) -> None:
    """ITT step update (depth-semantics 2): selected y += alpha * s * f_t(y) * phi_t.

    Computed densely over all rows and blended with `where` (a decode batch has few rows, and a
    fixed handful of ops costs less than gathering and scattering the selected and skipped rows)."""
    phi = phi.float()
    old = y.float()
    new = old * (1 + phi) if skip_rule == "paper" else old
    new = torch.where((slot_of_row == -1).unsqueeze(1), new, old)
    if len(step_out):
        selected = (slot_of_row >= 0).unsqueeze(1)
        f = step_out.index_select(0, slot_of_row.clamp(min=0).long()).float()
        new = torch.where(selected, old + (alpha * scores).unsqueeze(1) * f * phi, new)
    y.copy_(new)


def depth_attention(
    q: torch.Tensor,  # [tokens, heads, d]
    k_cache: torch.Tensor,  # [tokens, max_depth, heads, d] each token's own depth states
    v_cache: torch.Tensor,
    num_valid: torch.Tensor,  # [tokens] depth entries each token has written (>= 1)
    scale: float,
) -> torch.Tensor:
    """Each token attends over its own first num_valid depth states (Dreamer DA)."""
    scores = torch.einsum("thd,tjhd->thj", q.float(), k_cache.float()) * scale
    beyond = torch.arange(k_cache.shape[1], device=q.device)[None, :] >= num_valid[:, None]
    scores.masked_fill_(beyond[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("thj,tjhd->thd", probs, v_cache.float()).to(q.dtype)


# ---- SAOBP: attention with a running per-key bias (depth-semantics section 5) -----------------------
# The bias lives in `bias_pages` [num_rows, block_size] fp32; `bias_table[..., h, block]` is the row
# holding (that head, that token block). log(M_ik / m_0) = log1p(A_ik * coef), coef = 1/m_0 - 1.


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
    bias_pages.view(-1).index_copy_(0, index[mask], values[mask].to(bias_pages.dtype))


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
