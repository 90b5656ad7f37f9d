"""Dreamer: depth recurrence with depth attention and expert attention (depth-semantics.md section 3;
paper 002, Eq. 2, 5, 7, 8).

One shared block applied `depth` times (the request's knob, 1..D). x_0 is the token embedding; for
depth index d = 0..depth-1:

    y       = x_d + DA(x_0..x_d) + SA(x_d)          DA, SA: each with its own pre-norm
    y       = y + EA(y)                              EA: its own pre-norm
    x_{d+1} = RMSNorm_out(y)                         the LM head reads x_depth

- SA: causal attention over tokens, QK-norm (per head, then RoPE over positions), one dense KV
  slot per depth (`depth{d}`): a request at depth n holds n slots' pages.
- DA: the token's own states across depths (append then attend: depth d sees 0..d), RoPE over the
  depth index (`da_rope`: "depth", or "reversed_half": the first half of the frequency pairs use d,
  the second half D - 1 - d with D the trained depth). Its cache is per token and of constant size
  (tokens x depth x 2 x d_DA values for one step): allocated when the step's tokens start their
  forward, compacted as tokens finish (a request's tokens finish at its depth), released at the end
  of the step. It never grows with the sequence (SlotKind.TOKEN_DEPTH, not in the page pool).
- EA: sigmoid-gated top-k MoE of SwiGLU experts; logits q.k_e / sqrt(r) with q = RoPE_d(W_q h)
  (rank r, rotated by the depth index, keys unrotated); top-k on logit + b (the checkpoint's
  selection bias); weights g_e / sum_topk g. Runs grouped by expert (tokens sorted by expert, one
  matmul per active expert).
- attn_experts = A > 0: the QKV and output projections are top-1 MoEs of linear experts; one
  router (same form as EA's) per token and depth picks e for both; projection = sigma_e x (W_e +
  W_shared) with the shared expert folded in at load time (Eq. 8).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from depthserve.archs.base import BuildOptions, DepthModel, StaticDecodeSpec
from depthserve.archs.dreamer.format import (
    P,
    DreamerConfig,
    DreamerPlan,
    DreamerRecord,
    DreamerSpec,
    knobs,
    read_weights,
    slot_name,
)
from depthserve.archs.dreamer.format import plan as dreamer_plan
from depthserve.archs.dreamer.format import report as dreamer_report
from depthserve.archs.llama.model import tie_lm_head
from depthserve.cache import SlotKind
from depthserve.depth import DepthParams, DepthReport, KnobSpec
from depthserve.kernels.dispatch import Kernels
from depthserve.layers.attention import decode_slot_meta, paged_attention
from depthserve.layers.norm import RMSNorm
from depthserve.layers.rotary import apply_rope, rope_tables

# Expert attention runs all experts as one batched matmul (rows padded to the busiest expert's
# count) when that computes at most this many rows per (token, expert) pair; else one per expert.
PADDED_EXPERTS_MAX_ROWS_PER_PAIR = 4


def depth_rope_angles(dim: int, depth_index: int, trained_depth: int, theta: float, mode: str,
                      device: torch.device | None = None) -> torch.Tensor:
    """[dim // 2] fp32 rotary angles at a depth index (mode "reversed_half": the second half of the
    frequency pairs run at D - 1 - d)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    pos = torch.full((dim // 2,), float(depth_index), dtype=torch.float64, device=device)
    if mode == "reversed_half":
        pos[dim // 4:] = float(trained_depth - 1 - depth_index)
    return (pos * inv_freq).float()


class DreamerForCausalLM(nn.Module, DepthModel):
    uses_step_batch = True
    readout_every_level = True  # the LM head reads any x_d (each depth's output is normed)

    def __init__(self, cfg: DreamerConfig, spec: DreamerSpec, max_positions: int):
        super().__init__()
        self.config, self.spec = cfg, spec
        d, H, H_kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        E, f, A, dda = spec.num_experts, spec.expert_intermediate_size, spec.attn_experts, spec.da_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        eps = cfg.rms_norm_eps
        self.da_norm, self.sa_norm, self.ea_norm, self.out_norm = (RMSNorm(d, eps) for _ in range(4))
        self.q_norm, self.k_norm = RMSNorm(hd, spec.qk_norm_eps), RMSNorm(hd, spec.qk_norm_eps)
        self.da_qkv = nn.Parameter(torch.zeros(3 * dda, d), requires_grad=False)
        self.da_o = nn.Parameter(torch.zeros(d, dda), requires_grad=False)
        self.q_size, self.kv_size = H * hd, H_kv * hd
        qkv_rows = self.q_size + 2 * self.kv_size
        if A == 0:
            self.sa_qkv = nn.Parameter(torch.zeros(qkv_rows, d), requires_grad=False)
            self.sa_o = nn.Parameter(torch.zeros(d, self.q_size), requires_grad=False)
        else:  # experts with the shared expert folded in (Eq. 8)
            self.sa_qkv = nn.Parameter(torch.zeros(A, qkv_rows, d), requires_grad=False)
            self.sa_o = nn.Parameter(torch.zeros(A, d, self.q_size), requires_grad=False)
        self.ea_gate_up = nn.Parameter(torch.zeros(E, 2 * f, d), requires_grad=False)
        self.ea_down = nn.Parameter(torch.zeros(E, d, f), requires_grad=False)
        # Routers run in fp32 whatever the model dtype (re-set by finish_load after a cast).
        self._fp32: dict[str, torch.Tensor] = {}
        self.routers: dict[str, dict[str, torch.Tensor]] = {}
        self.max_positions = max_positions
        self.static_columns: list[slice] = []  # depth slots of a static decode row (static_decode_spec)
        self.scale = hd**-0.5
        self.da_scale = spec.da_head_dim**-0.5
        self._tables()
        # Per-token depth cache accounting (SlotKind.TOKEN_DEPTH): values held now (0 between steps),
        # and one record per step: (tokens, largest depth in the batch, peak values held).
        self.token_depth_live_values = 0
        self.token_depth_steps: deque[tuple[int, int, int]] = deque(maxlen=4096)

    def _tables(self, device: torch.device | None = None) -> None:
        cfg, spec = self.config, self.spec
        cos, sin = rope_tables(cfg.head_dim, self.max_positions, cfg.rope_theta, device=device)
        self.rope_cos, self.rope_sin = cos, sin
        D = spec.depth
        da = torch.stack([depth_rope_angles(spec.da_head_dim, j, D, spec.da_rope_theta, spec.da_rope, device)
                          for j in range(D)])
        router = torch.stack([depth_rope_angles(spec.expert_rank, j, D, spec.router_rope_theta, "depth", device)
                              for j in range(D)])
        self.da_cos, self.da_sin = da.cos(), da.sin()
        self.router_cos, self.router_sin = router.cos(), router.sin()

    # ---- what the engine asks of every model -------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    # ---- depth ------------------------------------------------------------------------------------
    def depth_knobs(self) -> dict[str, KnobSpec]:
        return knobs(self.spec)

    def plan(self, depth: DepthParams) -> DreamerPlan:
        return dreamer_plan(self.config, self.spec, depth)

    def new_record(self, plan: DreamerPlan) -> DreamerRecord:
        return DreamerRecord(self.spec.depth, self.spec.top_k)

    def report(self, seq) -> DepthReport:
        return dreamer_report(self.config, self.spec, seq.plan, seq.depth_record, seq.num_computed_tokens,
                              len(seq.output_token_ids))

    def token_depth_values(self, num_tokens: int, depth: int | None = None) -> int:
        """Values of the per-token depth cache for `num_tokens` tokens (bound: tokens x D x 2 x d_DA)."""
        return num_tokens * (depth or self.spec.depth) * 2 * self.spec.da_dim

    def step_cache_bytes_bound(self, max_step_tokens: int) -> int:
        """The most bytes the per-token depth cache can take in one step of `max_step_tokens`
        tokens: the engine sets this aside from its cache memory before sizing the page pool."""
        return self.token_depth_values(max_step_tokens) * self.da_qkv.element_size()

    def step_cache_bytes(self) -> tuple[dict[SlotKind, int], dict[SlotKind, int]]:
        """Bytes of the per-token depth cache (outside the page pool): held now (0 between steps),
        and the peak of the last step."""
        size = self.da_qkv.element_size()
        last = self.token_depth_steps[-1][2] if self.token_depth_steps else 0
        return {SlotKind.TOKEN_DEPTH: self.token_depth_live_values * size}, {SlotKind.TOKEN_DEPTH: last * size}

    # ---- the forward --------------------------------------------------------------------------------
    def _router(self, name: str, h: torch.Tensor, depth_index: int) -> torch.Tensor:
        """Router logits q.k_e / sqrt(r), q = RoPE_d(W_q h), fp32 on every path. [rows, experts]"""
        router = self.routers[name]
        q = h.float() @ router["query"].t()
        r = q.shape[-1]
        cos, sin = self.router_cos[depth_index], self.router_sin[depth_index]
        q1, q2 = q[:, : r // 2], q[:, r // 2 :]
        q = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
        return (q @ router["keys"].t()) / math.sqrt(r)

    @staticmethod
    def _grouped(x: torch.Tensor, weight: torch.Tensor, order: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x[i] @ weight[e_i]^T, grouped by expert: rows sorted by expert, one matmul per active expert."""
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = order[start : start + count]
                out[rows] = x.index_select(0, rows) @ weight[e].t()
                start += count
        return out

    def _sa(self, x, cos, sin, pool, meta, depth_index):
        cfg = self.config
        n = x.shape[0]
        h = self.sa_norm(x)
        choice = None
        if self.spec.attn_experts:
            logits = self._router("sa", h, depth_index)
            choice = (logits + self.routers["sa"]["bias"]).argmax(-1)
            sigma = torch.sigmoid(logits.gather(1, choice[:, None]))[:, 0].to(x.dtype)[:, None]
            if meta.static is None:
                order = torch.argsort(choice, stable=True)
                counts = torch.bincount(choice, minlength=self.spec.attn_experts).tolist()
                expert = lambda rows, weight: self._grouped(rows, weight, order, counts)  # noqa: E731
            else:  # static shapes: every expert on every row, each row keeping its own
                expert = lambda rows, weight: self._chosen(rows, weight, choice)  # noqa: E731
            qkv = expert(h, self.sa_qkv) * sigma
        else:
            qkv = h @ self.sa_qkv.t()
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(n, cfg.num_heads, cfg.head_dim))
        k = self.k_norm(k.reshape(n, cfg.num_kv_heads, cfg.head_dim))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        out = paged_attention(q, k, v, pool, meta, slice(None), self.scale).reshape(n, self.q_size)
        if choice is not None:
            return expert(out, self.sa_o) * sigma, choice
        return out @ self.sa_o.t(), None

    @staticmethod
    def _chosen(x: torch.Tensor, weight: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """x[i] @ weight[e_i]^T at static shapes: every expert on every row, then each row's own."""
        every = torch.einsum("nd,aod->nao", x, weight)
        return every.gather(1, choice[:, None, None].expand(-1, 1, every.shape[2]))[:, 0]

    def _da(self, x, k_cache, v_cache, depth_index, kernels: Kernels):
        """Depth attention: append this depth's key/value to each token's depth cache, then attend over 0..d."""
        spec = self.spec
        n = x.shape[0]
        q, k, v = (self.da_norm(x) @ self.da_qkv.t()).view(n, 3, spec.da_heads, spec.da_head_dim).unbind(1)
        cos = self.da_cos[depth_index].expand(n, -1)
        sin = self.da_sin[depth_index].expand(n, -1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache[:, depth_index] = k
        v_cache[:, depth_index] = v
        valid = torch.full((n,), depth_index + 1, dtype=torch.int32, device=x.device)
        out = kernels.depth_attention(q, k_cache, v_cache, valid, self.da_scale)
        return out.reshape(n, spec.da_dim) @ self.da_o.t()

    def _ea_static(self, y, depth_index):
        """Expert attention at static shapes: every expert on every row, weighted by the row's gates
        (zero for the experts it did not select)."""
        h = self.ea_norm(y)
        top, weights = self._ea_route(h, depth_index, y.dtype)
        every = self._expert_mlp(h.expand(self.spec.num_experts, -1, -1), self.ea_gate_up, self.ea_down)
        gates = torch.zeros(h.shape[0], self.spec.num_experts, dtype=y.dtype, device=y.device).scatter(1, top, weights)
        return torch.einsum("ne,end->nd", gates, every), top

    def _ea_route(self, h, depth_index, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts [n, k] on logit + b and their weights g_e / sum_topk g."""
        logits = self._router("ea", h, depth_index)
        top = torch.topk(logits + self.routers["ea"]["bias"], self.spec.top_k, dim=-1).indices  # [n, k]
        gates = torch.sigmoid(logits.gather(1, top))
        return top, (gates / gates.sum(-1, keepdim=True)).to(dtype)

    def _ea(self, y, depth_index):
        """Expert attention: sigmoid gates, top-k on logit + b, grouped by expert."""
        spec = self.spec
        h = self.ea_norm(y)
        top, weights = self._ea_route(h, depth_index, y.dtype)
        flat = top.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts = flat[order]  # each (token, expert) pair's expert, sorted
        tokens = torch.arange(h.shape[0], device=h.device).repeat_interleave(spec.top_k)[order]
        counts = torch.bincount(flat, minlength=spec.num_experts)
        width = int(counts.max())
        if spec.num_experts * width <= PADDED_EXPERTS_MAX_ROWS_PER_PAIR * len(flat):
            expert_out = self._experts_padded(h, tokens, experts, counts, width)
        else:
            expert_out = self._experts_looped(h, tokens, counts.tolist())
        out = torch.zeros_like(y)
        out.index_add_(0, tokens, expert_out * weights.reshape(-1)[order][:, None])
        return out, top

    def _expert_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """SwiGLU expert MLP; weights [..., 2f, d] and [..., d, f] (one expert, or a stack of experts)."""
        f = self.spec.expert_intermediate_size
        gate, up = (x @ gate_up.transpose(-1, -2)).split([f, f], dim=-1)
        return (F.silu(gate) * up) @ down.transpose(-1, -2)

    def _experts_looped(self, h, tokens, counts: list[int]) -> torch.Tensor:
        """Each (token, expert) pair's expert output, in pair order: one matmul per active expert."""
        outs, start = [], 0
        for e, count in enumerate(counts):
            if count:
                rows = tokens[start : start + count]
                outs.append(self._expert_mlp(h.index_select(0, rows), self.ea_gate_up[e], self.ea_down[e]))
                start += count
        return torch.cat(outs)

    def _experts_padded(self, h, tokens, experts, counts, width: int) -> torch.Tensor:
        """The same in two batched matmuls over all experts, each expert's rows padded to `width`: for
        decode batches, where the pairs spread over most experts a few rows each and one small matmul
        per expert costs more in calls than in arithmetic."""
        slot = torch.arange(len(tokens), device=h.device) - (torch.cumsum(counts, 0) - counts)[experts]
        position = experts * width + slot
        x = h.new_zeros(self.spec.num_experts * width, h.shape[1]).index_copy_(0, position, h.index_select(0, tokens))
        out = self._expert_mlp(x.view(self.spec.num_experts, width, -1), self.ea_gate_up, self.ea_down)
        return out.reshape(-1, h.shape[1]).index_select(0, position)

    def forward(self, input_ids, positions, pool, meta) -> torch.Tensor:
        if meta.static is not None:
            return self.static_forward(input_ids, positions, pool, meta)
        step = meta.batch
        spec = self.spec
        x = self.embed_tokens(input_ids)
        out = torch.empty_like(x)
        n_rows = x.shape[0]
        sizes = [item.num_tokens for item in step.items]
        owner = np.repeat(np.arange(len(step.items)), sizes)  # the item of each packed row
        # Each row's depth: its item's level, lowered where a token stops early (the confidence exit).
        depth = np.repeat([self._depth(item) for item in step.items], sizes)
        exits = _ConfidenceExit(step.items, owner)
        max_depth = int(depth.max())
        # The step's per-token depth cache: its tokens x the batch's largest depth (<= D).
        shape = (n_rows, max_depth, spec.da_heads, spec.da_head_dim)
        k_cache, v_cache = x.new_zeros(shape), x.new_zeros(shape)  # zeros: unread depths stay finite
        live = peak = 2 * k_cache.numel()
        self.token_depth_live_values = live
        cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
        ea_record = torch.full((n_rows, spec.depth, spec.top_k), -1, dtype=torch.int32, device=x.device)
        attn_record = torch.full((n_rows, spec.depth), -1, dtype=torch.int32, device=x.device)
        rows = np.arange(n_rows)  # packed rows of the tokens still running, ascending
        rows_t = None  # the same as a tensor (None: every row)
        for j in range(max_depth):
            running = depth[rows] > j
            if not running.any():  # every token stopped early: x holds each one's last level
                break
            if not running.all():
                # Tokens that stop at depth j finish their forward: x_j is final, their depth cache
                # is released (the cache is compacted to the tokens still running).
                keep = torch.from_numpy(np.flatnonzero(running)).to(x.device)
                done = torch.from_numpy(np.flatnonzero(~running)).to(x.device)
                out[torch.from_numpy(rows[~running]).to(x.device)] = x.index_select(0, done)
                x, cos, sin = x.index_select(0, keep), cos.index_select(0, keep), sin.index_select(0, keep)
                k_cache, v_cache = k_cache.index_select(0, keep), v_cache.index_select(0, keep)
                self.token_depth_live_values = 2 * k_cache.numel()
                rows = rows[running]
                rows_t = torch.from_numpy(rows).to(x.device)
            items, counts = np.unique(owner[rows], return_counts=True)
            active = [step.items[i] for i in items]
            sa_meta = step.level_meta(active, [self._level_slot(item, j) for item in active], counts=counts.tolist())
            sa, choice = self._sa(x, cos, sin, pool, sa_meta, j)
            y = x + self._da(x, k_cache, v_cache, j, meta.kernels) + sa
            ea, top = self._ea(y, j)
            x = self.out_norm(y + ea)
            exits.check(self, x, rows, j + 1, depth)
            index = slice(None) if rows_t is None else rows_t
            ea_record[index, j] = top.to(torch.int32)
            if choice is not None:
                attn_record[index, j] = choice.to(torch.int32)
        out[slice(None) if rows_t is None else rows_t] = x
        del k_cache, v_cache
        self.token_depth_live_values = 0
        self.token_depth_steps.append((n_rows, max_depth, peak))
        exits.finish(depth)
        self._record(step, ea_record.cpu().numpy(), attn_record.cpu().numpy(), exits.readouts)
        return out

    @staticmethod
    def _depth(item) -> int:
        """How deep the item's tokens run this step: the depth policy's level for a range knob."""
        return item.plan.step_level(item.level)

    def _level_slot(self, item, j: int) -> slice | str:
        """Depth j's slot of the item: its columns while every token runs j, else the routed slot."""
        if j < item.plan.min_recurrences:
            kv = self.config.num_kv_heads
            return slice(j * kv, (j + 1) * kv)
        return slot_name(j)

    def static_forward(self, input_ids, positions, pool, meta) -> torch.Tensor:
        """A decode step at static shapes: every row runs the D depths and keeps depth j where its
        own depth exceeds j; the routing choices go to meta.static.decisions (-1: not run)."""
        spec = self.spec
        x = self.embed_tokens(input_ids)
        n = x.shape[0]
        depths = meta.static.settings[:, 0]
        shape = (n, spec.depth, spec.da_heads, spec.da_head_dim)
        k_cache, v_cache = x.new_zeros(shape), x.new_zeros(shape)
        cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
        ea_record, attn_record = [], []
        cap = meta.static.level_cap or spec.depth  # no row recurs past the cap
        for j in range(cap):
            runs = depths > j
            sa, choice = self._sa(x, cos, sin, pool, decode_slot_meta(meta, self.static_columns[j]), j)
            y = x + self._da(x, k_cache, v_cache, j, meta.kernels) + sa
            ea, top = self._ea_static(y, j)
            x = torch.where(runs[:, None], self.out_norm(y + ea), x)
            ea_record.append(torch.where(runs[:, None], top, -1))
            attn_record.append(torch.where(runs, choice, -1) if choice is not None else torch.full_like(depths, -1))
        for _ in range(cap, spec.depth):  # depths past the cap: not run by any row
            ea_record.append(torch.full_like(ea_record[-1], -1))
            attn_record.append(torch.full_like(attn_record[-1], -1))
        decisions = torch.cat([torch.stack(ea_record, 1).reshape(n, -1), torch.stack(attn_record, 1)], dim=1)
        meta.static.decisions.copy_(decisions.to(torch.int32))
        return x

    def static_decode_spec(self) -> StaticDecodeSpec:
        """Rows hold every depth's slot; a row's setting is its depth; its decisions the EA top-k
        [D, k] and the attention expert [D] of every depth."""
        deepest = self.plan(DepthParams(depth=self.spec.depth)).layout
        self.static_columns = [deepest.columns(j) for j in range(self.spec.depth)]
        return StaticDecodeSpec(deepest, settings=1, decisions=self.spec.depth * (self.spec.top_k + 1),
                                levels=tuple(range(1, self.spec.depth + 1)))

    def static_settings(self, plan: DreamerPlan) -> np.ndarray:
        return np.array([plan.recurrences], dtype=np.float32)

    def after_static_step(self, record: DreamerRecord, position: int, decisions: np.ndarray) -> dict[str, int]:
        D, k = self.spec.depth, self.spec.top_k
        record.write(position, decisions[None, : D * k].reshape(1, D, k), decisions[None, D * k :])
        return {}

    @staticmethod
    def _record(step, ea: np.ndarray, attn: np.ndarray, readouts: np.ndarray) -> None:
        for item in step.items:
            rows = slice(item.row, item.row + item.num_tokens)
            item.record.write(item.start, ea[rows], attn[rows], readouts[rows])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # the LM head reads x_depth (already normed)

    # ---- weights ------------------------------------------------------------------------------------
    # ---- weights ------------------------------------------------------------------------------------
    def take_weights(self, weights: dict[str, torch.Tensor], source: str) -> set[str]:
        """The block's tensors, checked against the spec, concatenated and folded into the fused
        parameters (the embedding and the LM head are left to the generic loader)."""
        cfg, spec = self.config, self.spec
        hf = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "tie_word_embeddings": cfg.tie_word_embeddings}
        read_weights(hf, spec, weights, source)
        w = {name: weights.pop(name) for name in [name for name in weights if name.startswith(P)]}
        params = {
            "da_norm.weight": w[P + "da_norm.weight"], "sa_norm.weight": w[P + "sa_norm.weight"],
            "ea_norm.weight": w[P + "ea_norm.weight"], "out_norm.weight": w[P + "out_norm.weight"],
            "q_norm.weight": w[P + "sa.q_norm.weight"], "k_norm.weight": w[P + "sa.k_norm.weight"],
            "da_qkv": torch.cat([w[P + f"da.{n}_proj.weight"] for n in "qkv"]),
            "da_o": w[P + "da.o_proj.weight"],
            "ea_gate_up": torch.cat([w[P + "ea.experts.gate_proj.weight"], w[P + "ea.experts.up_proj.weight"]], dim=1),
            "ea_down": w[P + "ea.experts.down_proj.weight"],
        }
        if spec.attn_experts == 0:
            params["sa_qkv"] = torch.cat([w[P + f"sa.{n}_proj.weight"] for n in "qkv"])
            params["sa_o"] = w[P + "sa.o_proj.weight"]
        else:  # Eq. 8: sigma_e x W_e + sigma_e x W_shared = sigma_e x (W_e + W_shared)
            experts = torch.cat([w[P + f"sa.experts.{n}_proj.weight"] for n in "qkv"], dim=1)
            shared = torch.cat([w[P + f"sa.shared_expert.{n}_proj.weight"] for n in "qkv"])
            params["sa_qkv"] = experts + shared[None]
            params["sa_o"] = w[P + "sa.experts.o_proj.weight"] + w[P + "sa.shared_expert.o_proj.weight"][None]
        own = dict(self.named_parameters())
        with torch.no_grad():
            for name, value in params.items():
                own[name].copy_(value)
        for name in ["ea"] + (["sa"] if spec.attn_experts else []):
            for part in ("query.weight", "keys", "bias"):
                self._fp32[f"{name}.{part}"] = w[P + f"{name}.router.{part}"].float().clone()
        return set(params)

    def after_load(self, loaded: set[str]) -> set[str]:
        return tie_lm_head(self, loaded)

    def finish_load(self, device: torch.device) -> None:
        """Routers and rotary tables stay fp32 whatever dtype the model was cast to."""
        self.routers = {}
        for key, value in self._fp32.items():
            name, part = key.split(".", 1)
            self.routers.setdefault(name, {})[part.split(".")[0]] = value.to(device)
        self._tables(device)


class _ConfidenceExit:
    """The confidence exit of one step (depth_policy `confidence`): the token of an item with an exit
    threshold whose readout is sampled (the step's last token, when the sequence samples after it)
    stops at the first level of its range, below its own level, whose readout gives its top-1 next
    token at least that probability. Counts each token's readouts (their cost)."""

    def __init__(self, items, owner: np.ndarray):
        self.threshold = np.full(len(owner), np.nan)
        for item in items:
            if item.exit_threshold is not None and item.end == item.seq.num_tokens:
                self.threshold[item.row + item.num_tokens - 1] = item.exit_threshold
        self.lowest = np.array([item.plan.elastic.minimum if item.plan.elastic is not None else 0
                                for item in items])[owner]
        self.items, self.owner = items, owner
        self.readouts = np.zeros(len(owner), dtype=np.int32)

    def check(self, model: DreamerForCausalLM, x: torch.Tensor, rows: np.ndarray, level: int,
              depth: np.ndarray) -> None:
        """After level `level` (x: the states of `rows`), lower `depth` of the confident rows."""
        asks = ~np.isnan(self.threshold[rows]) & (self.lowest[rows] <= level) & (level < depth[rows])
        if not asks.any():
            return
        at = np.flatnonzero(asks)
        top = torch.softmax(model.compute_logits(x.index_select(0, torch.from_numpy(at).to(x.device))), dim=-1)
        confident = top.amax(dim=-1).cpu().numpy() >= self.threshold[rows[at]]
        self.readouts[rows[at]] += 1
        depth[rows[at[confident]]] = level

    def finish(self, depth: np.ndarray) -> None:
        """Each item with an exit threshold learns the level each of its tokens ran at."""
        for i, item in enumerate(self.items):
            if item.exit_threshold is not None:
                item.ran_levels = depth[self.owner == i].tolist()


def build(hf_config: dict, spec: DreamerSpec, options: BuildOptions) -> DreamerForCausalLM:
    return DreamerForCausalLM(DreamerConfig.from_hf(hf_config), spec, options.max_len)
