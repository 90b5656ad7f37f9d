"""What Inkling-2's layers read from the paged cache beyond plain attention, on torch ops
(docs/depth-semantics.md, "Public looped models: Inkling-2"):

- attention with an additive relative position bias that depends on the query (one value per head
  and backward distance `0 <= d < span`, zero beyond) and a per-query sink logit (an extra softmax
  entry with a zero value), optionally over a sliding window;
- the last `kernel` inputs of a short causal convolution, stored per token in a windowed slot.

The kernels of depthserve/kernels have neither, so these gather the slot's pages themselves.
"""

from __future__ import annotations

import torch

from depthserve.kernels import paged as paged_ops
from depthserve.layers.attention import AttentionMetadata, KVPool


def row_page_tables(meta: AttentionMetadata) -> torch.Tensor:
    """[rows, blocks, row_width]: each packed row's page table (prefill rows share their sequence's)."""
    if not meta.prefills:  # a decode step (at static shapes too): its table as it is
        return meta.decode_page_table
    tables = [prefill.page_table for prefill in meta.prefills for _ in range(prefill.num_tokens)]
    width_blocks = max([t.shape[0] for t in tables] + ([meta.decode_page_table.shape[1]] if meta.num_decodes else [1]))
    out = []
    if tables:
        stacked = [torch.nn.functional.pad(t, (0, 0, 0, width_blocks - t.shape[0])) for t in tables]
        out.append(torch.stack(stacked))
    if meta.num_decodes:
        table = meta.decode_page_table
        out.append(torch.nn.functional.pad(table, (0, 0, 0, width_blocks - table.shape[1])))
    return torch.cat(out)


def row_positions(meta: AttentionMetadata) -> torch.Tensor:
    """[rows] the position of each packed row's token."""
    if not meta.prefills:  # computed on the device: no host synchronisation in a decode step
        return meta.decode_context_lens.long() - 1
    parts = [torch.arange(p.context_len - p.num_tokens, p.context_len) for p in meta.prefills]
    if meta.num_decodes:
        parts.append(meta.decode_context_lens.cpu().long() - 1)
    return torch.cat(parts).to(meta.slot_index.device)


def store(pages: torch.Tensor, meta: AttentionMetadata, columns: slice, values: torch.Tensor) -> None:
    """Write each row's `values` [rows, heads * head_dim] into the slot's pages (keys or values side)."""
    head_dim = pages.shape[-1]
    index = meta.slot_index[:, columns].reshape(-1)
    paged_ops.masked_index_copy_(pages.view(-1, head_dim), index, values.reshape(-1, head_dim).to(pages.dtype),
                                 index >= 0)


def conv_history(pages: torch.Tensor, meta: AttentionMetadata, columns: slice, kernel: int) -> torch.Tensor:
    """[rows, kernel, heads * head_dim]: entry `lag` is the stored input `lag` tokens back (0: the row's
    own, already stored), zeros before the sequence's first token."""
    block, head_dim = meta.block_size, pages.shape[-1]
    tables = row_page_tables(meta)[:, :, columns]  # [rows, blocks, heads]
    back = row_positions(meta)[:, None] - torch.arange(kernel, device=tables.device)[None, :]
    valid = back >= 0
    back = back.clamp(min=0)
    page = tables.gather(1, (back // block)[:, :, None].expand(-1, -1, tables.shape[2]).long())
    flat = page.long() * block + (back % block)[:, :, None]
    values = pages.view(-1, head_dim)[flat]  # [rows, kernel, heads, head_dim]
    values = torch.where(valid[:, :, None, None], values, torch.zeros((), dtype=values.dtype))
    return values.flatten(2).float()


def _attend(q, keys, values, distance, rel_logits, span, sinks, scale, window):
    """q [n, H, d]; keys, values [n, H, L, d]; distance [n, L] (query position - key position);
    rel_logits [n, H, span]; sinks [n, H]. Returns [n, H, d]."""
    scores = torch.einsum("nhd,nhld->nhl", q, keys) * scale
    index = distance.clamp(0, span - 1)[:, None, :].expand(-1, q.shape[1], -1)
    bias = rel_logits.gather(-1, index)
    in_span = ((distance >= 0) & (distance < span))[:, None, :]
    scores = scores + torch.where(in_span, bias, torch.zeros((), dtype=bias.dtype))
    visible = distance >= 0
    if window is not None:
        visible = visible & (distance < window)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    weights = torch.softmax(torch.cat([scores, sinks[:, :, None]], dim=-1).float(), dim=-1)[..., :-1]
    return torch.einsum("nhl,nhld->nhd", weights.to(values.dtype), values)


def biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, meta: AttentionMetadata,
                     columns: slice, scale: float, window: int | None, rel_logits: torch.Tensor, span: int,
                     sinks: torch.Tensor) -> torch.Tensor:
    """Store the rows' keys/values [rows, kv_heads, d] in the slot, then attend causally with the
    relative position bias and sinks. q [rows, heads, d]; rel_logits [rows, heads, span]; sinks [rows, heads]."""
    paged_ops.store_kv(k, v, pool.k_pages, pool.v_pages, meta.slot_index[:, columns])
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for prefill in meta.prefills:
        rows = slice(prefill.token_start, prefill.token_start + prefill.num_tokens)
        table = prefill.page_table[:, columns].T[None]  # [1, kv_heads, blocks]
        keys = paged_ops.gather_kv(pool.k_pages, table)[0, :, : prefill.context_len].repeat_interleave(group, 0)
        vals = paged_ops.gather_kv(pool.v_pages, table)[0, :, : prefill.context_len].repeat_interleave(group, 0)
        positions = torch.arange(prefill.context_len - prefill.num_tokens, prefill.context_len, device=q.device)
        distance = positions[:, None] - torch.arange(prefill.context_len, device=q.device)[None, :]
        n = prefill.num_tokens
        out[rows] = _attend(q[rows], keys[None].expand(n, -1, -1, -1), vals[None].expand(n, -1, -1, -1), distance,
                            rel_logits[rows], span, sinks[rows], scale, window)
    if meta.num_decodes:
        rows = slice(meta.num_prefill_tokens, None)
        table = meta.decode_page_table[:, :, columns].transpose(1, 2)
        keys = paged_ops.gather_kv(pool.k_pages, table).repeat_interleave(group, 1)
        vals = paged_ops.gather_kv(pool.v_pages, table).repeat_interleave(group, 1)
        lens = meta.decode_context_lens.long()
        distance = (lens - 1)[:, None] - torch.arange(keys.shape[2], device=q.device)[None, :]
        out[rows] = _attend(q[rows], keys, vals, distance, rel_logits[rows], span, sinks[rows], scale, window)
    return out
