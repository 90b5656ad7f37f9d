"""SAOBP: one-step belief-propagation attention (docs/depth-semantics.md section 5; paper 003, Eq. 9-11).

For query row j of an SAOBP layer's head, with raw scores s_jk and unrefined causal softmax row A_j:

    out_j = softmax_k(s_jk + c_k) . V            over k <= j
    c_k   = sum_{i < j} log(M_ik / m_0)          rows k <= i < j (masked entries send m_0: no term)
    M_ik  = A_ik + m_0 (1 - A_ik),  m_0 = e^lambda ("high", repulsive) or e^-lambda ("low", attractive)

and with `self_message` the row's own log(M_jk / m_0) is added too (A_j first: two passes over the
keys). log(M_ik / m_0) = log1p(A_ik (1/m_0 - 1)): the engine computes it in that form (`coef` below
is 1/m_0 - 1), in fp32, in log space.

Engine: the running c_k of every cached key lives in the sequence's per-key bias slot (format.py:
rows of fp32 in the K half of pool pages). It changes for every cached key at every step, so it is
per sequence: no prefix caching (`CacheLayout.uses_prefix_cache`), and forks compute their own.

A prefill chunk [start, end) reads the cached c_k (rows < start; positions >= start have none yet)
and adds, for row j, the terms of the chunk's earlier rows (an exclusive cumulative sum over the
chunk's rows; inclusive with the self message), then writes back c_k + all of the chunk's terms.
A decode row attends with the cached bias (its own, newest key: 0), then a second kernel adds
its terms log(M_jk / m_0) to every key's bias (and sets the new key's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthserve.archs.base import BuildOptions, StaticDecodeSpec
from depthserve.archs.llama.format import LlamaConfig
from depthserve.archs.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from depthserve.archs.saobp.format import SAOBPPlan, SAOBPSpec, head_rows, rows_per_page
from depthserve.archs.saobp.format import plan as saobp_plan
from depthserve.depth import DepthParams
from depthserve.layers.attention import AttentionMetadata, KVPool


@dataclass
class BiasTables:
    """One step's bias row tables: for each batch part, [seqs, blocks, bias pages per block] page ids."""

    pages: torch.Tensor  # [num_pages * R, block_size] fp32 view of the pool's K storage
    prefill: torch.Tensor | None  # [prefill seqs, blocks, P] int64
    decode: torch.Tensor | None  # [decodes, blocks, P] int64
    rows_per_page: int

    @classmethod
    def of(cls, pool: KVPool, meta: AttentionMetadata, plan: SAOBPPlan) -> "BiasTables":
        """The bias columns of the step's sequences' page tables."""
        prefill, decode = meta.sequence_tables(plan.bias_columns)
        return cls(pool_bias_rows(pool, plan.rows_per_page), prefill, decode, plan.rows_per_page)

    def tables(self, base: torch.Tensor | None, column: torch.Tensor, sub: torch.Tensor) -> torch.Tensor | None:
        """[seqs, H, blocks] bias row ids of one layer's heads."""
        if base is None:
            return None
        return (base[:, :, column] * self.rows_per_page + sub).transpose(1, 2)


def pool_bias_rows(pool: KVPool, rows: int) -> torch.Tensor:
    """[num_pages * rows, block_size] the pool's K storage as rows of fp32 biases."""
    num_pages, bs = pool.k_pages.shape[0], pool.k_pages.shape[1]
    return pool.k_pages.view(num_pages, -1).view(torch.float32).view(num_pages * rows, bs)


class SAOBPAttention(LlamaAttention):
    def __init__(self, cfg: LlamaConfig, slot: int, position: int, spec: SAOBPSpec):
        super().__init__(cfg, slot)
        self.position = position  # index among the SAOBP layers
        self.coef = spec.coef
        self.self_message = spec.self_message
        # (bias page column, row within the page) of each query head: set by finish_load, as the
        # rows per page depend on the dtype the model is cast to.
        self.bias_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x, cos, sin, pool: KVPool, meta: AttentionMetadata, columns: slice,
                bias: BiasTables) -> torch.Tensor:
        n = x.shape[0]
        kernels = meta.kernels
        q, k, v = self.qkv(x, cos, sin)
        kernels.store_kv(k, v, pool.k_pages, pool.v_pages, meta.slot_index[:, columns])
        out = torch.empty_like(q)
        column, sub = self.bias_rows
        if meta.prefills:
            rows = slice(0, meta.num_prefill_tokens)
            packed = meta.packed_prefills()
            tables = packed.page_tables[:, :, columns].transpose(1, 2)
            out[rows] = kernels.saobp_prefill_attention(
                q[rows], pool.k_pages, pool.v_pages, tables, bias.pages, bias.tables(bias.prefill, column, sub),
                packed.query_starts, packed.context_lens, self.scale, self.coef, self.self_message)
        if meta.num_decodes:
            rows = slice(meta.num_prefill_tokens, None)
            table = meta.decode_page_table[:, :, columns].transpose(1, 2)
            bias_table = bias.tables(bias.decode, column, sub)
            out[rows], lse = kernels.saobp_decode_attention(
                q[rows], pool.k_pages, pool.v_pages, table, bias.pages, bias_table, meta.decode_context_lens,
                self.scale, self.coef, self.self_message)
            kernels.saobp_bias_update(q[rows], pool.k_pages, table, bias.pages, bias_table,
                                      meta.decode_context_lens, lse, self.scale, self.coef)
        return self.o_proj(out.reshape(n, self.q_size))


class SAOBPDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: LlamaConfig, index: int, position: int, spec: SAOBPSpec):
        super().__init__(cfg, index)
        self.self_attn = SAOBPAttention(cfg, index, position, spec)

    def forward(self, x, cos, sin, pool, meta, columns, bias: BiasTables) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, pool, meta, columns, bias)
        return h + self.mlp(self.post_attention_layernorm(h))


class SAOBPForCausalLM(LlamaForCausalLM):
    uses_step_batch = True  # the bias slot's columns come from the requests' full page tables

    def __init__(self, cfg: LlamaConfig, spec: SAOBPSpec, max_positions: int):
        super().__init__(cfg, max_positions)
        self.spec = spec
        self._fixed_plan: SAOBPPlan | None = None  # every request's plan, made at the first use (after the cast)
        for position, index in enumerate(spec.layer_indices(cfg.num_layers)):
            self.layers[index] = SAOBPDecoderLayer(cfg, index, position, spec)

    def plan(self, depth: DepthParams) -> SAOBPPlan:
        return saobp_plan(self.config, self.spec, depth, self.norm.weight.element_size())

    def fixed_plan(self) -> SAOBPPlan:
        """The plan of every request (SAOBP has no knobs), for the model's dtype."""
        if self._fixed_plan is None:
            self._fixed_plan = self.plan(DepthParams())
        return self._fixed_plan

    def static_decode_spec(self) -> StaticDecodeSpec:
        return StaticDecodeSpec(self.fixed_plan().layout)

    def forward(self, input_ids, positions, pool: KVPool, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        plan = self.fixed_plan()
        bias = BiasTables.of(pool, meta, plan)
        for i, layer in enumerate(self.layers):
            extra = (bias,) if isinstance(layer, SAOBPDecoderLayer) else ()
            x = layer(x, cos, sin, pool, meta, plan.layout.columns(i), *extra)
        return self.norm(x)

    def finish_load(self, device: torch.device) -> None:
        """Rotary tables, and each SAOBP head's bias row for pages of the model's dtype."""
        super().finish_load(device)
        rows = rows_per_page(self.config.head_dim, self.norm.weight.element_size())
        for layer in self.layers:
            if isinstance(layer, SAOBPDecoderLayer):
                column, sub = head_rows(self.config.num_heads, layer.self_attn.position, rows)
                layer.self_attn.bias_rows = (torch.from_numpy(column).to(device), torch.from_numpy(sub).to(device))


def build(hf_config: dict, spec: SAOBPSpec, options: BuildOptions) -> SAOBPForCausalLM:
    return SAOBPForCausalLM(LlamaConfig.from_hf(hf_config), spec, options.max_len)
