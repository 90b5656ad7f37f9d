"""Paged attention over one KV slot, with the batch's metadata passed in explicitly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from depthserve.kernels.dispatch import Kernels


@dataclass
class PrefillSeqMeta:
    token_start: int  # row of its first query in the packed batch
    num_tokens: int
    context_len: int  # keys visible to its last query
    page_table: torch.Tensor  # [num_blocks, row_width]


@dataclass
class PackedPrefills:
    """The step's prefill chunks as one varlen batch (built once per step, shared by every layer)."""

    page_tables: torch.Tensor  # [num_seqs, max_blocks, row_width], padded with page 0
    query_starts: torch.Tensor  # [num_seqs + 1]
    context_lens: torch.Tensor  # [num_seqs]
    max_queries: int  # the longest chunk's queries, known on the host (the GPU kernel's grid)
    # Every chunk starts its sequence (no earlier chunk, no prefix hit): the step's own keys are all
    # the keys its queries see.
    fresh: bool = False


@dataclass
class StaticRows:
    """A decode step at static shapes (depthserve/engine/static_decode.py): what a depth model
    reads per row instead of the step's StepBatch."""

    settings: torch.Tensor  # [rows, spec.settings] float32 knobs (DepthModel.row_settings)
    state_pages: torch.Tensor  # [rows, pages] pages of the per-sequence state (spec.state_bytes), -1: none
    positions: torch.Tensor  # [rows]
    decisions: torch.Tensor  # [rows, spec.decisions] int32, written by the forward (routing choices)
    routed_lens: torch.Tensor  # [rows, routed slots] tokens each routed slot holds before this step
    columns: dict[str, slice]  # slot name -> its columns of a row's page table (StaticDecodeSpec.columns)
    routed_index: dict[str, int]  # routed slot name -> its column of routed_lens
    # The deepest level any row of the step runs (StaticDecodeSpec.levels): the forward runs no
    # iteration past it. None: the model has no levels (every iteration runs).
    level_cap: int | None = None
    # StaticDecodeSpec.compiled_regions: module class -> its compiled forward (called with the module)
    regions: dict[type, Callable] = field(default_factory=dict)


def call_region(module: torch.nn.Module, meta: AttentionMetadata, *args: Any) -> Any:
    """`module(*args)`; in a static decode step that compiles the module's class as a region
    (StaticDecodeSpec.compiled_regions), through that compiled forward."""
    compiled = None if meta.static is None else meta.static.regions.get(type(module))
    return module(*args) if compiled is None else compiled(module, *args)


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
    kernels: Kernels  # the ops bound to the engine's kernel backend (EngineArgs.kernel_backend)
    # The step's per-sequence view (depthserve.layers.batch.StepBatch) for depth models; None for plain ones.
    batch: Any = field(default=None, repr=False)
    # A decode step at static shapes: per-row knobs and state pages (meta.batch is None then).
    static: StaticRows | None = field(default=None, repr=False)
    _packed: PackedPrefills | None = field(default=None, repr=False)

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_context_lens is None else int(self.decode_context_lens.shape[0])

    def sequence_tables(self, columns: slice) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Columns `columns` of the full page tables of the step's prefill sequences and of its decode
        sequences ([seqs, blocks, width] each; None: no such sequence), for a slot the step's own tables
        leave out (a per-key bias slot): an eager step's come from its StepBatch, a static decode
        step's tables are full already."""
        if self.static is not None:
            return None, self.decode_page_table[:, :, columns]
        return self.batch.sequence_tables(columns)

    def packed_prefills(self) -> PackedPrefills:
        if self._packed is None:
            device = self.slot_index.device
            max_blocks = max(prefill.page_table.shape[0] for prefill in self.prefills)
            width = self.prefills[0].page_table.shape[1]
            tables = torch.zeros(len(self.prefills), max_blocks, width, dtype=self.prefills[0].page_table.dtype,
                                 device=device)
            for i, prefill in enumerate(self.prefills):
                tables[i, : prefill.page_table.shape[0]] = prefill.page_table
            starts = [prefill.token_start for prefill in self.prefills] + [self.num_prefill_tokens]
            self._packed = PackedPrefills(
                page_tables=tables,
                query_starts=torch.tensor(starts, dtype=torch.int32, device=device),
                context_lens=torch.tensor([prefill.context_len for prefill in self.prefills], dtype=torch.int32,
                                          device=device),
                max_queries=max(prefill.num_tokens for prefill in self.prefills),
                fresh=all(prefill.context_len == prefill.num_tokens for prefill in self.prefills),
            )
        return self._packed


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
    window: int | None = None,
) -> torch.Tensor:
    """Store the step's keys/values in the slot, then attend causally. Returns [num_tokens, num_q_heads, head_dim].

    `window`: a query sees only the last `window` keys, its own included (a sliding-window layer).
    Its decoding rows take `paged_window_decode_attention` (torch, or the native CPU kernel), its
    prompt chunks `paged_window_prefill_attention` (torch; on CUDA flash for chunks that start their
    sequences: the native prefill and Triton kernels attend over the whole context)."""
    meta.kernels.store_kv(k, v, pool.k_pages, pool.v_pages, meta.slot_index[:, slot_columns])
    if not meta.prefills and meta.num_decodes:  # decode only: the kernel's output as it is (no copy kernel per layer)
        return _decode_attention(q, pool, meta, slot_columns, scale, window)
    if meta.prefills and not meta.num_decodes:  # prefill only: likewise
        return _prefill_attention(q, k, v, pool, meta, slot_columns, scale, window)
    out = torch.empty_like(q)
    if meta.prefills:
        rows = slice(0, meta.num_prefill_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], pool, meta, slot_columns, scale, window)
    if meta.num_decodes:
        rows = slice(meta.num_prefill_tokens, None)  # the rest: no bound for a compiled graph to specialise on
        out[rows] = _decode_attention(q[rows], pool, meta, slot_columns, scale, window)
    return out


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, meta: AttentionMetadata,
                       slot_columns: slice, scale: float, window: int | None = None) -> torch.Tensor:
    """The prefill rows' queries `q` against their sequences' keys in the slot (the last `window`
    where given); `k`, `v`: the rows' own keys and values, which a form may read instead of the pool
    when every chunk starts its sequence (kernels/paged.py, `paged_prefill_attention_varlen`)."""
    packed = meta.packed_prefills()
    tables = packed.page_tables[:, :, slot_columns].transpose(1, 2)  # [seqs, kv_heads, blocks]
    args = (q, pool.k_pages, pool.v_pages, tables, packed.query_starts, packed.context_lens, scale)
    fresh = dict(max_queries=packed.max_queries, fresh_kv=(k, v) if packed.fresh else None)
    if window is None:
        return meta.kernels.paged_prefill_attention_varlen(*args, **fresh)
    return meta.kernels.paged_window_prefill_attention(*args, window, **fresh)


def _decode_attention(q: torch.Tensor, pool: KVPool, meta: AttentionMetadata, slot_columns: slice,
                      scale: float, window: int | None = None) -> torch.Tensor:
    """The decoding rows' queries `q` against the slot's pages (the last `window` keys where given)."""
    table = meta.decode_page_table[:, :, slot_columns].transpose(1, 2)  # [batch, kv_heads, blocks]
    if window is None:
        return meta.kernels.paged_decode_attention(q, pool.k_pages, pool.v_pages, table, meta.decode_context_lens,
                                                   scale)
    return meta.kernels.paged_window_decode_attention(q, pool.k_pages, pool.v_pages, table, meta.decode_context_lens,
                                                      scale, window)


def decode_slot_meta(meta: AttentionMetadata, columns: slice, read_heads: tuple[int, ...] | None = None, *,
                     stores: torch.Tensor | None = None, context_lens: torch.Tensor | None = None) -> AttentionMetadata:
    """A decode-only step's metadata narrowed to one slot's columns; `read_heads` maps each attended
    head to a stored one (a KV head may repeat: uneven GQA subsets); `stores` [rows] bool: the rows
    that store their key (default: as the write index says); `context_lens`: the slot's own (a
    routed slot's length) instead of the step's."""
    table = meta.decode_page_table[:, :, columns]
    if read_heads is not None:  # (a list index would become a data-dependent gather in a compiled graph)
        table = torch.stack([table[:, :, head] for head in read_heads], dim=2)
    index = meta.slot_index[:, columns]
    if stores is not None:
        index = torch.where(stores[:, None], index, -1)
    return AttentionMetadata(
        num_tokens=index.shape[0], block_size=meta.block_size, slot_index=index, prefills=[], num_prefill_tokens=0,
        decode_page_table=table, decode_context_lens=meta.decode_context_lens if context_lens is None else context_lens,
        kernels=meta.kernels, static=meta.static)
