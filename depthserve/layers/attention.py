"""Paged attention over one KV slot, with the batch's metadata passed in explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthserve.kernels import ops


@dataclass
class PrefillSeqMeta:
    token_start: int  # row of its first query in the packed batch
    num_tokens: int
    context_len: int  # keys visible to its last query
    page_table: torch.Tensor  # [num_blocks, row_width]


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's packed batch.

    Tokens are packed: prefill chunks first (each sequence contiguous), then one token per
    decoding sequence. Page tables hold every token-covering slot; a layer picks its slot's
    columns with `slot_columns`.
    """

    num_tokens: int
    block_size: int
    slot_index: torch.Tensor  # [num_tokens, row_width] flat cache index (page * block_size + offset)
    prefills: list[PrefillSeqMeta]
    num_prefill_tokens: int
    decode_page_table: torch.Tensor | None  # [num_decodes, max_blocks, row_width]
    decode_context_lens: torch.Tensor | None  # [num_decodes]

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_context_lens is None else int(self.decode_context_lens.shape[0])


@dataclass
class KVPool:
    """The page pool shared by every slot of every sequence."""

    k_pages: torch.Tensor  # [num_pages, block_size, head_dim]
    v_pages: torch.Tensor


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] new keys (already rotated)
    v: torch.Tensor,
    pool: KVPool,
    meta: AttentionMetadata,
    slot_columns: slice,
    scale: float,
) -> torch.Tensor:
    """Store the step's keys/values in the slot, then attend causally. Returns [num_tokens, num_q_heads, head_dim]."""
    ops.store_kv(k, v, pool.k_pages, pool.v_pages, meta.slot_index[:, slot_columns])
    out = torch.empty_like(q)
    for seq in meta.prefills:
        rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
        table = seq.page_table[:, slot_columns].transpose(0, 1)  # [kv_heads, blocks]
        out[rows] = ops.paged_prefill_attention(q[rows], pool.k_pages, pool.v_pages, table, seq.context_len, scale)
    if meta.num_decodes:
        rows = slice(meta.num_prefill_tokens, meta.num_tokens)
        table = meta.decode_page_table[:, :, slot_columns].transpose(1, 2)  # [batch, kv_heads, blocks]
        out[rows] = ops.paged_decode_attention(
            q[rows], pool.k_pages, pool.v_pages, table, meta.decode_context_lens, scale
        )
    return out
