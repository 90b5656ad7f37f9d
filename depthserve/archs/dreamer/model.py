"""Dreamer: depth recurrence with depth attention and expert attention (docs/depth-semantics.md section 3;
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
  selection bias); weights g_e / sum_topk g. Runs through layers/experts.py: grouped by expert in
  eager steps (each expert once on its (token, expert) pairs), every expert on every token at
  static shapes.
- attn_experts = A > 0: the QKV and output projections are top-1 MoEs of linear experts; one
  router (same form as EA's) per token and depth picks e for both; projection = sigma_e x (W_e +
  W_shared) with the shared expert folded in at load time (Eq. 8); run as EA's experts.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from depthserve.archs.base import BuildOptions, DepthModel, RequestState, StaticDecodeSpec
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
from depthserve.layers.attention import AttentionMetadata, KVPool, paged_attention
from depthserve.layers.embedding import checkpoint_embedding
from depthserve.layers.experts import Expert, mix_experts, plan_experts
from depthserve.layers.norm import RMSNorm
from depthserve.layers.rotary import apply_rope, rope_tables
from depthserve.layers.rows import step_rows


def depth_rope_angles(dim: int, depth_index: int, trained_depth: int, theta: float, mode: str,
                      device: torch.device | None = None) -> torch.Tensor:
    """[dim // 2] fp32 rotary angles at a depth index (mode "reversed_half": the second half of the
    frequency pairs run at D - 1 - d)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    pos = torch.full((dim // 2,), float(depth_index), dtype=torch.float64, device=device)
    if mode == "reversed_half":
        pos[dim // 4:] = float(trained_depth - 1 - depth_index)
    return (pos * inv_freq).float()


class DepthRouter:
    """Router logits q.k_e / sqrt(r) with q = RoPE_d(W_q h) (the rank-r query rotated by the depth
    index, the keys not), and the checkpoint's selection bias b. fp32 whatever the model dtype."""

    def __init__(self, query: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor):
        self.query, self.keys, self.bias = query, keys, bias  # [r, d], [experts, r], [experts]
        self.cos, self.sin = cos, sin  # [D, r // 2] rotary tables over the depth index

    def __call__(self, h: torch.Tensor, depth_index: int) -> torch.Tensor:
        """[rows, experts] logits (without the bias)."""
        q = h.float() @ self.query.t()
        r = q.shape[-1]
        cos, sin = self.cos[depth_index], self.sin[depth_index]
        q1, q2 = q[:, : r // 2], q[:, r // 2 :]
        q = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
        return (q @ self.keys.t()) / math.sqrt(r)


class SelfAttention(nn.Module):
    """SA: causal attention over the tokens at one depth, QK-norm then RoPE over positions, its own KV
    slot per depth. With attention experts (A > 0) the QKV and output projections are the top-1
    expert of one router per token and depth, scaled by its gate sigma_e (Eq. 8)."""

    def __init__(self, cfg: DreamerConfig, spec: DreamerSpec):
        super().__init__()
        d, H, H_kv, hd, A = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, spec.attn_experts
        self.num_heads, self.num_kv_heads, self.head_dim = H, H_kv, hd
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_norm, self.k_norm = RMSNorm(hd, spec.qk_norm_eps), RMSNorm(hd, spec.qk_norm_eps)
        self.q_size, self.kv_size = H * hd, H_kv * hd
        rows = self.q_size + 2 * self.kv_size
        experts = () if A == 0 else (A,)  # experts with the shared expert folded in (Eq. 8)
        self.qkv = nn.Parameter(torch.zeros(*experts, rows, d), requires_grad=False)
        self.o = nn.Parameter(torch.zeros(*experts, d, self.q_size), requires_grad=False)
        self.num_experts = A
        self.router: DepthRouter | None = None  # set by finish_load when A > 0
        self.scale = hd**-0.5

    def forward(self, x, cos, sin, pool: KVPool, meta: AttentionMetadata, columns: slice, depth_index: int,
                static_shapes: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention output and each row's attention expert (None without experts). The QKV and
        output projections run each row through its expert (the same plan for both: layers/experts.py)."""
        n = x.shape[0]
        h = self.norm(x)
        if self.num_experts:
            logits = self.router(h, depth_index)
            choice = (logits + self.router.bias).argmax(-1, keepdim=True)  # [n, 1]
            sigma = torch.sigmoid(logits.gather(1, choice)).to(x.dtype)
            experts = plan_experts(choice, self.num_experts, static_shapes)
            qkv = mix_experts(experts, h, _linear_experts(self.qkv), sigma)
        else:
            qkv = h @ self.qkv.t()
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, pool, meta, columns, self.scale).reshape(n, self.q_size)
        if self.num_experts:
            return mix_experts(experts, out, _linear_experts(self.o), sigma), choice[:, 0]
        return out @ self.o.t(), None


def _linear_experts(weight: torch.Tensor) -> Expert:
    """Linear experts x @ weight[e]^T over a stack of expert weights [experts, out, in]."""
    return lambda rows, e: rows @ weight[e].transpose(-1, -2)


class DepthAttention(nn.Module):
    """DA: each token attends over its own states at depths 0..d (append, then attend), RoPE over the
    depth index; the per-token depth cache lives for one step (SlotKind.TOKEN_DEPTH)."""

    def __init__(self, cfg: DreamerConfig, spec: DreamerSpec):
        super().__init__()
        d, dda = cfg.hidden_size, spec.da_dim
        self.heads, self.head_dim, self.dim = spec.da_heads, spec.da_head_dim, dda
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv = nn.Parameter(torch.zeros(3 * dda, d), requires_grad=False)
        self.o = nn.Parameter(torch.zeros(d, dda), requires_grad=False)
        self.scale = spec.da_head_dim**-0.5
        self.cos = self.sin = torch.zeros(0)  # [D, da_head_dim // 2] rotary tables (set by the model)

    def forward(self, x, k_cache: torch.Tensor, v_cache: torch.Tensor, depth_index: int,
                kernels: Kernels) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (self.norm(x) @ self.qkv.t()).view(n, 3, self.heads, self.head_dim).unbind(1)
        cos = self.cos[depth_index].expand(n, -1)
        sin = self.sin[depth_index].expand(n, -1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache[:, depth_index] = k
        v_cache[:, depth_index] = v
        valid = torch.full((n,), depth_index + 1, dtype=torch.int32, device=x.device)
        out = kernels.depth_attention(q, k_cache, v_cache, valid, self.scale)
        return out.reshape(n, self.dim) @ self.o.t()


class ExpertAttention(nn.Module):
    """EA: sigmoid-gated top-k MoE of SwiGLU experts; top-k on logit + b, weights g_e / sum_topk g."""

    def __init__(self, cfg: DreamerConfig, spec: DreamerSpec):
        super().__init__()
        d, E, f = cfg.hidden_size, spec.num_experts, spec.expert_intermediate_size
        self.num_experts, self.top_k, self.width = E, spec.top_k, f
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up = nn.Parameter(torch.zeros(E, 2 * f, d), requires_grad=False)
        self.down = nn.Parameter(torch.zeros(E, d, f), requires_grad=False)
        self.router: DepthRouter | None = None  # set by finish_load

    def forward(self, y, depth_index: int, static_shapes: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The EA output and each row's top-k experts [rows, k]: each (row, expert) pair through its
        expert (layers/experts.py), weighted and summed per row."""
        h = self.norm(y)
        top, weights = self.route(h, depth_index, y.dtype)
        return mix_experts(plan_experts(top, self.num_experts, static_shapes), h, self._expert, weights), top

    def route(self, h, depth_index: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts [n, k] on logit + b and their weights g_e / sum_topk g."""
        logits = self.router(h, depth_index)
        top = torch.topk(logits + self.router.bias, self.top_k, dim=-1).indices  # [n, k]
        gates = torch.sigmoid(logits.gather(1, top))
        return top, (gates / gates.sum(-1, keepdim=True)).to(dtype)

    def _expert(self, x: torch.Tensor, e: int | slice) -> torch.Tensor:
        """SwiGLU expert e on its rows [n, d], or (a slice) those experts on theirs [experts, n, d]."""
        gate, up = (x @ self.gate_up[e].transpose(-1, -2)).split([self.width, self.width], dim=-1)
        return (F.silu(gate) * up) @ self.down[e].transpose(-1, -2)


class DreamerBlock(nn.Module):
    """The shared block, one application at depth index d: y = x_d + DA(x_0..x_d) + SA(x_d),
    x_{d+1} = RMSNorm_out(y + EA(y))."""

    def __init__(self, cfg: DreamerConfig, spec: DreamerSpec):
        super().__init__()
        self.sa = SelfAttention(cfg, spec)
        self.da = DepthAttention(cfg, spec)
        self.ea = ExpertAttention(cfg, spec)
        self.out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, pool: KVPool, meta: AttentionMetadata, columns: slice,
                depth_index: int, kernels: Kernels, static_shapes: bool):
        """x_{d+1}, and the decisions taken: the EA top-k [rows, k], the attention expert [rows] or None."""
        sa, choice = self.sa(x, cos, sin, pool, meta, columns, depth_index, static_shapes)
        y = x + self.da(x, k_cache, v_cache, depth_index, kernels) + sa
        ea, top = self.ea(y, depth_index, static_shapes)
        return self.out_norm(y + ea), top, choice


class DreamerForCausalLM(nn.Module, DepthModel):
    uses_step_batch = True
    readout_every_level = True  # the LM head reads any x_d (each depth's output is normed)

    def __init__(self, cfg: DreamerConfig, spec: DreamerSpec, max_positions: int):
        super().__init__()
        self.config, self.spec = cfg, spec
        self.embed_tokens = checkpoint_embedding(cfg.vocab_size, cfg.hidden_size)
        self.block = DreamerBlock(cfg, spec)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Routers run in fp32 whatever the model dtype (re-set by finish_load after a cast).
        self._fp32: dict[str, torch.Tensor] = {}
        self.max_positions = max_positions
        # Rotary tables over positions and depth, computed by finish_load (on the meta device the
        # model is built on, computing them would import torch._dynamo: layers/rotary.py).
        self.rope_cos = self.rope_sin = self.router_cos = self.router_sin = torch.zeros(0)
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
        self.block.da.cos, self.block.da.sin = da.cos(), da.sin()
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

    def report(self, request: RequestState) -> DepthReport:
        return dreamer_report(self.config, self.spec, request.plan, request.record, request.num_computed_tokens,
                              request.num_output_tokens)

    def token_depth_values(self, num_tokens: int, depth: int | None = None) -> int:
        """Values of the per-token depth cache for `num_tokens` tokens (bound: tokens x D x 2 x d_DA)."""
        return num_tokens * (depth or self.spec.depth) * 2 * self.spec.da_dim

    def step_cache_bytes_bound(self, max_step_tokens: int) -> int:
        """The most bytes the per-token depth cache can take in one step of `max_step_tokens`
        tokens: the engine sets this aside from its cache memory before sizing the page pool."""
        return self.token_depth_values(max_step_tokens) * self.block.da.qkv.element_size()

    def step_cache_bytes(self) -> tuple[dict[SlotKind, int], dict[SlotKind, int]]:
        """Bytes of the per-token depth cache (outside the page pool): held now (0 between steps),
        and the peak of the last step."""
        size = self.block.da.qkv.element_size()
        last = self.token_depth_steps[-1][2] if self.token_depth_steps else 0
        return {SlotKind.TOKEN_DEPTH: self.token_depth_live_values * size}, {SlotKind.TOKEN_DEPTH: last * size}

    # ---- the forward --------------------------------------------------------------------------------
    def forward(self, input_ids, positions, pool, meta) -> torch.Tensor:
        """x_0 = embed(tokens); depth index j = 0, 1, .. for the rows whose depth exceeds j:
        y = x_j + DA(x_0..x_j) + SA(x_j), x_{j+1} = RMSNorm_out(y + EA(y)). A row's depth is its
        request's (the depth policy's level for a range knob), lowered where a token exits early."""
        spec = self.spec
        rows = step_rows(meta)
        depths = rows.confidence_exit(0)  # each row's depth, lowered as tokens exit (eager steps)
        deepest = rows.deepest(depths.levels, spec.depth)
        x = self.embed_tokens(input_ids)
        n = x.shape[0]
        # The step's per-token depth cache: its tokens x the batch's deepest depth (static shapes: D,
        # one shape for every level cap). Zeros: unread depths stay finite.
        shape = (n, spec.depth if rows.static_shapes else deepest, spec.da_heads, spec.da_head_dim)
        k_cache, v_cache = x.new_zeros(shape), x.new_zeros(shape)
        peak = 2 * k_cache.numel()
        cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
        ea_record, attn_record = [], []  # per depth index: the experts of every row (-1: not run)
        level, entered = rows, []
        for j in range(deepest):
            inner = level.narrow(depths.levels, j + 1)
            if inner.empty:  # every token stopped early: x holds each one's last depth
                break
            # Tokens whose depth is j finish their forward here: their x_j is final, their depth cache
            # released (gathered rows: the cache is compacted to the tokens still running).
            entered.append((inner, x))
            x, cos, sin, k_cache, v_cache = (inner.take(t) for t in (x, cos, sin, k_cache, v_cache))
            if not rows.static_shapes:
                self.token_depth_live_values = 2 * k_cache.numel()
            sa_meta, columns = inner.attend(slot_name(j))
            x, top, choice = self.block(x, cos, sin, k_cache, v_cache, pool, sa_meta, columns, j, meta.kernels,
                                        rows.static_shapes)
            depths.check(self.compute_logits, x, inner.rows, j + 1)
            ea_record.append(inner.spread(top.to(torch.int32), -1))
            attn_record.append(inner.spread(choice.to(torch.int32), -1) if choice is not None
                               else torch.full((n,), -1, dtype=torch.int32, device=x.device))
            level = inner
        for inner, before in reversed(entered):
            x = inner.merge(before, x)
        del k_cache, v_cache
        if not rows.static_shapes:
            self.token_depth_live_values = 0
            self.token_depth_steps.append((n, deepest, peak))
        depths.finish()
        unrun = torch.full((n, spec.top_k), -1, dtype=torch.int32, device=x.device)
        ea_record += [unrun] * (spec.depth - len(ea_record))
        attn_record += [unrun[:, 0]] * (spec.depth - len(attn_record))
        rows.emit(torch.cat([torch.stack(ea_record, 1).reshape(n, -1), torch.stack(attn_record, 1),
                             depths.readouts(x.device)[:, None]], dim=1))
        return x

    def static_decode_spec(self) -> StaticDecodeSpec:
        """Rows hold every depth's slot; a row's setting is its depth; its decisions the EA top-k
        [D, k], the attention expert [D] of every depth and the exit's readouts."""
        deepest = self.plan(DepthParams(depth=self.spec.depth)).layout
        return StaticDecodeSpec(deepest, settings=1, decisions=self.spec.depth * (self.spec.top_k + 1) + 1,
                                levels=tuple(range(1, self.spec.depth + 1)))

    def row_settings(self, plan: DreamerPlan, level: int | None) -> np.ndarray:
        return np.array([plan.step_level(level)], dtype=np.float32)

    def record_decisions(self, record: DreamerRecord, start: int, decisions: np.ndarray) -> dict[str, int]:
        D, k = self.spec.depth, self.spec.top_k
        n = len(decisions)
        record.write(start, decisions[:, : D * k].reshape(n, D, k), decisions[:, D * k: D * (k + 1)],
                     decisions[:, D * (k + 1)])
        return {}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # the LM head reads x_depth (already normed)

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
            "block.da.norm.weight": w[P + "da_norm.weight"], "block.sa.norm.weight": w[P + "sa_norm.weight"],
            "block.ea.norm.weight": w[P + "ea_norm.weight"], "block.out_norm.weight": w[P + "out_norm.weight"],
            "block.sa.q_norm.weight": w[P + "sa.q_norm.weight"], "block.sa.k_norm.weight": w[P + "sa.k_norm.weight"],
            "block.da.qkv": torch.cat([w[P + f"da.{n}_proj.weight"] for n in "qkv"]),
            "block.da.o": w[P + "da.o_proj.weight"],
            "block.ea.gate_up": torch.cat([w[P + "ea.experts.gate_proj.weight"], w[P + "ea.experts.up_proj.weight"]],
                                          dim=1),
            "block.ea.down": w[P + "ea.experts.down_proj.weight"],
        }
        if spec.attn_experts == 0:
            params["block.sa.qkv"] = torch.cat([w[P + f"sa.{n}_proj.weight"] for n in "qkv"])
            params["block.sa.o"] = w[P + "sa.o_proj.weight"]
        else:  # Eq. 8: sigma_e x W_e + sigma_e x W_shared = sigma_e x (W_e + W_shared)
            experts = torch.cat([w[P + f"sa.experts.{n}_proj.weight"] for n in "qkv"], dim=1)
            shared = torch.cat([w[P + f"sa.shared_expert.{n}_proj.weight"] for n in "qkv"])
            params["block.sa.qkv"] = experts + shared[None]
            params["block.sa.o"] = w[P + "sa.experts.o_proj.weight"] + w[P + "sa.shared_expert.o_proj.weight"][None]
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
        self._tables(device)
        for name, module in (("ea", self.block.ea), ("sa", self.block.sa)):
            if f"{name}.keys" in self._fp32:
                query, keys, bias = (self._fp32[f"{name}.{part}"].to(device)
                                     for part in ("query.weight", "keys", "bias"))
                module.router = DepthRouter(query, keys, bias, self.router_cos, self.router_sin)


def build(hf_config: dict, spec: DreamerSpec, options: BuildOptions) -> DreamerForCausalLM:
    return DreamerForCausalLM(DreamerConfig.from_hf(hf_config), spec, options.max_len)
