"""Paged attention over the KV page pool: the torch implementations (the CPU path and the
reference of the Triton kernels in `triton/paged.py`).

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
    keep = index >= 0
    masked_index_copy_(k_pages.view(-1, head_dim), index, k.reshape(-1, head_dim).to(k_pages.dtype), keep)
    masked_index_copy_(v_pages.view(-1, head_dim), index, v.reshape(-1, head_dim).to(v_pages.dtype), keep)


def masked_index_copy_(dest: torch.Tensor, index: torch.Tensor, source: torch.Tensor, keep: torch.Tensor) -> None:
    """dest[index[i]] = source[i] where keep[i]; rows not kept change nothing.

    Without a data-dependent shape or branch (no host synchronisation, so it can run inside a
    CUDA-graph capture and traces whole under torch.compile): a row not kept is written too, as a
    copy of the first kept row (the same index and the same value, so the duplicate write is
    harmless in any order), or, when no row is kept, as dest[0] onto itself.
    """
    if index.numel() == 0:
        return
    index = index.long()
    if dest.device.type == "cpu" and not torch.compiler.is_compiling():
        # Eager on the CPU the host reads the mask at no cost: the plain copy, a dozen fewer
        # dispatched ops per call (two calls per layer in a batch-1 decode step).
        if not bool(keep.all()):
            index, source = index[keep], source[keep]
        dest.index_copy_(0, index, source)
        return
    first = torch.argmax(keep.to(torch.uint8)).view(1)  # the first kept row (0 when none is)
    any_kept = keep.index_select(0, first)  # [1] (a tensor index, not an item: nothing leaves the device)
    stand_in_index = torch.where(any_kept, index.index_select(0, first), 0)
    row_shape = (-1,) + (1,) * (source.dim() - 1)
    stand_in_row = torch.where(any_kept.view(row_shape), source.index_select(0, first), dest[:1])
    dest.index_copy_(0, torch.where(keep, index, stand_in_index),
                     torch.where(keep.view(row_shape), source, stand_in_row))


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
    window: int | None = None,  # keys a query sees, its own included (sliding-window layers); None: all
) -> torch.Tensor:
    """Single-query attention over each sequence's paged keys. Returns [batch, num_q_heads, head_dim].

    GQA by giving each KV head its group of query heads as a group of query rows: one SDPA call
    over [batch, kv_heads, group, d] queries and [batch, kv_heads, len, d] keys, with the keys past
    each context masked. On CPU that reaches SDPA's fused kernel: two batched matmuls around a
    softmax take 3x as long in bf16 at batch 1 (1.5x in fp32) on a 2-core Intel Xeon (AVX-512 BF16,
    AMX), and SDPA with `enable_gqa` and one query row per head longer still.
    """
    batch, num_q_heads, head_dim = q.shape
    keys = gather_kv(k_pages, page_table)  # [batch, kv_heads, max_len, d]
    values = gather_kv(v_pages, page_table)
    num_kv_heads, max_len = keys.shape[1], keys.shape[2]
    query = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim).to(keys.dtype)
    key_pos = torch.arange(max_len, device=q.device)[None, :]
    visible = key_pos < context_lens[:, None]
    if window is not None:
        visible = visible & (key_pos >= context_lens[:, None] - window)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


def paged_window_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                  page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  window: int) -> torch.Tensor:
    """paged_decode_attention of a sliding-window layer: its own op, since only this form and the
    native CPU kernel take a window (the Triton kernel attends over the whole context)."""
    return paged_decode_attention(q, k_pages, v_pages, page_table, context_lens, scale, window)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_queries, num_q_heads, head_dim], positions start..start+n-1 of one sequence
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,  # [num_kv_heads, num_blocks] of this sequence
    context_len: int,  # keys visible to the last query (start + num_queries)
    scale: float,
    window: int | None = None,  # keys a query sees, its own included (sliding-window layers); None: all
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
    if start == 0 and window is None:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        key_pos = torch.arange(context_len, device=q.device)
        query_pos = torch.arange(start, context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if window is not None:
            mask = mask & (key_pos[None, :] > query_pos[:, None] - window)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def longest_chunk(query_starts: torch.Tensor) -> int:
    """The most queries of any chunk packed by `query_starts` [seqs + 1] (a device read, and so a
    wait for the device, where it lives on a GPU: the engine passes `max_queries` instead)."""
    return int((query_starts[1:] - query_starts[:-1]).max())


def paged_prefill_attention_varlen(
    q: torch.Tensor,  # [total_queries, num_q_heads, head_dim], packed by sequence
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_tables: torch.Tensor,  # [num_seqs, num_kv_heads, num_blocks]
    query_starts: torch.Tensor,  # [num_seqs + 1] row of each sequence's first query
    context_lens: torch.Tensor,  # [num_seqs] keys visible to each sequence's last query
    scale: float,
    window: int | None = None,  # keys a query sees, its own included (sliding-window layers); None: all
    *,
    max_queries: int | None = None,  # the longest chunk's queries where the caller knows it (unused here)
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # the chunks' own keys/values (unused here)
) -> torch.Tensor:
    """Causal attention of several packed prompt chunks, each over its own sequence's cache.

    `fresh_kv`: given when every chunk starts its sequence, the chunks' own keys and values
    ([total_queries, num_kv_heads, head_dim], packed like q and already stored in the pool), which
    are then all the keys there are; a form may attend over them instead of reading the pool (the
    CUDA form does, kernels/flash.py). This form reads the pool."""
    out = torch.empty_like(q)
    starts = query_starts.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        rows = slice(starts[i], starts[i + 1])
        if rows.start < rows.stop:
            out[rows] = paged_prefill_attention(q[rows], k_pages, v_pages, page_tables[i], context_len, scale, window)
    return out


def paged_window_prefill_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                   page_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                                   scale: float, window: int, *, max_queries: int | None = None,
                                   fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """paged_prefill_attention_varlen of a sliding-window layer: its own op, since the Triton varlen
    kernel takes no window (its CUDA form hands fresh chunks to flash with the window, and the rest to
    this implementation)."""
    return paged_prefill_attention_varlen(q, k_pages, v_pages, page_tables, query_starts, context_lens, scale, window)
