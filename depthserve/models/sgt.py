"""SGT: static head-subset attention loops (depth-semantics.md section 1; paper 000, Eq. 6).

For a looped layer l with ordered query-head set S_l, after the layer's attention residual and
before its MLP, repeat k = 1..n (n = the request's `loops` for l):

    h = h + sum_{i in S_l} c_i * W_O^(i) . Attn_i(RMSNorm_a(h))

with the layer's own W_Q/W_K/W_V rows of the heads in S_l, its own RMSNorm_a, and c_i the head's
output scale (1 unless the checkpoint has fractional head decays). Each (layer, iteration) has
its own KV cache slot holding only the KV heads S_l needs (with GQA: the KV groups of the
selected query heads), so a loop slot costs |G_l| / H_kv of a dense layer slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from depthserve.depth import DepthParams, KnobSpec
from depthserve.engine.cache_spec import CacheLayout, SlotKind, SlotSpec
from depthserve.layers.attention import paged_attention
from depthserve.layers.rotary import apply_rope
from depthserve.loading.checkpoint import SGTLayer, SGTSpec
from depthserve.models.flops import plain_flops
from depthserve.models.llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM


def loop_slot_name(layer: int, iteration: int) -> str:
    return f"layer{layer}.loop{iteration}"


@dataclass(frozen=True)
class SGTPlan:
    """One request's loop counts, fixed for its lifetime, and where its loop slots sit."""

    loops: dict[int, int]  # looped layer -> iterations
    layout: CacheLayout
    columns: dict[str, slice]  # loop slot name -> columns of the request's page table


class HeadSubsetAttention(nn.Module):
    """Attention of the query heads S only, over the KV heads they need (one loop iteration)."""

    def __init__(self, cfg: LlamaConfig, spec: SGTLayer):
        super().__init__()
        group = cfg.num_heads // cfg.num_kv_heads
        scales = spec.head_scales or (1.0,) * len(spec.heads)
        # Order the heads by KV group (the sum over heads does not depend on the order).
        order = sorted(range(len(spec.heads)), key=lambda i: (spec.heads[i] // group, spec.heads[i]))
        self.q_heads = [spec.heads[i] for i in order]
        self.head_scales = [float(scales[i]) for i in order]
        kv_of = [h // group for h in self.q_heads]
        self.kv_heads = sorted(set(kv_of))  # the KV heads this slot stores
        per_group = [kv_of.count(g) for g in self.kv_heads]
        if len(set(per_group)) == 1:
            # Every stored KV head serves the same number of query heads: grouped attention as is.
            self.read_heads = None
        else:
            # Uneven groups: attend through one table row per query head (a KV head may repeat).
            self.read_heads = np.array([self.kv_heads.index(g) for g in kv_of], dtype=np.int64)
        self.head_dim = cfg.head_dim
        self.num_q, self.num_kv = len(self.q_heads), len(self.kv_heads)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.num_q + 2 * self.num_kv) * cfg.head_dim,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_q * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    @torch.no_grad()
    def copy_from(self, cfg: LlamaConfig, full: nn.Module) -> None:
        """Take the subset's rows of the layer's own (fused) W_Q/W_K/W_V and columns of W_O."""
        d = self.head_dim
        q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d

        def rows(offset: int, heads: list[int]) -> torch.Tensor:
            return torch.cat([torch.arange(offset + h * d, offset + (h + 1) * d) for h in heads])

        index = torch.cat([rows(0, self.q_heads), rows(q_size, self.kv_heads), rows(q_size + kv_size, self.kv_heads)])
        self.qkv_proj.weight.copy_(full.qkv_proj.weight[index])
        if self.qkv_proj.bias is not None:
            self.qkv_proj.bias.copy_(full.qkv_proj.bias[index])
        columns = full.o_proj.weight[:, rows(0, self.q_heads)].clone()
        for j, scale in enumerate(self.head_scales):
            columns[:, j * d : (j + 1) * d] *= scale
        self.o_proj.weight.copy_(columns)

    def forward(self, x, cos, sin, pool, meta) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split([(self.num_q + self.num_kv) * self.head_dim, self.num_kv * self.head_dim], -1)
        qk = apply_rope(qk.reshape(n, self.num_q + self.num_kv, self.head_dim), cos, sin)
        q, k = qk.split([self.num_q, self.num_kv], dim=1)
        v = v.reshape(n, self.num_kv, self.head_dim)
        out = paged_attention(q, k, v, pool, meta, slice(None), self.scale)
        return self.o_proj(out.reshape(n, self.num_q * self.head_dim))


class SGTDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: LlamaConfig, index: int, spec: SGTLayer):
        super().__init__(cfg, index)
        self.spec = spec
        self.loop_attn = HeadSubsetAttention(cfg, spec)

    def forward(self, x, cos, sin, pool, meta, columns) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, pool, meta, columns)
        h = self.loops(h, cos, sin, pool, meta.batch)
        return h + self.mlp(self.post_attention_layernorm(h))

    def loops(self, h, cos, sin, pool, step) -> torch.Tensor:
        """Eq. 6, iteration k for the rows of the requests that run at least k iterations."""
        k = 1
        while True:
            items = [item for item in step.items if item.plan.loops[self.index] >= k]
            if not items:
                return h
            name = loop_slot_name(self.index, k)
            meta = step.slot_meta(items, [item.plan.columns[name] for item in items], self.loop_attn.read_heads)
            rows = step.rows(items)
            if rows is None:  # every row of the batch
                h = h + self.loop_attn(self.input_layernorm(h), cos, sin, pool, meta)
            else:  # gather -> iterate -> scatter
                hs = h.index_select(0, rows)
                hs = hs + self.loop_attn(self.input_layernorm(hs), cos.index_select(0, rows),
                                         sin.index_select(0, rows), pool, meta)
                h = h.index_copy(0, rows, hs)
            k += 1


class SGTForCausalLM(LlamaForCausalLM):
    uses_step_batch = True

    def __init__(self, cfg: LlamaConfig, spec: SGTSpec, max_positions: int):
        super().__init__(cfg, max_positions)
        self.spec = spec
        self.max_loops = spec.max_loops
        for layer in spec.layers:
            self.layers[layer.layer] = SGTDecoderLayer(cfg, layer.layer, layer)

    # ---- depth ------------------------------------------------------------------------------------
    def depth_knobs(self) -> dict[str, KnobSpec]:
        trained = {s.layer: s.loops for s in self.spec.layers}
        default = next(iter(trained.values())) if len(set(trained.values())) == 1 else trained
        return {
            "loops": KnobSpec(
                "loops",
                f"extra head-subset attention iterations per looped layer {list(trained)} "
                f"(an integer for all, or a map layer -> count; trained: {trained}; "
                f"above the trained count is extrapolation, up to max_loops={self.max_loops})",
                0, self.max_loops, default, kind="int_or_map", keys=tuple(trained),
            )
        }

    def plan_depth(self, depth: DepthParams) -> SGTPlan:
        depth = depth.normalized(self.depth_knobs())
        loops = {s.layer: s.loops for s in self.spec.layers}
        if isinstance(depth.loops, int):
            loops = {layer: depth.loops for layer in loops}
        elif isinstance(depth.loops, dict):
            loops.update(depth.loops)  # layers not in the map keep their trained count
        slots = [SlotSpec(f"layer{i}", SlotKind.DENSE, self.config.num_kv_heads) for i in range(self.config.num_layers)]
        for s in self.spec.layers:
            heads = self.layers[s.layer].loop_attn.num_kv
            slots += [SlotSpec(loop_slot_name(s.layer, k), SlotKind.HEAD_SUBSET, heads) for k in range(1, loops[s.layer] + 1)]
        layout = CacheLayout(tuple(slots))
        columns = {name: cols for name, cols in layout.slot_columns().items() if ".loop" in name}
        return SGTPlan(loops, layout, columns)

    def cache_layout(self, depth: DepthParams) -> CacheLayout:
        return self.plan_depth(depth).layout

    def depth_report(self, seq) -> dict:
        plan: SGTPlan = seq.state["depth_plan"]
        trained = {s.layer: s.loops for s in self.spec.layers}
        tokens = seq.num_computed_tokens
        cfg = self.config
        base = plain_flops(cfg, tokens, len(seq.output_token_ids))
        extra = 0.0
        ctx_sum = tokens * (tokens + 1) / 2
        for s in self.spec.layers:
            attn = self.layers[s.layer].loop_attn
            d, hd = cfg.hidden_size, cfg.head_dim
            weights = 2 * d * (attn.num_q + 2 * attn.num_kv) * hd + 2 * attn.num_q * hd * d
            extra += plan.loops[s.layer] * (tokens * weights + 4 * attn.num_q * hd * ctx_sum)
        return {
            "architecture": "sgt",
            "loops": dict(plan.loops),
            "trained_loops": trained,
            "extrapolated": sorted(layer for layer, n in plan.loops.items() if n > trained[layer]),
            "tokens": tokens,
            # per looped layer: (token, iteration) pairs run over the tokens this request processed
            "loop_iterations": {layer: tokens * n for layer, n in plan.loops.items()},
            "flops": base + extra,  # this request's FLOPs (depthserve/models/flops.py)
            "plain_flops": base,  # the plain model's FLOPs on the same tokens
            "relative_compute": (base + extra) / base if base else 1.0,
        }

    # ---- weights -----------------------------------------------------------------------------------
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        super().load_hf_state_dict(weights)
        for s in self.spec.layers:
            layer = self.layers[s.layer]
            layer.loop_attn.copy_from(self.config, layer.self_attn)

