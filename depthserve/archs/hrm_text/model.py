"""HRM-Text (Sapient): a high-level and a low-level stack of decoder layers, cycled (docs/depth-semantics.md,
"Public looped models: HRM-Text"), computed as transformers' HrmTextForCausalLM computes it.

    zH = embed(ids) * embedding_scale;  zL = z_L_init
    for h in 1..h_cycles:
        for l in 1..l_cycles:  zL = L_stack(zL + zH)
        zH = H_stack(zH + zL)
    logits = W_head zH

A stack is `layers_per_stack` pre-norm decoder layers and a final RMS norm; no norm carries a weight.
Attention is multi-head (keys and values as many heads as queries), rotated, and its output is
gated by sigmoid(W_gate x) before W_O. Every invocation of a layer (each low cycle of each high
cycle, each high cycle) has its own KV slot (format.invocation_slots).

Prefix-LM (knob `prefix_lm`): the prompt is one block whose tokens attend to each other both ways;
the tokens after it attend causally. The prompt runs in one forward (the plan's prefill_chunk), so
its queries attend over the forward's own keys without a mask, while its keys enter the slot for
the tokens decoded after it. A prefix-cache hit (only ever on the same prompt: the layout is
prompt-keyed) leaves the prompt's last tokens to compute: their one forward attends without a mask
over the cached prompt keys and its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from depthserve.archs.base import BuildOptions, DepthModel, RequestState, StaticDecodeSpec
from depthserve.archs.hrm_text.format import (
    FUSED_PARTS,
    HrmTextConfig,
    HrmTextPlan,
    high_slot_name,
    knobs,
    low_slot_name,
    parameter_name,
    read_config,
    split_part,
)
from depthserve.archs.hrm_text.format import plan as hrm_plan
from depthserve.archs.hrm_text.format import report as hrm_report
from depthserve.depth import DepthParams, DepthReport, KnobSpec
from depthserve.errors import CheckpointFormatError
from depthserve.layers.attention import AttentionMetadata, KVPool, call_region, paged_attention
from depthserve.layers.batch import BatchItem
from depthserve.layers.embedding import checkpoint_embedding
from depthserve.layers.rotary import apply_rope, rope_tables
from depthserve.layers.rows import StepRows, step_rows


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight, computed in fp32."""
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


@dataclass(frozen=True)
class PromptForward:
    """A request's rows that compute the rest of its bidirectional prompt: rows `first` to
    `first + count` of the step's rows, and the flat cache index [earlier tokens, heads] of the keys
    of the prompt tokens before them in the layer's slot (a prefix-cache hit; None: none)."""

    first: int
    count: int
    earlier: torch.Tensor | None


def prompt_forwards(rows: StepRows) -> list[tuple[int, BatchItem]]:
    """(first row, item) of each request among `rows` whose forward ends its bidirectional prompt
    (plan.forward_tokens: such a forward always runs to the prompt's end) with more than one token."""
    if rows.static_shapes:  # a decode step at static shapes: no prompt in it
        return []
    found, offset = [], 0
    for index, count in zip(rows.item_indices, rows.item_row_counts):
        item = rows.step.items[index]
        if item.plan.prefix_lm and item.start < item.num_prompt_tokens and count > 1:
            found.append((offset, item))
        offset += count
    return found


def prompt_forward(first: int, item: BatchItem, slot: str, block_size: int, device: torch.device) -> PromptForward:
    """The PromptForward of `item`'s rows in the layer whose keys live in `slot`."""
    if item.start == 0:
        return PromptForward(first, item.num_tokens, None)
    positions = np.arange(item.start)
    pages = item.table[positions // block_size, item.slot_columns[slot]]  # [earlier tokens, heads]
    index = pages.astype(np.int64) * block_size + (positions % block_size)[:, None]
    return PromptForward(first, item.num_tokens, torch.from_numpy(index).to(device))


class HrmTextAttention(nn.Module):
    def __init__(self, cfg: HrmTextConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        width = cfg.num_heads * cfg.head_dim
        self.gqkv_proj = nn.Linear(cfg.hidden_size, 4 * width, bias=False)  # gate, q, k, v
        self.o_proj = nn.Linear(width, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, cos, sin, pool: KVPool, meta: AttentionMetadata, columns: slice,
                bidirectional: list[tuple[int, int]]) -> torch.Tensor:
        n = x.shape[0]
        gate, q, k, v = self.gqkv_proj(x).view(n, 4, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope(q.contiguous(), cos, sin), apply_rope(k.contiguous(), cos, sin)
        v = v.contiguous()
        out = paged_attention(q, k, v, pool, meta, columns, self.scale)
        for prompt in bidirectional:
            rows = slice(prompt.first, prompt.first + prompt.count)
            keys, values = k[rows], v[rows]
            if prompt.earlier is not None:  # the prompt's keys before this forward, from the cache
                keys = torch.cat([pool.k_pages.flatten(0, 1)[prompt.earlier].to(k.dtype), keys])
                values = torch.cat([pool.v_pages.flatten(0, 1)[prompt.earlier].to(v.dtype), values])
            both_ways = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys.transpose(0, 1),
                                                       values.transpose(0, 1), scale=self.scale)
            out[rows] = both_ways.transpose(0, 1)
        return self.o_proj((torch.sigmoid(gate) * out).reshape(n, -1))


class HrmTextMLP(nn.Module):
    def __init__(self, cfg: HrmTextConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class HrmTextDecoderLayer(nn.Module):
    def __init__(self, cfg: HrmTextConfig):
        super().__init__()
        self.attn = HrmTextAttention(cfg)
        self.mlp = HrmTextMLP(cfg)
        self.eps = cfg.rms_norm_eps

    def forward(self, x, cos, sin, pool, meta, columns, bidirectional) -> torch.Tensor:
        x = x + self.attn(rms_norm(x, self.eps), cos, sin, pool, meta, columns, bidirectional)
        return x + self.mlp(rms_norm(x, self.eps))


class HrmTextStack(nn.Module):
    def __init__(self, cfg: HrmTextConfig):
        super().__init__()
        self.layers = nn.ModuleList(HrmTextDecoderLayer(cfg) for _ in range(cfg.layers_per_stack))
        self.eps = cfg.rms_norm_eps

    def forward(self, x, rows: StepRows, cos, sin, pool, slot_names: list[str]) -> torch.Tensor:
        """The stack over the rows `rows` (x, cos, sin already taken for them), layer j in slot_names[j]."""
        prompts = prompt_forwards(rows)
        for layer, slot in zip(self.layers, slot_names):
            sub_meta, columns = rows.attend(slot)
            bidirectional = [prompt_forward(first, item, slot, pool.k_pages.shape[1], x.device) for first, item in prompts]
            x = call_region(layer, sub_meta, x, cos, sin, pool, sub_meta, columns, bidirectional)
        return rms_norm(x, self.eps)


class HrmTextForCausalLM(nn.Module, DepthModel):
    uses_step_batch = True
    checkpoint_prefix = ""

    def __init__(self, cfg: HrmTextConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.max_positions = max_positions
        self.embed_tokens = checkpoint_embedding(cfg.vocab_size, cfg.hidden_size)
        self.L_module = HrmTextStack(cfg)
        self.H_module = HrmTextStack(cfg)
        self.z_L_init = nn.Parameter(torch.zeros(cfg.hidden_size), requires_grad=False)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None  # filled by finish_load

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def forward(self, input_ids, positions, pool: KVPool, meta: AttentionMetadata) -> torch.Tensor:
        cfg, rows = self.config, step_rows(meta)
        cos, sin = self.rope[0][positions], self.rope[1][positions]
        high = self.embed_tokens(input_ids) * cfg.embedding_scale
        low = self.z_L_init.to(high.dtype).expand_as(high).contiguous()
        h_settings, l_settings = rows.setting(0), rows.setting(1)
        layers = range(cfg.layers_per_stack)
        for h in range(rows.deepest(h_settings, cfg.max_h_cycles)):
            level = rows.narrow(h_settings, h + 1)
            level_high, level_low = level.take(high), level.take(low)
            level_cos, level_sin = level.take(cos), level.take(sin)
            for l in range(level.deepest(l_settings, cfg.max_l_cycles)):
                cycle = level.narrow(l_settings, l + 1)
                out = self.L_module(cycle.take(level_low) + cycle.take(level_high), cycle, cycle.take(level_cos),
                                    cycle.take(level_sin), pool, [low_slot_name(h, l, j) for j in layers])
                level_low = cycle.merge(level_low, out)
            level_high = self.H_module(level_high + level_low, level, level_cos, level_sin, pool,
                                       [high_slot_name(h, j) for j in layers])
            high, low = level.merge(high, level_high), level.merge(low, level_low)
        return high

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- depth ------------------------------------------------------------------------------------
    def depth_knobs(self) -> dict[str, KnobSpec]:
        return knobs(self.config)

    def plan(self, depth: DepthParams) -> HrmTextPlan:
        return hrm_plan(self.config, depth, self.max_positions)

    def static_decode_spec(self) -> StaticDecodeSpec:
        """Rows hold the slots of the most cycles of both stacks; a row's settings are its cycles, and
        a batch runs capped at its deepest row's level, the larger of its two cycle counts (both
        loops stop there). The decoder layer is compiled as a region: one graph serves both stacks
        at every cycle and cap."""
        cfg = self.config
        deepest = self.plan(DepthParams(h_cycles=cfg.max_h_cycles, l_cycles=cfg.max_l_cycles)).layout
        levels = tuple(range(1, max(cfg.max_h_cycles, cfg.max_l_cycles) + 1))
        return StaticDecodeSpec(deepest, settings=2, levels=levels, compiled_regions=(HrmTextDecoderLayer,))

    def static_level(self, plan: HrmTextPlan) -> int:
        return max(plan.h_cycles, plan.l_cycles)

    def row_settings(self, plan: HrmTextPlan, level: int | None) -> np.ndarray:
        return np.array([plan.h_cycles, plan.l_cycles], dtype=np.float32)

    def report(self, request: RequestState) -> DepthReport:
        return hrm_report(self.config, request.plan, request.num_computed_tokens, request.num_output_tokens)

    # ---- weights ----------------------------------------------------------------------------------
    @torch.no_grad()
    def take_weights(self, weights: dict[str, torch.Tensor], source: str) -> set[str]:
        """Every tensor, fused or split (format.parameter_name), copied one at a time; a split
        projection fills its rows of the fused parameter, which counts as filled once every part has."""
        params = dict(self.named_parameters())
        filled, parts_seen = set(), {}
        for checkpoint_name in [name for name in weights if parameter_name(name) in params]:
            target = parameter_name(checkpoint_name)
            tensor, param = weights.pop(checkpoint_name), params[target]
            part = split_part(checkpoint_name)
            if part is None:
                destination = param
            else:
                pieces = len(next(p for f, p in FUSED_PARTS.items() if f".{f}." in f".{target}"))
                destination = param.view(pieces, -1, param.shape[1])[part]
                parts_seen.setdefault(target, set()).add(part)
            if tuple(tensor.shape) != tuple(destination.shape):
                raise CheckpointFormatError(f"{source}: {checkpoint_name} must be {list(destination.shape)}, "
                                            f"got {list(tensor.shape)}")
            destination.copy_(tensor)
            if part is None or len(parts_seen[target]) == pieces:
                filled.add(target)
        return filled

    def after_load(self, loaded: set[str]) -> set[str]:
        if self.config.tie_word_embeddings or "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed_tokens.weight
            return {"lm_head.weight"}
        return set()

    def finish_load(self, device: torch.device) -> None:
        """The rotary tables, fp32 whatever the model dtype."""
        self.rope = tuple(t.to(device) for t in rope_tables(self.config.head_dim, self.max_positions,
                                                            self.config.rope_theta))


# config.json's `dtype` (`torch_dtype` before transformers 4.56): what the tensors are stored in
STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build(hf_config: dict, spec: HrmTextConfig, options: BuildOptions) -> HrmTextForCausalLM:
    """`options.max_loops`: the engine's ceiling of both cycle knobs instead of the checkpoint's."""
    if options.max_loops is not None:
        spec = read_config(hf_config, max_cycles=options.max_loops)
    dtype = STORED_DTYPES.get(hf_config.get("dtype") or hf_config.get("torch_dtype"), torch.float32)
    return HrmTextForCausalLM(spec, options.max_len).to(dtype)
