"""SGT: static head-subset attention loops (docs/depth-semantics.md section 1; paper 000, Eq. 6).

For a looped layer l with ordered query-head set S_l, after the layer's attention residual and
before its MLP, repeat k = 1..n (n = the request's `loops` for l):

    h = h + sum_{i in S_l} c_i * W_O^(i) . Attn_i(RMSNorm_a(h))

with the layer's own W_Q/W_K/W_V rows of the heads in S_l, its own RMSNorm_a, and c_i the head's
output scale (1 unless the checkpoint has fractional head decays). Each (layer, iteration) has
its own KV cache slot holding only the KV heads S_l needs (with GQA: the KV groups of the
selected query heads), so a loop slot costs |G_l| / H_kv of a dense layer slot.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from depthserve.archs.base import BuildOptions, RequestState, StaticDecodeSpec
from depthserve.archs.llama.format import LlamaConfig
from depthserve.archs.llama.model import LlamaDecoderLayer, LlamaForCausalLM
from depthserve.archs.sgt.format import SGTLayer, SGTPlan, SGTSpec, kv_heads_of, loop_slot_name, loops_knob
from depthserve.archs.sgt.format import plan as sgt_plan
from depthserve.archs.sgt.format import report as sgt_report
from depthserve.depth import DepthParams, DepthReport, KnobSpec
from depthserve.layers.attention import paged_attention
from depthserve.layers.quantized import served_weight
from depthserve.layers.rotary import apply_rope
from depthserve.layers.rows import StepRows, step_rows


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
        self.kv_heads = kv_heads_of(cfg, spec)  # the KV heads this slot stores
        per_group = [kv_of.count(g) for g in self.kv_heads]
        if len(set(per_group)) == 1:
            # Every stored KV head serves the same number of query heads: grouped attention as is.
            self.read_heads = None
        else:
            # Uneven groups: attend through one table row per query head (a KV head may repeat).
            self.read_heads = tuple(self.kv_heads.index(g) for g in kv_of)
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
        self.qkv_proj.weight.copy_(served_weight(full.qkv_proj)[index])
        if self.qkv_proj.bias is not None:
            self.qkv_proj.bias.copy_(full.qkv_proj.bias[index])
        columns = served_weight(full.o_proj)[:, rows(0, self.q_heads)].clone()
        for j, scale in enumerate(self.head_scales):
            columns[:, j * d : (j + 1) * d] *= scale
        self.o_proj.weight.copy_(columns)

    def forward(self, x, cos, sin, pool, meta, columns: slice) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split([(self.num_q + self.num_kv) * self.head_dim, self.num_kv * self.head_dim], -1)
        qk = apply_rope(qk.reshape(n, self.num_q + self.num_kv, self.head_dim), cos, sin)
        q, k = qk.split([self.num_q, self.num_kv], dim=1)
        v = v.reshape(n, self.num_kv, self.head_dim)
        out = paged_attention(q, k, v, pool, meta, columns, self.scale)
        return self.o_proj(out.reshape(n, self.num_q * self.head_dim))


class SGTDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: LlamaConfig, index: int, spec: SGTLayer, setting: int, max_loops: int):
        super().__init__(cfg, index)
        self.spec = spec
        self.loop_attn = HeadSubsetAttention(cfg, spec)
        self.setting = setting  # which of a request's row settings is this layer's loop count
        self.max_loops = max_loops

    def forward(self, x, cos, sin, pool, meta, columns, rows: StepRows) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, pool, meta, columns)
        h = self.loops(h, cos, sin, pool, rows)
        return h + self.mlp(self.post_attention_layernorm(h))

    def loops(self, h, cos, sin, pool, rows: StepRows) -> torch.Tensor:
        """Eq. 6, iteration k for the rows whose requests' tokens run at least k iterations this
        step (a range knob: the depth policy's level). Iteration k attends over its own slot, which
        with a range knob past its minimum holds only the tokens that ran k (section 6)."""
        loops = rows.setting(self.setting)
        for k in range(1, rows.deepest(loops, self.max_loops) + 1):
            level = rows.narrow(loops, k)
            meta, columns = level.attend(loop_slot_name(self.index, k), self.loop_attn.read_heads)
            hs = level.take(h)
            hs = hs + self.loop_attn(self.input_layernorm(hs), level.take(cos), level.take(sin), pool, meta, columns)
            h = level.merge(h, hs)
        return h


class SGTForCausalLM(LlamaForCausalLM):
    uses_step_batch = True

    def __init__(self, cfg: LlamaConfig, spec: SGTSpec, max_positions: int, max_loops: int):
        super().__init__(cfg, max_positions)
        self.spec = spec
        self.max_loops = max_loops
        for setting, layer in enumerate(spec.layers):
            self.layers[layer.layer] = SGTDecoderLayer(cfg, layer.layer, layer, setting, max_loops)
        self._deepest = sgt_plan(cfg, spec, DepthParams(loops=max_loops))  # a static decode row's slots

    def forward(self, input_ids, positions, pool, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        rows = step_rows(meta)
        layout = self._base_plan.layout
        for i, layer in enumerate(self.layers):
            extra = (rows,) if isinstance(layer, SGTDecoderLayer) else ()
            x = layer(x, cos, sin, pool, meta, layout.columns(i), *extra)
        return self.norm(x)

    def depth_knobs(self) -> dict[str, KnobSpec]:
        return {"loops": loops_knob(self.spec, self.max_loops)}

    def plan(self, depth: DepthParams) -> SGTPlan:
        return sgt_plan(self.config, self.spec, depth)

    def static_decode_spec(self) -> StaticDecodeSpec:
        return StaticDecodeSpec(self._deepest.layout, settings=len(self.spec.layers),
                                levels=tuple(range(self.max_loops + 1)))

    def row_settings(self, plan: SGTPlan, level: int | None) -> np.ndarray:
        return np.array([plan.step_loops(layer.layer, level) for layer in self.spec.layers], dtype=np.float32)

    def report(self, request: RequestState) -> DepthReport:
        return sgt_report(self.config, self.spec, request.plan, request.num_computed_tokens,
                          request.num_output_tokens, request.levels)

    def after_load(self, loaded: set[str]) -> set[str]:
        """Each loop iteration runs the layer's own heads: the subset's rows of its W_Q/W_K/W_V."""
        derived = super().after_load(loaded)
        for s in self.spec.layers:
            layer = self.layers[s.layer]
            layer.loop_attn.copy_from(self.config, layer.self_attn)
            derived |= {f"layers.{s.layer}.loop_attn.{name}" for name, _ in layer.loop_attn.named_parameters()}
        return derived

    def after_quantization(self) -> None:
        for s in self.spec.layers:
            layer = self.layers[s.layer]
            layer.loop_attn.copy_from(self.config, layer.self_attn)


def build(hf_config: dict, spec: SGTSpec, options: BuildOptions) -> SGTForCausalLM:
    return SGTForCausalLM(LlamaConfig.from_hf(hf_config), spec, options.max_len,
                          spec.max_loops if options.max_loops is None else options.max_loops)
