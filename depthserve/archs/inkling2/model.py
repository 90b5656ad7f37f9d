"""Inkling-2's looped text model (Thinking Machines' Inkling-2-Mini; docs/depth-semantics.md,
"Public looped models: Inkling-2"), computed as transformers' Inkling2LoopForCausalLM computes it.

    x      = RMSNorm(embed(ids));  blocks = []          (per token: a stack of block states)
    layers before the band, once
    the looped band, `loops` passes, each from the band's input; pass t > 1 mixes into each
        layer's query, key, value and MLP inputs a message read (by learned queries) from pass
        t-1's block states and output, through gates (1 - tanh f) * h + tanh g * m
    layers after the band, once (after the last pass)
    out    = softcap(W_head RMSNorm(BlockAttn(blocks, x)))

A layer reads its inputs by attention over the token's block states (BlockAttn: learned queries
over the RMS-normed stack); a layer at a block boundary pushes its input onto the stack and
restarts its residual. Attention has no rotary embedding: positions enter through a
query-conditioned relative position bias, short causal convolutions (keys, values, and after the
attention and the MLP) and a log scaling of long positions in full layers; each query head has a
sink logit. The MLP is a mixture of experts with sigmoid top-k routing in fp32.

Caches, per layer invocation (the layer, or pass t of a looped layer): its keys and values, and
two windowed slots holding the last conv_kernel_size inputs of its four convolutions.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from depthserve.archs.base import BuildOptions, DepthModel, RequestState, StaticDecodeSpec
from depthserve.archs.inkling2.attention import biased_attention, conv_history, store
from depthserve.archs.inkling2.format import Inkling2Config, Inkling2Plan, base_slots, knobs, slot_names
from depthserve.archs.inkling2.format import plan as inkling2_plan
from depthserve.archs.inkling2.format import report as inkling2_report
from depthserve.cache import CacheLayout
from depthserve.depth import DepthParams, DepthReport, KnobSpec
from depthserve.errors import CheckpointFormatError
from depthserve.layers.attention import AttentionMetadata, KVPool, call_region
from depthserve.layers.embedding import checkpoint_embedding
from depthserve.layers.rows import step_rows
from depthserve.loading.weights import keep_stored_width

CLIP_EPS = 1e-6  # transformers' L2 clip
BLOCK_NORM_EPS = 1e-6  # the block attention residuals' unweighted RMS norm


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (threshold / (norm + CLIP_EPS)).clamp(max=1.0)


def log_scale(x: torch.Tensor, positions: torch.Tensor, cfg: Inkling2Config) -> torch.Tensor:
    """x [rows, heads, d] scaled up at positions past log_scaling_n_floor (full layers)."""
    tau = 1.0 + cfg.log_scaling_alpha * torch.log(((positions + 1).float() / cfg.log_scaling_n_floor).clamp(min=1.0))
    return x * tau[:, None, None]


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


class Norm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = _param(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.float() * rms(x, self.eps)


def block_attention(queries: torch.Tensor, blocks: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
    """queries [q, H] over each token's stack of block states [rows, b, H] and `partial` [rows, H]:
    [rows, q, H]."""
    stacked = rms(torch.cat([blocks, partial[:, None]], dim=1), BLOCK_NORM_EPS)
    scores = torch.einsum("qh,rbh->rqb", queries.float(), stacked) * stacked.shape[-1] ** -0.5
    return torch.einsum("rqb,rbh->rqh", torch.softmax(scores, dim=-1), stacked)


class ShortConv(nn.Module):
    """A depthwise causal convolution over the last `kernel` inputs, plus the input, rescaled."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = _param(channels, 1, kernel)
        self.kernel = kernel

    def forward(self, x: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        taps = self.weight.float()[:, 0].flip(-1).T  # [kernel, channels], row lag: the input lag tokens back
        return ((history * taps).sum(1) + x.float()) / math.sqrt(self.kernel + 1)


class DynamicConv(nn.Module):
    """Taps = static per-channel taps + per-token taps projected from the layer input, shared per head."""

    def __init__(self, channels: int, hidden: int, heads: int, kernel: int):
        super().__init__()
        self.static_w = _param(kernel, channels)  # row lag: the input lag tokens back
        self.weight_proj = _param(heads * kernel, hidden)
        self.heads, self.kernel = heads, kernel

    def forward(self, x: torch.Tensor, history: torch.Tensor, dynamic_input: torch.Tensor) -> torch.Tensor:
        rows, channels = x.shape
        dynamic = F.linear(dynamic_input, self.weight_proj).float().view(rows, self.heads, 1, self.kernel)
        taps = self.static_w.float().T.reshape(self.heads, channels // self.heads, self.kernel) + dynamic
        windows = history.transpose(1, 2).reshape(rows, self.heads, channels // self.heads, self.kernel)
        out = (windows * taps).sum(-1).reshape(rows, channels)
        return (out + x.float()) / math.sqrt(2 * self.kernel + 1)


class Attention(nn.Module):
    def __init__(self, cfg: Inkling2Config, layer: int):
        super().__init__()
        self.cfg, self.sliding = cfg, cfg.is_sliding(layer)
        self.num_heads, self.num_kv_heads = cfg.heads(layer)
        d, hidden = cfg.head_dim, cfg.hidden_size
        self.wq_du = nn.Linear(hidden, self.num_heads * d, bias=False)
        self.wk_dv = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.wv_dv = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.wo_ud = nn.Linear(self.num_heads * d, hidden, bias=False)
        self.gate_attn = nn.Linear(hidden, self.num_heads * d, bias=False)
        self.attn_sink_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.wr_du = nn.Linear(hidden, self.num_heads * cfg.d_rel, bias=False)
        kv = self.num_kv_heads * d
        if self.sliding:
            self.k_sconv = ShortConv(kv, cfg.conv_kernel_size)
            self.v_sconv = ShortConv(kv, cfg.conv_kernel_size)
        else:
            self.k_sconv = DynamicConv(kv, hidden, self.num_kv_heads, cfg.conv_kernel_size)
            self.v_sconv = DynamicConv(kv, hidden, self.num_kv_heads, cfg.conv_kernel_size)
        self.q_l2_clip = nn.Module()
        self.q_l2_clip.scale = _param(self.num_heads, d)
        self.rel_l2_clip = nn.Module()
        self.rel_l2_clip.scale = _param(self.num_heads, cfg.d_rel)
        self.rel_logits_proj = nn.Module()
        self.rel_logits_proj.proj = _param(cfg.d_rel, cfg.rel_span(layer))
        self.window, self.span, self.scale = cfg.window(layer), cfg.rel_span(layer), d**-0.5

    def _scaled(self, x: torch.Tensor, scale: torch.Tensor, threshold: float, positions: torch.Tensor) -> torch.Tensor:
        x = l2_clip(x.float() * scale.float(), threshold)
        return x if self.sliding else log_scale(x, positions, self.cfg)

    def _conv(self, conv, x, history, dynamic_input):
        return conv(x, history) if self.sliding else conv(x, history, dynamic_input)

    def forward(self, qh, kh, vh, positions, pool: KVPool, slots) -> torch.Tensor:
        """qh, kh, vh [rows, hidden]: the normed inputs of the queries (also of the bias, sinks and
        output gate), keys and values; slots: (metadata, columns) of the invocation's three slots."""
        cfg, rows, d = self.cfg, qh.shape[0], self.cfg.head_dim
        (meta, attention_cols), conv = slots[0], slots[1]
        q = self._scaled(self.wq_du(qh).view(rows, self.num_heads, d), self.q_l2_clip.scale, cfg.qk_clip, positions)
        k_in, v_in = self.wk_dv(kh), self.wv_dv(vh)
        store(pool.k_pages, *conv, k_in)
        store(pool.v_pages, *conv, v_in)
        k = self._conv(self.k_sconv, k_in, conv_history(pool.k_pages, *conv, cfg.conv_kernel_size), kh)
        v = self._conv(self.v_sconv, v_in, conv_history(pool.v_pages, *conv, cfg.conv_kernel_size), vh)
        k = l2_clip(k.view(rows, self.num_kv_heads, d), cfg.qk_clip)
        v = rms(v.view(rows, self.num_kv_heads, d), cfg.rms_norm_eps)
        rel = self._scaled(self.wr_du(qh).view(rows, self.num_heads, -1), self.rel_l2_clip.scale, cfg.rel_clip,
                           positions)
        rel_logits = rel @ self.rel_logits_proj.proj.float()
        sinks = self.attn_sink_proj(qh).float()
        out = biased_attention(q.to(qh.dtype), k.to(qh.dtype), v.to(qh.dtype), pool, meta, attention_cols,
                               self.scale, self.window, rel_logits, self.span, sinks)
        gate = torch.sigmoid(self.gate_attn(qh).float())
        return self.wo_ud((out.reshape(rows, -1).float() * gate).to(qh.dtype))


class Experts(nn.Module):
    """The routed experts, each a SwiGLU of two linear layers (so that `--quantization` serves them
    from codes on the native kernels, as every other projection); a step's tokens run grouped by
    expert, one matmul pair per expert hit."""

    def __init__(self, cfg: Inkling2Config):
        super().__init__()
        hidden, inner = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up = nn.ModuleList(nn.Linear(hidden, 2 * inner, bias=False)  # [gate; up] rows
                                     for _ in range(cfg.num_experts))
        self.down = nn.ModuleList(nn.Linear(inner, hidden, bias=False) for _ in range(cfg.num_experts))
        self.gate_cap, self.up_cap = cfg.mlp_gate_softcap, cfg.mlp_up_softcap

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[index](x).float().chunk(2, dim=-1)
        hidden = (softcap(gate, self.gate_cap) * torch.sigmoid(gate) * softcap(up, self.up_cap)).to(x.dtype)
        return self.down[index](hidden).float()

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                static_shapes: bool = False) -> torch.Tensor:
        """x [rows, H]; experts, weights [rows, k]: the sum over each row's experts, in fp32, added in
        expert order. static_shapes: every expert runs on every row and a row keeps the experts it
        chose (a decode step at static shapes: no host synchronisation, no data-dependent shape)."""
        if static_shapes:
            return self._every_expert(x, experts, weights)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.gate_up)).tolist()
        rows_of = order // experts.shape[1]
        pair_weights = weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = rows_of[start:start + count]
            out.index_add_(0, rows, self.expert(expert, x[rows]) * pair_weights[start:start + count, None])
            start += count
        return out

    def _every_expert(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in range(len(self.gate_up)):
            chosen = experts == expert  # [rows, k]: at most one hit per row
            weight = torch.where(chosen, weights, 0.0).sum(-1, keepdim=True)
            out = out + torch.where(chosen.any(-1, keepdim=True), self.expert(expert, x) * weight, 0.0)
        return out


class Router(nn.Module):
    def __init__(self, cfg: Inkling2Config):
        super().__init__()
        self.weight = _param(cfg.num_experts, cfg.hidden_size)
        self.bias = _param(cfg.num_experts)  # the score correction: it chooses, it does not weigh
        self.top_k, self.route_scale = cfg.experts_per_token, cfg.route_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts, weights) [rows, k], from scores in fp32."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        experts = torch.topk(scores + self.bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        return experts, weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.route_scale


class MoE(nn.Module):
    def __init__(self, cfg: Inkling2Config):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor, static_shapes: bool = False) -> torch.Tensor:
        experts, weights = self.gate(x)
        return self.experts(x, experts, weights, static_shapes)


class MessageGate(nn.Module):
    """(1 - tanh f) * h + tanh g * m, f and g low-rank projections of [norm(h), norm(m)]."""

    def __init__(self, cfg: Inkling2Config):
        super().__init__()
        self.down_weight = _param(cfg.loop_gate_rank, 2 * cfg.hidden_size)
        self.forget_weight = _param(cfg.hidden_size, cfg.loop_gate_rank)
        self.gain_weight = _param(cfg.hidden_size, cfg.loop_gate_rank)
        self.eps = cfg.rms_norm_eps

    def forward(self, h: torch.Tensor, message: torch.Tensor) -> torch.Tensor:
        h, message = h.float(), message.float()
        low = F.linear(torch.cat([rms(h, self.eps), rms(message, self.eps)], -1), self.down_weight.float())
        return (1 - torch.tanh(F.linear(low, self.forget_weight.float()))) * h + torch.tanh(
            F.linear(low, self.gain_weight.float())) * message


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Inkling2Config, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.sliding, self.boundary = cfg.is_sliding(index), cfg.is_block_boundary(index)
        self.attn = Attention(cfg, index)
        self.mlp = MoE(cfg)
        eps = cfg.rms_norm_eps
        if self.sliding:
            self.attn_norm = Norm(cfg.hidden_size, eps)
        else:
            self.q_input_norm, self.k_input_norm, self.v_input_norm = (Norm(cfg.hidden_size, eps) for _ in range(3))
        self.mlp_norm = Norm(cfg.hidden_size, eps)
        self.attn_sconv = ShortConv(cfg.hidden_size, cfg.conv_kernel_size)
        self.mlp_sconv = ShortConv(cfg.hidden_size, cfg.conv_kernel_size)
        if index in cfg.looped_layers:
            self.controllers = nn.ModuleDict({part: MessageGate(cfg) for part in ("attn", "k", "v", "mlp")})

    def _attention_inputs(self, x, inputs, messages):
        """The normed query, key and value inputs; inputs: the block attention's [rows, 1 or 3, H] (None: x)."""
        if self.sliding:
            h = x.float() if inputs is None else inputs[:, 0]
            parts = (h, h, h) if messages is None else tuple(
                self.controllers[name](h, messages[:, i]) for i, name in enumerate(("attn", "k", "v")))
            return tuple(self.attn_norm(p) for p in parts)
        parts = (x.float(),) * 3 if inputs is None else inputs.unbind(1)
        if messages is not None:
            parts = tuple(self.controllers[name](p, messages[:, i]) for i, (name, p) in
                          enumerate(zip(("attn", "k", "v"), parts)))
        return self.q_input_norm(parts[0]), self.k_input_norm(parts[1]), self.v_input_norm(parts[2])

    def forward(self, x, blocks, attention_query, mlp_query, positions, pool, slots, messages=None):
        """x [rows, H] fp32, blocks [rows, b, H] (this layer's input pushed already at a boundary, as
        the model does it after calling the layer in transformers: the stack the MLP input reads)."""
        dtype = self.mlp_norm.weight.dtype
        inputs = None if attention_query is None else block_attention(attention_query, blocks[:, :-1] if
                                                                       self.boundary else blocks, x)
        qh, kh, vh = (p.to(dtype) for p in self._attention_inputs(x, inputs, messages))
        attention = call_region(self.attn, slots[0][0], qh, kh, vh, positions, pool, slots)
        res = slots[2]
        store(pool.k_pages, *res, attention)
        attention = self.attn_sconv(attention, conv_history(pool.k_pages, *res, self.cfg.conv_kernel_size))
        residual = attention if self.boundary else x.float() + attention
        h = block_attention(mlp_query.view(1, -1), blocks, residual)[:, 0]
        if messages is not None:
            h = self.controllers["mlp"](h, messages[:, 3])
        out = call_region(self.mlp, res[0], self.mlp_norm(h).to(dtype), res[0].static is not None)
        store(pool.v_pages, *res, out)
        out = self.mlp_sconv(out, conv_history(pool.v_pages, *res, self.cfg.conv_kernel_size))
        return residual + out


class AttentionResidualQueries(nn.Module):
    def __init__(self, cfg: Inkling2Config):
        super().__init__()
        # attn_queries[i] is layer i + 1's (layer 0 reads its input as it is)
        self.attn_queries = nn.ParameterList(
            _param(cfg.hidden_size) if cfg.is_sliding(i) else _param(3, cfg.hidden_size)
            for i in range(1, cfg.num_layers))
        self.mlp_queries = nn.ParameterList(_param(cfg.hidden_size) for _ in range(cfg.num_layers))
        self.output_query = _param(cfg.hidden_size)


class Inkling2ForCausalLM(nn.Module, DepthModel):
    uses_step_batch = True
    checkpoint_prefix = ""

    def __init__(self, cfg: Inkling2Config, max_positions: int):
        super().__init__()
        self.config, self.max_positions = cfg, max_positions
        self.embed = checkpoint_embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.attn_res = AttentionResidualQueries(cfg)
        band = cfg.loop_end - cfg.loop_start
        # per looped layer: rows 2l, 2l+1 the query and MLP message queries; in kv_queries its key and value ones
        self.middle_cycle_cross_pass_queries = _param(2 * band, cfg.hidden_size)
        self.middle_cycle_cross_pass_kv_queries = _param(2 * band, cfg.hidden_size)
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.unembed = nn.Linear(cfg.hidden_size, cfg.unpadded_vocab_size, bias=False)
        self.base_columns = dict(CacheLayout(base_slots(cfg)).slot_columns())

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def _attention_query(self, i: int) -> torch.Tensor | None:
        if i == 0:
            return None
        query = self.attn_res.attn_queries[i - 1]
        return query.view(-1, query.shape[-1])

    def _message_queries(self, band_index: int) -> torch.Tensor:
        """[4, H]: the query, key, value and MLP message queries of a looped layer."""
        q, kv = self.middle_cycle_cross_pass_queries, self.middle_cycle_cross_pass_kv_queries
        l = 2 * band_index
        return torch.stack([q[l], kv[l], kv[l + 1], q[l + 1]]).float()

    def _layer(self, i, x, blocks, positions, pool, slots, messages=None):
        if self.config.is_block_boundary(i):
            blocks = torch.cat([blocks, x[:, None].float()], dim=1)
        x = self.layers[i](x, blocks, self._attention_query(i), self.attn_res.mlp_queries[i], positions, pool, slots,
                           messages)
        return x, blocks

    def forward(self, input_ids, positions, pool: KVPool, meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.config
        x = self.embed_norm(self.embed(input_ids)).float()
        blocks = x.new_zeros(x.shape[0], 0, x.shape[1])
        for i in range(cfg.loop_start):
            x, blocks = self._layer(i, x, blocks, positions, pool, self._slots(meta, i))
        x, blocks = self.band(x, blocks, positions, pool, meta)
        for i in range(cfg.loop_end, cfg.num_layers):
            x, blocks = self._layer(i, x, blocks, positions, pool, self._slots(meta, i))
        x = block_attention(self.attn_res.output_query.view(1, -1), blocks, x)[:, 0]
        return self.norm(x).to(self.norm.weight.dtype)

    def _slots(self, meta: AttentionMetadata, i: int) -> tuple[tuple[AttentionMetadata, slice], ...]:
        return tuple((meta, self.base_columns[name]) for name in slot_names(i))

    def band(self, x, blocks, positions, pool, meta):
        """The looped band's passes: pass t over the rows whose requests run at least t loops; pass t
        > 1 restarts from the band's input with messages from pass t-1's block states and output."""
        cfg, rows = self.config, step_rows(meta)
        loops = rows.setting(0)
        entry_x, entry_blocks = x, blocks
        pre_blocks = blocks.shape[1]
        for t in range(1, rows.deepest(loops, cfg.max_loops) + 1):
            level = rows.narrow(loops, t)
            xs, bs = level.take(entry_x), level.take(entry_blocks)
            ps = level.take(positions)
            previous = None if t == 1 else (level.take(x), level.take(blocks)[:, pre_blocks + 1:])
            for band_index, i in enumerate(cfg.looped_layers):
                slots = tuple(level.attend(name) for name in slot_names(i, t))
                messages = None
                if previous is not None:
                    messages = block_attention(self._message_queries(band_index), previous[1], previous[0])
                xs, bs = self._layer(i, xs, bs, ps, pool, slots, messages)
            # every row runs pass 1, whose stack is wider than the band's input: it replaces it
            x, blocks = level.merge(x, xs), (bs if t == 1 else level.merge(blocks, bs))
        return x, blocks

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.unembed(hidden).float(), self.config.final_logit_softcap)

    # ---- depth ------------------------------------------------------------------------------------
    def depth_knobs(self) -> dict[str, KnobSpec]:
        return knobs(self.config)

    def plan(self, depth: DepthParams) -> Inkling2Plan:
        return inkling2_plan(self.config, depth)

    def row_settings(self, plan: Inkling2Plan, level: int | None) -> np.ndarray:
        return np.array([plan.step_level(level)], dtype=np.float32)

    def static_decode_spec(self) -> StaticDecodeSpec:
        """Rows hold the slots of the most loops (every layer's own first, at the columns the eager
        step reads them from); a row's setting is its loop count, and a batch runs capped at its
        deepest row's. The experts run on every row (Experts, static_shapes). The attention (one
        graph per layer type) and the mixture of experts (one graph) are compiled as regions, the
        glue between them runs as it is: the graphs to compile do not grow with the loops, nor
        with the kinds of layer (every layer differs from its neighbours in its block boundary, its
        type or its messages)."""
        cfg = self.config
        deepest = self.plan(DepthParams(loops=cfg.max_loops)).layout
        return StaticDecodeSpec(deepest, settings=1, levels=tuple(range(1, cfg.max_loops + 1)),
                                compiled_regions=(Attention, MoE))

    def report(self, request: RequestState) -> DepthReport:
        return inkling2_report(self.config, request.plan, request.num_computed_tokens, request.num_output_tokens)

    # ---- weights ----------------------------------------------------------------------------------
    @torch.no_grad()
    def take_weights(self, weights: dict[str, torch.Tensor], source: str) -> set[str]:
        """Every tensor by its released name (`model.llm.*`, as transformers saves it too), read and
        copied one at a time: each experts tensor [experts, out, in] into the experts' own linear
        layers (gate and up rows de-interleaved), the LM head's padding rows dropped. Quantized
        experts (NVFP4, MXFP8 scales beside them) are refused."""
        params = dict(self.named_parameters())
        filled = set()
        for checkpoint_name in list(weights):
            target = parameter_name(checkpoint_name)
            if target.endswith(("_scale", "_amax", "_outer_scale_denominator")):
                raise CheckpointFormatError(f"{source}: {checkpoint_name}: quantized experts are not served "
                                            "(dequantize them to bf16 first)")
            if target.endswith(EXPERT_TENSORS):
                tensor = weights.pop(checkpoint_name)
                count = len(self.get_submodule(target))
                if tensor.dim() != 3 or tensor.shape[0] != count:
                    raise CheckpointFormatError(f"{source}: {checkpoint_name} must hold {count} experts' weights "
                                                f"[experts, out, in], got {list(tensor.shape)}")
                if target.endswith("gate_up"):
                    tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
                for expert, expert_tensor in enumerate(tensor):
                    name = f"{target}.{expert}.weight"
                    _copy_weight(params[name], expert_tensor, f"{source}: {checkpoint_name}[{expert}]")
                    filled.add(name)
                continue
            if target not in params:
                continue
            tensor = weights.pop(checkpoint_name)
            if target == "unembed.weight" and tensor.shape[0] > params[target].shape[0]:
                tensor = tensor[: params[target].shape[0]]
            _copy_weight(params[target], tensor, f"{source}: {checkpoint_name}")
            filled.add(target)
        return filled


EXPERT_TENSORS = (".mlp.experts.gate_up", ".mlp.experts.down")  # the released w13_weight, w2_weight


def _copy_weight(param: nn.Parameter, tensor: torch.Tensor, where: str) -> None:
    """Copy a checkpoint tensor into its parameter, keeping a tensor stored wider than the model's dtype."""
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointFormatError(f"{where} must be {list(param.shape)}, got {list(tensor.shape)}")
    keep_stored_width(param, tensor)
    param.copy_(tensor)


def parameter_name(checkpoint_name: str) -> str:
    """The engine's parameter of a released tensor name."""
    name = checkpoint_name.removeprefix("model.llm.").removeprefix("model.")
    name = name.replace(".mlp.experts.w13_weight", ".mlp.experts.gate_up").replace(".mlp.experts.w2_weight",
                                                                                   ".mlp.experts.down")
    return name


STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def stored_dtype(hf_config: dict) -> torch.dtype:
    return STORED_DTYPES.get(hf_config.get("dtype") or hf_config.get("torch_dtype"), torch.float32)


def build(hf_config: dict, spec: Inkling2Config, options: BuildOptions) -> Inkling2ForCausalLM:
    """`options.max_loops`: the engine's ceiling of `loops` instead of the checkpoint's. Built in the
    checkpoint's stored dtype; routers, gates and convolutions compute in fp32 whatever it is."""
    if options.max_loops is not None:
        spec = replace(spec, max_loops=options.max_loops)
    return Inkling2ForCausalLM(spec, options.max_len).to(stored_dtype(hf_config))
